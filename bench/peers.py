"""Where ``make peers`` put the peer servers (``scripts/build_peers.sh``), and a clear error when it
has not run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

DEFAULT_PEERS_DIR = Path(__file__).resolve().parent.parent / ".peers"


class PeersMissing(RuntimeError):
    """The peers are not built: the message says how to build them."""


# The llama-cpp-python sdist scripts/build_peers.sh builds (its stamp names it).
VERSION = "0.3.36"


class Peers(NamedTuple):
    root: Path
    llama_server: Path  # llama.cpp's server binary
    llama_dir: Path  # the vendored llama.cpp tree (convert_hf_to_gguf.py, conversion/, gguf-py/)
    convert_python: Path  # the converter venv's interpreter

    @property
    def version(self) -> str:
        return VERSION

    @classmethod
    def find(cls, root: Path | None = None) -> Peers:
        """The peers under ``root`` (``$EPD_PEERS_DIR``, else ``.peers`` in the checkout)."""
        base = root or Path(os.environ.get("EPD_PEERS_DIR", DEFAULT_PEERS_DIR))
        peers = cls(
            base,
            base / "build" / "bin" / "llama-server",
            base / "llama.cpp",
            base / "convert-venv" / "bin" / "python",
        )
        stamp = base / f".built-llama-cpp-{VERSION}"
        missing = [str(p) for p in (*peers[1:], stamp) if not p.exists()]
        if missing:
            raise PeersMissing(f"peers not built (missing {', '.join(missing)}): run `make peers` first")
        return peers
