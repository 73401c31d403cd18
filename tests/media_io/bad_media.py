"""A corpus of hostile and broken image inputs, built in memory in a few milliseconds.

``bad_image_corpus()`` returns ``name -> bytes``; ``EXPECTED[name]`` is the error class that
``sniff`` + ``decode_image`` must raise for it (``None``: it must decode, e.g. a PNG whose name
says ``.jpg``). The bombs are cheap to build: a valid header that claims huge dimensions followed
by a tiny compressed body, which is exactly what makes them dangerous to a naive decoder.

Video cases live with the video tests.
"""

from __future__ import annotations

import io
import random
import struct
import zlib

from PIL import Image

from media_io.errors import BadMedia, MediaError, MediaTooLarge, UnsupportedMedia

HTML_PAGE = b"<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head><body>gone</body></html>\n"


def small_image(fmt: str, size: tuple[int, int] = (64, 48), mode: str = "RGB") -> bytes:
    """A valid little image with a gradient (so truncation removes real data)."""
    w, h = size
    img = Image.new(mode, size)
    img.putdata(
        [((x * 4) % 256, (y * 5) % 256, (x + y) % 256)[: len(mode)] for y in range(h) for x in range(w)]
    )
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    """One PNG chunk with its length and CRC."""
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_bomb(width: int = 30000, height: int = 30000) -> bytes:
    """A structurally valid PNG header claiming ``width x height`` RGB pixels, with a tiny IDAT
    (a few rows of zeros): decoding it for real would need ``width*height*3`` bytes."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    rows = zlib.compress(bytes((width * 3 + 1) * 4), 9)  # 4 filtered rows of zeros
    return (
        b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", rows) + png_chunk(b"IEND", b"")
    )


def gif_bomb(width: int = 65535, height: int = 65535) -> bytes:
    """A GIF whose logical screen is ``width x height`` holding one 1x1 frame (a few dozen bytes)."""
    header = b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0)  # 2-colour global table
    palette = b"\x00\x00\x00\xff\xff\xff"
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, 1, 1, 0)
    lzw = b"\x02\x02\x44\x01\x00"  # min code size 2, one sub-block: clear, index 0, end
    return header + palette + frame + lzw + b"\x3b"


def jpeg_huge_dims(width: int = 60000, height: int = 60000) -> bytes:
    """A small valid JPEG whose SOF marker is patched to claim ``width x height``."""
    data = bytearray(small_image("JPEG"))
    i = 2
    while i < len(data) - 9:
        assert data[i] == 0xFF, "walked off the JPEG marker chain"
        marker, seg_len = data[i + 1], struct.unpack(">H", data[i + 2 : i + 4])[0]
        if marker in (0xC0, 0xC1, 0xC2):  # SOF: length, precision, height, width
            data[i + 5 : i + 9] = struct.pack(">HH", height, width)
            return bytes(data)
        i += 2 + seg_len
    raise AssertionError("no SOF marker found")


def bad_image_corpus() -> dict[str, bytes]:
    """Name -> bytes of every case; see ``EXPECTED`` for what each must raise."""
    jpeg, png = small_image("JPEG"), small_image("PNG")
    webp, gif = small_image("WEBP"), small_image("GIF")
    bmp = small_image("BMP")
    png_bad_crc = bytearray(png)
    png_bad_crc[29] ^= 0xFF  # inside IHDR's CRC field (8 signature + 4 len + 4 type + 13 data)
    rng = random.Random(1234)
    random_bytes = bytes(rng.getrandbits(8) for _ in range(4096))
    return {
        "zero_bytes": b"",
        "random_bytes": random_bytes,
        "text": b"just some words, not a picture\n" * 4,
        "html_as_image.jpg": HTML_PAGE,
        "svg": b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>',
        "tiff": b"II*\x00\x08\x00\x00\x00" + bytes(64),
        "video_as_image.jpg": b"\x00\x00\x00\x20ftypisom\x00\x00\x02\x00isomiso2avc1mp41" + bytes(64),
        "jpeg_soi_only": b"\xff\xd8\xff",
        "truncated_jpeg": jpeg[: len(jpeg) // 2],
        "truncated_png": png[: len(png) // 2],
        "truncated_webp": webp[: len(webp) // 2],
        "truncated_gif": gif[: len(gif) // 2],
        "truncated_bmp": bmp[: len(bmp) // 2],
        "png_bad_crc": bytes(png_bad_crc),
        "bmp_garbage_header": b"BM" + bytes(12) + struct.pack("<I", 40) + b"\xff" * 40,
        "png_bomb_30000x30000": png_bomb(),
        "gif_bomb_65535x65535": gif_bomb(),
        "jpeg_claims_60000x60000": jpeg_huge_dims(),
        "png_9000x9000_over_our_cap": png_bomb(9000, 9000),
        "wrong_extension.jpg": png,  # a PNG named .jpg: formats come from bytes, so this decodes
    }


EXPECTED: dict[str, type[MediaError] | None] = {
    "zero_bytes": BadMedia,
    "random_bytes": UnsupportedMedia,
    "text": UnsupportedMedia,
    "html_as_image.jpg": UnsupportedMedia,
    "svg": UnsupportedMedia,
    "tiff": UnsupportedMedia,
    "video_as_image.jpg": UnsupportedMedia,
    "jpeg_soi_only": BadMedia,
    "truncated_jpeg": BadMedia,
    "truncated_png": BadMedia,
    "truncated_webp": BadMedia,
    "truncated_gif": BadMedia,
    "truncated_bmp": BadMedia,
    "png_bad_crc": BadMedia,
    "bmp_garbage_header": BadMedia,
    "png_bomb_30000x30000": MediaTooLarge,
    "gif_bomb_65535x65535": MediaTooLarge,
    "jpeg_claims_60000x60000": MediaTooLarge,
    "png_9000x9000_over_our_cap": MediaTooLarge,
    "wrong_extension.jpg": None,
}
