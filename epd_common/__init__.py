"""Leaf modules every epd package may import (no model, media or serving code here); ``messages``
holds what the roles send each other."""
