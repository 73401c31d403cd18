"""``epd encoder``: run encoder workers alone (flags map onto ``WorkerConfig``).

With CUDA, one process per device; on CPU ``--workers N`` processes share the cores. Worker i
listens on ``--port + i``. A single worker runs in this process; several are supervised children.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses

from encoder.serving.worker import WorkerConfig, plan_workers, serve_worker
from epd.config_cli import (
    add_dataclass_args,
    add_model_dir_argument,
    dataclass_from_args,
    dataclass_to_argv,
    model_path_from,
)
from epd.supervisor import ChildSpec, Supervisor, python_argv
from media_io.processor_config import preprocess_config_from_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, WorkerConfig)
    parser.add_argument("--workers", type=int, default=1, help="CPU worker processes (GPU: one per device)")
    add_model_dir_argument(parser, "its vision tower and its processor settings")


def worker_config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """The flags' WorkerConfig; ``--model DIR`` sets the checkpoint and its preprocessing."""
    base = dataclass_from_args(WorkerConfig, args)
    path = model_path_from("encoder", args.model_dir, base.model_path)
    if args.model_dir:
        base = dataclasses.replace(
            base, model_path=path, preprocess=preprocess_config_from_dir(args.model_dir, base.preprocess)
        )
    return base


def worker_argv(cfg: WorkerConfig) -> tuple[str, ...]:
    """argv that starts exactly the worker ``cfg`` describes, as a child process."""
    return python_argv("encoder", "--workers", "1", *dataclass_to_argv(cfg))


def worker_child(cfg: WorkerConfig, index: int) -> ChildSpec:
    health = f"{cfg.url}/health" if not cfg.uds else "http://localhost/health"
    return ChildSpec(name=f"encoder-{index}", argv=worker_argv(cfg), health_url=health, uds=cfg.uds)


def run(args: argparse.Namespace) -> int:
    base = worker_config_from_args(args)
    configs = plan_workers(base, cpu_workers=args.workers)
    if len(configs) == 1:
        serve_worker(configs[0])
        return 0

    async def supervise() -> None:
        sup = Supervisor([worker_child(c, i) for i, c in enumerate(configs)])
        await sup.start()
        print("epd encoder workers: " + ", ".join(c.url for c in configs), flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await sup.stop()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(supervise())
    return 0
