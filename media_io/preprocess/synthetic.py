"""Camera-like synthetic images for tests and benchmarks (no image files ship with the repo).

A smooth colour field, a few filled shapes with hard edges, per-pixel sensor noise, then a
small Gaussian blur standing in for the lens's point spread (real photos have no aliased,
one-pixel-sharp edges). Deterministic for a given ``seed``.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageChops, ImageDraw, ImageFilter


def synthetic_photo(
    width: int, height: int, seed: int = 0, noise: float = 8.0, blur: float = 1.5
) -> Image.Image:
    """An RGB ``width x height`` image of gradients + shapes + noise, blurred by ``blur`` pixels.

    Built from Pillow's C primitives (a 4K image takes well under a second).
    """
    rng = np.random.default_rng(seed)
    # Smooth colour field: a coarse random grid, bicubic-upsampled to full size.
    coarse = rng.uniform(30, 225, size=(4, 5, 3)).astype(np.uint8)  # [4, 5, 3]
    pil = Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC)
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
    if noise > 0:
        # Sensor noise, independent per channel, centred on 128. Drawing a fresh value per pixel
        # costs seconds at 4K, so a 251x241 tile (prime sides) is repeated: the period is far
        # longer than any resampling kernel, so it still looks like white noise to the resize.
        tile_w, tile_h = min(width, 251), min(height, 241)
        tile = rng.normal(128.0, noise, size=(tile_h, tile_w, 3)).clip(0, 255).astype(np.uint8)
        tile_img = Image.fromarray(tile)
        bands = Image.new("RGB", (width, height))
        for ty in range(0, height, tile_h):
            for tx in range(0, width, tile_w):
                bands.paste(tile_img, (tx, ty))
        pil = ImageChops.add(pil, bands, scale=1.0, offset=-128)
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
