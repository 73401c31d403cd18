"""Audio encode benchmark: MiMo-V2.5's audio path (decode, resample, log-mel, encoder) over a long
file, epd's pipelined way against one plain pass.

    python -m bench.audio [--quick] [--json PATH] [--minutes M] [--repeats N] [--workers N]
                          [--streams N] [--batch N] [--tokenizer-layers L] [--local-layers L]

Input: ``--minutes`` (60; 2.5 with ``--quick``) of 44.1 kHz stereo AAC-LC at 128 kb/s in M4A,
generated once with PyAV (a speech-like signal: a three-harmonic voice whose pitch changes every
200 ms "syllable" under a sin^2 envelope, the right channel at 0.8 of the left, plus independent
Gaussian noise at -34 dB per channel; FFmpeg's native AAC encoder, perceptual noise substitution
off: a decoder fills PNS bands from a random state that runs from the stream's start, so a range
decoded after a seek would hold other noise there, see ``media_io.audio_ranges``) and cached
under ``$EPD_BENCH_CACHE`` (default ``~/.cache/epd-bench``).

The model: MiMo-V2.5's audio encoder (``encoder.models.mimo_audio``) at the release's widths
(/work/shared/reference/mimo_v25.md sections 1 and 6: tokenizer d_model 1024, 16 heads, FFN 4096,
conv stem, stride-2 downsample, 20-codebook RVQ of [1024, 1024, 256, 128 x 17]; tower: 20
embedding tables of 1280 x 1024, groups of 4, local transformer 1024 wide with 16 heads and a
4096 MLP, projection 4096 -> 16384 -> 4096) but few layers (``--tokenizer-layers`` 2, windowed
then full, the skip after layer 2; ``--local-layers`` 1), random weights from ``--seed``. The
tokenizer's window is not documented; 100 frames each side is used here. ``--quick`` shrinks the
widths (d_model 128, local 128, out 256) so that the smoke run takes seconds.

Rows:

- ``single-pass`` (the baseline): what a user of PyAV and torch writes. ``container.decode(audio=0)``
  over the whole file, each frame through one ``av.AudioResampler`` to 24 kHz (planar float, the
  source layout), the channels averaged; one log-mel of the whole clip (``torch.stft``, centred,
  reflect padding, periodic Hann 960, hop 240, magnitude, torchaudio's HTK mel filters, log of the
  clamp at 1e-7); then the encoder over the 60 s (6000-frame) segments one after another. torch on
  its default threads;
- ``ours``: epd's way made fast. The file's audio decoded and resampled as 60 s output ranges in the
  decode process pool (``media_io.audio_ranges``: each range seeks before its start, drops the first
  frame after the seek, resamples from a point of the resampler's grid; equal to the sequential
  decode sample for sample), ``--workers`` processes on one thread each; each segment's log-mel from
  its range plus 480 samples of its neighbours (``media_io.audio_features.log_mel``, the rows of
  the whole-clip log-mel); the segments encoded by ``--streams`` encoder threads, each taking the
  next ``--batch`` segments as one forward with torch on cores / streams intra-op threads; decode
  runs ahead of encoding (overlapped);
- ``floor-decode``: decode only, every packet of the file decoded in one pass, nothing else.

Checks: ours gives the baseline's rows (``ROW_TOL``, relative to the rows' largest magnitude) and
the same codes. The variants run alternately (baseline, ours, baseline, ...), each after a short
pause, ``--repeats`` times; the time of a variant is its median. Per-segment latency (P50/P90/P99):
the encoder forward of each segment (its batch's time divided by its size; ours runs ``--streams``
forwards at once, each on fewer threads, so its forwards are longer and overlap), and the time to
the first segment's rows. The shares of the baseline's time (decode, features,
encoder) are reported, so that a missed target says where the time went.

The summary (``--json``): ``speedup_vs_single_pass``, ``speedup_per_core``, the shares, the floor,
seconds per hour of audio of each row, the target (1.6x on 2 cores, 0.8 per core) and whether it
is met, and the check's results.
"""

from __future__ import annotations

import argparse
import os
import queue
import threading
import time
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any, NamedTuple

import av
import numpy as np
import torch

from bench.common import (
    add_common_args,
    format_machine,
    machine_info,
    percentiles,
    print_table,
    usable_cores,
    write_json,
)
from encoder.models.mimo_audio.encoder import MiMoAudioEncoder
from encoder.models.mimo_audio.tokenizer import AudioTokenizerEncoder
from encoder.models.mimo_audio.tokenizer_config import AudioTokenizerConfig
from encoder.models.mimo_audio.tower import AudioTower
from encoder.models.mimo_audio.tower_config import AudioTowerConfig
from epd_common.runtime import torch_threads
from media_io.audio_config import AudioConfig
from media_io.audio_features import log_mel
from media_io.audio_ranges import OutRange, probe_track, submit_ranges
from media_io.video_decode import shutdown_pools, warm_pool

SOURCE_RATE = 44100
BIT_RATE = 128_000
CODEBOOKS = (1024, 1024, 256) + (128,) * 17
WINDOW = 100  # tokenizer's windowed layers: frames each side (undocumented in the release)

# Issue 31's target on this project's 2-core machine: 1.6x the single pass, 0.8 per core.
TARGET_SPEEDUP_PER_CORE = 0.8
# Ours against the baseline. The two compute the log-mel differently (one torch.stft over the
# clip vs per-segment rfft frames) and run the encoder on other thread counts, which moves values
# by float32 rounding: log-mel within MEL_TOL (a log: a mel value far below its frame's energy
# carries the FFT's rounding as a relative error; 9e-5 seen); rows within ROW_TOL of the rows'
# largest magnitude.
# The tokenizer's RVQ takes a nearest codebook entry: a near tie (random weights give some) can
# flip under that rounding, and the row of the group holding it then differs wholly; such rows are
# counted and may be at most MAX_FLIPPED_ROWS of all rows (the other rows are held to ROW_TOL).
MEL_TOL = 5e-4
ROW_TOL = 1e-3
MAX_FLIPPED_ROWS = 1e-3
PAUSE_S = 0.05


def cache_dir() -> Path:
    return Path(os.environ.get("EPD_BENCH_CACHE", Path.home() / ".cache" / "epd-bench"))


def make_audio(minutes: float, seed: int) -> Path:
    """The cached M4A of ``minutes`` (generated on first use: ~2 minutes for an hour)."""
    path = (
        cache_dir() / f"speech_{SOURCE_RATE}hz_stereo_aac{BIT_RATE // 1000}k_nopns_{minutes:g}min_s{seed}.m4a"
    )
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".part.m4a")
    rng = np.random.default_rng(seed)
    total = int(minutes * 60 * SOURCE_RATE)
    print(f"generating {minutes:g} min of AAC into {path} (once) ...", flush=True)
    t0 = time.perf_counter()
    with av.open(str(tmp), mode="w", format="mp4") as out:
        stream = out.add_stream("aac", rate=SOURCE_RATE)
        stream.layout = "stereo"
        stream.bit_rate = BIT_RATE
        stream.options = {"aac_pns": "0"}
        at = 0
        while at < total:
            n = min(SOURCE_RATE, total - at)  # one second per frame handed to the encoder
            t = (np.arange(n) + at) / SOURCE_RATE
            syllable = np.floor(t / 0.2)
            pitch = 120.0 + 80.0 * np.sin(syllable * 1.7)  # Hz, one per syllable
            envelope = np.sin(np.pi * (t / 0.2 - syllable)) ** 2
            voice = sum(np.sin(2 * np.pi * pitch * h * t) / h for h in (1, 2, 3)) * envelope * 0.3
            noise = rng.normal(0.0, 0.02, (2, n))
            wave = (np.stack([voice, 0.8 * voice]) + noise).astype(np.float32)  # [2, n]
            frame = av.AudioFrame.from_ndarray(wave, format="fltp", layout="stereo")
            frame.sample_rate = SOURCE_RATE
            frame.pts = at
            frame.time_base = Fraction(1, SOURCE_RATE)
            for packet in stream.encode(frame):
                out.mux(packet)
            at += n
        for packet in stream.encode(None):
            out.mux(packet)
    tmp.rename(path)
    print(f"generated in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


class Widths(NamedTuple):
    d_model: int
    heads: int
    ffn: int
    local_dim: int
    local_heads: int
    local_ffn: int
    out_hidden: int


REAL = Widths(1024, 16, 4096, 1024, 16, 4096, 4096)
QUICK = Widths(128, 4, 256, 128, 4, 256, 256)


def build_encoder(widths: Widths, tokenizer_layers: int, local_layers: int, seed: int) -> MiMoAudioEncoder:
    """MiMo-V2.5's audio encoder with random weights (see the module docstring), float32, eval."""
    tok_cfg = AudioTokenizerConfig(
        n_mels=128,
        d_model=widths.d_model,
        encoder_layers=tokenizer_layers,
        encoder_attention_heads=widths.heads,
        encoder_ffn_dim=widths.ffn,
        avg_pooler=2,
        encoder_skip_layer_id=tokenizer_layers,
        encoder_attn_window_size=(WINDOW, WINDOW),
        hybrid_attention=True,
        num_quantizers=len(CODEBOOKS),
        codebook_size=CODEBOOKS,
    )
    tower_cfg = AudioTowerConfig(
        input_local_layers=local_layers,
        input_local_dim=widths.local_dim,
        input_local_attn_heads=widths.local_heads,
        input_local_intermediate_size=widths.local_ffn,
        out_hidden_size=widths.out_hidden,
    )
    torch.manual_seed(seed)
    tokenizer = AudioTokenizerEncoder(tok_cfg)
    for c, size in enumerate(CODEBOOKS):
        getattr(tokenizer.quantizer, f"embed_{c}").copy_(torch.randn(size, widths.d_model) / (1 + c))
    model = MiMoAudioEncoder(tokenizer, AudioTower(tower_cfg))
    return model.eval().requires_grad_(False)


class Encoded(NamedTuple):
    mel: torch.Tensor  # [T, n_mels] float32, the whole clip's log-mel
    rows: torch.Tensor  # [pads, out_hidden] float32, segments in order
    codes: torch.Tensor  # [codes, 20] int64
    forward_s: list[float]  # per segment: its forward's share of the wall time
    done_s: list[float]  # per segment: seconds from the start of the run to its rows
    decode_s: float
    features_s: float
    encoder_s: float


# ------------------------------------------------------------------------------------------------
# The baseline and the floor


def whole_clip_log_mel(samples: torch.Tensor, cfg: AudioConfig) -> torch.Tensor:
    """[T, n_mels]: one torch.stft over the whole clip, as a user would write it."""
    from torchaudio.functional import melscale_fbanks

    window = torch.hann_window(cfg.window_size, periodic=True)
    spec = torch.stft(
        samples,
        n_fft=cfg.n_fft,
        hop_length=cfg.hop_length,
        win_length=cfg.window_size,
        window=window,
        center=True,
        pad_mode="reflect",
        return_complex=True,
    ).abs()  # [n_fft/2 + 1, T]
    fb = melscale_fbanks(cfg.n_fft // 2 + 1, cfg.f_min, cfg.sample_rate / 2, cfg.n_mels, cfg.sample_rate)
    return torch.log(torch.clamp(spec.T @ fb, min=cfg.log_floor))  # [T, n_mels]


def single_pass(path: Path, model: MiMoAudioEncoder, cfg: AudioConfig) -> Encoded:
    t0 = time.perf_counter()
    resampler: av.AudioResampler | None = None
    chunks: list[np.ndarray] = []
    with av.open(str(path)) as container:
        for frame in container.decode(audio=0):
            if resampler is None:
                resampler = av.AudioResampler(format="fltp", layout=frame.layout.name, rate=cfg.sample_rate)
            chunks.extend(f.to_ndarray().mean(axis=0, dtype=np.float32) for f in resampler.resample(frame))
    assert resampler is not None
    chunks.extend(f.to_ndarray().mean(axis=0, dtype=np.float32) for f in resampler.resample(None))
    samples = torch.from_numpy(np.concatenate(chunks))
    t1 = time.perf_counter()
    mel = whole_clip_log_mel(samples, cfg)
    t2 = time.perf_counter()
    seg = model.tower.cfg.audio_segment_size
    rows, codes, forward_s, done_s = [], [], [], []
    with torch.inference_mode():
        for start in range(0, mel.shape[0], seg):
            f0 = time.perf_counter()
            out = model([mel[start : start + seg]])
            rows.append(out.rows)
            codes.append(out.codes[0])
            now = time.perf_counter()
            forward_s.append(now - f0)
            done_s.append(now - t0)
    t3 = time.perf_counter()
    return Encoded(mel, torch.cat(rows), torch.cat(codes), forward_s, done_s, t1 - t0, t2 - t1, t3 - t2)


def decode_floor(path: Path) -> int:
    """Decode every packet of the first audio stream; the samples decoded (per channel)."""
    n = 0
    with av.open(str(path)) as container:
        for frame in container.decode(audio=0):
            n += frame.samples
    return n


# ------------------------------------------------------------------------------------------------
# Ours


def segment_features(ranges: Sequence[np.ndarray], k: int, cfg: AudioConfig) -> torch.Tensor:
    """Segment k's rows of the whole clip's log-mel, from range k and ``n_fft / 2`` samples of each
    neighbour (a row is centred on its sample and reaches half a window each side; the clip's own
    ends are reflect-padded by ``log_mel`` as by the whole-clip pass)."""
    half = cfg.n_fft // 2
    last = k + 1 == len(ranges)
    left = ranges[k - 1][-half:] if k > 0 else ranges[k][:0]
    right = ranges[k][:0] if last else ranges[k + 1][:half]
    mel = log_mel([torch.from_numpy(np.concatenate([left, ranges[k], right]))], cfg)[0]
    skip = len(left) // cfg.hop_length  # rows centred before the range's first sample
    rows = mel.shape[0] - skip if last else len(ranges[k]) // cfg.hop_length
    return mel[skip : skip + rows]


def ours(
    path: Path, model: MiMoAudioEncoder, cfg: AudioConfig, workers: int, streams: int, batch: int
) -> Encoded:
    t0 = time.perf_counter()
    seg = model.tower.cfg.audio_segment_size
    seg_samples = seg * cfg.hop_length  # 60 s of output samples
    track = probe_track(path)
    # Whole 60 s ranges, the last one open-ended (60 to 120 s): it then never holds fewer samples
    # than its neighbour's context, and the encoder cuts it into its own 6000-frame segments.
    n_ranges = max(1, int(track.duration_s * cfg.sample_rate) // seg_samples)
    out_ranges = [
        OutRange(k * seg_samples, (k + 1) * seg_samples if k < n_ranges - 1 else None)
        for k in range(n_ranges)
    ]
    futures = submit_ranges(path, cfg.sample_rate, out_ranges, workers, track)
    decoded: list[np.ndarray] = []
    jobs: queue.Queue[tuple[int, list[torch.Tensor]] | None] = queue.Queue(maxsize=2 * streams)
    results: dict[int, tuple[torch.Tensor, torch.Tensor, float, float]] = {}
    errors: list[BaseException] = []
    threads_per_stream = max(1, usable_cores() // streams)
    features_s = 0.0

    def encode_worker() -> None:
        with torch.inference_mode():
            while (job := jobs.get()) is not None:
                first, mels = job
                try:
                    f0 = time.perf_counter()
                    out = model(mels)
                    per = (time.perf_counter() - f0) / len(mels)
                    at = 0
                    for i, n in enumerate(out.pad_counts):
                        results[first + i] = (
                            out.rows[at : at + n],
                            out.codes[i],
                            per,
                            time.perf_counter() - t0,
                        )
                        at += n
                except BaseException as e:
                    errors.append(e)

    with torch_threads(threads_per_stream):
        pool = [threading.Thread(target=encode_worker, daemon=True) for _ in range(streams)]
        for t in pool:
            t.start()
        pending: list[torch.Tensor] = []
        mels: list[torch.Tensor] = []
        first = 0
        decoded_s = 0.0
        try:
            for k in range(n_ranges):
                w0 = time.perf_counter()
                while len(decoded) < min(k + 2, n_ranges):  # range k and its right neighbour
                    decoded.append(futures[len(decoded)].result())
                decoded_s += time.perf_counter() - w0
                f0 = time.perf_counter()
                pending.append(segment_features(decoded, k, cfg))
                mels.append(pending[-1])
                if k > 0:
                    decoded[k - 1] = decoded[k - 1][:0]  # no longer needed: free it
                features_s += time.perf_counter() - f0
                if len(pending) == batch or k == n_ranges - 1:
                    jobs.put((first, pending))
                    first += len(pending)
                    pending = []
        finally:
            for f in futures:
                f.cancel()
            for _ in pool:
                jobs.put(None)
            for t in pool:
                t.join()
    if errors:
        raise errors[0]
    t_end = time.perf_counter()
    order = [results[k] for k in range(n_ranges)]
    return Encoded(
        torch.cat(mels),
        torch.cat([r[0] for r in order]),
        torch.cat([r[1] for r in order]),
        [r[2] for r in order],
        [r[3] for r in order],
        decoded_s,  # waiting for decode (decode itself overlaps)
        features_s,
        t_end - t0 - decoded_s - features_s,
    )


# ------------------------------------------------------------------------------------------------


class Check(NamedTuple):
    ok: bool
    mel_max_abs_diff: float  # log-mel, ours vs the whole-clip pass
    codes_equal_fraction: float  # of all [frames, 20] codes
    rows_with_other_codes: int  # rows whose 4 frames' codes are not all the baseline's
    rows_max_abs_diff: float  # over the other rows (same codes)
    row_scale: float  # max |baseline row value|
    rows: int


def compare(base: Encoded, cand: Encoded) -> Check:
    """Ours against the baseline (see ``MEL_TOL``, ``ROW_TOL`` and ``MAX_FLIPPED_ROWS``)."""
    n = base.rows.shape[0]
    if (
        base.mel.shape != cand.mel.shape
        or base.rows.shape != cand.rows.shape
        or base.codes.shape != cand.codes.shape
    ):
        return Check(False, float("inf"), 0.0, n, float("inf"), 0.0, n)
    mel_diff = float((base.mel - cand.mel).abs().max())
    differs = (base.codes != cand.codes).any(dim=1)  # [frames]
    group = base.rows.shape[0] * 4 - differs.shape[0]  # the last row's repeated frames
    flipped = torch.cat([differs, differs[-1:].expand(group)]).view(n, 4).any(dim=1)  # [rows]
    same = ~flipped
    row_diff = float((base.rows[same] - cand.rows[same]).abs().max()) if bool(same.any()) else 0.0
    scale = float(base.rows.abs().max())
    n_flipped = int(flipped.sum())
    ok = mel_diff <= MEL_TOL and row_diff <= ROW_TOL * scale and n_flipped <= MAX_FLIPPED_ROWS * n
    codes = float((base.codes == cand.codes).float().mean())
    return Check(ok, mel_diff, codes, n_flipped, row_diff, scale, n)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--minutes", type=float, default=None, help="audio length (60; 2.5 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="alternating runs of each (2; 1 quick)")
    parser.add_argument("--workers", type=int, default=None, help="decode processes (usable cores)")
    parser.add_argument("--streams", type=int, default=None, help="encoder threads (usable cores)")
    parser.add_argument("--batch", type=int, default=1, help="60 s segments per encoder forward")
    parser.add_argument("--tokenizer-layers", type=int, default=2)
    parser.add_argument("--local-layers", type=int, default=1)
    args = parser.parse_args(argv)
    minutes = args.minutes if args.minutes is not None else (2.5 if args.quick else 60.0)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 2)
    cores = usable_cores()
    workers = args.workers or cores
    streams = args.streams or cores
    cfg = AudioConfig()
    path = make_audio(minutes, args.seed)
    model = build_encoder(QUICK if args.quick else REAL, args.tokenizer_layers, args.local_layers, args.seed)
    machine = machine_info()
    warm_pool(workers)

    base_runs: list[Encoded] = []
    ours_runs: list[Encoded] = []
    floor_s: list[float] = []
    decoded_samples = 0
    for _ in range(repeats):
        for which in ("single-pass", "ours", "floor-decode"):
            time.sleep(PAUSE_S)
            t0 = time.perf_counter()
            if which == "single-pass":
                base_runs.append(single_pass(path, model, cfg))
            elif which == "ours":
                ours_runs.append(ours(path, model, cfg, workers, streams, args.batch))
            else:
                decoded_samples = decode_floor(path)
            elapsed = time.perf_counter() - t0
            if which == "floor-decode":
                floor_s.append(elapsed)
            print(f"  {which}: {elapsed:.2f} s", flush=True)
    shutdown_pools()

    def wall(e: Encoded) -> float:
        return e.decode_s + e.features_s + e.encoder_s

    base_t = float(np.median([wall(e) for e in base_runs]))
    ours_t = float(np.median([wall(e) for e in ours_runs]))
    floor_t = float(np.median(floor_s))
    check = compare(base_runs[0], ours_runs[0])
    assert all(compare(base_runs[0], e).ok for e in base_runs[1:]), "the baseline is not repeatable"
    base0 = base_runs[0]
    per_hour = 60.0 / minutes
    shares = {
        "decode": base0.decode_s / wall(base0),
        "features": base0.features_s / wall(base0),
        "encoder": base0.encoder_s / wall(base0),
    }
    seg_base = percentiles(base0.forward_s)
    seg_ours = percentiles(ours_runs[0].forward_s)
    speedup = base_t / ours_t
    rows = [
        ["single-pass", base_t, base_t * per_hour, 1.0, seg_base.p50, seg_base.p90, seg_base.p99],
        ["ours", ours_t, ours_t * per_hour, speedup, seg_ours.p50, seg_ours.p90, seg_ours.p99],
        [
            "floor-decode",
            floor_t,
            floor_t * per_hour,
            base_t / floor_t,
            float("nan"),
            float("nan"),
            float("nan"),
        ],
    ]
    print_table(
        f"audio: {minutes:g} min of 44.1 kHz stereo AAC -> 24 kHz log-mel -> MiMo audio encoder",
        ["row", "wall s", "s per hour", "x single pass", "seg P50 s", "seg P90 s", "seg P99 s"],
        rows,
        caption=format_machine(machine)
        + f" | workers {workers}, streams {streams}, batch {args.batch}"
        + f" | baseline shares: decode {shares['decode']:.0%}, features {shares['features']:.0%},"
        + f" encoder {shares['encoder']:.0%} | check: {check}",
    )
    summary = {
        "speedup_vs_single_pass": speedup,
        "speedup_per_core": speedup / cores,
        "target_speedup": TARGET_SPEEDUP_PER_CORE * cores,
        "target_met": speedup >= TARGET_SPEEDUP_PER_CORE * cores,
        "single_pass_s": base_t,
        "ours_s": ours_t,
        "decode_floor_s": floor_t,
        "single_pass_s_per_hour": base_t * per_hour,
        "ours_s_per_hour": ours_t * per_hour,
        "decode_floor_s_per_hour": floor_t * per_hour,
        "baseline_shares": shares,
        "ours_phases_s": {
            "waiting_for_decode": ours_runs[0].decode_s,
            "features": ours_runs[0].features_s,
            "encoder_and_rest": ours_runs[0].encoder_s,
        },
        "segment_forward_s": {"single_pass": seg_base._asdict(), "ours": seg_ours._asdict()},
        # time to the first segment's rows: the baseline decodes the whole file and its log-mel first
        "first_rows_s": {"single_pass": base0.done_s[0], "ours": ours_runs[0].done_s[0]},
        "outputs_match": check.ok,
        "check": check._asdict(),
        "tolerances": {"mel_abs": MEL_TOL, "row_rel": ROW_TOL, "flipped_rows_fraction": MAX_FLIPPED_ROWS},
        "decoded_samples_floor": decoded_samples,
        "minutes": minutes,
    }
    results = [dict(zip(["row", "wall_s", "s_per_hour", "speedup"], r[:4], strict=True)) for r in rows]
    config = {**vars(args), "minutes": minutes, "repeats": repeats, "workers": workers, "streams": streams}
    write_json(args.json, machine=machine, config=config, results=results, summary=summary)
    return summary


if __name__ == "__main__":
    main()
