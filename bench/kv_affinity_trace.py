"""The multi-turn agent trace of ``bench.kv_affinity``, deterministic from a seed.

    session s, turn t:   [system] [user 0] [assistant 0] ... [user t-1] [assistant t-1] [user t]
                          shared   ^-------------- this session's own history -------^  new

Every session opens with the same system prompt; each turn appends one user message (text of
``user_chars`` bytes, some turns with one image first) and, once the answer is back, the assistant's
reply exactly as it was returned. A user message starts with a tag drawn per session, so two
sessions share the system message and the chat template's ``<|im_start|>user\\n`` and nothing more.
Images are small JPEGs (``bench.cache_ingress.photo_jpeg``: a gradient plus noise seeded per
session and turn), sent as base64 data URIs; the history re-sends them every later turn.

This module knows nothing of the service: it builds messages, estimates their prompt length for
the default byte-level tokenizer (one token per UTF-8 byte, ``TEMPLATE_TOKENS`` per message), and
sizes the KV budget of an engine for the trace (``kv_budget``; ``bench.kv_affinity`` says why).
"""

from __future__ import annotations

import base64
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from bench.cache_ingress import photo_jpeg
from llm_core.caches.kv_groups import window_pages
from llm_core.caches.kv_pool import KVCacheConfig, KVLayout, plan_group_pools
from llm_core.models.checkpoint import default_llm_config
from llm_core.serving.server_config import EngineConfig

IMAGE_SIZE = 224  # 16 x 16 patches of 14, merged 2 x 2: 64 image tokens with the default encoder
IMAGE_TOKENS = 64
# <|im_start|> role \n ... <|im_end|> \n around each message's content ("user": 1 + 5 + 2 tokens)
TEMPLATE_TOKENS = {"system": 10, "user": 8, "assistant": 13}
GENERATION_PROMPT_TOKENS = 11  # <|im_start|>assistant\n
IMAGE_WRAP_TOKENS = 2  # <|vision_start|> ... <|vision_end|>
# A reply of n tokens is at most 3n bytes of text: a byte the random model emits that is not valid
# UTF-8 comes back as U+FFFD (3 bytes), and re-enters the next prompt as those 3 bytes.
REPLY_BYTES_PER_TOKEN = 3

_WORDS = (
    "agent", "tool", "call", "plan", "step", "file", "read", "write", "search", "result", "error",
    "retry", "check", "test", "build", "run", "output", "input", "value", "list", "table", "index",
    "cache", "page", "token", "model", "request", "answer", "context", "memory", "task", "goal",
    "user", "system", "note", "draft", "review", "change", "patch", "diff", "line", "branch",
    "merge", "commit", "log",
)  # fmt: skip


@dataclass(frozen=True)
class TraceConfig:
    sessions: int = 16
    turns: int = 6
    system_chars: int = 600  # bytes of system prompt text: tokens, with the byte-level tokenizer
    user_chars: tuple[int, int] = (100, 200)  # bytes per user message, uniform in [lo, hi]
    image_rate: float = 0.25  # chance that a turn's user message carries one image
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.turns < 1:
            raise ValueError(f"TraceConfig needs sessions >= 1 and turns >= 1, got {self}")
        lo, hi = self.user_chars
        if not 32 <= lo <= hi:  # room for the session tag that opens every user message
            raise ValueError(f"TraceConfig.user_chars must be 32 <= lo <= hi, got {self.user_chars}")
        if self.turns > 999:
            raise ValueError(f"TraceConfig.turns must be <= 999, got {self.turns}")
        if not 0.0 <= self.image_rate <= 1.0:
            raise ValueError(f"TraceConfig.image_rate must be in [0, 1], got {self.image_rate}")


@dataclass(frozen=True)
class Turn:
    text: str  # the user message's text
    image: bytes | None  # JPEG bytes of the image sent before the text, or None


@dataclass(frozen=True)
class Session:
    index: int
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Trace:
    config: TraceConfig
    system: str
    sessions: tuple[Session, ...]

    @property
    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def images(self) -> int:
        return sum(t.image is not None for s in self.sessions for t in s.turns)


def _words(rng: random.Random, n_chars: int) -> str:
    """Random words joined by spaces, exactly ``n_chars`` ASCII characters."""
    out: list[str] = []
    size = -1
    while size < n_chars:
        w = rng.choice(_WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


def make_trace(config: TraceConfig) -> Trace:
    """The trace of ``config``: the same config gives the same text and the same image bytes."""
    rng = random.Random(f"kv-affinity/{config.seed}")
    system = "You are a coding agent. Follow the plan. " + _words(rng, config.system_chars)
    system = system[: config.system_chars]
    sessions: list[Session] = []
    for s in range(config.sessions):
        srng = random.Random(f"kv-affinity/{config.seed}/session/{s}")
        tag = "".join(srng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(12))
        turns: list[Turn] = []
        for t in range(config.turns):
            n = srng.randint(*config.user_chars)
            head = f"[{tag} #{t}] "
            text = head + _words(srng, n - len(head))
            image = None
            if srng.random() < config.image_rate:
                image = photo_jpeg(_image_seed(config.seed, s, t), IMAGE_SIZE, IMAGE_SIZE)
            turns.append(Turn(text, image))
        sessions.append(Session(s, tuple(turns)))
    return Trace(config, system, tuple(sessions))


def _image_seed(seed: int, session: int, turn: int) -> int:
    return (seed * 1_000_003 + session) * 1_009 + turn


def warm_up_image(seed: int) -> bytes:
    """An image of the trace's size that no trace image equals (a seed no session reaches)."""
    return photo_jpeg((1 << 48) + seed, IMAGE_SIZE, IMAGE_SIZE)


def data_uri(jpeg: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode("ascii")


def user_message(turn: Turn) -> dict[str, Any]:
    if turn.image is None:
        return {"role": "user", "content": turn.text}
    return {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": data_uri(turn.image)}},
            {"type": "text", "text": turn.text},
        ],
    }


def turn_messages(trace: Trace, session: Session, turn: int, replies: Sequence[str]) -> list[dict[str, Any]]:
    """The messages of ``session``'s turn ``turn``: the system prompt, every earlier turn's user
    message and reply (``replies[i]`` is turn i's answer as returned), then this turn's message."""
    if len(replies) < turn:
        raise ValueError(f"turn {turn} needs the replies of turns 0..{turn - 1}, got {len(replies)}")
    messages: list[dict[str, Any]] = [{"role": "system", "content": trace.system}]
    for i in range(turn):
        messages.append(user_message(session.turns[i]))
        messages.append({"role": "assistant", "content": replies[i]})
    messages.append(user_message(session.turns[turn]))
    return messages


def estimate_prompt_tokens(messages: Sequence[dict[str, Any]]) -> int:
    """The prompt length the default byte-level tokenizer and template give ``messages``
    (within a few tokens: the template's exact markup is the ingress's)."""
    n = GENERATION_PROMPT_TOKENS
    for m in messages:
        n += TEMPLATE_TOKENS[m["role"]]
        content = m["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        for p in parts:
            if p["type"] == "text":
                n += len(p["text"].encode("utf-8"))
            else:
                n += IMAGE_TOKENS + IMAGE_WRAP_TOKENS
    return n


def session_peak_tokens(trace: Trace, session: Session, max_tokens: int) -> int:
    """An upper bound on the KV ``session`` holds at its end: its last prompt with every reply at
    the longest text ``max_tokens`` tokens can come back as, plus the last answer."""
    reply = "x" * (max_tokens * REPLY_BYTES_PER_TOKEN)
    last = len(session.turns) - 1
    return estimate_prompt_tokens(turn_messages(trace, session, last, [reply] * last)) + max_tokens


def system_tokens(trace: Trace) -> int:
    """The shared part of every prompt: the system message."""
    return estimate_prompt_tokens([{"role": "system", "content": trace.system}]) - GENERATION_PROMPT_TOKENS


class KVBudget(NamedTuple):
    kv_memory_bytes: int  # --llm-engine-kv-memory-bytes
    swa_fraction: float  # --llm-engine-window-fraction
    full_pages: int
    swa_pages: int
    page_size: int
    affinity_tokens: int  # full KV an engine holds with an even share of the live sessions
    round_robin_tokens: int  # full KV an engine needs to keep every live session


def _window(layout: KVLayout) -> int:
    """The default model's one window (its KV groups: full attention, then one window)."""
    (window,) = [g.spec.sliding_window for g in layout.groups if g.spec.sliding_window is not None]
    return window


def kv_budget(trace: Trace, concurrency: int, engines: int, max_tokens: int) -> KVBudget:
    """Per-engine KV bytes and SWA share of the default model (fp32) for ``trace`` played
    ``concurrency`` sessions at a time over ``engines`` (the module docstring says why); the split
    is checked against the engine's own ``plan_group_pools``."""
    ec = EngineConfig()
    ps = ec.page_size
    layout = KVLayout.from_model_config(default_llm_config(), torch.float32)
    live = min(concurrency, len(trace.sessions))
    rooms = math.ceil(2 * live / engines)  # twice the even share of live sessions per engine
    shared = system_tokens(trace)
    peak = max(session_peak_tokens(trace, s, max_tokens) for s in trace.sessions) - shared
    full_pages = math.ceil(shared / ps) + rooms * (math.ceil(peak / ps) + 1)
    window = window_pages(_window(layout), ps)
    # a window per cached branch point (a session's last turn and the one it heals) and the system
    # prompt's, one per sequence in flight, and one prefill batch beyond the window
    swa_pages = window * (2 * rooms + 1 + live) + math.ceil(ec.max_num_batched_tokens / ps)
    full_page, swa_page = (
        ps * layout.bytes_per_token(sliding=False),
        ps * layout.bytes_per_token(sliding=True),
    )
    # half a page of slack on each side, so float rounding in plan_group_pools cannot lose a page
    swa_bytes, full_bytes = swa_pages * swa_page + swa_page // 2, full_pages * full_page + full_page // 2
    total = swa_bytes + full_bytes
    fraction = swa_bytes / total
    plan = plan_group_pools(layout.groups, KVCacheConfig(total, ps, fraction))
    assert plan == (full_pages, swa_pages), (plan, full_pages, swa_pages)
    return KVBudget(
        total,
        fraction,
        full_pages,
        swa_pages,
        ps,
        shared + math.ceil(live / engines) * peak,
        shared + live * peak,
    )
