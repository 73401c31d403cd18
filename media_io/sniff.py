"""What kind of media some bytes are, from their magic bytes alone.

Content-Type headers and file extensions are not trusted: origins mislabel media, and an error
page served with ``image/jpeg`` is common. ``sniff`` reads at most the first few hundred bytes,
so it is cheap enough to run on the event loop.

Supported: images jpeg, png, webp, gif, bmp; videos mp4, mov, mkv, webm, avi; audio wav, flac,
mp3, ogg (Vorbis or Opus), m4a (AAC in MP4) and raw AAC (ADTS). Recognized but refused with a
specific message (415): HTML/XML/SVG, plain text, PDF, TIFF, HEIF/AVIF, JPEG 2000,
ICO, archives. Empty input is BadMedia (400).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from media_io.errors import BadMedia, UnsupportedMedia

Modality = Literal["image", "video", "audio"]


class MediaKind(NamedTuple):
    """The modality and container/codec format of some media bytes."""

    modality: Modality
    # image: "jpeg" | "png" | "webp" | "gif" | "bmp"; video: "mp4" | "mov" | "mkv" | "webm" | "avi";
    # audio: "wav" | "flac" | "mp3" | "ogg" | "m4a" | "aac"
    format: str


IMAGE_FORMATS: frozenset[str] = frozenset({"jpeg", "png", "webp", "gif", "bmp"})
VIDEO_FORMATS: frozenset[str] = frozenset({"mp4", "mov", "mkv", "webm", "avi"})
AUDIO_FORMATS: frozenset[str] = frozenset({"wav", "flac", "mp3", "ogg", "m4a", "aac"})
# ISO-BMFF major brands of audio-only files (iTunes audio, audiobooks, 3GPP audio).
_AUDIO_BRANDS = frozenset({b"M4A ", b"M4B ", b"M4P ", b"F4A ", b"F4B "})

# Sizes of the BMP info header variants (BITMAPCOREHEADER .. BITMAPV5HEADER). "BM" alone is too
# weak a signature: plenty of text starts with "BM".
_BMP_DIB_SIZES = frozenset({12, 16, 40, 52, 56, 64, 108, 124})
# ISO-BMFF brands that are still images, not video.
_HEIF_BRANDS = frozenset(
    {b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1", b"avif", b"avis"}
)
# QuickTime files may lack `ftyp` and start directly with one of these atoms.
_QT_ATOMS = frozenset({b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot"})
_MARKUP_PREFIXES = (b"<!doctype html", b"<html", b"<head", b"<body", b"<script", b"<!--", b"<meta", b"<title")
_OTHER_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"%PDF-", "PDF documents"),
    (b"II*\x00", "TIFF images"),
    (b"MM\x00*", "TIFF images"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG 2000 images"),
    (b"\xff\x4f\xff\x51", "JPEG 2000 images"),
    (b"\x00\x00\x01\x00", "ICO icons"),
    (b"PK\x03\x04", "ZIP archives"),
    (b"\x1f\x8b", "gzip data"),
    (b"8BPS", "Photoshop documents"),
)


def sniff(data: bytes) -> MediaKind:
    """The MediaKind of ``data`` from its leading bytes.

    Raises BadMedia for empty input and UnsupportedMedia (415) for anything that is not one of
    the supported image or video formats, with a message that says what it looks like instead.
    """
    if not data:
        raise BadMedia("empty media (0 bytes)")
    head = bytes(data[:512])
    kind = _image_kind(head) or _audio_kind(head) or _video_kind(head)
    if kind is not None:
        return kind
    raise UnsupportedMedia(_describe_unsupported(head))


def _image_kind(h: bytes) -> MediaKind | None:
    if h.startswith(b"\xff\xd8\xff"):
        return MediaKind("image", "jpeg")
    if h.startswith(b"\x89PNG\r\n\x1a\n"):
        return MediaKind("image", "png")
    if h.startswith((b"GIF87a", b"GIF89a")):
        return MediaKind("image", "gif")
    if h[:4] == b"RIFF" and h[8:12] == b"WEBP":
        return MediaKind("image", "webp")
    if h[:2] == b"BM" and len(h) >= 18 and int.from_bytes(h[14:18], "little") in _BMP_DIB_SIZES:
        return MediaKind("image", "bmp")
    return None


def _audio_kind(h: bytes) -> MediaKind | None:
    if h[:4] == b"RIFF" and h[8:12] == b"WAVE":
        return MediaKind("audio", "wav")
    if h.startswith(b"fLaC"):
        return MediaKind("audio", "flac")
    if h.startswith(b"OggS"):
        # Ogg also carries Theora video, rare enough on the web that Ogg means Vorbis or Opus here;
        # a file with no audio stream is refused by the decoder, naming it
        return MediaKind("audio", "ogg")
    if h[4:8] == b"ftyp" and h[8:12] in _AUDIO_BRANDS:
        return MediaKind("audio", "m4a")
    if h.startswith(b"ID3"):  # an ID3v2 tag leads most MP3 files
        return MediaKind("audio", "mp3")
    if len(h) >= 4 and h[0] == 0xFF and h[1] & 0xE0 == 0xE0:
        # an MPEG audio frame header: 11 sync bits, version (2), layer (2). Layer 00 is ADTS AAC
        # (whose version bits are 1x); MPEG-1/2 layers I-III are MP3 and its elders.
        version, layer = (h[1] >> 3) & 0b11, (h[1] >> 1) & 0b11
        bitrate, rate = h[2] >> 4, (h[2] >> 2) & 0b11
        if layer == 0:
            return MediaKind("audio", "aac") if h[1] & 0xF6 == 0xF0 else None
        if version != 0b01 and bitrate not in (0, 0b1111) and rate != 0b11:
            return MediaKind("audio", "mp3")
    return None


def _video_kind(h: bytes) -> MediaKind | None:
    if h[4:8] == b"ftyp":
        brand = h[8:12]
        if brand in _HEIF_BRANDS:
            return None  # a still-image container; refused by _describe_unsupported
        return MediaKind("video", "mov" if brand == b"qt  " else "mp4")
    if h[4:8] in _QT_ATOMS:
        return MediaKind("video", "mov")
    if h.startswith(b"\x1a\x45\xdf\xa3"):
        # EBML header; its DocType element says which flavor.
        return MediaKind("video", "webm" if b"webm" in h[:64] else "mkv")
    if h[:4] == b"RIFF" and h[8:12] == b"AVI ":
        return MediaKind("video", "avi")
    return None


def _describe_unsupported(h: bytes) -> str:
    if h[4:8] == b"ftyp" and h[8:12] in _HEIF_BRANDS:
        return f"HEIF/AVIF images (brand {h[8:12].decode('latin-1')!r}) are not supported"
    for magic, what in _OTHER_MAGIC:
        if h.startswith(magic):
            return f"{what} are not supported"
    text = h.lstrip(b"\xef\xbb\xbf").lstrip().lower()
    if text.startswith(_MARKUP_PREFIXES):
        return "got an HTML page, not media (the URL may serve an error or login page)"
    if text.startswith(b"<?xml") or text.startswith(b"<svg"):
        return "SVG/XML documents are not supported"
    if text.startswith((b"{", b"[")) and _is_text(h):
        return "got JSON text, not media"
    if _is_text(h):
        return "got plain text, not media"
    return f"unrecognized media format (first bytes {h[:8].hex(' ')})"


def _is_text(h: bytes) -> bool:
    try:
        s = h.decode("utf-8")
    except UnicodeDecodeError as exc:
        # A multi-byte character cut at the 512-byte boundary is still text.
        if exc.start < len(h) - 3:
            return False
        s = h[: exc.start].decode("utf-8")
    return all(c.isprintable() or c in "\t\n\r\f" for c in s)
