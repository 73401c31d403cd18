"""Writing an embedded default checkpoint once, safely under concurrent first starts: both roles'
defaults (the encoder's tower, the LLM) are generated from a fixed seed into a directory named
by their recipe (``epd_common.settings.default_checkpoint_dir``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from epd_common.checkpoint.config_json import CONFIG_FILE


def write_once(target: Path, write: Callable[[Path], None], complete: Callable[[Path], bool]) -> Path:
    """``target``, written by ``write`` unless ``complete(target)`` already holds.

    ``write`` fills a temporary sibling directory that is then renamed into place, so concurrent
    writers (processes or threads) see either no checkpoint or a complete one; the loser of a race
    discards its copy."""
    if complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / CONFIG_FILE).is_file():  # not a lost race with another writer
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
