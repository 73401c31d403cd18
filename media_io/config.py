"""Frozen configuration for media handling. Everything that changes the patches is in
``PreprocessConfig`` so that it can be folded into the MediaKey."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, get_args

# CLIP normalization used by Qwen2-VL's processor.
CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)

# Which frames of a video are sampled, at what size, and what time each temporal pair shows: one
# rule per processor family, implemented in ``media_io.video_sampling`` (see there for each).
# The processor files of a checkpoint choose it (``media_io.processor_config``).
VideoSamplingRule = Literal["qwen2_vl", "mimo_v2"]
VIDEO_SAMPLING_RULES: tuple[str, ...] = get_args(VideoSamplingRule)


@dataclass(frozen=True)
class PreprocessConfig:
    """Preprocessing parameters. The defaults are Qwen2-VL's (``Qwen2VLImageProcessor`` and
    ``Qwen2VLVideoProcessor``); a checkpoint's processor files override them
    (``media_io.processor_config``). Patch and merge size are parameters everywhere: MiMo-V2.5
    has patch 16, merge 2 (factor 32, rows of 3 * 2 * 16 * 16 = 1536 values)."""

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
    # How the frame indices, the per-frame pixel cap and the pair timestamps are computed from
    # the numbers above (``media_io.video_sampling``).
    video_sampling: VideoSamplingRule = "qwen2_vl"

    def __post_init__(self) -> None:
        for name in (
            "patch_size",
            "temporal_patch_size",
            "merge_size",
            "min_pixels",
            "max_pixels",
            "min_frames",
            "max_frames",
            "video_min_pixels",
            "video_max_pixels",
            "video_total_pixels",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"PreprocessConfig.{name} must be a positive int, got {value!r}")
        if isinstance(self.fps, bool) or not isinstance(self.fps, (int, float)) or not self.fps > 0:
            raise ValueError(f"PreprocessConfig.fps must be a positive number, got {self.fps!r}")
        # Canonical types, so that equal settings hash (and key) equally: 1 and 1.0 fps, lists
        # and tuples of mean/std.
        object.__setattr__(self, "fps", float(self.fps))
        if self.video_sampling not in VIDEO_SAMPLING_RULES:
            raise ValueError(
                f"PreprocessConfig.video_sampling must be one of {list(VIDEO_SAMPLING_RULES)}, "
                f"got {self.video_sampling!r}"
            )
        for name in ("image_mean", "image_std"):
            values = tuple(float(x) for x in getattr(self, name))
            if len(values) != 3:
                raise ValueError(f"PreprocessConfig.{name} must have 3 values, got {list(values)}")
            object.__setattr__(self, name, values)
        if not all(s > 0 for s in self.image_std):
            raise ValueError(f"PreprocessConfig.image_std must be positive, got {list(self.image_std)}")

    @property
    def factor(self) -> int:
        """Side lengths are multiples of this: patch_size * merge_size (Qwen2-VL 28, MiMo-V2.5 32)."""
        return self.patch_size * self.merge_size

    @property
    def row_size(self) -> int:
        """Values in one pixel_values row: 3 * temporal_patch * patch * patch (Qwen2-VL 1176,
        MiMo-V2.5 1536)."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    def key_params(self) -> dict[str, object]:
        """The parameters that change the output, for the MediaKey digest: every field (each one
        changes the pixels, the grid or the sampled frames), so a new field enters the key by
        being declared here."""
        out: dict[str, object] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


@dataclass(frozen=True)
class MediaLimits:
    """Caps that protect the service from hostile or accidental huge inputs."""

    max_bytes: int = 64 * 1024 * 1024
    max_image_pixels: int = 64 * 1024 * 1024  # checked from the header, before the full decode
    max_video_seconds: float = 3600.0
    max_video_frames: int = 768
    max_video_pixels_per_frame: int = 3840 * 2160
    # an audio clip's length (from its header, then counted while decoding): its samples and
    # features grow with it (one hour at 24 kHz: 345 MB of float32 samples)
    max_audio_seconds: float = 3600.0
    # an audio stream's header, checked before anything is decoded: a 1 Hz "hour" is a few KB that
    # resamples to gigabytes; no speech or music codec runs below 4 kHz or above 384 kHz
    min_audio_sample_rate: int = 4000
    max_audio_sample_rate: int = 384_000
    max_audio_channels: int = 8
    # all audio and video of one request together (``media_io.media_seconds``): the caps above
    # bound one clip, this a request of many
    max_request_media_seconds: float = 3600.0


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
