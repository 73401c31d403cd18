"""Text from a request is text: a chat's strings never become special-token ids.

A chat template writes control tokens around the messages (``<|im_start|>user\\n ... <|im_end|>``,
``<|vision_start|><|image_pad|><|vision_end|>``). Tokenizing the rendered prompt as one string
would read the same spellings in a user's text as those tokens: a user could close their own turn
and write the assistant's, or add a pad that misaligns the prompt with its media. Here only the
template's own tokens are special:

    messages ──mask──▶ each special spelled in a request string becomes a mark ⟨k⟩, and so does an
             │         edge of a string that could join its neighbour into one (``<|im_`` + ``end|>``)
             ──render (either renderer, unchanged)──▶ text whose only specials are the template's
             ──tokenize with specials──▶ ids; a run of ids between two special ids whose text holds
                       a mark is tokenized again from that text, marks put back, specials as text

    <|im_start|>user\\nwhat is ⟨0⟩?<|im_end|>\\n<|im_start|>assistant\\n
    └─special─┘└─ run: "user\\nwhat is <|im_end|>?" as text ─┘└─special─┘ ...

A mark is a private-use character, the index, another private-use character (a request string
holding either character has it masked too, so every mark in the rendered text is ours): no
whitespace at its edges, so it survives what templates do to a message's text (strip it, split
reasoning off) and moves with the text around it. ``marks[k]`` is what mark ``k`` stands for (""
for an edge). (Not looked for: a special the template itself begins before a request string and
finishes after it; no template writes half a token.)

Parity: a run without a mark keeps the ids of the whole-prompt tokenization, so a chat whose text
spells no special gets exactly the ids it always had (and transformers' ids: the parity tests). A
marked run is tokenized on its own; the tokenizer splits every prompt at its added tokens before
anything else, so that is the same as in place for the byte-level BPE of the families served here
(Qwen2-VL, MiMo) and for word-level, WordPiece and Unigram models too (the marks are looked for
in the rendered text, never in decoded ids, so a tokenizer without byte fallback that reads a mark
as its unknown token changes nothing). A Metaspace pre-tokenizer that prefixes only the prompt's
first word (``prepend_scheme="first"``) gets no prefix on a run after a special, as in place.

Which tokens are special: the tokenizer's added tokens marked ``special`` (``Tokenizer.special_texts``,
what transformers' ``split_special_tokens`` reads as text). A non-special added token (Qwen's
``<tool_call>``) is vocabulary like any word and still matches in request text.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llm_core.prompts.tokenizer import Tokenizer

# A mark: OPEN, its index, CLOSE (two private-use characters of Supplementary Private Use Area-A).
OPEN = "\U000f0000"
CLOSE = "\U000f0001"
_MARK = re.compile(f"{OPEN}([0-9]+){CLOSE}")
# Message fields besides the content that hold free text a template may write out.
TEXT_FIELDS = ("reasoning_content", "thinking", "reasoning")


@dataclass(frozen=True)
class MaskedChat:
    """A chat's messages with every special spelled in their strings masked (see the module
    docstring); ``encode`` turns what a renderer made of ``messages`` into prompt ids."""

    messages: list[dict[str, Any]]
    marks: tuple[str, ...]  # marks[k]: the request text mark k stands for ("" at an edge)

    def encode(self, tokenizer: Tokenizer, rendered: str) -> list[int]:
        """Ids of ``rendered`` (``messages`` as the chat template wrote them): the template's
        special tokens as their ids, every masked spelling as the characters it is."""
        if not self.marks:
            return tokenizer.encode(rendered)  # no request string spells a special: one call
        ids, spans = tokenizer.encode_spans(rendered)
        out: list[int] = []
        run: list[int] = []  # ids since the last special
        start = 0  # where the run's text starts in `rendered`
        for token, (begin, end) in zip(ids, spans, strict=True):
            if token in tokenizer.special_ids:  # written by the template: request strings spell none
                out += self._run(tokenizer, rendered, start, begin, run)
                out.append(token)
                run, start = [], end
            else:
                run.append(token)
        out += self._run(tokenizer, rendered, start, len(rendered), run)
        return out

    def _run(self, tokenizer: Tokenizer, rendered: str, start: int, end: int, ids: list[int]) -> list[int]:
        """The ids of ``rendered[start:end]`` (a run between specials, ``ids`` as the whole-prompt
        tokenization gave them): those ids, or the run's text with its marks put back,
        tokenized as the segment it is (the prompt's first, or one after a special)."""
        text = rendered[start:end]
        if OPEN not in text:
            return ids
        unmasked = _MARK.sub(lambda m: self.marks[int(m[1])], text)
        return tokenizer.encode_text(unmasked, starts_prompt=start == 0)


def mask_chat(messages: Sequence[Mapping[str, Any]], specials: Sequence[str]) -> MaskedChat:
    """``messages`` (plain JSON data) with each string's special spellings, and each edge that
    could complete one across a neighbour, replaced by marks. A chat spelling none comes back equal
    to ``messages`` with no marks. The mark characters themselves are masked too where a request
    string holds them, so every mark in the rendered text is one of ours."""
    if not specials:
        return MaskedChat([dict(m) for m in messages], ())
    spelled, suffixes, prefixes, longest = _spellings(tuple(specials))
    marks: list[str] = []

    def mark(text: str) -> str:
        marks.append(text)
        return f"{OPEN}{len(marks) - 1}{CLOSE}"

    def masked(text: str) -> str:
        body = spelled.sub(lambda m: mark(m[0]), text)
        if not body:
            return body
        ends = range(1, min(len(body), longest) + 1)
        head = any(body[:j] in suffixes for j in ends)
        tail = any(body[-j:] in prefixes for j in ends)
        return (mark("") if head else "") + body + (mark("") if tail else "")

    out = [_mask_message(m, masked) for m in messages]
    return MaskedChat(out, tuple(marks))


def encode_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    render: Callable[[list[dict[str, Any]]], str],
) -> list[int]:
    """Prompt ids of ``messages`` as ``render`` (a chat template) writes them, with the request's
    strings tokenized as text: ``mask_chat``, render, ``MaskedChat.encode``."""
    chat = mask_chat(messages, tokenizer.special_texts)
    return chat.encode(tokenizer, render(chat.messages))


@functools.lru_cache(maxsize=8)
def _spellings(specials: tuple[str, ...]) -> tuple[re.Pattern[str], frozenset[str], frozenset[str], int]:
    """What ``mask_chat`` looks for, per tokenizer: the spellings to mask (one pass; the longest
    first where two start at the same place), the proper suffixes (a string starting with one
    could end a special begun before it), the proper prefixes (a string ending with one could
    begin a special finished after it), and the longest spelling's length."""
    spelled = re.compile(
        "|".join(re.escape(s) for s in sorted({*specials, OPEN, CLOSE}, key=len, reverse=True))
    )
    suffixes = frozenset(s[i:] for s in specials for i in range(1, len(s)))
    prefixes = frozenset(s[:i] for s in specials for i in range(1, len(s)))
    return spelled, suffixes, prefixes, max(map(len, specials))


def _mask_message(message: Mapping[str, Any], fn: Callable[[str], str]) -> dict[str, Any]:
    """``message`` with ``fn`` applied to its text: the content string, each text part's text and
    the reasoning fields; structure (role, part types, media fields) stays as it is."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, str):
        out["content"] = fn(content)
    elif isinstance(content, list):
        out["content"] = [
            {**p, "text": fn(p["text"])} if isinstance(p, Mapping) and isinstance(p.get("text"), str) else p
            for p in content
        ]
    for key in TEXT_FIELDS:
        if isinstance(out.get(key), str):
            out[key] = fn(out[key])
    return out
