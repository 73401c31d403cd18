"""Frozen configuration for media handling. Everything that changes the patches is in
``PreprocessConfig`` so that it can be folded into the MediaKey."""

from __future__ import annotations

from dataclasses import dataclass, field

# CLIP normalization used by Qwen2-VL's processor.
CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class PreprocessConfig:
    """Qwen2-VL preprocessing parameters (the defaults match ``Qwen2VLImageProcessor``)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    # Video: frames sampled at `fps`, count clamped to [min_frames, max_frames] and made even.
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 28 * 28 * 768
    # Total pixel budget of one video's frames: 90% of 128000 tokens, the rule transformers'
    # Qwen2VLVideoProcessor applies with cap_pixels_per_frame=True (and qwen-vl-utils by default).
    video_total_pixels: int = int(128000 * 28 * 28 * 0.9)

    @property
    def factor(self) -> int:
        """Side lengths are multiples of this (patch_size * merge_size = 28)."""
        return self.patch_size * self.merge_size

    @property
    def row_size(self) -> int:
        """Values in one pixel_values row: 3 * temporal_patch * patch * patch = 1176."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    def key_params(self) -> dict[str, object]:
        """The parameters that change the output, for the MediaKey digest."""
        return {
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "merge_size": self.merge_size,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "fps": self.fps,
            "min_frames": self.min_frames,
            "max_frames": self.max_frames,
            "video_min_pixels": self.video_min_pixels,
            "video_max_pixels": self.video_max_pixels,
            "video_total_pixels": self.video_total_pixels,
        }


@dataclass(frozen=True)
class MediaLimits:
    """Caps that protect the service from hostile or accidental huge inputs."""

    max_bytes: int = 64 * 1024 * 1024
    max_image_pixels: int = 64 * 1024 * 1024  # checked from the header, before the full decode
    max_video_seconds: float = 3600.0
    max_video_frames: int = 768
    max_video_pixels_per_frame: int = 3840 * 2160


@dataclass(frozen=True)
class FetchConfig:
    """Downloads through one shared aiohttp session."""

    connect_timeout_s: float = 5.0
    total_timeout_s: float = 30.0
    max_bytes: int = 64 * 1024 * 1024
    max_redirects: int = 5
    limit_per_host: int = 16
    limit_total: int = 128
    # SSRF guard: private/loopback/link-local/... targets are refused unless allowlisted here.
    allow_hosts: tuple[str, ...] = ()
    allow_cidrs: tuple[str, ...] = ()
    # `file:` URLs are refused unless a root is configured; then only paths under it are served.
    file_root: str | None = None
    user_agent: str = "epd/0.1"
    extra_headers: dict[str, str] = field(default_factory=dict)
