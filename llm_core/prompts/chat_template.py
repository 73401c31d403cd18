"""The checkpoint's chat template: found, compiled and rendered the way transformers 5 does it.

Where the template comes from (first found wins). transformers has two loaders that disagree: the
processor (what renders multimodal prompts) reads ``chat_template.json`` before
``chat_template.jinja`` and never reads ``tokenizer_config.json``; the tokenizer reads
``chat_template.jinja`` before ``tokenizer_config.json`` and never reads ``chat_template.json``.
We take the processor's template when there is one, else the tokenizer's:

    1. processor_config.json   "chat_template" (legacy; transformers warns but uses it)
    2. chat_template.json      {"chat_template": ...}  (legacy processor file)
    3. chat_template.jinja     the raw template
    4. tokenizer_config.json   "chat_template": a string, or a list of {"name", "template"}
                               of which we take "default"

A string or a list of named templates is accepted in each JSON form. ``additional_chat_templates/``
(named templates beside the default) is not read: only the default template renders prompts.

Rendering matches ``transformers.utils.chat_template_utils``: an ``ImmutableSandboxedEnvironment``
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that
does not HTML-escape (``json.dumps`` with ``ensure_ascii=False``), the globals ``raise_exception``,
``strftime_now``, a ``dict`` that only builds dicts and a ``namespace`` that refuses ``_`` names; the
context is the tokenizer config's special tokens (``bos_token`` ... ``mask_token`` and the
model-specific ``*_token`` strings such as ``image_token``), then the caller's extras, then
``messages``, ``tools=None``, ``documents=None`` and ``add_generation_prompt``. Messages are
normalized as transformers does: keys whose value is None dropped, the reasoning field copied to
``reasoning_content`` and ``thinking``, OpenAI ``image_url`` parts turned into ``image`` parts (the
processor does this; we do the same for ``video_url``), everything else reduced to plain JSON data.

The template emits one placeholder per media item (Qwen2-VL: ``<|vision_start|><|image_pad|>
<|vision_end|>``); ``expand_media_placeholders`` then repeats each pad to the item's token count,
as ``Qwen2VLProcessor`` does. ``check_message_parts`` refuses a part the model cannot take before any
media is fetched.

Errors: a template file that is missing its key, does not parse, or does not compile raises
``TemplateFileError`` with the full path (a broken checkpoint: the server should not start). A
request the template cannot render raises ``ChatTemplateError`` (a 400) naming the template's file
name and, when a shorter conversation renders, the first message that makes it fail.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

PROCESSOR_CONFIG_FILE = "processor_config.json"
LEGACY_CHAT_TEMPLATE_FILE = "chat_template.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"

# transformers' PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES.
NAMED_SPECIAL_TOKENS: tuple[str, ...] = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat request that cannot be rendered (a 400): ``param`` names the offending field."""

    def __init__(self, message: str, param: str) -> None:
        self.param = param
        super().__init__(f"{param}: {message}")


class TemplateFileError(ValueError):
    """A checkpoint's chat template file that cannot be read or compiled; names the file (and line)."""

    def __init__(self, path: Path, message: str, lineno: int | None = None) -> None:
        self.path = path
        self.lineno = lineno
        where = f"{path}" if lineno is None else f"{path} (template line {lineno})"
        super().__init__(f"{where}: {message}")


class _TemplateRaised(jinja2.TemplateError):
    """What the template's ``raise_exception(message)`` raises."""


# --- the environment -------------------------------------------------------------------------


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes (<, >, &, ') and takes only indent; templates expect neither.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` for templates: builds dicts, exposes nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` for templates: refuses underscore names (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's signature trick: `self` may be a key
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


# --- loading ---------------------------------------------------------------------------------


@dataclass
class ChatTemplate:
    """A compiled chat template and the special tokens its context carries."""

    source: str
    path: Path  # the file it came from (for a JSON form, the JSON file)
    special_tokens: dict[str, str] = field(default_factory=dict)
    _template: jinja2.Template = field(init=False, repr=False)

    def __post_init__(self) -> None:
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateFileError(
                self.path, f"the chat template does not compile: {e.message}", e.lineno
            ) from e

    @property
    def file_name(self) -> str:
        """The file's name without its directory (what a client may see in an error)."""
        return self.path.name

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text for ``messages`` (content a string or a list of parts).

        ``extra`` becomes template variables (e.g. ``add_vision_id=True``), overriding special tokens.
        Raises ``ChatTemplateError`` for messages that are not objects, an empty conversation, a
        ``raise_exception`` in the template or any other render failure.
        """
        chat = _normalize_messages(messages)
        context = {**self.special_tokens, **_plain(extra)}
        try:
            return self._render(chat, add_generation_prompt, context)
        except Exception as e:  # a template can raise anything (TypeError on a list, SecurityError, ...)
            raise self._render_error(chat, add_generation_prompt, context, e) from e

    def _render(
        self, chat: list[dict[str, Any]], add_generation_prompt: bool, context: dict[str, Any]
    ) -> str:
        variables = {"tools": None, "documents": None, **context}
        return self._template.render(**variables, messages=chat, add_generation_prompt=add_generation_prompt)

    def _render_error(
        self,
        chat: list[dict[str, Any]],
        add_generation_prompt: bool,
        context: dict[str, Any],
        error: Exception,
    ) -> ChatTemplateError:
        reason = str(error) if isinstance(error, _TemplateRaised) else f"{type(error).__name__}: {error}"
        line = _template_line(error.__traceback__)
        where = self.file_name if line is None else f"{self.file_name} line {line}"
        culprit = self._first_failing_message(chat, add_generation_prompt, context, str(error))
        if culprit is None:
            return ChatTemplateError(
                f"the chat template ({where}) cannot render the messages: {reason}", "messages"
            )
        return ChatTemplateError(
            f"the chat template ({where}) fails at messages[{culprit}]: {reason}", f"messages[{culprit}]"
        )

    def _first_failing_message(
        self, chat: list[dict[str, Any]], add_generation_prompt: bool, context: dict[str, Any], error: str
    ) -> int | None:
        """The index ``i`` such that ``chat[: i + 1]`` fails with ``error`` and ``chat[:i]`` does not.

        A binary search over prefixes (the whole chat fails, the empty one must not), so the answer is
        a real boundary even for a template whose failures are not monotone in the length. None when
        the error does not reproduce (it depends on the clock) or the empty conversation fails the
        same way (the template fails whatever the messages).
        """
        if not self._fails_with(chat, add_generation_prompt, context, error):
            return None
        if self._fails_with([], add_generation_prompt, context, error):
            return None
        lo, hi = 0, len(chat)  # chat[:lo] does not fail with `error`; chat[:hi] does
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._fails_with(chat[:mid], add_generation_prompt, context, error):
                hi = mid
            else:
                lo = mid
        return hi - 1

    def _fails_with(
        self, chat: list[dict[str, Any]], add_generation_prompt: bool, context: dict[str, Any], error: str
    ) -> bool:
        try:
            self._render(chat, add_generation_prompt, context)
        except Exception as e:
            return str(e) == error
        return False


def load_chat_template(model_dir: str | Path) -> ChatTemplate | None:
    """The checkpoint's default chat template (see the module docstring for the order); None if none.

    Raises ``TemplateFileError`` naming the file when a template file (or the tokenizer config that
    supplies the special tokens) cannot be read or parsed, has no usable template, or the template
    does not compile.
    """
    model_dir = Path(model_dir)
    found = _find_template(model_dir)
    if found is None:
        return None
    source, path = found
    if not source.strip():
        raise TemplateFileError(path, "the chat template is empty")
    return ChatTemplate(source=source, path=path, special_tokens=_special_tokens(model_dir))


def _find_template(model_dir: Path) -> tuple[str, Path] | None:
    for name in (PROCESSOR_CONFIG_FILE, LEGACY_CHAT_TEMPLATE_FILE):
        path = model_dir / name
        if path.is_file():
            value = _read_json(path).get("chat_template")
            if value is not None:
                return _default_template(value, path), path
            if name == LEGACY_CHAT_TEMPLATE_FILE:
                raise TemplateFileError(path, "no 'chat_template' key")
    path = model_dir / CHAT_TEMPLATE_FILE
    if path.is_file():
        return _read_text(path), path
    path = model_dir / TOKENIZER_CONFIG_FILE
    if path.is_file():
        value = _read_json(path).get("chat_template")
        if value is not None:
            return _default_template(value, path), path
    return None


def _default_template(value: Any, path: Path) -> str:
    """A template string, or the "default" one of a list of ``{"name": ..., "template": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named: dict[str, Any] = {}
        for entry in value:
            if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)):
                raise TemplateFileError(
                    path, '\'chat_template\' list entries must be {"name", "template"} objects'
                )
            named[entry["name"]] = entry.get("template")
        if "default" not in named:
            raise TemplateFileError(path, f"no template named 'default' among {sorted(named)}")
        if not isinstance(named["default"], str):
            raise TemplateFileError(path, "the 'default' chat template is not a string")
        return str(named["default"])
    raise TemplateFileError(
        path, f"'chat_template' must be a string or a list of named templates, got {value!r}"
    )


def _special_tokens(model_dir: Path) -> dict[str, str]:
    """The special-token variables transformers gives the template (its ``special_tokens_map``).

    From ``tokenizer_config.json``: the named tokens (a string or an AddedToken object), every other
    ``*_token`` string (model-specific tokens such as ``image_token``) and the names in an
    ``extra_special_tokens`` object. A legacy ``special_tokens_map.json`` overrides them when the
    config has no ``added_tokens_decoder`` (transformers reads it only then).
    """
    path = model_dir / TOKENIZER_CONFIG_FILE
    config = _read_json(path) if path.is_file() else {}
    out: dict[str, str] = {}
    for key, value in config.items():
        if key in NAMED_SPECIAL_TOKENS:
            if (text := _token_text(value)) is not None:
                out[key] = text
        elif key.endswith("_token") and isinstance(value, str):
            out[key] = value
    extra = config.get("extra_special_tokens", config.get("additional_special_tokens"))
    if isinstance(extra, Mapping):
        out.update({str(k): t for k, v in extra.items() if (t := _token_text(v)) is not None})
    legacy = model_dir / SPECIAL_TOKENS_MAP_FILE
    if "added_tokens_decoder" not in config and legacy.is_file():
        for key, value in _read_json(legacy).items():
            text = _token_text(value)
            if (key in NAMED_SPECIAL_TOKENS or key.endswith("_token")) and text is not None:
                out[key] = text
    return out


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])  # a serialized AddedToken
    return None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")  # universal newlines, as transformers' open() reads it
    except (OSError, UnicodeDecodeError) as e:
        raise TemplateFileError(path, f"cannot read the file ({e})") from e


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(_read_text(path))
    except ValueError as e:
        raise TemplateFileError(path, f"not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise TemplateFileError(path, "the file must hold a JSON object")
    return value


# --- messages --------------------------------------------------------------------------------


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("must be a list of messages", "messages")
    if not messages:
        raise ChatTemplateError("the conversation is empty", "messages")
    out: list[dict[str, Any]] = []
    for mi, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError("must be an object", f"messages[{mi}]")
        msg = {str(k): _plain(v) for k, v in message.items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_FIELDS if k in msg), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        if isinstance(msg.get("content"), list):
            msg["content"] = [_template_part(p) for p in msg["content"]]
        out.append(msg)
    return out


def _template_part(part: Any) -> Any:
    """OpenAI ``image_url`` / ``video_url`` parts as transformers' ``image`` / ``video`` parts."""
    if isinstance(part, dict) and part.get("type") in ("image_url", "video_url") and part["type"] in part:
        kind = part["type"]
        value = part[kind]
        url = value.get("url", "") if isinstance(value, dict) else value
        return {"type": kind.removesuffix("_url"), "url": url}
    return part


def _plain(value: Any) -> Any:
    """Plain JSON data (what transformers lets a template see); other objects become ``"<Type>"``."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _template_line(tb: TracebackType | None) -> int | None:
    """The innermost template line in a traceback (jinja maps template frames to ``<template>``)."""
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line
