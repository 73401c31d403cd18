"""Maps frozen config dataclasses onto argparse flags, so that every option is declared once: in
its dataclass. Field ``max_body_bytes`` becomes ``--max-body-bytes``; a nested dataclass field
``engine: EngineConfig`` contributes ``--engine-page-size`` and so on (with ``flatten`` the nested
fields keep their own names). Defaults and types come from the dataclass.

Supported field types: int, float, str, a ``Literal`` of strings (the flag takes one of them), bool
(``--flag`` / ``--no-flag``), ``X | None``, and ``tuple[T, ...]`` (repeat the flag). Other field
types are not exposed on the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")

_SCALARS: dict[Any, Any] = {int: int, float: float, str: str}


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _flag(prefix: str, name: str) -> str:
    return "--" + (prefix + name).replace("_", "-")


def add_dataclass_args(
    parser: argparse.ArgumentParser | Any,
    cls: type,
    *,
    prefix: str = "",
    flatten: tuple[str, ...] = (),
    skip: tuple[str, ...] = (),
) -> None:
    """Add one flag per supported field of ``cls``; defaults stay None so unset flags are visible."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        tp, _ = _unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):
            sub_prefix = prefix if f.name in flatten else f"{prefix}{f.name}_"
            add_dataclass_args(parser, tp, prefix=sub_prefix, flatten=flatten, skip=skip)  # type: ignore[arg-type]
            continue
        default = _default(f)
        dest = (prefix + f.name).replace("-", "_")
        help_text = f"default: {default!r}"
        if tp is bool:
            parser.add_argument(
                _flag(prefix, f.name),
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        elif tp in _SCALARS:
            parser.add_argument(
                _flag(prefix, f.name), dest=dest, type=_SCALARS[tp], default=None, help=help_text
            )
        elif typing.get_origin(tp) is typing.Literal and all(isinstance(a, str) for a in typing.get_args(tp)):
            parser.add_argument(
                _flag(prefix, f.name), dest=dest, choices=typing.get_args(tp), default=None, help=help_text
            )
        elif typing.get_origin(tp) is tuple and typing.get_args(tp)[-1] is Ellipsis:
            item = typing.get_args(tp)[0]
            if item in _SCALARS:
                parser.add_argument(
                    _flag(prefix, f.name),
                    dest=dest,
                    type=_SCALARS[item],
                    action="append",
                    default=None,
                    help=f"repeatable; {help_text}",
                )


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def dataclass_from_args(
    cls: type[T],
    args: argparse.Namespace,
    *,
    prefix: str = "",
    flatten: tuple[str, ...] = (),
    base: T | None = None,
) -> T:
    """Build ``cls`` from parsed flags: fields whose flag was given override ``base`` (or defaults)."""
    hints = typing.get_type_hints(cls)
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init:
            continue
        tp, _ = _unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):
            sub_prefix = prefix if f.name in flatten else f"{prefix}{f.name}_"
            current = getattr(base, f.name) if base is not None else None
            if current is None and not _any_flag_set(tp, args, sub_prefix, flatten):  # type: ignore[arg-type]
                continue
            changes[f.name] = dataclass_from_args(tp, args, prefix=sub_prefix, flatten=flatten, base=current)  # type: ignore[arg-type]
            continue
        value = getattr(args, prefix + f.name, None)
        if value is not None:
            changes[f.name] = tuple(value) if isinstance(value, list) else value
    if base is None:
        return cls(**changes)
    return dataclasses.replace(base, **changes)  # type: ignore[type-var]


def _any_flag_set(cls: type, args: argparse.Namespace, prefix: str, flatten: tuple[str, ...]) -> bool:
    return any(
        getattr(args, prefix + f.name, None) is not None
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
    )


def dataclass_to_argv(cfg: Any, *, prefix: str = "", flatten: tuple[str, ...] = ()) -> list[str]:
    """The flags that rebuild ``cfg`` through ``dataclass_from_args`` (fields equal to their default
    are left out). Used to start child processes with exactly a parent's config."""
    out: list[str] = []
    for f in dataclasses.fields(cfg):
        if not f.init:
            continue
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            sub_prefix = prefix if f.name in flatten else f"{prefix}{f.name}_"
            out += dataclass_to_argv(value, prefix=sub_prefix, flatten=flatten)
            continue
        if value is None or value == _default(f):
            continue
        flag = _flag(prefix, f.name)
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, tuple):
            for item in value:
                out += [flag, str(item)]
        elif isinstance(value, int | float | str):
            out += [flag, str(value)]
    return out


def add_model_dir_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """``--model DIR`` (dest ``model_dir``): a Hugging Face checkpoint directory; ``what`` says
    which parts of it this command uses."""
    parser.add_argument(
        "--model", dest="model_dir", metavar="DIR", help=f"a Hugging Face checkpoint directory: {what}"
    )


def model_path_from(command: str, model_dir: str | None, model_path: str | None) -> str | None:
    """The checkpoint a role loads: ``--model`` or ``--model-path``, refusing both at once."""
    if model_dir and model_path:
        raise SystemExit(f"epd {command}: give --model or --model-path, not both")
    return model_dir or model_path
