"""The model ids the service answers to, as vLLM names them.

    epd serve --model DIR                              served ids: (DIR as typed,)
    epd serve --llm-model DIR ...                      (DIR as typed,)
    epd serve --served-model-name a --served-model-name b    (a, b)
    epd serve                                          ("epd-default",): the embedded default

``/v1/models`` lists every served id; responses report the first (vLLM's rule); a request may name
any of them, or none. Another name is a 404 in vLLM's words (``resolve_model``). Clients that read
``/v1/models`` and then load the tokenizer or processor from the id (SGLang's ``bench_serving``)
find the directory they gave. The engines ``epd serve`` starts serve the same ids.

Deprecated spellings, kept for one release with a logged warning: ``--model-name`` (the ingress's
old single name) and ``--llm-served-model-name`` (the engine's, under ``epd serve``); both now
mean ``--served-model-name``.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from epd_common.errors import APIError, bad_request
from epd_common.model_id import DEFAULT_MODEL_ID, served_model_names

if TYPE_CHECKING:
    from epd.config import IngressConfig

log = logging.getLogger(__name__)

# deprecated flag -> its argparse dest (each is repeatable, as --served-model-name is)
DEPRECATED_FLAGS: dict[str, str] = {
    "--model-name": "deprecated_model_name",
    "--llm-served-model-name": "deprecated_llm_served_model_name",
}


def resolve_model(config: IngressConfig, requested: Any) -> str:
    """The id to report in the response to a request whose body names ``requested`` (its
    ``model``; None or "" when it names none): the first served id. Raises ``APIError`` 404
    (``NotFoundError``, param ``model``) for a name not served, 400 for a ``model`` that is not a
    string."""
    served = config.served_model_names
    if requested is None or requested == "":
        return served[0]
    if not isinstance(requested, str):
        raise bad_request(f"'model' must be a string, got {type(requested).__name__}", "model")
    if requested not in served:
        raise APIError(404, f"The model `{requested}` does not exist.", type="NotFoundError", param="model")
    return served[0]


def add_deprecated_name_flags(parser: argparse.ArgumentParser) -> None:
    """The old spellings of ``--served-model-name`` (see the module docstring)."""
    for flag, dest in DEPRECATED_FLAGS.items():
        parser.add_argument(
            flag,
            dest=dest,
            action="append",
            default=None,
            metavar="NAME",
            help="deprecated (removed in the next release): use --served-model-name",
        )


def names_from_args(args: argparse.Namespace, model_path: str | None) -> tuple[str, ...]:
    """The served ids from ``--served-model-name`` and its deprecated spellings (each used one
    logs a warning), else ``model_path`` as typed, else the embedded default's id."""
    names = list(getattr(args, "served_model_name", None) or ())
    for flag, dest in DEPRECATED_FLAGS.items():
        old: Sequence[str] = getattr(args, dest, None) or ()
        if old:
            log.warning(
                "%s is deprecated and will be removed in the next release: use --served-model-name", flag
            )
            names += [n for n in old if n not in names]
    return served_model_names(names, model_path)


__all__ = ["DEFAULT_MODEL_ID", "add_deprecated_name_flags", "names_from_args", "resolve_model"]
