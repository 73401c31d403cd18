"""``epd serve``: the ingress, the encoder workers and the LLM engine on one machine.

    epd serve ──▶ supervisor ──▶ encoder-0..N-1   (python -m epd.cli encoder ..., free loopback ports)
       │                   └──▶ llm              (python -m epd.cli llm ...)
       └──▶ ingress (uvicorn in this process) ──ring──▶ local workers + every --encoder-url

All roles share one node embedding cache namespace (``serve-<port>`` unless set), so the ingress and
the engine read what the workers wrote. A crashed child is restarted on the same address and the
ring marks it down and up again. SIGTERM drains in-flight requests (uvicorn's graceful shutdown),
stops the children and removes the namespace's shared memory.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import shutil
import signal
import socket
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from encoder.caches.embed_cache import default_root
from encoder.serving.worker import WorkerConfig, plan_workers
from epd.config import IngressConfig
from epd.config_cli import add_dataclass_args, dataclass_from_args, dataclass_to_argv
from epd.encoder_cmd import worker_child
from epd.llm_cmd import default_llm_dir
from epd.llm_servers.vllm_launch import VLLMLaunch, VLLMLaunchError, launch_args
from epd.llm_servers.vllm_routing import KVEventsAt, local_kv_events, remove_local
from epd.model_check import ModelDirError, check_model_dir
from epd.placement import CpuSplit, cpu_list, pinned_argv, plan_split
from epd.served_model import add_deprecated_name_flags, names_from_args
from epd.supervisor import ChildFailed, ChildSpec, Supervisor, python_argv
from epd_common.runtime import AUTO_DTYPE, DTYPES
from epd_common.store.local_redis import LocalRedis
from epd_common.store.store import StoreError
from llm_core.kv_transfer.shm_transport import namespace_files
from llm_core.prompts.chat_template import TemplateFileError
from llm_core.prompts.tokenizer import TokenizerError
from llm_core.serving.server_config import LLMServerConfig
from media_io.processor_config import ProcessorConfigError, preprocess_config_from_dir

if TYPE_CHECKING:
    from epd.ingress import Ingress

log = logging.getLogger("epd.serve")


@dataclass(frozen=True)
class ServeConfig:
    ingress: IngressConfig = field(default_factory=IngressConfig)
    encoder: WorkerConfig = field(default_factory=WorkerConfig)  # template for the local workers
    llm: LLMServerConfig = field(default_factory=LLMServerConfig)
    encoder_workers: int = 1  # local CPU workers (with CUDA: one per device)
    remote_encoders: tuple[str, ...] = ()  # --encoder-url: workers on other hosts, added to the ring
    llm_instances: int = 1  # local LLM engines, each publishing its KV events to the router
    llm_prefill_instances: int = 0  # local prefill-only engines (prefill/decode split)
    llm_decode_instances: int = 0  # local decode-only engines
    remote_llms: tuple[str, ...] = ()  # --llm-url: engines on other hosts, routed over too
    start_llm: bool = True
    log_level: str = "info"
    model_dir: str | None = None  # --model: one checkpoint directory for every role
    # --llm-server vllm without --llm-url: the local vLLM server this serve starts and supervises
    vllm_python: str | None = None
    vllm_args: tuple[str, ...] = ()
    vllm_kv_cache_gib: float = 2.0
    vllm_dtype: str = "auto"
    # where a local vLLM and epd's side run (``epd.placement``): auto, off or LLM_CORES:EPD_CORES
    cpu_split: str = "auto"


# Fields that `epd serve` derives itself instead of taking from flags.
_INGRESS_DERIVED = ("encoder_urls", "encoder_weights", "llm_urls", "llm_roles", "llm_model_dir")
_WORKER_DERIVED = (
    "host",
    "port",
    "uds",
    "public_url",
    "cache_namespace",
    "cache_root",
    "preprocess",
    "limits",
    "store",
)
_LLM_DERIVED = (
    "host",
    "port",
    "uds",
    "cache_namespace",
    "log_level",
    "kv_events_endpoint",
    "kv_events_replay_endpoint",
    "role",
    "served_model_name",  # the ingress's --served-model-name (--llm-served-model-name: deprecated)
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, IngressConfig, skip=_INGRESS_DERIVED)
    enc = parser.add_argument_group("encoder workers")
    add_dataclass_args(enc, WorkerConfig, prefix="encoder_", skip=_WORKER_DERIVED)
    llm = parser.add_argument_group("LLM engine")
    add_dataclass_args(llm, LLMServerConfig, prefix="llm_", skip=_LLM_DERIVED)
    add_deprecated_name_flags(parser)
    parser.add_argument(
        "--llm-backend",
        dest="llm_server",
        choices=("epd", "vllm"),
        default=None,
        help="deprecated (removed in the next release): use --llm-server",
    )
    parser.add_argument(
        "--encoder-workers", type=int, default=1, help="local CPU encoder workers; default: 1"
    )
    parser.add_argument(
        "--model",
        dest="model_dir",
        metavar="DIR",
        help="one Hugging Face checkpoint directory for every role: the encoders load its vision tower "
        "and processor settings, the engine its language model, the ingress its tokenizer and chat template",
    )
    parser.add_argument(
        "--encoder-model", dest="encoder_model_path", help="encoder checkpoint dir (split set-ups)"
    )
    parser.add_argument("--llm-model", dest="llm_model_path", help="LLM checkpoint dir (split set-ups)")
    parser.add_argument(
        "--encoder-url",
        dest="remote_encoders",
        action="append",
        default=[],
        help="remote encoder worker (repeatable)",
    )
    parser.add_argument(
        "--llm-instances",
        type=int,
        default=1,
        help="local LLM engines; the ingress routes each chat to the one holding its prefix (default: 1)",
    )
    parser.add_argument(
        "--llm-prefill-instances",
        type=int,
        default=0,
        help="local prefill-only engines: with --llm-decode-instances, a chat's prompt is computed on a "
        "prefill engine (chosen by affinity) and its KV handed to a decode engine (chosen by load)",
    )
    parser.add_argument(
        "--llm-decode-instances", type=int, default=0, help="local decode-only engines (see above)"
    )
    parser.add_argument(
        "--llm-url",
        dest="remote_llms",
        action="append",
        default=[],
        help="remote LLM engine (repeatable), routed over with the local ones",
    )
    parser.add_argument(
        "--store",
        dest="store_url",
        metavar="URL",
        help="the cache tier shared by nodes: redis://HOST:PORT[/DB] (Redis or Valkey), or 'local' to "
        "start a redis-server on loopback for this machine (same as --store-url)",
    )
    parser.add_argument(
        "--dtype",
        type=_dtype_arg,
        help="the compute dtype of every role (auto, float32, bfloat16, float16), as vLLM's --dtype: "
        "the encoders, the engines and a local vLLM; --encoder-dtype / --llm-dtype / --vllm-dtype "
        "override it per role (default: auto, the checkpoint's)",
    )
    parser.add_argument("--no-llm", dest="start_llm", action="store_false", help="serve /v1/encode only")
    vllm = parser.add_argument_group("vLLM server (--llm-server vllm)")
    vllm.add_argument(
        "--vllm-python",
        metavar="PY",
        help="the interpreter that runs the local vLLM server (default: .peers/vllm-venv from "
        "`make vllm-peer`, else vllm on PATH); not used with --llm-url",
    )
    vllm.add_argument(
        "--vllm-arg",
        dest="vllm_args",
        action="append",
        default=[],
        metavar="ARGS",
        help="extra arguments for the local vLLM server (repeatable; shell words), e.g. "
        "--vllm-arg='--max-num-seqs 64'",
    )
    vllm.add_argument(
        "--vllm-dtype",
        help="the local vLLM server's --dtype (default: --dtype, else auto: vLLM's choice for the checkpoint; "
        "float32 gives transformers' float32 results)",
    )
    vllm.add_argument(
        "--cpu-split",
        default="auto",
        metavar="auto|off|LLM:EPD",
        help="cores of the local vLLM's inference threads and of epd's ingress and encoders, kept "
        "apart (auto: vLLM the upper half, epd the lower; LLM:EPD as core lists, e.g. 8-15:0-7; off)",
    )
    vllm.add_argument(
        "--vllm-kv-cache-gib",
        type=float,
        default=2.0,
        help="KV space of the local vLLM server's CPU backend (VLLM_CPU_KVCACHE_SPACE); default: 2",
    )
    parser.add_argument("--log-level", default="info")


# vLLM's spellings of its --dtype values, so that its users' command lines work as typed.
_DTYPE_ALIASES = {"float": "float32", "half": "float16"}


def _dtype_arg(value: str) -> str:
    name = _DTYPE_ALIASES.get(value, value)
    if name != AUTO_DTYPE and name not in DTYPES:
        choices = ", ".join([AUTO_DTYPE, *sorted(DTYPES), *sorted(_DTYPE_ALIASES)])
        raise argparse.ArgumentTypeError(f"unknown dtype {value!r}: choose one of {choices}")
    return name


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    ingress = dataclass_from_args(IngressConfig, args)
    encoder = dataclass_from_args(WorkerConfig, args, prefix="encoder_")
    llm = dataclass_from_args(LLMServerConfig, args, prefix="llm_")
    if args.dtype is not None:  # every role's, where its own flag does not say otherwise
        if getattr(args, "encoder_dtype", None) is None:
            encoder = dataclasses.replace(encoder, dtype=args.dtype)
        if getattr(args, "llm_dtype", None) is None:
            llm = dataclasses.replace(llm, dtype=args.dtype)
    if args.model_dir:
        if encoder.model_path or llm.model_path:
            raise SystemExit("epd serve: give --model DIR, or --encoder-model / --llm-model, not both")
        # The checkpoint's processor settings are the preprocessing of every role (and enter the
        # MediaKey), over the --preprocess-* defaults.
        ingress = dataclasses.replace(
            ingress, preprocess=preprocess_config_from_dir(args.model_dir, ingress.preprocess)
        )
        encoder = dataclasses.replace(encoder, model_path=args.model_dir)
        llm = dataclasses.replace(llm, model_path=args.model_dir)
    # The ids served (epd.served_model): the ingress and every engine it starts answer to the same.
    names = names_from_args(args, llm.model_path)
    ingress = dataclasses.replace(ingress, served_model_name=names)
    llm = dataclasses.replace(llm, served_model_name=names)
    # One deadline for every stage unless a stage's own flag says otherwise.
    if getattr(args, "encoder_max_queue_wait_s", None) is None:
        encoder = dataclasses.replace(encoder, max_queue_wait_s=ingress.max_queue_wait_s)
    if getattr(args, "llm_engine_max_queue_wait_s", None) is None:
        llm = dataclasses.replace(
            llm, engine=dataclasses.replace(llm.engine, max_queue_wait_s=ingress.max_queue_wait_s)
        )
    return ServeConfig(
        ingress=ingress,
        encoder=encoder,
        llm=llm,
        encoder_workers=args.encoder_workers,
        remote_encoders=tuple(args.remote_encoders),
        llm_instances=args.llm_instances,
        llm_prefill_instances=args.llm_prefill_instances,
        llm_decode_instances=args.llm_decode_instances,
        remote_llms=tuple(args.remote_llms),
        start_llm=args.start_llm,
        log_level=args.log_level,
        model_dir=args.model_dir,
        vllm_python=args.vllm_python,
        vllm_args=launch_args(args.vllm_args),
        vllm_kv_cache_gib=args.vllm_kv_cache_gib,
        vllm_dtype=args.vllm_dtype or args.dtype or "auto",
        cpu_split=args.cpu_split,
    )


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Plan:
    """What will run: the children and the ingress config that points at them."""

    local_redis_port: int | None  # --store local: the redis-server this serve starts
    children: list[ChildSpec]
    encoder_children: dict[str, str]  # child name -> worker url
    llm_children: dict[str, str]  # child name -> engine url
    ingress: IngressConfig
    namespace: str


def vllm_child(
    cfg: ServeConfig, port: int, kv_events: KVEventsAt | None = None, cpus: tuple[int, ...] = ()
) -> ChildSpec:
    """The local vLLM server of ``--llm-server vllm`` as a supervised child (restarted if it dies),
    publishing its KV events at ``kv_events`` (fixed ports: a restarted server publishes where the
    router listens), on ``cpus`` when given (``epd.placement``)."""
    assert cfg.llm.model_path is not None
    try:
        launch = VLLMLaunch(
            cfg.llm.model_path,
            port,
            python=cfg.vllm_python,
            kv_cache_gib=cfg.vllm_kv_cache_gib,
            dtype=cfg.vllm_dtype,
            max_model_len=None,  # the checkpoint's own context (--vllm-arg to cap it)
            served_model_names=cfg.ingress.served_model_names,  # the ids epd serves
            extra_args=cfg.vllm_args,
            ec_path=cfg.ingress.vllm_ec_path,  # an encoder-cache consumer of that folder
            kv_events=kv_events,
        )
        argv = tuple(launch.argv())
    except VLLMLaunchError as exc:  # no vLLM, or a checkpoint it cannot load
        raise SystemExit(f"epd serve: {exc}") from exc
    env = launch.environ()
    if cpus:
        argv = pinned_argv(argv, cpus)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list(cpus))  # one inference thread a core
    return ChildSpec("vllm", argv, f"{launch.url}/health", env=env, ready_timeout_s=600.0, own_group=True)


def local_vllm(cfg: ServeConfig) -> bool:
    """Whether this serve starts a vLLM server of its own."""
    return cfg.start_llm and cfg.ingress.llm_server == "vllm" and not cfg.remote_llms


def cpu_split(cfg: ServeConfig) -> CpuSplit | None:
    """The placement of a local vLLM and epd's side (None: no local vLLM, or none asked)."""
    if not local_vllm(cfg):
        return None
    try:
        return plan_split(cfg.cpu_split, os.sched_getaffinity(0))
    except ValueError as exc:
        raise SystemExit(f"epd serve: {exc}") from exc


def plan(cfg: ServeConfig, split: CpuSplit | None = None) -> Plan:
    ing = cfg.ingress
    namespace = ing.cache_namespace if ing.cache_namespace != "default" else f"serve-{ing.port}"
    local_redis = None
    if ing.store.url == "local":
        local_redis = free_port("127.0.0.1")
        ing = dataclasses.replace(
            ing, store=dataclasses.replace(ing.store, url=f"redis://127.0.0.1:{local_redis}/0")
        )
    template = dataclasses.replace(
        cfg.encoder,
        host="127.0.0.1",
        port=free_port("127.0.0.1"),
        cache_namespace=namespace,
        preprocess=ing.preprocess,
        limits=ing.limits,
        cache_capacity_bytes=cfg.encoder.cache_capacity_bytes or ing.cache_capacity_bytes,
        store=ing.store,
    )
    workers = plan_workers(template, cpu_workers=cfg.encoder_workers)
    # plan_workers numbers ports from the template's; give each worker its own free port instead.
    workers = [dataclasses.replace(w, port=free_port("127.0.0.1")) for w in workers]
    children = [worker_child(w, i) for i, w in enumerate(workers)]
    encoder_children = {c.name: w.url for c, w in zip(children, workers, strict=True)}
    llm_children: dict[str, str] = {}
    roles: list[str] = []
    if cfg.start_llm and ing.llm_server == "vllm":
        if cfg.llm_prefill_instances or cfg.llm_decode_instances:
            raise SystemExit("epd serve: --llm-server vllm runs no epd engines (no prefill/decode split)")
        if local_vllm(cfg):  # one local vLLM server on the same checkpoint, supervised
            if not cfg.llm.model_path:
                raise SystemExit("epd serve: --llm-server vllm needs --model DIR (or --llm-url URL)")
            events = local_kv_events()  # unix sockets: vLLM binds them, only this machine reaches them
            child = vllm_child(cfg, free_port("127.0.0.1"), events, split.llm if split else ())
            ing = dataclasses.replace(ing, vllm_kv_events=(f"{events.endpoint},{events.replay}",))
            llm_children[child.name] = child.health_url.removesuffix("/health")
            roles.append("both")
            children.append(child)
    elif cfg.start_llm:
        roles_split = cfg.llm_prefill_instances or cfg.llm_decode_instances
        counts = {"both": 0 if roles_split else cfg.llm_instances}
        if roles_split:
            counts = {"prefill": cfg.llm_prefill_instances, "decode": cfg.llm_decode_instances}
            if min(counts.values()) < 1:
                raise SystemExit(
                    "epd serve: a prefill/decode split needs --llm-prefill-instances and --llm-decode-instances >= 1"
                )
        elif cfg.llm_instances < 0 or (cfg.llm_instances == 0 and not cfg.remote_llms):
            raise SystemExit("epd serve: --llm-instances must be >= 1 (or 0 with --llm-url)")
        single = sum(counts.values()) == 1
        for role, n in counts.items():
            for i in range(n):
                name = "llm" if single else (f"llm-{i}" if role == "both" else f"llm-{role}-{i}")
                llm = dataclasses.replace(
                    cfg.llm,
                    host="127.0.0.1",
                    port=free_port("127.0.0.1"),
                    cache_namespace=namespace,
                    role=role,  # type: ignore[arg-type]
                    store=ing.store,  # evicted KV pages too, with a host tier (--llm-engine-host-kv-bytes)
                    # fixed ports, so a restarted engine publishes where the router listens
                    kv_events_endpoint=f"tcp://127.0.0.1:{free_port('127.0.0.1')}",
                    kv_events_replay_endpoint=f"tcp://127.0.0.1:{free_port('127.0.0.1')}",
                )
                url = f"http://127.0.0.1:{llm.port}"
                llm_children[name] = url
                roles.append(role)
                children.append(ChildSpec(name, python_argv("llm", *dataclass_to_argv(llm)), f"{url}/health"))
    ingress = dataclasses.replace(
        ing,
        cache_namespace=namespace,
        encoder_urls=tuple(w.url for w in workers) + cfg.remote_encoders,
        llm_urls=(tuple(llm_children.values()) + cfg.remote_llms) if cfg.start_llm else (),
        llm_roles=(tuple(roles) + ("both",) * len(cfg.remote_llms)) if cfg.start_llm else (),
        llm_model_dir=cfg.llm.model_path,
    )
    return Plan(local_redis, children, encoder_children, llm_children, ingress, namespace)


async def serve(cfg: ServeConfig) -> int:
    import uvicorn

    from epd.ingress_app import build_app

    split = cpu_split(cfg)
    if split is not None:
        # epd's side: this process, and the encoder workers it starts (they inherit it and size
        # their threads by it); vLLM is started on its own cores
        os.sched_setaffinity(0, split.epd)
    p = plan(cfg, split)
    try:
        app = build_app(p.ingress)  # tokenizer, chat template: a broken one stops us before any child
    except (TokenizerError, TemplateFileError) as exc:
        print(f"epd serve: {exc}", file=sys.stderr)
        return 1
    ingress = app.state.ingress

    def on_down(spec: ChildSpec) -> None:
        if spec.name in p.encoder_children:
            ingress.router.mark_down(p.encoder_children[spec.name])
        if spec.name in p.llm_children:
            ingress.engines.mark(p.llm_children[spec.name], False)

    def on_up(spec: ChildSpec) -> None:
        if spec.name in p.encoder_children:
            ingress.router.mark_up(p.encoder_children[spec.name])
        if spec.name in p.llm_children:
            ingress.llm_server_up(p.llm_children[spec.name])

    sup = Supervisor(p.children, on_down=on_down, on_up=on_up)
    redis: LocalRedis | None = None
    try:
        try:
            if p.local_redis_port is not None:
                redis = LocalRedis(port=p.local_redis_port, maxmemory_bytes=p.ingress.store.max_bytes)
                redis.start()
            if p.llm_children and cfg.ingress.llm_server == "epd" and cfg.llm.model_path is None:
                # the embedded default's files, written once here rather than by each engine child
                # at once (its MTP heads are distilled: tens of seconds on a first start)
                await asyncio.to_thread(default_llm_dir)
            await sup.start()
        except (ChildFailed, StoreError) as exc:
            print(f"epd serve: {exc}", file=sys.stderr)
            return 1
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=p.ingress.host,
                port=p.ingress.port,
                log_level=cfg.log_level,
                timeout_graceful_shutdown=30,
            )
        )
        announce = asyncio.create_task(_announce(server, p, ingress, split))
        await server.serve()
        announce.cancel()
        return 0 if server.started else 1
    finally:
        await sup.stop()
        if redis is not None:
            redis.stop()
        shutil.rmtree(default_root(p.namespace), ignore_errors=True)
        for events in p.ingress.vllm_kv_events if p.llm_children else ():  # a local vLLM's sockets
            remove_local(KVEventsAt(events.split(",")[0]))
        # KV handed between engines whose exporter died (kill -9) before anyone fetched it
        for left in namespace_files(p.namespace):
            left.unlink(missing_ok=True)


async def _announce(server: object, p: Plan, ingress: Ingress, split: CpuSplit | None) -> None:
    while not getattr(server, "started", False):
        await asyncio.sleep(0.05)
    print(
        f"epd serving on http://{p.ingress.host}:{p.ingress.port}  "
        f"(encoders: {len(p.ingress.encoder_urls)}, llm: {', '.join(p.ingress.llm_urls) or 'off'}, "
        f"cache namespace: {p.namespace})",
        flush=True,
    )
    print(banner_paths(ingress.active_paths()), flush=True)
    if split is not None:
        print(split.describe(), flush=True)


def banner_paths(active: dict[str, Any]) -> str:
    """The start banner's lines on what runs each hot step, and every fallback in use."""
    lines = []
    for url, paths in active["paths"]["encoders"].items():
        lines.append(f"  encoder {url}: " + ", ".join(f"{k}={v}" for k, v in paths.items()))
    if active["paths"]["llm"]:
        lines.append("  llm: " + ", ".join(f"{k}={v}" for k, v in active["paths"]["llm"].items()))
    lines += [f"  WARNING slower fallback in use: {f}" for f in active["fallbacks"]]
    return "\n".join(lines) if lines else "  (no role reported its paths)"


class _Terminated(SystemExit):
    """SIGTERM outside uvicorn's own handling (during start-up, or re-raised by uvicorn after its
    graceful shutdown): unwind through ``serve``'s finally so the children stop and the shared
    memory is removed."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated(0)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
        if cfg.model_dir:  # before any role starts: a broken directory never half-starts the service
            print(check_model_dir(cfg.model_dir).describe(), flush=True)
    except (ProcessorConfigError, ModelDirError) as exc:
        print(f"epd serve: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, _on_sigterm)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # uvloop: the ingress's event loop is its bottleneck under load (HTTP parsing, proxying),
    # and uvloop with httptools cuts what a request costs it
    import uvloop

    return uvloop.run(serve(cfg))
