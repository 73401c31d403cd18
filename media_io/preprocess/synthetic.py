"""Camera-like synthetic images for tests and benchmarks (no image files ship with the repo).

A smooth colour gradient, a few filled shapes with hard edges, per-pixel sensor noise, then a
small Gaussian blur standing in for the lens's point spread (real photos have no aliased,
one-pixel-sharp edges). Deterministic for a given ``seed``.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


def synthetic_photo(
    width: int, height: int, seed: int = 0, noise: float = 8.0, blur: float = 1.5
) -> Image.Image:
    """An RGB ``width x height`` image of gradients + shapes + noise, blurred by ``blur`` pixels."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]  # [H, 1]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :]  # [1, W]
    c0, c1, c2 = rng.uniform(40, 215, size=3)
    img = np.empty((height, width, 3), dtype=np.float32)  # [H, W, 3]
    img[..., 0] = c0 + 60 * (x - 0.5) + 30 * np.sin(6.0 * y)
    img[..., 1] = c1 + 60 * (y - 0.5) + 30 * np.cos(4.0 * x)
    img[..., 2] = c2 + 40 * (x - y)
    if noise > 0:
        img += rng.standard_normal((height, width, 3), dtype=np.float32) * noise
    pil = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(pil)
    side = min(width, height)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        r = int(rng.integers(max(2, side // 20), max(3, side // 4)))
        fill = tuple(int(v) for v in rng.integers(0, 256, size=3))
        if rng.random() < 0.5:
            draw.ellipse((x0, y0, x0 + r, y0 + r), fill=fill)
        else:
            draw.rectangle((x0, y0, x0 + r, y0 + r // 2), fill=fill)
    if blur > 0:
        pil = pil.filter(ImageFilter.GaussianBlur(blur))
    return pil


def encode(img: Image.Image, fmt: str = "JPEG", quality: int = 90) -> bytes:
    """``img`` encoded as ``fmt`` (JPEG with 4:2:0 chroma, like most cameras)."""
    buf = io.BytesIO()
    if fmt.upper() == "JPEG":
        img.save(buf, "JPEG", quality=quality)
    else:
        img.save(buf, fmt)
    return buf.getvalue()
