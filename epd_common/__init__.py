"""Leaf modules every epd package may import (no model, media or serving code here)."""
