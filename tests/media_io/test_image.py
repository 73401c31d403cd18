"""Image decode: formats, EXIF orientation, colour modes (parity with the reference processor's
RGB conversion), pixel caps before decoding, and the bad-input corpus."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from media_io.config import MediaLimits
from media_io.errors import BadMedia, MediaError, MediaTooLarge, UnsupportedMedia
from media_io.image import decode_image, decode_image_sized
from media_io.sniff import sniff
from tests.media_io.bad_media import EXPECTED, bad_image_corpus, png_bomb, small_image


def encode(img: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def pattern(w: int = 40, h: int = 24) -> np.ndarray:
    """An asymmetric RGB pattern, so any flip or rotation changes it."""  # [H, W, 3] uint8
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 6 % 256, y * 10 % 256, (x * y) % 256], axis=-1).astype(np.uint8)


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "GIF", "WEBP", "JPEG"])
def test_formats_decode_to_rgb(fmt: str) -> None:
    src = pattern()
    options: dict[str, dict[str, object]] = {
        "WEBP": {"lossless": True},
        "JPEG": {"quality": 95, "subsampling": 0},
    }
    kw = options.get(fmt, {})
    img = decode_image(encode(Image.fromarray(src), fmt, **kw))
    assert img.mode == "RGB" and img.size == (40, 24)
    out = np.asarray(img).astype(int)
    if fmt in ("PNG", "BMP", "WEBP"):
        assert np.array_equal(out, src)  # lossless
    elif fmt == "JPEG":
        assert np.abs(out - src).mean() < 4


# EXIF orientation -> the numpy transform that makes the stored pixels upright.
ORIENTATIONS = {
    1: lambda a: a,
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1],
    5: lambda a: a.transpose(1, 0, 2),
    6: lambda a: np.rot90(a, -1),
    7: lambda a: np.rot90(a, 2).transpose(1, 0, 2),
    8: lambda a: np.rot90(a, 1),
}


@pytest.mark.parametrize("orientation", sorted(ORIENTATIONS))
def test_exif_orientation(orientation: int) -> None:
    src = pattern()
    exif = Image.Exif()
    exif[0x0112] = orientation
    out = np.asarray(decode_image(encode(Image.fromarray(src), "PNG", exif=exif)))
    assert np.array_equal(out, ORIENTATIONS[orientation](src))


@pytest.mark.parametrize("orientation", sorted(ORIENTATIONS))
def test_jpeg_size_hint_drafts_in_the_upright_frame(orientation: int) -> None:
    # 320x192 stored; the hint asks for a quarter of the upright size, so libjpeg decodes at 1/4.
    src = np.kron(pattern(40, 24), np.ones((8, 8, 1), np.uint8))  # [192, 320, 3], 8x8 blocks
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(Image.fromarray(src), "JPEG", quality=95, subsampling=0, exif=exif)
    full = np.asarray(decode_image(data)).astype(np.int16)
    seen: list[tuple[int, int]] = []

    def quarter(height: int, width: int) -> tuple[int, int]:
        seen.append((height, width))
        return height // 4, width // 4

    got = decode_image_sized(data, min_size=quarter)
    up_h, up_w = full.shape[:2]
    assert seen == [(up_h, up_w)] and got.full_size == (up_h, up_w)  # hint sees the upright size
    assert (got.image.height, got.image.width) == (up_h // 4, up_w // 4)
    # Same picture, same orientation: each drafted pixel is its 4x4 block of the full decode.
    pooled = full.reshape(up_h // 4, 4, up_w // 4, 4, 3).mean(axis=(1, 3))
    assert np.abs(np.asarray(got.image) - pooled).mean() < 4.0


def test_size_hint_decodes_at_full_size_when_half_would_undershoot() -> None:
    data = encode(Image.fromarray(pattern(200, 100)), "JPEG", quality=90)
    got = decode_image_sized(data, min_size=lambda h, w: (h // 2 + 1, w // 2))
    assert got.image.size == (200, 100) and got.full_size == (100, 200)


def test_size_hint_is_ignored_for_other_formats_and_its_errors_propagate() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # PNG: EXIF read after the pixels, so full_size is the rotated output size
    got = decode_image_sized(
        encode(Image.fromarray(pattern()), "PNG", exif=exif), min_size=lambda h, w: (1, 1)
    )
    assert got.image.size == (24, 40) and got.full_size == (40, 24)

    def refuse(height: int, width: int) -> tuple[int, int]:
        raise BadMedia(f"{width}x{height} refused by the hint")

    with pytest.raises(BadMedia, match="40x24 refused"):
        decode_image(encode(Image.fromarray(pattern()), "JPEG"), item="x", min_size=refuse)


@pytest.mark.filterwarnings("ignore:Corrupt EXIF data")
def test_corrupt_exif_keeps_the_image() -> None:
    img = Image.fromarray(pattern())
    data = encode(img, "JPEG", exif=b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\xff\xff")
    assert decode_image(data).size == (40, 24)


def _reference_rgb(data: bytes) -> np.ndarray:
    """The reference rule (transformers' ``convert_to_rgb``, used by Qwen2VLImageProcessor),
    computed independently in float: straight alpha over opaque white when the image has an
    alpha band or a ``transparency`` entry, otherwise Pillow's plain RGB conversion."""
    img = Image.open(io.BytesIO(data))
    if "A" not in img.getbands() and "transparency" not in img.info:
        return np.asarray(img.convert("RGB"))
    rgba = np.asarray(img.convert("RGBA")).astype(np.float64)  # [H, W, 4]
    alpha = rgba[..., 3:4] / 255.0
    return np.round(rgba[..., :3] * alpha + 255.0 * (1.0 - alpha)).astype(np.uint8)


def _mode_cases() -> dict[str, bytes]:
    rgba = np.concatenate(
        [pattern(), np.tile(np.arange(0, 240, 6, dtype=np.uint8), (24, 1))[..., None]], axis=-1
    )
    grey = pattern()[..., 0]
    pal = Image.fromarray(pattern()).quantize(16)
    pal.info["transparency"] = 3
    la = Image.fromarray(np.stack([grey, grey[::-1]], axis=-1), mode="LA")
    return {
        "rgba_png": encode(Image.fromarray(rgba), "PNG"),
        "rgba_webp": encode(Image.fromarray(rgba), "WEBP", lossless=True),
        "la_png": encode(la, "PNG"),
        "l_png": encode(Image.fromarray(grey), "PNG"),
        "l_jpeg": encode(Image.fromarray(grey), "JPEG"),
        "one_bit_png": encode(Image.fromarray(grey > 100), "PNG"),
        "palette_transparency_png": encode(pal, "PNG"),
        "palette_transparency_gif": encode(pal, "GIF", transparency=3),
        "palette_png": encode(Image.fromarray(pattern()).quantize(16), "PNG"),
        "cmyk_jpeg": encode(Image.fromarray(pattern()).convert("CMYK"), "JPEG"),
    }


@pytest.mark.parametrize("case", sorted(_mode_cases()))
def test_colour_modes_match_reference_processor(case: str) -> None:
    data = _mode_cases()[case]
    out = decode_image(data)
    assert out.mode == "RGB"
    diff = np.abs(np.asarray(out).astype(int) - _reference_rgb(data).astype(int))
    assert diff.max() <= 1  # Pillow composites in integer arithmetic: off by at most one


def test_transparency_is_composited_on_white() -> None:
    rgba = np.zeros((4, 4, 4), np.uint8)  # fully transparent black
    rgba[0, 0] = (10, 20, 30, 255)  # one opaque pixel
    out = np.asarray(decode_image(encode(Image.fromarray(rgba), "PNG")))
    assert tuple(out[0, 0]) == (10, 20, 30)
    assert (out[1:] == 255).all()


def test_sixteen_bit_grey_is_scaled_not_clipped() -> None:
    ramp = (np.arange(256 * 4, dtype=np.uint32).reshape(4, 256) * 64).astype(np.uint16)  # 0..65472
    data = encode(Image.fromarray(ramp), "PNG")
    assert Image.open(io.BytesIO(data)).mode.startswith("I")
    out = np.asarray(decode_image(data))
    assert out.shape == (4, 256, 3)
    assert np.array_equal(out[..., 0], (ramp >> 8).astype(np.uint8))
    assert (out[..., 0] == out[..., 1]).all() and (out[..., 1] == out[..., 2]).all()


def test_animated_gif_uses_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=50)
    out = np.asarray(decode_image(buf.getvalue()))
    assert tuple(out[0, 0]) == (255, 0, 0)


def test_pixel_cap_is_checked_from_the_header() -> None:
    # 9000x9000 is below Pillow's own bomb threshold, so this is our check: it must fire on the
    # header (the tiny IDAT would otherwise surface as a truncation error after decoding).
    with pytest.raises(MediaTooLarge, match=r"9000x9000 = 81000000 pixels") as err:
        decode_image(png_bomb(9000, 9000), item="bomb")
    assert err.value.status == 413 and err.value.item == "bomb"
    with pytest.raises(MediaTooLarge, match="pixel limit"):
        decode_image(small_image("PNG"), MediaLimits(max_image_pixels=64 * 48 - 1))
    assert decode_image(small_image("PNG"), MediaLimits(max_image_pixels=64 * 48)).size == (64, 48)


def test_byte_cap() -> None:
    data = small_image("PNG")
    with pytest.raises(MediaTooLarge, match="byte limit"):
        decode_image(data, MediaLimits(max_bytes=len(data) - 1))


def test_video_bytes_are_not_an_image() -> None:
    with pytest.raises(UnsupportedMedia, match="expected an image"):
        decode_image(b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00mp42isom" + bytes(32), item="clip")


@pytest.fixture(scope="module")
def corpus() -> dict[str, bytes]:
    return bad_image_corpus()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_input_corpus(corpus: dict[str, bytes], name: str) -> None:
    data = corpus[name]
    expected = EXPECTED[name]
    if expected is None:
        assert decode_image(data, item=name).mode == "RGB"
        return
    with pytest.raises(expected) as err:
        decode_image(data, item=name)
    assert type(err.value) is expected
    assert err.value.item == name and str(err.value).startswith(f"{name}: ")
    assert len(err.value.message) > 10  # says what was wrong


def test_corpus_through_sniff(corpus: dict[str, bytes]) -> None:
    """What sniff refuses, it refuses with the same class decode_image reports; what it lets through
    is an image (or a video that decode_image must refuse)."""
    assert set(corpus) == set(EXPECTED)
    for name, data in corpus.items():
        try:
            kind = sniff(data)
        except MediaError as exc:
            assert type(exc) is EXPECTED[name], name
        else:
            assert kind.modality == "image" or EXPECTED[name] is UnsupportedMedia, name


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["PNG", "JPEG", "GIF", "WEBP", "BMP"]), st.floats(0.0, 1.0), st.integers(0, 2**32 - 1))
def test_damaged_images_never_crash(fmt: str, cut: float, seed: int) -> None:
    """Truncated and bit-flipped images: an RGB image or a typed MediaError, nothing else."""
    data = bytearray(small_image(fmt, (24, 16)))
    rng = np.random.default_rng(seed)
    for pos in rng.integers(0, len(data), size=3):
        data[pos] ^= 1 << int(rng.integers(0, 8))
    data = data[: int(len(data) * cut)]
    try:
        img = decode_image(bytes(data), item="fuzz")
    except MediaError as exc:
        assert exc.item == "fuzz"
        return
    assert img.mode == "RGB"
