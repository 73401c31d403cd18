"""bench.vlm_peer: epd's encode stage in front of vLLM, against vLLM alone and epd alone, on one
Qwen2.5-VL checkpoint, in one run (needs the vLLM peer: ``make vllm-peer``).

    python -m bench.vlm_peer [--quick] [--json PATH] [--real-widths]
    python -m bench.vlm_peer --probe [--json PATH]      (vLLM alone under each of its settings)

Three sides, all up at once and driven one at a time by the same client with the same requests
(chat completions, greedy, ``--max-tokens`` output tokens, images as http URLs of a loopback media
server that adds ``--latency-ms`` per response, like an object store):

    vllm        vLLM's OpenAI server alone, given the raw image URLs: it downloads, decodes and
                preprocesses them (its Hugging Face processor, in its API server process), runs the
                tower and the language model
    epd+vllm    ``epd serve --model DIR --llm-server vllm --llm-url URL``: epd's ingress downloads,
                its encoder workers decode, preprocess and run the tower (node cache and MediaKeys
                as always), and the chat goes to the *same* vLLM server with one ``image_embeds``
                part per image
    epd         ``epd serve --model DIR``: epd's own engine behind the same ingress and encoders

The checkpoint is a Qwen2.5-VL directory both load (written once under ``bench.llm.cache_dir()``
with the tokenizer, chat template and processor files of ``tests.fixtures.qwen2_5_vl``): the tower
of ``bench.pipeline_tower`` (one window-attention block of width 32: its forward is a small part of
a request, as on an accelerator; ``forward_fraction`` says how small) and the fixture's tiny
language model (3 layers, width 128, head_dim 32, which vLLM's CPU attention takes), so that
neither the forward nor the language model hides the pipeline around them. Images are bounded by
3136..1003520 pixels (28*28*1280, Qwen's recommended ``max_pixels`` and epd's default): a
1920x1080 image is 1,280 image tokens. ``--real-widths`` uses a tower at Qwen2.5-VL's real widths
(hidden 1280, 16 heads, 2 blocks) and a 2-layer language model of width 2048 (head_dim 128) instead,
with images of at most 28*28*256 pixels (256 tokens): at those widths a CPU forward is not small.

Workloads, each a closed loop at ``--concurrency`` (16) of ``--requests`` requests (text:
``--text-requests``) per side and repeat:

    cold    every request a distinct JPEG (fresh bytes: ``bench.media_corpus.unique_variant``) of
            640x480 .. 1920x1080, in the same order for every side
    zipf    images drawn by Zipf(``--zipf-s``) over a pool of ``--zipf-pool`` distinct JPEGs of those
            sizes; the same draws for every side, a fresh pool (new bytes) per side and repeat, so
            every repeat starts with cold caches (``repeat_share``: requests whose image came before)
    text    text only, a distinct prompt per request

``--repeats`` repeats run every workload on every side, the side order rotating per repeat, so
that a slow spell of a shared machine hits all sides alike; each phase starts once the machine's
CPUs are quiet (``bench.common.wait_for_quiet_cpu``: a server's work after its last answer does
not land on the next side's phase). Then:

    vllm given embeds   the cold chats sent to the same vLLM as epd sends them (one
                        ``image_embeds`` part of each image's grid, random values, a fresh uuid):
                        what vLLM alone needs for the language-model side of a request, so
                        ``embeds_bound_qps_ratio_cold`` is the most epd+vllm could reach over vllm
                        if epd's own work were free
    epd encode only     the cold images to epd+vllm's ``/v1/encode`` (vLLM idle): epd's encode
                        stage alone, ``encode_bound_qps_ratio_cold`` the other half's bound (on
                        a machine where both halves share the cores, the two do not add up)
    open loop           cold requests at Poisson arrivals of 0.8x vLLM-alone's cold closed-loop QPS
                        (or ``--open-rate``) per side: P90 at a load every side should sustain

Before the servers start, the tower's forward alone is timed on the cold corpus
(``bench.ceiling``): ``forward_fraction`` = its time per image over vLLM-alone's time per cold
request (1 / QPS). CPU time is read from /proc for every server process by role (vLLM's API
server and its engine core with its worker; epd's ingress, encoders and engine): the second table.

epd in front of vLLM runs on the cores vLLM's inference threads are not bound to (``--epd-cpus``,
taskset), as ``epd serve``'s own ``--cpu-split`` places a local vLLM; vLLM alone keeps every core.
vLLM runs as its users would run it strongest on this machine (``--vllm-*``; ``--probe`` measures
vLLM alone under each setting: thread binding ``VLLM_CPU_OMP_THREADS_BIND`` (by default inference
on core 0, core 1 left to the API server), ``--api-server-count``, its multimodal processor cache
``--mm-processor-cache-gb`` and the fast (torchvision) or slow (PIL) image processor).

Summary: ``qps_ratio_cold``, ``p90_ratio_cold`` (epd+vllm over vllm, cold closed loop; < 1 is
better), ``qps_ratio_zipf``, ``text_qps_ratio``, ``open_p90_ratio_cold``; the same for epd alone
(``epd_*``); ``*_median`` variants are the median over repeats of each repeat's ratio;
``forward_fraction``; ``ideal_split_ratio_cold`` = 1 / (1 / ``embeds_bound_qps_ratio_cold`` + 1 /
``encode_bound_qps_ratio_cold``), what the two halves in series reach at equal cores; ``targets_met``
(cold >= max(1, 0.9 x ideal) with P90 <= 1x, Zipf >= 1.5x, text >= 0.95x, open-loop P90 <= 0.5x).
``same_text_*``: the share of requests whose answer text equals vLLM-alone's (informative: epd's
preprocessing is within a tolerance of transformers', not bit-equal, and the model is random).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp

from bench.common import (
    add_common_args,
    format_machine,
    machine_info,
    percentiles,
    print_table,
    usable_cores,
    wait_for_quiet_cpu,
    write_json,
)
from bench.llm import TINY_QWEN_FIXTURE, build_once, cache_dir
from bench.loadgen import (
    LoadResult,
    Outcome,
    SendFn,
    closed_loop,
    merge_results,
    new_session,
    open_loop,
    send_one,
)
from bench.media_corpus import (
    DEFAULT_IMAGE_SIZES,
    CorpusItem,
    default_corpus_dir,
    image_corpus,
    unique_variant,
)
from bench.service_proc import ServiceProcess, free_port, tree_cpu_seconds
from epd.placement import parse_cpus, pinned_argv
from tests.fixtures.media_server import MediaServer

SIDES = ("vllm", "epd+vllm", "epd")
WORKLOADS = ("cold", "zipf", "text")
CHAT_PATH = "/v1/chat/completions"
ENCODE_PATH = "/v1/encode"
# The cold and Zipf images: 640x480 .. 1920x1080 (the corpus's sizes without 448x448).
IMAGE_SIZES = tuple(s for s in DEFAULT_IMAGE_SIZES if s != (448, 448))
QUICK_IMAGE_SIZES = ((640, 480), (800, 600))
IMAGE_PROMPT = "Describe the picture in one sentence."
TEXT_SOURCE = (
    "the cat sits on a red mat near the window while birds sing outside and a small boat drifts "
    "across the lake as the sun sets behind green hills where old villages and quiet farms lie "
    "along a mountain road that winds through the valley"
)
TEXT_WORDS = tuple(TEXT_SOURCE.split())

# ---- checkpoints ---------------------------------------------------------------------------------

MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280  # Qwen's recommended bound, epd's default: at most 1,280 image tokens
REAL_MAX_PIXELS = 28 * 28 * 256  # at real widths the forward is heavy on a CPU: smaller images
CHECKPOINT_SEED = 20261203


def _vision(**fields: Any) -> dict[str, Any]:
    from tests.fixtures.qwen2_5_vl import TINY_VISION

    return {**TINY_VISION, **fields}


def pipeline_spec() -> dict[str, Any]:
    """The tower of ``bench.pipeline_tower`` and the fixture's tiny language model."""
    from bench.pipeline_tower import PIPELINE_TOWER as T
    from tests.fixtures.qwen2_5_vl import TINY_TEXT

    vision = _vision(
        depth=T.depth,
        hidden_size=T.hidden_size,
        intermediate_size=T.intermediate_size,
        num_heads=T.num_heads,
        window_size=T.window_size,
        fullatt_block_indexes=list(T.fullatt_block_indexes),
    )
    return {"name": "pipeline", "vision": vision, "text": dict(TINY_TEXT), "pixels": [MIN_PIXELS, MAX_PIXELS]}


def real_widths_spec() -> dict[str, Any]:
    """Qwen2.5-VL's real tower widths with 2 blocks (one window, one full attention) and a 2-layer
    language model of width 2048 (head_dim 128, as Qwen2.5-VL-3B)."""
    from tests.fixtures.qwen2_5_vl import TINY_TEXT

    vision = _vision(
        depth=2,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        window_size=112,
        fullatt_block_indexes=[1],
    )
    text = {
        **TINY_TEXT,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1000000.0},
    }
    return {"name": "real-widths", "vision": vision, "text": text, "pixels": [MIN_PIXELS, REAL_MAX_PIXELS]}


def build_checkpoint(out_dir: Path, spec: dict[str, Any], seed: int = CHECKPOINT_SEED) -> Path:
    """A Qwen2.5-VL directory of ``spec``'s sizes, written by transformers' ``save_pretrained``, with
    the fixture's tokenizer, chat template and processor files (image bounds from ``spec``)."""
    import torch
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    from tests.fixtures import qwen2_5_vl as fx

    tokenizer = fx.build_tokenizer()
    ids = fx.special_token_ids(tokenizer)
    bos, eos = ids[fx.ENDOFTEXT], ids[fx.IM_END]
    text = spec["text"]
    config = Qwen2_5_VLConfig(
        vision_config={**spec["vision"], "out_hidden_size": text["hidden_size"]},
        text_config={**text, "vocab_size": fx.VOCAB_SIZE, "bos_token_id": bos, "eos_token_id": eos},
        image_token_id=ids[fx.IMAGE_PAD],
        video_token_id=ids[fx.VIDEO_PAD],
        vision_start_token_id=ids[fx.VISION_START],
        vision_end_token_id=ids[fx.VISION_END],
        tie_word_embeddings=False,
    )
    config.bos_token_id, config.eos_token_id = bos, eos
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    # the fixture's weights recipe: sharp attention, no special token ever greedy (no early eos)
    fx._randomize(model, seed + 1, specials_from=min(ids.values()))
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = bos, [eos, bos], bos
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    lo, hi = spec["pixels"]
    image_processor = Qwen2VLImageProcessor(min_pixels=lo, max_pixels=hi)
    video_processor = Qwen2VLVideoProcessor(
        min_pixels=fx.VIDEO_MIN_PIXELS,
        max_pixels=fx.VIDEO_MAX_PIXELS,
        fps=fx.VIDEO_FPS,
        cap_pixels_per_frame=True,
    )
    processor = Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=fx.CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    image_processor.save_pretrained(out_dir)
    video_processor.save_pretrained(out_dir)
    path = out_dir / "preprocessor_config.json"  # the released files' spelling of the bounds, too
    settings = json.loads(path.read_text())
    settings.update(min_pixels=lo, max_pixels=hi)
    path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return out_dir


def ensure_checkpoint(spec: dict[str, Any]) -> Path:
    """``spec``'s checkpoint under the bench cache, built on first use (keyed by the spec, the
    fixture's source and transformers' version)."""
    import transformers

    key = hashlib.sha256(
        json.dumps(spec, sort_keys=True).encode()
        + TINY_QWEN_FIXTURE.read_bytes()
        + transformers.__version__.encode()
        + str(CHECKPOINT_SEED).encode()
    ).hexdigest()[:12]
    return build_once(cache_dir() / f"vlm-peer-{spec['name']}-{key}", lambda tmp: build_checkpoint(tmp, spec))


# ---- vLLM settings --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VLLMSettings:
    """How the vLLM server runs (what ``--probe`` compares)."""

    bind: str = "auto"  # VLLM_CPU_OMP_THREADS_BIND: auto = inference on core 0, core 1 left to the API server
    api_servers: int = 1  # --api-server-count: processes that parse, fetch and preprocess
    mm_cache_gb: float = 4.0  # --mm-processor-cache-gb (vLLM's default: 4)
    processor: str = "fast"  # the HF image processor: fast (torchvision, the default here) or slow (PIL)
    keep_alive_s: int | None = None  # VLLM_HTTP_TIMEOUT_KEEP_ALIVE (None: vLLM's default, 5 s)

    def label(self) -> str:
        return (
            f"bind={self.bind} api_servers={self.api_servers} mm_cache_gb={self.mm_cache_gb:g} "
            f"processor={self.processor}"
            + (f" keep_alive_s={self.keep_alive_s}" if self.keep_alive_s is not None else "")
        )

    def env(self) -> dict[str, str]:
        out = {"VLLM_CPU_OMP_THREADS_BIND": self.bind}
        if self.keep_alive_s is not None:
            out["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] = str(self.keep_alive_s)
        return out

    def args(self) -> tuple[str, ...]:
        out = ["--mm-processor-cache-gb", f"{self.mm_cache_gb:g}"]
        if self.api_servers != 1:
            out += ["--api-server-count", str(self.api_servers)]
        if self.processor == "slow":
            out += ["--mm-processor-kwargs", json.dumps({"use_fast": False})]
        return tuple(out)


# --probe: vLLM's defaults, then one setting changed at a time.
PROBES: tuple[VLLMSettings, ...] = (
    VLLMSettings(),
    VLLMSettings(bind="0-1"),
    VLLMSettings(bind="nobind"),
    VLLMSettings(api_servers=2),
    VLLMSettings(processor="slow"),
    VLLMSettings(mm_cache_gb=0.0),
)


def start_vllm(model_dir: Path, settings: VLLMSettings, log: Path, max_seqs: int) -> Any:
    from epd.llm_servers.vllm_launch import VLLMLaunch, VLLMProcess

    launch = VLLMLaunch(
        str(model_dir),
        free_port(),
        served_model_names=("bench",),
        dtype="float32",
        max_model_len=4096,
        kv_cache_gib=1.0,
        extra_args=(
            "--max-num-seqs",
            str(max(max_seqs, 16)),
            "--disable-uvicorn-access-log",
            *settings.args(),
        ),
        env=settings.env(),
    )
    return VLLMProcess(launch, log, ready_timeout_s=420.0).start()


# ---- requests -------------------------------------------------------------------------------------


def _chat(content: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }


class Requests:
    """The request bodies of every phase. For a workload and repeat every side gets the same images
    (base image and order) and texts; image bytes are fresh per side and repeat (no side, nor a
    later repeat, finds another's images in a cache)."""

    def __init__(self, server: MediaServer, images: Sequence[CorpusItem], seed: int, max_tokens: int) -> None:
        self.server = server
        self.images = list(images)
        self.seed = seed
        self.max_tokens = max_tokens
        self.run_id = uuid.uuid4().hex[:10]

    def _image(self, name: str, base: int) -> dict[str, Any]:
        item = self.images[base]
        data = unique_variant(item.data, f"{self.run_id}-{name}")
        url = self.server.add(f"{name}.jpg", data, item.content_type)
        return _chat(
            [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": IMAGE_PROMPT}],
            self.max_tokens,
        )

    def cold(self, side: str, rep: int, n: int) -> list[dict[str, Any]]:
        """``n`` distinct images: every base size once per cycle, each cycle shuffled."""
        rng = random.Random(self.seed * 1_000_003 + 17 * rep + 1)
        order: list[int] = []
        while len(order) < n:
            cycle = list(range(len(self.images)))
            rng.shuffle(cycle)
            order += cycle
        return [self._image(f"{_slug(side)}-r{rep}-cold-{i}", b) for i, b in enumerate(order[:n])]

    def zipf(self, side: str, rep: int, n: int, pool: int, s: float) -> tuple[list[dict[str, Any]], float]:
        """``n`` draws by Zipf(``s``) over ``pool`` images (pool item k: a fixed base size), and the
        share of draws whose image was drawn before."""
        rng = random.Random(self.seed * 1_000_003 + 17 * rep + 2)
        weights = [1.0 / (k + 1) ** s for k in range(pool)]
        draws = rng.choices(range(pool), weights=weights, k=n)
        base_rng = random.Random(self.seed + 5)
        base_of = [base_rng.randrange(len(self.images)) for _ in range(pool)]
        bodies: dict[int, dict[str, Any]] = {}
        out = []
        for k in draws:
            if k not in bodies:
                bodies[k] = self._image(f"{_slug(side)}-r{rep}-zipf-{k}", base_of[k])
            out.append(bodies[k])
        return out, 1.0 - len(bodies) / max(1, n)

    def embeds(self, rep: int, n: int, model_dir: Path) -> list[dict[str, Any]]:
        """The cold images' chats as vLLM takes them from epd: one ``image_embeds`` part of the
        image's grid (its size through the checkpoint's ``smart_resize``), random values, a fresh
        uuid per request (no cache hit), the same text."""
        import torch

        from epd.llm_servers.vllm_embeds import tensor_b64
        from media_io.preprocess.resize import smart_resize
        from media_io.processor_config import preprocess_config_from_dir

        cfg = preprocess_config_from_dir(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        hidden, merge = config["text_config"]["hidden_size"], cfg.merge_size
        rng = random.Random(self.seed * 1_000_003 + 17 * rep + 1)
        gen = torch.Generator().manual_seed(rep)
        out = []
        for i in range(n):
            item = self.images[rng.randrange(len(self.images))]
            h, w = smart_resize(item.height, item.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
            grid = [1, h // cfg.patch_size, w // cfg.patch_size]
            rows = grid[1] * grid[2] // (merge * merge)
            part = {
                "type": "image_embeds",
                "uuid": f"{self.run_id}-embeds-{rep}-{i}",
                "image_embeds": {
                    "image_embeds": tensor_b64(torch.randn(rows, hidden, generator=gen)),
                    "image_grid_thw": grid,
                },
            }
            out.append(_chat([part, {"type": "text", "text": IMAGE_PROMPT}], self.max_tokens))
        return out

    def text(self, rep: int, n: int) -> list[dict[str, Any]]:
        """``n`` distinct prompts of 24..40 words."""
        rng = random.Random(self.seed * 1_000_003 + 17 * rep + 3)
        out = []
        for i in range(n):
            words = " ".join(rng.choice(TEXT_WORDS) for _ in range(rng.randint(24, 40)))
            out.append(_chat([{"type": "text", "text": f"Story {rep}.{i}: {words}."}], self.max_tokens))
        return out


def _slug(side: str) -> str:
    return side.replace("+", "-")


# ---- sides and load -------------------------------------------------------------------------------


class Answer(NamedTuple):
    text: str
    completion_tokens: int
    prompt_tokens: int


def chat_sender(answers: dict[int, Answer]) -> SendFn:
    """A load-generator send function for chat completions; answers go to ``answers`` by index and
    ``Outcome.cache_hit`` is whether every media item was an epd cache hit (None without media info)."""

    async def send(
        session: aiohttp.ClientSession, endpoint: str, body: dict[str, Any], index: int, t0: float
    ) -> Outcome:
        start = time.perf_counter() - t0
        status, hit, error = 0, None, None
        try:
            async with session.post(endpoint, json=body) as resp:
                status = resp.status
                raw = await resp.read()
            if status != 200:
                error = f"HTTP {status}: {raw[:200].decode(errors='replace')}"
            else:
                doc = json.loads(raw)
                media = doc.get("media") or []
                hit = all(bool(m.get("cache_hit")) for m in media) if media else None
                usage = doc.get("usage") or {}
                answers[index] = Answer(
                    str(doc["choices"][0]["message"].get("content") or ""),
                    int(usage.get("completion_tokens") or 0),
                    int(usage.get("prompt_tokens") or 0),
                )
        except (
            aiohttp.ClientError,
            TimeoutError,
            OSError,
            ValueError,
            KeyError,
            IndexError,
            TypeError,
        ) as exc:
            error = f"{type(exc).__name__}: {exc}"
        return Outcome(index, start, time.perf_counter() - t0, status, hit, error, {})

    return send


# A server's processes by role: a direct child whose command line holds the marker counts as the role.
ROLE_MARKERS = (
    ("VLLM::EngineCore", "vllm engine"),
    ("epd.cli encoder", "epd encoders"),
    ("epd.cli llm", "epd engine"),
)


def pin_frontend(root: int, cpus: Sequence[int], api_cpus: Sequence[int] | None = None) -> None:
    """Every thread of vLLM's processes under ``root`` but its workers (whose inference threads
    carry their own binding) onto ``cpus``; the API server itself (``root``) onto ``api_cpus``
    when given."""
    for pid in [root, *_children(root)]:
        with contextlib.suppress(OSError):
            if b"Worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            on = api_cpus if pid == root and api_cpus else cpus
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), on)


def _children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                text = Path(f"/proc/{name}/stat").read_text()
                if int(text[text.rfind(")") + 2 :].split()[1]) == pid:
                    out.append(int(name))
    return out


def _role(pid: int) -> str | None:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return next((role for marker, role in ROLE_MARKERS if marker in cmdline), None)


def process_cpu(roots: Sequence[tuple[int, str]]) -> dict[str, float]:
    """CPU seconds used so far by each root's process tree, split by role (``ROLE_MARKERS``; the rest
    of a tree counts as the root's label). Empty without /proc."""
    out: dict[str, float] = {}
    for pid, label in roots:
        total = tree_cpu_seconds(pid)
        if total is None:
            continue
        for child in _children(pid):
            role = _role(child)
            if role is not None:
                part = tree_cpu_seconds(child) or 0.0
                out[role] = out.get(role, 0.0) + part
                total -= part
        out[label] = out.get(label, 0.0) + total
    return out


@dataclasses.dataclass
class Side:
    name: str
    url: str
    roots: list[tuple[int, str]]  # the processes it runs on (pid, label), each with its tree
    model: str = ""
    # vLLM's API server (its tree), and the cores its API server and engine core run on while this
    # side is driven (``place``): epd in front keeps them on vLLM's own cores, as
    # ``epd serve --cpu-split`` places a local vLLM; None: every core (vLLM alone)
    vllm_pid: int | None = None
    vllm_cpus: tuple[int, ...] | None = None
    api_cpus: tuple[int, ...] | None = None  # vLLM's API server apart from its engine core (None: with it)

    def cpu(self) -> dict[str, float]:
        return process_cpu(self.roots)

    def place(self) -> None:
        """Move vLLM's API server and engine core threads to this side's cores (its worker's
        inference threads stay where ``VLLM_CPU_OMP_THREADS_BIND`` bound them)."""
        if self.vllm_pid is not None:
            pin_frontend(
                self.vllm_pid, self.vllm_cpus or tuple(sorted(os.sched_getaffinity(0))), self.api_cpus
            )

    def learn_model(self) -> None:
        """The model id its /v1/models names first (vLLM needs it in every request)."""
        import urllib.request

        with urllib.request.urlopen(self.url + "/v1/models", timeout=10) as resp:
            self.model = str(json.loads(resp.read())["data"][0]["id"])


class Phase(NamedTuple):
    side: str
    workload: str
    mode: str  # closed | open
    repeat: int
    result: LoadResult
    answers: dict[int, Answer]
    cpu_s: dict[str, float]  # the side's processes by role, during the phase (empty: unknown)
    client_cpu_s: float  # this process (load generator + media server)
    repeat_share: float | None  # zipf: requests whose image came before in the phase
    loadavg: tuple[float, float]  # the machine's 1-minute load average before and after


def drive(
    side: Side,
    workload: str,
    bodies: Sequence[dict[str, Any]],
    *,
    mode: str,
    level: float,
    repeat: int,
    seed: int = 0,
    repeat_share: float | None = None,
    encode: bool = False,
) -> Phase:
    """One closed (``level`` = concurrency) or open (``level`` = rate/s) loop of ``bodies``: chats,
    or with ``encode`` each chat's image URL to epd's ``/v1/encode`` (the encode stage alone)."""
    answers: dict[int, Answer] = {}
    send = send_one if encode else chat_sender(answers)
    side.place()
    wait_for_quiet_cpu()  # the side driven before may still be busy after its last answer

    def body(i: int) -> dict[str, Any]:
        if encode:
            return {"items": [{"url": bodies[i]["messages"][0]["content"][0]["image_url"]["url"]}]}
        return {**bodies[i], "model": side.model}

    async def go() -> LoadResult:
        async with new_session(timeout_s=600.0) as session:
            url = side.url + (ENCODE_PATH if encode else CHAT_PATH)
            if mode == "closed":
                return await closed_loop(
                    session, url, body, concurrency=int(level), requests=len(bodies), send=send
                )
            return await open_loop(session, url, body, rate=level, requests=len(bodies), seed=seed, send=send)

    load0, cpu0, client0 = os.getloadavg()[0], side.cpu(), time.process_time()
    result = asyncio.run(go())
    cpu1 = side.cpu()
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu1 if k in cpu0}
    if result.errors:
        examples = sorted({o.error for o in result.outcomes if o.error})[:3]
        print(f"warning: {side.name} {workload} {mode}: {result.errors} of {len(bodies)} failed: {examples}")
    client = time.process_time() - client0
    loads = (load0, os.getloadavg()[0])
    return Phase(side.name, workload, mode, repeat, result, answers, cpu, client, repeat_share, loads)


# ---- summary --------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def aggregate(phases: Sequence[Phase]) -> dict[str, Any]:
    """One side, workload and mode over its repeats: QPS = all answers / summed wall time, latency
    percentiles over every answered request, and per-repeat QPS."""
    merged = merge_results([p.result for p in phases])
    lat = merged.latencies_s()
    pct = percentiles(lat) if lat else None
    answers = [a for p in phases for a in p.answers.values()]
    hits = [o.cache_hit for o in merged.outcomes if o.cache_hit is not None]
    parts: dict[str, float] = {}
    for p in phases:
        for k, v in p.cpu_s.items():
            parts[k] = parts.get(k, 0.0) + v
    cpu = sum(parts.values()) if all(p.cpu_s for p in phases) else None
    n_ok = len(merged.ok)
    errors = sorted({o.error for o in merged.outcomes if o.error})[:3]
    shares = [p.repeat_share for p in phases if p.repeat_share is not None]
    return {
        "side": phases[0].side,
        "workload": phases[0].workload,
        "mode": phases[0].mode,
        "level": phases[0].result.level,
        "repeats": len(phases),
        "requests": len(merged.outcomes),
        "errors": merged.errors,
        "error_examples": errors,
        "qps": merged.qps,
        "qps_per_repeat": [p.result.qps for p in phases],
        "p50_ms": pct.p50 * 1e3 if pct else None,
        "p90_ms": pct.p90 * 1e3 if pct else None,
        "p99_ms": pct.p99 * 1e3 if pct else None,
        "mean_ms": pct.mean * 1e3 if pct else None,
        "p90_ms_per_repeat": [
            percentiles(p.result.latencies_s()).p90 * 1e3 if p.result.ok else None for p in phases
        ],
        "epd_cache_hit_share": sum(hits) / len(hits) if hits else None,
        "repeat_share": statistics.mean(shares) if shares else None,
        "completion_tokens_mean": statistics.mean(a.completion_tokens for a in answers) if answers else None,
        "prompt_tokens_mean": statistics.mean(a.prompt_tokens for a in answers) if answers else None,
        "service_cpu_ms_per_request": cpu * 1e3 / n_ok if cpu is not None and n_ok else None,
        "cpu_ms_per_request_by_role": {k: v * 1e3 / n_ok for k, v in parts.items()} if n_ok and cpu else {},
        "client_cpu_ms_per_request": sum(p.client_cpu_s for p in phases) * 1e3 / max(1, len(merged.outcomes)),
        "loadavg_max": max(max(p.loadavg) for p in phases),
    }


def _median_ratio(num: Sequence[float | None], den: Sequence[float | None]) -> float | None:
    rs = [a / b for a, b in zip(num, den, strict=False) if a is not None and b]
    return statistics.median(rs) if rs else None


def same_text_share(phases: Sequence[Phase], side: str, ref: str = "vllm") -> float | None:
    """The share of requests (same workload, repeat and index) whose answer text equals ``ref``'s."""
    by_key = {(p.side, p.workload, p.mode, p.repeat): p.answers for p in phases}
    same = total = 0
    for (s, w, m, r), answers in by_key.items():
        if s != side or m != "closed":
            continue
        other = by_key.get((ref, w, m, r), {})
        for i, a in answers.items():
            if i in other:
                total += 1
                same += int(a.text == other[i].text)
    return same / total if total else None


def summarize(records: Sequence[dict[str, Any]], ceiling_images_per_s: float | None) -> dict[str, Any]:
    rec = {(r["side"], r["workload"], r["mode"]): r for r in records}

    def get(side: str, workload: str, key: str, mode: str = "closed") -> Any:
        r = rec.get((side, workload, mode))
        return r[key] if r else None

    out: dict[str, Any] = {}
    for prefix, side in (("", "epd+vllm"), ("epd_", "epd")):
        out[f"{prefix}qps_ratio_cold"] = _ratio(get(side, "cold", "qps"), get("vllm", "cold", "qps"))
        out[f"{prefix}p90_ratio_cold"] = _ratio(get(side, "cold", "p90_ms"), get("vllm", "cold", "p90_ms"))
        out[f"{prefix}qps_ratio_zipf"] = _ratio(get(side, "zipf", "qps"), get("vllm", "zipf", "qps"))
        out[f"{prefix}text_qps_ratio"] = _ratio(get(side, "text", "qps"), get("vllm", "text", "qps"))
        out[f"{prefix}open_p90_ratio_cold"] = _ratio(
            get(side, "cold", "p90_ms", "open"), get("vllm", "cold", "p90_ms", "open")
        )
        for w, key in (("cold", "qps_ratio_cold"), ("zipf", "qps_ratio_zipf"), ("text", "text_qps_ratio")):
            out[f"{prefix}{key}_median"] = _median_ratio(
                get(side, w, "qps_per_repeat") or [], get("vllm", w, "qps_per_repeat") or []
            )
        out[f"{prefix}p90_ratio_cold_median"] = _median_ratio(
            get(side, "cold", "p90_ms_per_repeat") or [], get("vllm", "cold", "p90_ms_per_repeat") or []
        )
    for side in SIDES:
        for w in WORKLOADS:
            out[f"{_slug(side)}_{w}_qps"] = get(side, w, "qps")
    vllm_cold = get("vllm", "cold", "qps")
    # vLLM given the embeddings directly, over vLLM given the images: the most epd+vllm can reach
    out["vllm_given_embeds_cold_qps"] = get("vllm given embeds", "cold", "qps")
    out["embeds_bound_qps_ratio_cold"] = _ratio(out["vllm_given_embeds_cold_qps"], vllm_cold)
    # epd's encode stage alone (vLLM idle) over vLLM alone: the other half's bound
    out["epd_encode_only_cold_qps"] = get("epd encode only", "cold", "qps")
    out["encode_bound_qps_ratio_cold"] = _ratio(out["epd_encode_only_cold_qps"], vllm_cold)
    # at equal cores, the two halves in series: 1 / (1 / LM side's bound + 1 / encode side's bound)
    eb, cb = out["embeds_bound_qps_ratio_cold"], out["encode_bound_qps_ratio_cold"]
    out["ideal_split_ratio_cold"] = 1.0 / (1.0 / eb + 1.0 / cb) if eb and cb else None
    out["ceiling_images_per_s"] = ceiling_images_per_s
    # the forward's share of a vLLM-alone cold request: forward time per image / time per request
    out["forward_fraction"] = _ratio(vllm_cold, ceiling_images_per_s)
    out["errors"] = sum(r["errors"] for r in records)
    qc, pc, qz, qt, op, ideal = (
        out[k]
        for k in (
            "qps_ratio_cold",
            "p90_ratio_cold",
            "qps_ratio_zipf",
            "text_qps_ratio",
            "open_p90_ratio_cold",
            "ideal_split_ratio_cold",
        )
    )
    # the CPU targets (equal cores for both sides; the seed's GPU goals, 2x QPS with P90 -18%, are
    # for a node where E has devices of its own: docs/performance.md)
    out["targets_met"] = {  # None: not measured in this run
        "qps_ratio_cold>=max(1,0.9*ideal)": None
        if qc is None or ideal is None
        else qc >= max(1.0, 0.9 * ideal),
        "p90_ratio_cold<=1": None if pc is None else pc <= 1.0,
        "qps_ratio_zipf>=1.5": None if qz is None else qz >= 1.5,
        "text_qps_ratio>=0.95": None if qt is None else qt >= 0.95,
        "open_p90_ratio_cold<=0.5": None if op is None else op <= 0.5,
    }
    return out


COLUMNS = [
    "side",
    "load",
    "n",
    "err",
    "QPS",
    "QPS per repeat",
    "P50 ms",
    "P90 ms",
    "P99 ms",
    "hits",
    "repeat",
    "CPU ms/req",
    "load avg",
]


def table_row(r: dict[str, Any]) -> list[object]:
    """One row of the results table (hits: epd's media-cache hits; repeat: Zipf draws seen before)."""

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.0f}%"

    def ms(v: float | None) -> object:
        return "-" if v is None else round(v)

    load = (
        f"{r['workload']} c={r['level']:.0f}"
        if r["mode"] == "closed"
        else f"{r['workload']} {r['level']:.1f}/s"
    )
    return [
        r["side"],
        load,
        r["requests"],
        r["errors"],
        r["qps"],
        " ".join(f"{q:.1f}" for q in r["qps_per_repeat"]) if r["mode"] == "closed" else "-",
        ms(r["p50_ms"]),
        ms(r["p90_ms"]),
        ms(r["p99_ms"]),
        pct(r["epd_cache_hit_share"]),
        pct(r["repeat_share"]),
        ms(r["service_cpu_ms_per_request"]),
        round(r["loadavg_max"], 1),
    ]


# ---- the run --------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    g = parser.add_argument_group("load")
    g.add_argument("--concurrency", type=int, default=16, help="closed-loop concurrency")
    g.add_argument("--requests", type=int, default=96, help="image requests per side, workload and repeat")
    g.add_argument("--text-requests", type=int, default=256, help="text-only requests per side and repeat")
    g.add_argument("--repeats", type=int, default=4, help="interleaved repeats (side order rotates)")
    g.add_argument("--warmup", type=int, default=6, help="untimed requests per side (images and texts)")
    g.add_argument("--open-requests", type=int, default=96, help="open-loop cold requests per side (0: none)")
    g.add_argument(
        "--embeds-requests",
        type=int,
        default=96,
        help="cold requests sent to vLLM as ready embeddings (what epd sends it; 0: none)",
    )
    g.add_argument(
        "--open-rate", type=float, default=None, help="open-loop rate/s (default 0.8x vllm cold QPS)"
    )
    g.add_argument("--zipf-pool", type=int, default=300, help="distinct images the Zipf draws range over")
    g.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent")
    g.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (greedy)")
    g.add_argument("--latency-ms", type=float, default=30.0, help="added media-server latency")
    g.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated subset of cold,zipf,text"
    )
    g = parser.add_argument_group("setup")
    g.add_argument("--real-widths", action="store_true", help="a tower and LLM at Qwen2.5-VL's real widths")
    g.add_argument("--model", type=Path, default=None, help="a Qwen2.5-VL directory (default: generated)")
    g.add_argument("--corpus-dir", type=Path, default=None, help="generated media cache")
    g.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temp dir)")
    g.add_argument("--ceiling-seconds", type=float, default=3.0, help="forward-only timing per configuration")
    g.add_argument(
        "--serve-arg", action="append", default=[], metavar="ARG", help="extra argument for both `epd serve`s"
    )
    g = parser.add_argument_group("vLLM (see --probe)")
    d = VLLMSettings()
    g.add_argument("--vllm-bind", default=d.bind, help="VLLM_CPU_OMP_THREADS_BIND (auto, 0-1, nobind, ...)")
    g.add_argument(
        "--epd-cpus",
        default="auto",
        help="cores of the epd in front of vLLM (auto: those vLLM's inference threads are not bound to; off)",
    )
    g.add_argument(
        "--vllm-frontend-cpus",
        choices=("llm", "epd", "all", "api-epd"),
        default="llm",
        help="with epd in front: vLLM's API server and engine core on the inference threads' cores, "
        "on epd's, or anywhere; api-epd: the API server on epd's cores, the engine core on vLLM's "
        "(its worker's inference threads stay bound)",
    )
    g.add_argument("--vllm-api-servers", type=int, default=d.api_servers, help="--api-server-count")
    g.add_argument("--vllm-mm-cache-gb", type=float, default=d.mm_cache_gb, help="--mm-processor-cache-gb")
    g.add_argument(
        "--vllm-processor", choices=("fast", "slow"), default=d.processor, help="HF image processor"
    )
    g.add_argument(
        "--vllm-keep-alive-s",
        type=int,
        default=d.keep_alive_s,
        help="VLLM_HTTP_TIMEOUT_KEEP_ALIVE (default: vLLM's 5 s, under epd's 15 s client pool: see the notes)",
    )
    g.add_argument(
        "--probes",
        default=None,
        help="with --probe: comma-separated indices into PROBES (default: all)",
    )
    g.add_argument(
        "--probe",
        action="store_true",
        help="measure vLLM alone (cold and Zipf) under each of PROBES' settings instead of the sides",
    )


def _quick(args: argparse.Namespace) -> None:
    args.requests = min(args.requests, 4)
    args.text_requests = min(args.text_requests, 4)
    args.repeats = min(args.repeats, 1)
    args.warmup = min(args.warmup, 1)
    args.concurrency = min(args.concurrency, 2)
    args.open_requests = min(args.open_requests, 3)
    args.embeds_requests = min(args.embeds_requests, 3)
    args.zipf_pool = min(args.zipf_pool, 4)
    args.ceiling_seconds = min(args.ceiling_seconds, 0.3)


def epd_cpus(spec: str, settings: VLLMSettings) -> tuple[int, ...]:
    """The cores epd in front of vLLM runs on (``--epd-cpus``): given, or (auto) those vLLM's
    inference threads are not bound to (its "auto" binding takes core 0 here); () for anywhere."""
    usable = sorted(os.sched_getaffinity(0))
    if spec == "off":
        return ()
    if spec != "auto":
        return parse_cpus(spec)
    bound = (
        {usable[0]}
        if settings.bind == "auto"
        else set()
        if settings.bind == "nobind"
        else set(parse_cpus(settings.bind))
    )
    rest = tuple(c for c in usable if c not in bound)
    return rest if rest and len(rest) < len(usable) else ()


def frontend_cpus(spec: str, epd: tuple[int, ...]) -> tuple[int, ...] | None:
    """Where vLLM's engine core (and API server) run while epd is in front (``--vllm-frontend-cpus``):
    ``llm`` the cores epd leaves (beside the inference threads), ``epd`` epd's own cores, ``all``
    every core (None); ``api-epd`` as ``llm``, the API server moved to epd's cores (``Side.api_cpus``)."""
    usable = tuple(sorted(os.sched_getaffinity(0)))
    if spec == "epd":
        return epd or None
    if spec in ("llm", "api-epd"):
        return tuple(c for c in usable if c not in epd) or None
    return None


class Servers:
    """vLLM and the two `epd serve`s, started together (epd alone while vLLM starts), always stopped."""

    def __init__(
        self, model_dir: Path, settings: VLLMSettings, log_dir: Path, args: argparse.Namespace
    ) -> None:
        self.model_dir = model_dir
        self.settings = settings
        self.log_dir = log_dir
        self.args = args
        self.vllm: Any = None
        self.procs: list[ServiceProcess] = []
        self.namespaces: list[str] = []

    def _epd(self, name: str, extra: Sequence[str]) -> ServiceProcess:
        port = free_port()
        namespace = f"bench-vlm-{uuid.uuid4().hex[:8]}"
        self.namespaces.append(namespace)
        cmd = [
            sys.executable, "-m", "epd.cli", "serve", "--port", str(port), "--model", str(self.model_dir),
            "--fetch-allow-hosts", "127.0.0.1", "--cache-namespace", namespace, *extra, *self.args.serve_arg,
        ]  # fmt: skip
        proc = ServiceProcess(
            name, cmd, f"http://127.0.0.1:{port}", self.log_dir / f"{_slug(name)}.log", ready_timeout_s=420.0
        )
        self.procs.append(proc)  # before start: a failed start is still stopped
        return proc

    def start(self, sides: Sequence[str]) -> list[Side]:
        failures: list[BaseException] = []
        alone = self._epd("epd", []) if "epd" in sides else None

        def start_alone() -> None:
            try:
                if alone is not None:
                    alone.start()
            except BaseException as exc:
                failures.append(exc)

        thread = threading.Thread(target=start_alone, name="start-epd")
        thread.start()
        try:
            t0 = time.monotonic()
            self.vllm = start_vllm(
                self.model_dir, self.settings, self.log_dir / "vllm.log", self.args.concurrency
            )
            print(f"vLLM up in {time.monotonic() - t0:.0f} s ({self.settings.label()})", flush=True)
            front = None
            if "epd+vllm" in sides:
                front = self._epd("epd+vllm", ["--llm-server", "vllm", "--llm-url", self.vllm.url])
                front.cmd = list(pinned_argv(tuple(front.cmd), epd_cpus(self.args.epd_cpus, self.settings)))
                front.start()
        finally:
            thread.join()
        if failures:
            raise failures[0]
        vllm_root = (self.vllm.proc.pid, "vllm api")
        out: list[Side] = []
        for name in sides:
            if name == "vllm":
                out.append(Side(name, self.vllm.url, [vllm_root], vllm_pid=self.vllm.proc.pid))
            elif name == "epd+vllm":
                assert front is not None and front.pid is not None
                mine = epd_cpus(self.args.epd_cpus, self.settings)
                theirs = frontend_cpus(self.args.vllm_frontend_cpus, mine)
                out.append(
                    Side(
                        name,
                        front.base_url,
                        [(front.pid, "epd ingress"), vllm_root],
                        vllm_pid=self.vllm.proc.pid,
                        vllm_cpus=theirs,
                        api_cpus=mine if self.args.vllm_frontend_cpus == "api-epd" else None,
                    )
                )
            else:
                assert alone is not None and alone.pid is not None
                # vLLM (idle) back on every core, as it was before the split's phases
                out.append(
                    Side(name, alone.base_url, [(alone.pid, "epd ingress")], vllm_pid=self.vllm.proc.pid)
                )
        for side in out:
            side.learn_model()
        return out

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        if self.vllm is not None:
            self.vllm.stop()
        for ns in self.namespaces:
            shutil.rmtree(f"/dev/shm/epd-{ns}", ignore_errors=True)


@contextlib.contextmanager
def servers(
    model_dir: Path, settings: VLLMSettings, log_dir: Path, args: argparse.Namespace, sides: Sequence[str]
) -> Iterator[list[Side]]:
    s = Servers(model_dir, settings, log_dir, args)
    try:
        yield s.start(sides)
    finally:
        s.stop()


def measure_ceiling(model_dir: Path, images: Sequence[CorpusItem], seconds: float) -> float | None:
    """Forward-only images/s of the checkpoint's tower over the images (the better way of using the
    cores), with nothing else running."""
    from bench.ceiling import best_ceiling
    from encoder.serving.worker import WorkerConfig
    from media_io.processor_config import preprocess_config_from_dir

    runs = best_ceiling(
        [it.data for it in images],
        cores=usable_cores(),
        patch_budget=WorkerConfig(device="cpu").batch_budget(),
        min_seconds=seconds,
        preprocess=preprocess_config_from_dir(model_dir),
        model_path=str(model_dir),
    )
    for c in runs:
        print(f"forward-only ({c.label}): {c.images_per_s:.2f} images/s ({c.patches_per_s:,.0f} patches/s)")
    return runs[0].images_per_s if runs else None


def run_sides(args: argparse.Namespace, model_dir: Path, images: Sequence[CorpusItem], log_dir: Path) -> int:
    machine = machine_info()
    settings = VLLMSettings(
        args.vllm_bind,
        args.vllm_api_servers,
        args.vllm_mm_cache_gb,
        args.vllm_processor,
        args.vllm_keep_alive_s,
    )
    workloads = [w for w in args.workloads.split(",") if w]
    ceiling = measure_ceiling(model_dir, images, args.ceiling_seconds)
    phases: list[Phase] = []
    with MediaServer(latency_s=args.latency_ms / 1e3) as media:
        reqs = Requests(media, images, args.seed, args.max_tokens)
        with servers(model_dir, settings, log_dir, args, SIDES) as sides:
            for side in sides:  # untimed: model pages, pools, connections, compiled shapes
                if args.warmup:
                    drive(
                        side,
                        "warm-up",
                        reqs.cold(side.name, -1, args.warmup),
                        mode="closed",
                        level=args.concurrency,
                        repeat=-1,
                    )
                    drive(
                        side,
                        "warm-up",
                        reqs.text(-1, args.warmup),
                        mode="closed",
                        level=args.concurrency,
                        repeat=-1,
                    )
            for rep in range(args.repeats):
                order = [sides[(rep + k) % len(sides)] for k in range(len(sides))]
                for workload in workloads:
                    for side in order:
                        t0 = time.perf_counter()
                        share = None
                        if workload == "cold":
                            bodies = reqs.cold(side.name, rep, args.requests)
                        elif workload == "zipf":
                            bodies, share = reqs.zipf(
                                side.name, rep, args.requests, args.zipf_pool, args.zipf_s
                            )
                        else:
                            bodies = reqs.text(rep, args.text_requests)
                        phase = drive(
                            side,
                            workload,
                            bodies,
                            mode="closed",
                            level=args.concurrency,
                            repeat=rep,
                            repeat_share=share,
                        )
                        phases.append(phase)
                        print(
                            f"repeat {rep + 1}/{args.repeats} {workload:<4} {side.name:<8}: "
                            f"{phase.result.qps:6.2f} QPS ({time.perf_counter() - t0:.0f} s)",
                            flush=True,
                        )
            if args.embeds_requests and "cold" in workloads:
                # vLLM given the embeddings epd would send, straight: the most epd+vllm could reach
                vllm_side = next(s for s in sides if s.name == "vllm")
                embeds_side = dataclasses.replace(vllm_side, name="vllm given embeds")
                bodies = reqs.embeds(0, args.embeds_requests, model_dir)
                phase = drive(embeds_side, "cold", bodies, mode="closed", level=args.concurrency, repeat=0)
                phases.append(phase)
                print(f"vllm given embeds: {phase.result.qps:6.2f} QPS", flush=True)
                # epd's encode stage alone (/v1/encode of the cold images, vLLM idle): its own capacity
                front = next(s for s in sides if s.name == "epd+vllm")
                encode_side = dataclasses.replace(front, name="epd encode only")
                bodies = reqs.cold(encode_side.name, 0, args.embeds_requests)
                phase = drive(
                    encode_side, "cold", bodies, mode="closed", level=args.concurrency, repeat=0, encode=True
                )
                phases.append(phase)
                print(f"epd encode only: {phase.result.qps:6.2f} QPS", flush=True)
            if args.open_requests and "cold" in workloads:
                vllm_cold = [p.result for p in phases if p.side == "vllm" and p.workload == "cold"]
                rate = args.open_rate or max(0.8 * merge_results(vllm_cold).qps, 0.1)
                for side in sides:
                    bodies = reqs.cold(side.name, 1000, args.open_requests)
                    phase = drive(side, "cold", bodies, mode="open", level=rate, repeat=0, seed=args.seed)
                    phases.append(phase)
                    print(f"open loop {rate:.2f}/s {side.name:<8}: P90 {_p90_ms(phase):.0f} ms", flush=True)
    groups: dict[tuple[str, str, str], list[Phase]] = {}
    for p in phases:
        groups.setdefault((p.side, p.workload, p.mode), []).append(p)
    records = [aggregate(g) for g in groups.values()]
    summary = summarize(records, ceiling)
    summary["same_text_epd_vllm"] = same_text_share(phases, "epd+vllm")
    summary["same_text_epd"] = same_text_share(phases, "epd")
    summary["vllm_settings"] = dataclasses.asdict(settings)
    summary["checkpoint"] = str(model_dir)
    caption = (
        f"{format_machine(machine)} | media latency {args.latency_ms:g} ms | vLLM {settings.label()} | "
        f"checkpoint {model_dir.name}"
    )
    print_table(
        f"epd in front of vLLM vs vLLM alone vs epd alone ({len(images)} image sizes "
        f"{images[0].width}x{images[0].height}..{images[-1].width}x{images[-1].height}, "
        f"{args.max_tokens} output tokens, greedy)",
        COLUMNS,
        [table_row(r) for r in records],
        caption=caption,
    )
    roles = [r for _, r in ROLE_MARKERS] + ["vllm api", "epd ingress"]
    roles = [
        r
        for r in dict.fromkeys(sorted(roles))
        if any(r in rec["cpu_ms_per_request_by_role"] for rec in records)
    ]
    if roles:
        print_table(
            "where the CPU goes: ms of CPU per answered request, by process (all threads and children)",
            ["side", "load", *roles],
            [
                [
                    r["side"],
                    f"{r['workload']} {r['mode']}",
                    *(round(r["cpu_ms_per_request_by_role"].get(x, 0.0)) for x in roles),
                ]
                for r in records
            ],
        )
    rows = [[k, v] for k, v in summary.items() if v is not None and not isinstance(v, dict | list)]
    rows += [[k, "-" if v is None else v] for k, v in summary["targets_met"].items()]
    print_table("summary", ["metric", "value"], rows)
    config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    write_json(args.json, machine=machine, config=config, results=records, summary=summary)
    if args.json:
        print(f"json: {args.json}")
    return 0 if summary["errors"] == 0 else 1


def _p90_ms(phase: Phase) -> float:
    lat = phase.result.latencies_s()
    return percentiles(lat).p90 * 1e3 if lat else float("nan")


def probe_one(
    args: argparse.Namespace, model_dir: Path, settings: VLLMSettings, reqs: Requests, log_dir: Path, k: int
) -> list[dict[str, Any]]:
    """vLLM alone under ``settings``: a warm-up, then one closed loop of every workload."""
    records = []
    with servers(model_dir, settings, log_dir, args, ["vllm"]) as (side,):
        if args.warmup:
            warm = reqs.cold(f"probe{k}", -1, args.warmup)
            drive(side, "warm-up", warm, mode="closed", level=args.concurrency, repeat=-1)
        for workload in WORKLOADS:
            share = None
            if workload == "cold":
                bodies = reqs.cold(f"probe{k}", 0, args.requests)
            elif workload == "zipf":
                bodies, share = reqs.zipf(f"probe{k}", 0, args.requests, args.zipf_pool, args.zipf_s)
            else:
                bodies = reqs.text(k, args.text_requests)
            phase = drive(
                side, workload, bodies, mode="closed", level=args.concurrency, repeat=0, repeat_share=share
            )
            rec = {"settings": settings.label(), **aggregate([phase])}
            records.append(rec)
            print(
                f"{settings.label()}: {workload} {rec['qps']:.2f} QPS, P90 {rec['p90_ms']:.0f} ms", flush=True
            )
    return records


def run_probe(args: argparse.Namespace, model_dir: Path, images: Sequence[CorpusItem], log_dir: Path) -> int:
    """vLLM alone under each of ``PROBES``' settings: one closed loop of every workload each."""
    machine = machine_info()
    records: list[dict[str, Any]] = []
    with MediaServer(latency_s=args.latency_ms / 1e3) as media:
        reqs = Requests(media, images, args.seed, args.max_tokens)
        chosen = [int(k) for k in args.probes.split(",")] if args.probes else range(len(PROBES))
        for k in chosen:
            settings = PROBES[k]
            try:
                records += probe_one(args, model_dir, settings, reqs, log_dir / f"probe-{k}", k)
            except Exception as exc:  # a setting vLLM refuses (or that kills it) is a result too
                print(f"{settings.label()}: failed: {exc!s:.2000}", flush=True)
                records.append({"settings": settings.label(), "workload": "-", "failed": f"{exc!s:.2000}"})
    print_table(
        "vLLM alone under each setting (closed loop)",
        ["settings", "workload", "n", "err", "QPS", "P50 ms", "P90 ms", "CPU ms/req", "load max"],
        [
            [
                r["settings"],
                r["workload"],
                r["requests"],
                r["errors"],
                r["qps"],
                r["p50_ms"],
                r["p90_ms"],
                r["service_cpu_ms_per_request"] if r["service_cpu_ms_per_request"] is not None else "-",
                r["loadavg_max"],
            ]
            if "failed" not in r
            else [r["settings"], "failed", "-", "-", "-", "-", "-", "-", r["failed"][-200:]]
            for r in records
        ],
        caption=format_machine(machine) + f" | media latency {args.latency_ms:g} ms",
    )
    best = {
        w: max(done, key=lambda r: r["qps"])["settings"]
        for w in WORKLOADS
        if (done := [r for r in records if r["workload"] == w])
    }
    print(f"best: {best}")
    config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    write_json(
        args.json, machine=machine, config=config, results=records, summary={"best": best, "probe": True}
    )
    return 0 if all(r.get("errors") == 0 for r in records) else 1


def run(args: argparse.Namespace) -> int:
    from epd.llm_servers.vllm_launch import find_vllm

    if args.quick:
        _quick(args)
    find_vllm()  # fail early (VLLMNotFound says how to get it)
    if not sys.stdout.isatty():
        os.environ.setdefault("COLUMNS", "200")
    spec = real_widths_spec() if args.real_widths else pipeline_spec()
    t0 = time.perf_counter()
    model_dir = args.model or ensure_checkpoint(spec)
    corpus_dir = args.corpus_dir or default_corpus_dir()
    images = image_corpus(corpus_dir, QUICK_IMAGE_SIZES if args.quick else IMAGE_SIZES, seed=args.seed)
    print(
        f"checkpoint {model_dir}, corpus {len(images)} images ({time.perf_counter() - t0:.1f} s)", flush=True
    )
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="epd-bench-vlm-"))
    print(f"logs: {log_dir}", flush=True)
    if args.probe:
        return run_probe(args, model_dir, images, log_dir)
    return run_sides(args, model_dir, images, log_dir)


def _exit_on_sigterm() -> None:
    """SIGTERM (``timeout``, a CI runner) raises SystemExit, so every server is still stopped."""
    import signal

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m bench.vlm_peer", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    _exit_on_sigterm()
    raise SystemExit(main())
