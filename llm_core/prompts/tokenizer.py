"""Tokenizer: encode/decode, ChatML chat template with media placeholder runs, and incremental
detokenization for streaming.

Real checkpoints ship a ``tokenizer.json`` (HF ``tokenizers`` format) and use it as is; a checkpoint
directory without one is an error (``TokenizerError`` names the file), and so is a tokenizer whose ids
do not all fit the model's embedding rows (``vocab_size`` in config.json). Only the embedded default
(no directory) uses the byte-level tokenizer the embedded models agree on:

    id 0..255   the byte with that value (any UTF-8 text round-trips)
    256 <|endoftext|> (eos)   257 <|im_start|>   258 <|im_end|>
    259 <|vision_start|>      260 <|vision_end|>  261 <|image_pad|>   262 <|video_pad|>

It is an ordinary ``tokenizers`` BPE with no merges over the 256 byte-level symbols, so it saves to
and loads from ``tokenizer.json`` like any other. This module knows nothing of models or media: a
placeholder run is only ``n`` copies of the pad id; the caller supplies ``n`` from the EmbeddingRef.

Two ways to encode: ``encode`` reads special tokens spelled in the text as their ids (for text the
server wrote, such as a rendered chat template), ``encode_text`` reads them as characters (for text
from a request; a chat's messages go through ``llm_core.prompts.request_text``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from epd_common.checkpoint.config_json import CONFIG_FILE, read_json_object
from epd_common.checkpoint.errors import CheckpointError
from llm_core.prompts.chat_template import ChatTemplateError  # defined there; still importable from here

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
# MiMo-V2.5's audio placeholder; not among the byte-level default's specials (no audio there).
AUDIO_PAD = "<|audio_pad|>"
SPECIAL_TOKENS: tuple[str, ...] = (
    EOS_TOKEN,
    IM_START,
    IM_END,
    VISION_START,
    VISION_END,
    IMAGE_PAD,
    VIDEO_PAD,
)
NUM_BYTES = 256
TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(ValueError):
    """A checkpoint's tokenizer that is missing or does not fit its model; names the file."""


def _byte_symbols() -> list[str]:
    """The printable stand-in for each byte used by byte-level BPE (``tokenizers``' ByteLevel).

    Bytes that are printable Latin-1 characters stand for themselves; the other 68 are moved to
    code points 256.. in byte order, so every byte has a distinct visible symbol.
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    symbols: list[str] = []
    shifted = 0
    for b in range(NUM_BYTES):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(NUM_BYTES + shifted))
            shifted += 1
    return symbols


def build_default_tokenizer() -> HFTokenizer:
    """The byte-level default: id b is byte b, then the seven specials at 256..262."""
    vocab = {sym: b for b, sym in enumerate(_byte_symbols())}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split and no prefix space: the byte sequence maps 1:1 onto ids.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == NUM_BYTES + i, t
    return tok


def save_default_tokenizer(directory: str | Path) -> Path:
    """Write the byte-level default as ``<directory>/tokenizer.json``; returns the file path."""
    path = Path(directory) / TOKENIZER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    build_default_tokenizer().save(str(path))
    return path


def load_tokenizer(model_dir: str | Path | None) -> Tokenizer:
    """``<model_dir>/tokenizer.json``, or the byte-level default for the embedded model (``None``).

    Raises ``TokenizerError`` when the directory has no ``tokenizer.json`` (a silent fallback would
    give a real model byte ids it was never trained on), when the file does not parse, or when its
    largest id is outside the embedding rows that ``config.json`` declares (``vocab_size``, or
    ``text_config.vocab_size`` for a vision-language checkpoint).
    """
    if model_dir is None:
        return Tokenizer(build_default_tokenizer())
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise TokenizerError(
            f"{path} not found: a checkpoint directory must ship its tokenizer as {TOKENIZER_FILE} "
            "(the byte-level tokenizer is only for the embedded default model)"
        )
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own untyped Exception for a bad file
        raise TokenizerError(f"{path}: not a valid tokenizers file ({e})") from e
    rows = _embedding_rows(Path(model_dir))
    id_bound = max(hf.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    if rows is not None and id_bound > rows:
        raise TokenizerError(
            f"{path}: the tokenizer has ids up to {id_bound - 1} but {Path(model_dir) / 'config.json'} "
            f"declares vocab_size {rows}: ids from {rows} up would index past the embedding table"
        )
    return Tokenizer(hf)


def _embedding_rows(model_dir: Path) -> int | None:
    """``vocab_size`` from ``config.json`` (top level, else ``text_config``); None when absent."""
    path = model_dir / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        config = read_json_object(path)
    except CheckpointError as e:
        raise TokenizerError(f"cannot read the model config: {e}") from e
    for scope in (config, config.get("text_config") or {}):
        if isinstance(scope, dict) and isinstance(scope.get("vocab_size"), int):
            return int(scope["vocab_size"])
    return None


class Tokenizer:
    """Thin wrapper over a ``tokenizers.Tokenizer`` with the ids the engine needs."""

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok = tok
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        # A text-only tokenizer.json may lack some of these; the engine then refuses media (and
        # takes eos from the model config).
        self.eos_token_id: int | None = tok.token_to_id(EOS_TOKEN)
        self.im_end_token_id: int | None = tok.token_to_id(IM_END)
        self.image_token_id: int | None = tok.token_to_id(IMAGE_PAD)
        self.video_token_id: int | None = tok.token_to_id(VIDEO_PAD)
        self.audio_token_id: int | None = tok.token_to_id(AUDIO_PAD)
        # The added tokens marked special (what transformers' split_special_tokens reads as text);
        # a non-special added token (Qwen's <tool_call>) is vocabulary like any word.
        specials = {i: t.content for i, t in tok.get_added_tokens_decoder().items() if t.special}
        self.special_ids: frozenset[int] = frozenset(specials)
        self.special_texts: tuple[str, ...] = tuple(specials.values())
        # The same tokenizer with its special tokens read as the characters they are: a copy, since
        # the flag is the tokenizer's state and a tokenizer may be shared between threads.
        self._as_text = HFTokenizer.from_str(tok.to_str())
        self._as_text.encode_special_tokens = True
        # The same for a run that does not start the prompt: a Metaspace pre-tokenizer that marks
        # only the prompt's first word ("first") must not mark a run after a special token.
        self._as_text_inner = _not_first(self._as_text)
        self._one: dict[int, str] = {}  # decode_one's cache (ids are few; strings are short)

    @property
    def media_pad_ids(self) -> dict[str, int]:
        """The placeholder id each modality's embedding rows go to ("image", "video", "audio"),
        for those this tokenizer has."""
        pads = {"image": self.image_token_id, "video": self.video_token_id, "audio": self.audio_token_id}
        return {kind: pad for kind, pad in pads.items() if pad is not None}

    def encode(self, text: str) -> list[int]:
        """Text to ids; special tokens written in the text (e.g. ``<|im_start|>``) become their ids.
        For text the server wrote (a rendered chat template); text from a request goes through
        ``encode_text`` or ``llm_core.prompts.request_text``."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_text(self, text: str, *, starts_prompt: bool = True) -> list[int]:
        """Text to ids with no special-token id among them: ``<|im_end|>`` written in the text is
        tokenized as its characters (for text from a request: a completions prompt string).
        ``starts_prompt=False``: the text follows a special token in a longer prompt, and is
        tokenized as that prompt's segment after the special (what differs is only a Metaspace
        pre-tokenizer's "first" prefix)."""
        tok = self._as_text if starts_prompt else self._as_text_inner
        return list(tok.encode(text, add_special_tokens=False).ids)

    def encode_spans(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """``encode(text)`` and each id's span of ``text`` (character offsets, end exclusive; an
        added token's span includes the whitespace it strips)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids), [(int(a), int(b)) for a, b in enc.offsets]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids to text; ids outside the vocabulary decode to nothing (random models emit them)."""
        valid = [i for i in ids if 0 <= i < self.vocab_size]
        return str(self._tok.decode(valid, skip_special_tokens=skip_special_tokens))

    def decode_valid(self, ids: list[int]) -> str:
        """``decode(ids)`` for ids all inside the vocabulary (the detokenizer's hot path)."""
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def decode_one(self, token_id: int) -> str:
        """``decode([token_id])`` of an id inside the vocabulary, cached per id."""
        text = self._one.get(token_id)
        if text is None:
            text = self._one[token_id] = self.decode_valid([token_id])
        return text

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render ChatML.

        ``content`` is a string or a list of parts: ``{"type": "text", "text": str}``,
        ``{"type": "image" | "video", "num_tokens": int}``. A media part becomes
        ``<|vision_start|>`` + pad * num_tokens + ``<|vision_end|>`` (num_tokens defaults to 1).
        """
        out: list[str] = []
        for mi, msg in enumerate(messages):
            role = msg.get("role")
            if role not in ("system", "user", "assistant", "tool"):
                raise ChatTemplateError(f"unknown role {role!r}", f"messages[{mi}].role")
            out.append(f"{IM_START}{role}\n{self._render_content(msg.get('content', ''), mi)}{IM_END}\n")
        if add_generation_prompt:
            out.append(f"{IM_START}assistant\n")
        return "".join(out)

    @staticmethod
    def _render_content(content: Any, mi: int) -> str:
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ChatTemplateError("content must be a string or a list of parts", f"messages[{mi}].content")
        parts: list[str] = []
        for pi, part in enumerate(content):
            param = f"messages[{mi}].content[{pi}]"
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                parts.append(str(part.get("text", "")))
            elif kind in ("image", "video"):
                n = part.get("num_tokens", 1)
                if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                    raise ChatTemplateError(f"num_tokens must be a positive integer, got {n!r}", param)
                pad = IMAGE_PAD if kind == "image" else VIDEO_PAD
                parts.append(VISION_START + pad * n + VISION_END)
            else:
                raise ChatTemplateError(f"unknown content part type {kind!r}", param)
        return "".join(parts)

    def detokenizer(self) -> IncrementalDetokenizer:
        """A fresh streaming decoder for one sequence's output ids."""
        return IncrementalDetokenizer(self)


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas without splitting a UTF-8 character.

    Decoding one id at a time breaks multi-byte characters (a byte-level id may be half of one) and
    tokenizers whose decoders look at neighbours. So we decode a short window of ids twice:

        ids:  ... [prefix_offset ........ read_offset ........ len(ids)]
                   └─ already emitted ──┘└──── new, not emitted yet ──┘

    and emit the difference, unless it ends in U+FFFD (an incomplete character that the next id may
    complete). ``flush()`` at the end emits whatever is held back, replacement characters included.

    Per id this is one ``tokenizers`` decode in the steady state, not two: ids outside the
    vocabulary are dropped when added (they decode to nothing wherever they are), and the
    already-emitted window is usually one id, whose text comes from a per-id cache.
    """

    tokenizer: Tokenizer
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # everything emitted so far

    def add(self, token_id: int) -> str:
        """Append one id; return the new text that is now safe to emit (may be empty)."""
        if 0 <= token_id < self.tokenizer.vocab_size:
            self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit what is held back (called once when the sequence finishes)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        tok = self.tokenizer
        prefix, read = self.prefix_offset, self.read_offset
        if read - prefix == 1:
            prefix_text = tok.decode_one(self.ids[prefix])
        else:
            prefix_text = tok.decode_valid(self.ids[prefix:read])
        new_text = tok.decode_valid(self.ids[prefix:])
        if len(new_text) <= len(prefix_text) and not final:
            return ""
        if new_text.endswith("\ufffd") and not final:
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = read
        self.read_offset = len(self.ids)
        self.text += delta
        return delta


def _not_first(tok: HFTokenizer) -> HFTokenizer:
    """``tok``, or a copy whose Metaspace pre-tokenizers with ``prepend_scheme`` "first" say
    "never": the tokenizer splits a prompt at its added tokens before pre-tokenizing, and "first"
    prefixes only the split at offset 0, so a later split's tokens are those of "never"."""
    spec = json.loads(tok.to_str())
    found = False

    def walk(node: Any) -> None:
        nonlocal found
        if isinstance(node, dict):
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                node["prepend_scheme"] = "never"
                found = True
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(spec.get("pre_tokenizer"))
    if not found:
        return tok
    out = HFTokenizer.from_str(json.dumps(spec))
    out.encode_special_tokens = tok.encode_special_tokens
    return out
