"""The libjpeg fast path: Pillow's pixels, reduced-scale decode, per-thread buffers, and fallback
(``None``) for everything it does not handle, so the Pillow path keeps owning the typed errors."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
from PIL import Image

from media_io.config import MediaLimits
from media_io.errors import BadMedia, MediaTooLarge, UnsupportedMedia
from media_io.jpeg import JPEG_KERNEL_AVAILABLE, ThreadDecodedJpeg, decode_jpeg_reusing
from media_io.preprocess import get_backend
from media_io.preprocess.synthetic import encode, synthetic_photo
from tests.media_io.bad_media import EXPECTED, bad_image_corpus

pytestmark = pytest.mark.skipif(not JPEG_KERNEL_AVAILABLE, reason="the libjpeg decoder was not built")


def _keep_all(height: int, width: int) -> tuple[int, int]:
    return height, width


def _jpeg(img: Image.Image, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", **kw)
    return buf.getvalue()


def _rgb(decoded: ThreadDecodedJpeg | None) -> np.ndarray:
    assert decoded is not None
    return np.asarray(decoded.image)[..., :3]  # [H, W, 3] uint8 (a copy)


@pytest.mark.parametrize(
    ("size", "options"),
    [
        ((640, 480), {"quality": 90}),  # 4:2:0 chroma: fancy upsampling must match Pillow's
        ((333, 217), {"quality": 75, "subsampling": 2}),  # sides that are not multiples of the MCU
        ((96, 64), {"quality": 95, "subsampling": 0}),
        ((300, 200), {"quality": 85, "progressive": True}),
    ],
)
def test_full_scale_decode_equals_pillow(size: tuple[int, int], options: dict[str, object]) -> None:
    data = _jpeg(synthetic_photo(*size, seed=sum(size)), **options)
    got = _rgb(decode_jpeg_reusing(data, min_size=_keep_all))
    assert np.array_equal(got, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


def test_greyscale_becomes_three_equal_channels() -> None:
    data = _jpeg(synthetic_photo(120, 90, seed=4).convert("L"))
    decoded = decode_jpeg_reusing(data, min_size=_keep_all)
    assert np.array_equal(_rgb(decoded), np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


@pytest.mark.parametrize(
    ("target", "scaled"),
    [
        ((300, 400), (300, 400)),  # needs every pixel
        ((150, 200), (150, 200)),  # exactly half: 1/2
        ((151, 200), (300, 400)),  # a row more than half: full size
        ((70, 90), (75, 100)),  # 1/4
        ((10, 10), (38, 50)),  # 1/8 is the smallest libjpeg offers
    ],
)
def test_scale_is_the_smallest_eighth_that_covers_the_target(
    target: tuple[int, int], scaled: tuple[int, int]
) -> None:
    data = encode(synthetic_photo(400, 300, seed=1))
    seen: list[tuple[int, int]] = []

    def hint(height: int, width: int) -> tuple[int, int]:
        seen.append((height, width))
        return target

    decoded = decode_jpeg_reusing(data, min_size=hint)
    assert decoded is not None and seen == [(300, 400)]  # the hint gets the full size
    assert decoded.full_size == (300, 400)
    assert (decoded.image.height, decoded.image.width) == scaled


def test_half_scale_stays_close_to_a_full_decode() -> None:
    data = encode(synthetic_photo(800, 600, seed=2))
    half = _rgb(decode_jpeg_reusing(data, min_size=lambda h, w: (h // 2, w // 2))).astype(np.int16)
    full = Image.open(io.BytesIO(data)).convert("RGB").reduce(2)  # 2x2 box average
    assert half.shape == (300, 400, 3)
    assert np.abs(half - np.asarray(full, dtype=np.int16)).mean() < 3


def test_a_thread_reuses_its_buffer_and_threads_do_not_share() -> None:
    a, b = (encode(synthetic_photo(64, 48, seed=s)) for s in (1, 2))
    first = decode_jpeg_reusing(a, min_size=_keep_all)
    assert first is not None
    kept = np.asarray(first.image).copy()
    second = decode_jpeg_reusing(b, min_size=_keep_all)
    assert second is not None
    # Same buffer: the first view now shows the second image (the documented contract).
    assert np.array_equal(np.asarray(first.image), np.asarray(second.image))
    assert not np.array_equal(kept, np.asarray(second.image))

    datas = [encode(synthetic_photo(160 + 8 * i, 120, seed=i)) for i in range(6)]
    expected = [np.asarray(Image.open(io.BytesIO(d)).convert("RGB")) for d in datas]
    failures: list[str] = []

    def worker(k: int) -> None:
        for _ in range(15):
            for i in range(k % 2, len(datas), 2):
                if not np.array_equal(_rgb(decode_jpeg_reusing(datas[i], min_size=_keep_all)), expected[i]):
                    failures.append(f"thread {k} image {i}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_what_the_fast_path_does_not_handle_returns_none() -> None:
    photo = synthetic_photo(64, 48, seed=3)
    png = io.BytesIO()
    photo.save(png, format="PNG")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise
    full = encode(photo)
    cases = {
        "png": png.getvalue(),
        "cmyk": _jpeg(photo.convert("CMYK")),
        "exif rotation": _jpeg(photo, exif=exif),
        "truncated": full[: len(full) // 2],
    }
    for name, data in cases.items():
        assert decode_jpeg_reusing(data, min_size=_keep_all) is None, name


def test_header_checks_raise_before_any_decode() -> None:
    data = encode(synthetic_photo(64, 48, seed=3))
    with pytest.raises(MediaTooLarge, match="pixel"):
        decode_jpeg_reusing(data, MediaLimits(max_image_pixels=64 * 48 - 1), min_size=_keep_all)
    with pytest.raises(UnsupportedMedia):
        decode_jpeg_reusing(b"<html>not an image</html>", min_size=_keep_all)
    with pytest.raises(BadMedia, match="blue"):

        def refuse(height: int, width: int) -> tuple[int, int]:
            raise BadMedia("too blue", "x")

        decode_jpeg_reusing(data, min_size=refuse)


def test_cpu_backend_raises_the_typed_error_for_every_bad_input() -> None:
    """The fast path hands what it cannot decode back to Pillow's path: errors stay typed."""
    backend = get_backend("cpu")
    for name, data in bad_image_corpus().items():
        expected = EXPECTED[name]
        if expected is None:
            backend.image_bytes(data, item=name)
            continue
        with pytest.raises(expected):
            backend.image_bytes(data, item=name)


@pytest.mark.parametrize("size", [(644, 476), (56, 56)])
def test_cpu_backend_on_a_jpeg_already_at_its_target_size(size: tuple[int, int]) -> None:
    """No resize: the patches come straight from the thread's decode buffer."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    data = encode(synthetic_photo(*size, seed=5))
    got = get_backend("cpu").image_bytes(data).pixel_values
    ref = Qwen2VLImageProcessorPil()(images=Image.open(io.BytesIO(data)), return_tensors="pt")
    expected = np.asarray(ref["pixel_values"])
    assert got.shape == expected.shape
    assert float(np.abs(got.numpy() - expected).max()) < 1e-5
