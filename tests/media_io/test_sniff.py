"""Magic-byte sniffing: real files of every supported format, and what must be refused."""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from media_io.errors import BadMedia, MediaError, UnsupportedMedia
from media_io.sniff import AUDIO_FORMATS, IMAGE_FORMATS, VIDEO_FORMATS, MediaKind, sniff
from tests.media_io.bad_media import HTML_PAGE, small_image


@pytest.mark.parametrize(
    ("pil_format", "expected"),
    [("JPEG", "jpeg"), ("PNG", "png"), ("WEBP", "webp"), ("GIF", "gif"), ("BMP", "bmp")],
)
def test_images_written_by_pillow(pil_format: str, expected: str) -> None:
    assert sniff(small_image(pil_format)) == MediaKind("image", expected)


def _encode_video(container: str, codec: str) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=4)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(2):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), i * 60, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("container", "codec", "expected"),
    [
        ("mp4", "mpeg4", "mp4"),
        ("mov", "mpeg4", "mov"),
        ("matroska", "mpeg4", "mkv"),
        ("webm", "libvpx", "webm"),
        ("avi", "mpeg4", "avi"),
    ],
)
def test_videos_written_by_ffmpeg(container: str, codec: str, expected: str) -> None:
    if codec not in av.codecs_available:
        pytest.skip(f"{codec} not built into this PyAV")
    assert sniff(_encode_video(container, codec)) == MediaKind("video", expected)


def test_quicktime_without_ftyp() -> None:
    assert sniff(struct.pack(">I", 16) + b"moov" + bytes(8)) == MediaKind("video", "mov")


def test_supported_format_sets() -> None:
    assert {"jpeg", "png", "webp", "gif", "bmp"} == IMAGE_FORMATS
    assert {"mp4", "mov", "mkv", "webm", "avi"} == VIDEO_FORMATS


def test_audio_format_set() -> None:
    assert {"wav", "flac", "mp3", "ogg", "m4a", "aac"} == AUDIO_FORMATS


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b"\xff\xfb\x90\x64" + bytes(8), MediaKind("audio", "mp3")),  # MPEG-1 layer III, no ID3 tag
        (b"\xff\xf3\x64\xc4" + bytes(8), MediaKind("audio", "mp3")),  # MPEG-2 layer III
        (b"\xff\xf1\x50\x80" + bytes(8), MediaKind("audio", "aac")),  # ADTS, MPEG-4, no CRC
        (b"ID3\x04\x00" + bytes(8), MediaKind("audio", "mp3")),
        (b"\x00\x00\x00\x20ftypM4A \x00\x00\x02\x00", MediaKind("audio", "m4a")),
    ],
)
def test_audio_headers(head: bytes, expected: MediaKind) -> None:
    assert sniff(head) == expected


@pytest.mark.parametrize("head", [b"\xff\xfb\xf0\x64", b"\xff\xfb\x9c\x64", b"\xff\xeb\x90\x64"])
def test_invalid_frame_headers_are_not_audio(head: bytes) -> None:
    # a free-format or "bad" bitrate index, a reserved sample rate, a reserved version: not MP3
    with pytest.raises(UnsupportedMedia):
        sniff(head + bytes(8))


def test_empty_is_bad_media() -> None:
    with pytest.raises(BadMedia, match="empty") as err:
        sniff(b"")
    assert err.value.status == 400


@pytest.mark.parametrize(
    "page",
    [
        HTML_PAGE,
        b"\xef\xbb\xbf  \n<!doctype HTML><html></html>",
        b"<HTML><BODY>Access denied</BODY></HTML>",
        b"\n\n<head><meta charset=utf-8></head>",
    ],
)
def test_html_is_unsupported_and_says_so(page: bytes) -> None:
    with pytest.raises(UnsupportedMedia, match="HTML") as err:
        sniff(page)
    assert err.value.status == 415


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"hello, this is text", "text"),
        (b'{"error": "not found"}', "JSON"),
        ("caf\u00e9 \u2615 ".encode() * 60, "text"),  # multi-byte characters cut at the sniff window
        (b"BM but just words in a file", "text"),  # "BM" alone is not a BMP
        (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "SVG"),
        (b"%PDF-1.7\n", "PDF"),
        (b"II*\x00\x08\x00\x00\x00", "TIFF"),
        (b"\x00\x00\x00\x1cftypheic\x00\x00\x00\x00mif1heic", "HEIF"),
        (b"\x00\x00\x00\x1cftypavif\x00\x00\x00\x00avifmif1", "HEIF/AVIF"),
        (b"PK\x03\x04" + bytes(26), "ZIP"),
        (bytes(range(256)), "unrecognized"),
    ],
)
def test_unsupported_inputs_are_named(data: bytes, needle: str) -> None:
    with pytest.raises(UnsupportedMedia, match=needle):
        sniff(data)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_sniff_is_total(data: bytes) -> None:
    """Any bytes: a MediaKind or a typed MediaError, never another exception."""
    try:
        kind = sniff(data)
    except MediaError:
        return
    # (audio joined the modalities: the lookup names all three)
    assert (
        kind.format in {"image": IMAGE_FORMATS, "video": VIDEO_FORMATS, "audio": AUDIO_FORMATS}[kind.modality]
    )


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=2000))
def test_sniff_reads_only_a_prefix(tail: bytes) -> None:
    """Appending bytes never changes the verdict of a recognised prefix (only headers matter)."""
    png = small_image("PNG")
    assert sniff(png + tail) == sniff(png)
