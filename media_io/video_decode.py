"""Decode the planned segments of a video into one [T, H, W, 3] uint8 array of sampled frames.

A segment (see ``video_plan``) is decoded either in this process (short clips, where a pool would
not pay off) or by a reused pool of worker processes ('forkserver': torch is imported here). The
parent puts the compressed bytes in one shared-memory segment and allocates the output
[T, H, W, 3] uint8 in another; workers attach both by name and write their frames into their own
slots. Nothing large is pickled. Both segments are unlinked in every path, errors included.

Per frame, only sampled frames are converted: the decoder's converter (swscale) makes RGB at the
source size, exactly as the reference's PyAV loader does, and torch's antialiased bicubic resize
(the reference's own resize) scales it to the target, so our frames are the reference's bit for
bit. Converting straight to the target size inside swscale is ~25% faster per kept frame but its
YUV-domain scaling shifts colours (mean |diff| 0.012 in normalized units, above our 0.01 parity
bound), so it is available as ``resize="swscale"`` only.
"""

from __future__ import annotations

import atexit
import io
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from multiprocessing import get_context
from multiprocessing.shared_memory import SharedMemory
from typing import Literal

import av
import av.error
import numpy as np
import torch

from media_io.video_plan import Segment, Target

ResizeMode = Literal["exact", "swscale"]

# Below this much decode work (frames x source pixels, ~1 s of 720p) the pool costs more than it
# saves: shared-memory set-up and task round trips are a few ms, decode is ~3 ms per 720p frame.
POOL_MIN_WORK = 300 * 1280 * 720
SHM_PREFIX = "epd_vid"


class SegmentDecodeError(Exception):
    """A segment failed in a worker; carries only a message so it pickles back cleanly."""


class FrameResizer:
    """Kept frame -> RGB at ``(height, width)``; see the module docstring for the two modes."""

    def __init__(self, height: int, width: int, mode: ResizeMode = "exact") -> None:
        self.height, self.width, self.mode = height, width, mode
        self._convert = av.video.reformatter.VideoReformatter()  # cached swscale context

    def __call__(self, frame: av.VideoFrame) -> np.ndarray:
        """[height, width, 3] uint8."""
        if self.mode == "swscale":
            out = self._convert.reformat(
                frame, self.width, self.height, "rgb24", interpolation="BICUBIC"
            ).to_ndarray()
            return np.asarray(out)
        rgb = self._convert.reformat(frame, format="rgb24").to_ndarray()  # [h, w, 3] source size
        return self.resize_rgb(np.asarray(rgb))

    def resize_rgb(self, rgb: np.ndarray) -> np.ndarray:
        """[h, w, 3] uint8 at the source size -> [height, width, 3] uint8 (torch, as the reference)."""
        if rgb.shape[:2] == (self.height, self.width):
            return rgb
        # torchvision's resize for uint8 on CPU is this call (native uint8 bicubic + antialias).
        rgb = np.ascontiguousarray(rgb)  # decoders may pad rows (linesize > 3 * width)
        h, w, c = rgb.shape
        # [1, 3, h, w] as a channels-last view of the HWC pixels. The batch stride is set to
        # the tensor's size, not left ambiguous, so that interpolate also allocates its output
        # channels-last (torch issue 68430): the result is then HWC-contiguous and copying it
        # into the output is one memcpy, not a strided gather.
        nchw = torch.from_numpy(rgb).as_strided((1, c, h, w), (h * w * c, 1, w * c, c))
        resized = torch.nn.functional.interpolate(
            nchw, size=(self.height, self.width), mode="bicubic", align_corners=False, antialias=True
        )  # [1, 3, H, W] uint8, channels-last
        return np.asarray(resized[0].permute(1, 2, 0).numpy())  # [H, W, 3]


def decode_segment(
    data: bytes | memoryview,
    segment: Segment,
    out: np.ndarray,
    resize: ResizeMode = "exact",
    threads: int = 0,
    on_frame: Callable[[], None] | None = None,
) -> int:
    """Decode ``segment`` of the container ``data`` into ``out[slot]`` for each of its targets.

    ``out`` is [T, H, W, 3] uint8. ``threads``: codec threads (0 = FFmpeg's choice, frame and
    slice threading). A target whose pts is never produced (a decoder that drops frames) gets
    the frame shown at that time: the last one before it. Returns the number of frames written.

    Raises:
        SegmentDecodeError: the bytes could not be decoded.
    """
    resizer = FrameResizer(out.shape[1], out.shape[2], resize)
    written = 0

    def emit(frame: av.VideoFrame, target: Target) -> None:
        nonlocal written
        out[target.slot] = resizer(frame)
        written += 1
        if on_frame is not None:
            on_frame()

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            stream.codec_context.thread_count = threads
            frames: Iterator[av.VideoFrame] | None = None
            prev: av.VideoFrame | None = None
            for run in segment.runs:
                if run.seek or frames is None:
                    container.seek(run.keyframe_pts, stream=stream, backward=True, any_frame=False)
                    frames = container.decode(stream)  # one generator per seek, resumed across runs
                    prev = None
                pending = list(run.targets)
                for frame in frames:
                    pts = frame.pts
                    if pts is None:
                        continue
                    while pending and pts > pending[0].pts:  # passed a target: it showed prev
                        emit(prev if prev is not None else frame, pending.pop(0))
                    while pending and pts == pending[0].pts:
                        emit(frame, pending.pop(0))
                    prev = frame
                    if not pending:
                        break
                if pending:  # the stream ended early: the last frame stays on screen
                    if prev is None:
                        raise SegmentDecodeError(
                            f"no frame decoded from the keyframe at pts {run.keyframe_pts}"
                        )
                    for target in pending:
                        emit(prev, target)
    except av.error.FFmpegError as e:
        raise SegmentDecodeError(f"corrupt video data: {e}") from e
    return written


# ---- worker pool --------------------------------------------------------------------------------

_pools: dict[int, ProcessPoolExecutor] = {}
_pools_lock = threading.Lock()


def _worker_init(owner_pid: int) -> None:
    torch.set_num_threads(1)  # one core per worker: the pool is the parallelism
    # A pool worker blocks on its task queue forever if the owner dies without shutting the
    # pool down (kill -9): the queue's pipe has writers in every worker, so no EOF arrives.
    # Leave when the owner is gone instead of lingering as an orphan.
    threading.Thread(target=_exit_with_owner, args=(owner_pid,), daemon=True).start()


def _exit_with_owner(owner_pid: int, period_s: float = 1.0) -> None:
    while True:
        time.sleep(period_s)
        try:
            os.kill(owner_pid, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:  # the pid was reused by another user's process
            os._exit(0)


def get_pool(workers: int) -> ProcessPoolExecutor:
    """The process pool of ``workers`` decoders, created on first use and reused."""
    with _pools_lock:
        pool = _pools.get(workers)
        if pool is None or getattr(pool, "_broken", False):
            ctx = get_context("forkserver")
            # Workers fork from a server that already imported us (torch, av): starting one
            # costs a fork, not a fresh interpreter importing torch. No effect if the server of
            # this process is already running.
            ctx.set_forkserver_preload([__name__])
            pool = ProcessPoolExecutor(
                workers, mp_context=ctx, initializer=_worker_init, initargs=(os.getpid(),)
            )
            _pools[workers] = pool
        return pool


def _worker_ping(hold_s: float) -> int:
    time.sleep(hold_s)  # stay busy a moment so that the other workers take the other pings
    return os.getpid()


def warm_pool(workers: int, timeout_s: float = 60.0) -> set[int]:
    """Start all of the pool's processes now (a service calls this at start, a benchmark before
    timing). Returns the workers' pids (fewer only if ``timeout_s`` ran out first)."""
    pool = get_pool(workers)
    pids: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while len(pids) < workers and time.monotonic() < deadline:
        pids.update(f.result() for f in [pool.submit(_worker_ping, 0.05) for _ in range(workers * 2)])
    return pids


@atexit.register
def shutdown_pools() -> None:
    """Stop every decoder pool (also registered at exit)."""
    with _pools_lock:
        for pool in _pools.values():
            pool.shutdown(wait=True, cancel_futures=True)
        _pools.clear()


def _worker_decode(
    src_name: str,
    src_size: int,
    out_name: str,
    shape: tuple[int, int, int, int],
    segment: Segment,
    resize: ResizeMode,
) -> int:
    src = SharedMemory(name=src_name)
    out = SharedMemory(name=out_name)
    error: str | None = None
    written = 0
    try:
        written = _decode_shared(src, src_size, out, shape, segment, resize)
    except Exception as e:
        # Keep only the message: the traceback holds views of the segments, which must be
        # released before they can be closed.
        error = str(e) if isinstance(e, SegmentDecodeError) else f"{type(e).__name__}: {e}"
    finally:
        src.close()
        out.close()
    if error is not None:
        raise SegmentDecodeError(error)
    return written


def _decode_shared(
    src: SharedMemory,
    src_size: int,
    out: SharedMemory,
    shape: tuple[int, int, int, int],
    segment: Segment,
    resize: ResizeMode,
) -> int:
    frames = np.ndarray(shape, dtype=np.uint8, buffer=_buf(out))  # [T, H, W, 3] view, no copy
    data = _buf(src)[:src_size]
    try:
        return decode_segment(data, segment, frames, resize, threads=1)
    finally:
        data.release()
        del frames


def _buf(shm: SharedMemory) -> memoryview:
    buf = shm.buf
    assert buf is not None, f"shared memory {shm.name} is closed"
    return buf


def _new_shm(size: int) -> SharedMemory:
    name = f"{SHM_PREFIX}_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    return SharedMemory(name=name, create=True, size=max(1, size))


def _adopt(shm: SharedMemory, shape: tuple[int, int, int, int]) -> np.ndarray:
    """An array over ``shm``'s mapping that owns it: unmapped when the last view is gone.

    ``SharedMemory.close()`` refuses while a numpy view exists, and its ``__del__`` would then
    complain; so the mapping is handed to the array (its memoryview keeps the mmap alive) and
    only the file descriptor is closed here. The segment must already be unlinked.
    """
    buf = _buf(shm)
    frames = np.ndarray(shape, dtype=np.uint8, buffer=buf)
    if hasattr(shm, "_buf") and hasattr(shm, "_mmap"):
        shm._buf = None  # type: ignore[attr-defined]
        shm._mmap = None  # type: ignore[attr-defined]
        shm.close()
        return frames
    copy = frames.copy()  # not CPython's layout: fall back to one copy
    del frames, buf
    shm.close()
    return copy


def decode_in_pool(
    data: bytes,
    segments: Sequence[Segment],
    shape: tuple[int, int, int, int],
    workers: int,
    resize: ResizeMode = "exact",
    progress: Callable[[int, int], None] | None = None,
) -> np.ndarray:
    """Decode ``segments`` in the worker pool into a fresh [T, H, W, 3] uint8 array (see module doc).

    Raises:
        SegmentDecodeError: a segment failed (the first failure; the rest are cancelled).
    """
    pool = get_pool(workers)
    total = shape[0]
    src = _new_shm(len(data))
    out: SharedMemory | None = None
    ok = False
    try:
        _buf(src)[: len(data)] = data
        out = _new_shm(int(np.prod(shape)))
        futures: list[Future[int]] = [
            pool.submit(_worker_decode, src.name, len(data), out.name, shape, seg, resize) for seg in segments
        ]
        try:
            done_frames = 0
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for f in finished:
                    done_frames += f.result()  # re-raises a worker's error
                if progress is not None:
                    progress(done_frames, total)
        finally:
            for f in futures:
                f.cancel()
            wait(futures)  # no worker may still be attached once the names go
        ok = True
    finally:
        src.close()
        src.unlink()
        if out is not None:
            out.unlink()  # the name goes now; on success the mapping lives on in the array
            if not ok:
                out.close()
    assert out is not None
    return _adopt(out, shape)
