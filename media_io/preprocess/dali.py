"""The ``dali`` backend: NVIDIA DALI pipelines for decode, resize, normalize and patchify.

With CUDA, JPEGs are decoded by nvJPEG (``device="mixed"``, fancy chroma upsampling on, so the
pixels match libjpeg-turbo's) and everything after runs on the GPU; the patches come back as a
CUDA tensor. Without CUDA the same graph runs on DALI's CPU operators (``device_id=None``).

Three pipelines are built once per backend and reused; per-sample target sizes travel as
``external_source`` inputs, so one pipeline serves every image shape:

    encoded  bytes --decoders.image--> HWC u8 -+
    pixels   HWC u8 ---------------------------+-> resize(cubic, antialias, to smart_resize target)
                                               |   -> crop_mirror_normalize(cfg mean/std, CHW float32)
                                               |   -> reshape [C, gh/m, m, p, gw/m, m, p]
                                               |   -> transpose -> [gh/m, gw/m, m, m, C, p, p]
                                               |   -> stack(x, ..., x): tp copies on a new temporal axis
                                               |   -> reshape [N, C*tp*p*p]
    frames   FHWC u8 (T padded to a multiple of tp) -> the same with a leading (gt, tp) split

Patch p, merge m, temporal patch tp, mean/std and the pixel bounds are the backend's
``PreprocessConfig`` (Qwen2-VL: 14 / 2 / 2, rows of 1176; MiMo-V2.5: 16 / 2 / 2, rows of 1536);
the pipelines are built for it, so one backend instance serves one config.

Only JPEGs (RGB or greyscale) go through DALI's decoder. Other formats, and JPEGs whose colour
handling differs (CMYK), are decoded by ``media_io.image.decode_image`` (Pillow: transparency
composited onto white, as transformers does) and enter through the ``pixels`` pipeline.

DALI's cubic filter is Catmull-Rom like Pillow's bicubic (a = -0.5) and widens its support when
downscaling; results differ from Pillow by rounding only (see the parity tests).
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from media_io.config import MediaLimits, PreprocessConfig
from media_io.errors import BadMedia, MediaError
from media_io.image import decode_image, to_rgb
from media_io.preprocess.patchify import Patches
from media_io.preprocess.resize import smart_resize, video_frame_target
from media_io.sniff import sniff

_EXIF_ORIENTATION_TAG = 0x0112
_TRANSPOSING_ORIENTATIONS = frozenset({5, 6, 7, 8})


class _Pipe:
    """One built DALI pipeline plus the lock that serializes feed + run on it."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.lock = threading.Lock()

    def run(self, feeds: dict[str, list[np.ndarray]]) -> Any:
        with self.lock:
            for name, data in feeds.items():
                self.pipe.feed_input(name, data)
            (out,) = self.pipe.run()
            return out


class DaliBackend:
    """Preprocessing with NVIDIA DALI; see ``PreprocessBackend`` for the contract.

    Args:
        cfg: preprocessing parameters.
        max_batch: largest number of samples per pipeline run (``images`` splits longer lists).
        num_threads: DALI CPU worker threads.
        use_gpu: ``None`` picks CUDA when available; ``True`` requires it; ``False`` forces CPU.
    """

    name = "dali"

    def __init__(
        self,
        cfg: PreprocessConfig = PreprocessConfig(),
        max_batch: int = 8,
        num_threads: int = 2,
        use_gpu: bool | None = None,
    ) -> None:
        self.cfg = cfg
        self.max_batch = max_batch
        self.num_threads = num_threads
        self.use_gpu = torch.cuda.is_available() if use_gpu is None else use_gpu
        self._pipes: dict[str, _Pipe] = {}
        self._build_lock = threading.Lock()

    # ----------------------------------------------------------------------------------- public

    def image(self, img: Image.Image, item: str | None = None) -> Patches:
        return self.images_with_items([img], [item])[0]

    def images(self, imgs: Sequence[Image.Image]) -> list[Patches]:
        return self.images_with_items(imgs, [str(i) for i in range(len(imgs))])

    def images_with_items(self, imgs: Sequence[Image.Image], items: Sequence[str | None]) -> list[Patches]:
        """``images`` with an item name per image for error messages."""
        pixels = [np.asarray(to_rgb(img)) for img in imgs]  # [H, W, 3] uint8 each
        targets = [
            self._image_target(a.shape[0], a.shape[1], it) for a, it in zip(pixels, items, strict=True)
        ]
        out: list[Patches] = []
        for lo in range(0, len(pixels), self.max_batch):
            hi = lo + self.max_batch
            out += self._run_images("pixels", pixels[lo:hi], targets[lo:hi])
        return out

    def image_bytes(
        self, data: bytes, limits: MediaLimits = MediaLimits(), item: str | None = None
    ) -> Patches:
        size = self._jpeg_upright_size(data, limits)
        if size is None:  # not a plain JPEG (or a header problem): Pillow decodes, raising typed errors
            return self.image(decode_image(data, limits, item), item)
        target = self._image_target(size[0], size[1], item)
        try:
            return self._run_images("encoded", [np.frombuffer(data, dtype=np.uint8)], [target])[0]
        except RuntimeError as exc:  # DALI reports decoder failures as RuntimeError
            raise BadMedia(f"corrupt or truncated jpeg image: {_dali_reason(exc)}", item) from exc

    def video(self, frames: np.ndarray, item: str | None = None) -> Patches:
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or frames.shape[0] == 0:
            raise BadMedia(
                f"video frames must be a non-empty [T, H, W, 3] uint8 array, got {frames.dtype} {frames.shape}",
                item,
            )
        c = self.cfg
        n, height, width, _ = frames.shape
        th, tw = video_frame_target(height, width, c, item)  # (H, W) itself when already at target
        if pad := -n % c.temporal_patch_size:  # repeat the last frame, as transformers does
            frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
        gt = frames.shape[0] // c.temporal_patch_size
        p, m, tp = c.patch_size, c.merge_size, c.temporal_patch_size
        shape = np.array([gt, tp, 3, th // p // m, m, p, tw // p // m, m, p], dtype=np.int32)
        feeds = {
            "frames": [np.ascontiguousarray(frames)],
            "size": [np.array([th, tw], dtype=np.float32)],
            "shape": [shape],
        }
        out = self._run("frames", feeds)
        return Patches(self._to_torch(out, 0), (gt, th // p, tw // p))

    # ---------------------------------------------------------------------------------- helpers

    def _image_target(self, height: int, width: int, item: str | None) -> tuple[int, int]:
        c = self.cfg
        return smart_resize(height, width, c.factor, c.min_pixels, c.max_pixels, item=item)

    def _run_images(
        self, source: str, samples: list[np.ndarray], targets: list[tuple[int, int]]
    ) -> list[Patches]:
        p, m = self.cfg.patch_size, self.cfg.merge_size
        feeds = {
            source: samples,
            "size": [np.array(t, dtype=np.float32) for t in targets],
            "shape": [
                np.array([3, th // p // m, m, p, tw // p // m, m, p], dtype=np.int32) for th, tw in targets
            ],
        }
        out = self._run(source, feeds)
        return [Patches(self._to_torch(out, i), (1, th // p, tw // p)) for i, (th, tw) in enumerate(targets)]

    def _to_torch(self, out: Any, i: int) -> torch.Tensor:
        """Copy sample ``i`` out of DALI's buffers (they are reused by the next run)."""
        sample = out[i]
        if self.use_gpu:
            from nvidia.dali.plugin.pytorch import feed_ndarray

            dst = torch.empty(tuple(sample.shape()), dtype=torch.float32, device="cuda")
            feed_ndarray(sample, dst, cuda_stream=torch.cuda.current_stream())
            return dst
        return torch.from_numpy(np.array(sample))  # [N, cfg.row_size] float32

    def _jpeg_upright_size(self, data: bytes, limits: MediaLimits) -> tuple[int, int] | None:
        """Upright ``(height, width)`` of a JPEG DALI can decode like Pillow, else None.

        Over-limit images return None too: ``decode_image`` then raises the typed error.
        """
        if len(data) > limits.max_bytes:
            return None
        try:
            if sniff(data).format != "jpeg":
                return None
            img = Image.open(io.BytesIO(data), formats=["JPEG"])
            orientation = img.getexif().get(_EXIF_ORIENTATION_TAG, 1)
        except (MediaError, OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError):
            return None
        width, height = img.size
        if img.mode not in ("RGB", "L") or width * height > limits.max_image_pixels or width * height <= 0:
            return None
        return (width, height) if orientation in _TRANSPOSING_ORIENTATIONS else (height, width)

    def _run(self, source: str, feeds: dict[str, list[np.ndarray]]) -> Any:
        pipe = self._pipe(source)
        try:
            return pipe.run(feeds)
        except RuntimeError:
            # DALI declares a pipeline that raised "no longer valid": drop it, the next call
            # builds a fresh one. Only the failing request sees the error.
            with self._build_lock:
                if self._pipes.get(source) is pipe:
                    del self._pipes[source]
            raise

    def _pipe(self, source: str) -> _Pipe:
        pipe = self._pipes.get(source)
        if pipe is None:
            with self._build_lock:
                pipe = self._pipes.get(source)
                if pipe is None:
                    pipe = _Pipe(
                        _build_pipeline(source, self.cfg, self.max_batch, self.num_threads, self.use_gpu)
                    )
                    self._pipes[source] = pipe
        return pipe


def _build_pipeline(
    source: str, cfg: PreprocessConfig, max_batch: int, num_threads: int, use_gpu: bool
) -> Any:
    """Build the DALI pipeline for ``source`` in ``("encoded", "pixels", "frames")``."""
    from nvidia.dali import fn, pipeline_def, types

    p, tp = cfg.patch_size, cfg.temporal_patch_size
    mean = [255.0 * v for v in cfg.image_mean]
    std = [255.0 * v for v in cfg.image_std]
    row = 3 * tp * p * p

    def graph() -> Any:
        size = fn.external_source(name="size", dtype=types.DALIDataType.FLOAT, ndim=1)  # [2]: target (H, W)
        shape = fn.external_source(
            name="shape", dtype=types.DALIDataType.INT32, ndim=1
        )  # reshape dims, see below
        if source == "encoded":
            data = fn.external_source(name="encoded", dtype=types.DALIDataType.UINT8, ndim=1)
            # nvJPEG ("mixed") on GPU with libjpeg-turbo's fancy chroma upsampling; libjpeg-turbo on CPU.
            pix: Any = fn.decoders.image(
                data,
                device="mixed" if use_gpu else "cpu",
                output_type=types.DALIImageType.RGB,
                jpeg_fancy_upsampling=True,
            )  # [H, W, 3]
        elif source == "pixels":
            pix = fn.external_source(name="pixels", dtype=types.DALIDataType.UINT8, ndim=3, layout="HWC")
            pix = pix.gpu() if use_gpu else pix
        else:
            pix = fn.external_source(name="frames", dtype=types.DALIDataType.UINT8, ndim=4, layout="FHWC")
            pix = pix.gpu() if use_gpu else pix
        # Catmull-Rom cubic with antialiasing for downscale; the output stays uint8 like Pillow's.
        x: Any
        pix = fn.resize(pix, size=size, interp_type=types.DALIInterpType.INTERP_CUBIC, antialias=True)
        if source == "frames":
            x = fn.crop_mirror_normalize(
                pix, dtype=types.DALIDataType.FLOAT, output_layout="FCHW", mean=mean, std=std
            )
            # [T, C, H, W] -> [gt, tp, C, gh/m, m, p, gw/m, m, p] -> [gt, gh/m, gw/m, m, m, C, tp, p, p]
            x = fn.reshape(x, shape=shape, layout="")
            x = fn.transpose(x, perm=[0, 3, 6, 4, 7, 2, 1, 5, 8])
        else:
            x = fn.crop_mirror_normalize(
                pix, dtype=types.DALIDataType.FLOAT, output_layout="CHW", mean=mean, std=std
            )
            # [C, H, W] -> [C, gh/m, m, p, gw/m, m, p] -> [gh/m, gw/m, m, m, C, p, p]
            x = fn.reshape(x, shape=shape, layout="")
            x = fn.transpose(x, perm=[1, 4, 2, 5, 0, 3, 6])
            # one frame repeated tp times: [gh/m, gw/m, m, m, C, tp, p, p]
            x = fn.stack(*([x] * tp), axis=5)
        return fn.reshape(x, shape=[-1, row])  # [N, 3 * tp * p * p]

    device_id = 0 if use_gpu else None
    build: Callable[..., Any] = pipeline_def(graph)
    pipe = build(
        batch_size=max_batch,
        num_threads=num_threads,
        device_id=device_id,
        prefetch_queue_depth=1,
        exec_dynamic=True,
    )
    pipe.build()
    return pipe


def _dali_reason(exc: BaseException) -> str:
    """The informative part of a DALI error (it wraps the cause in pipeline boilerplate)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if "encountered:" in lines:
        rest = lines[lines.index("encountered:") + 1 :]
        if rest:
            return rest[0].rstrip(" :")
    return lines[0] if lines else type(exc).__name__
