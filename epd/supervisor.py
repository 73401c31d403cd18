"""Starts child processes (encoder workers, the LLM engine), waits until they are healthy, restarts
the ones that die, and stops them all on shutdown.

Children get PR_SET_PDEATHSIG so that a kill -9 of the parent does not leave them running. A
restarted child keeps its address, so the router only needs to mark it down and up again; the
supervisor reports both transitions through callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from epd_common.child_process import child_env, die_with_parent

log = logging.getLogger("epd.supervisor")


@dataclass(frozen=True)
class ChildSpec:
    """One supervised process: how to start it and how to know it is ready."""

    name: str
    argv: tuple[str, ...]
    health_url: str  # GET answers 200 once the child serves
    uds: str | None = None  # when the child listens on a unix socket, the health check goes through it
    env: dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float | None = None  # this child's start-up limit (None: the supervisor's)
    # The child starts processes of its own that do not stop with it (vLLM's engine core and
    # workers): it gets its own process group, and stop / restart signal the whole group.
    own_group: bool = False


Callback = Callable[[ChildSpec], Awaitable[None] | None]


class ChildFailed(RuntimeError):
    """A child exited, or did not become healthy, during start-up."""


class Supervisor:
    def __init__(
        self,
        children: Sequence[ChildSpec],
        *,
        ready_timeout_s: float = 120.0,
        restart_backoff_s: float = 0.5,
        on_down: Callback | None = None,
        on_up: Callback | None = None,
    ) -> None:
        self.children = list(children)
        self.ready_timeout_s = ready_timeout_s
        self.restart_backoff_s = restart_backoff_s
        self.on_down = on_down
        self.on_up = on_up
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.restarts: dict[str, int] = {c.name: 0 for c in children}
        self._stopping = False
        self._monitor: asyncio.Task[None] | None = None
        self._groups: set[int] = set()  # pids that lead a process group of their own

    async def start(self) -> None:
        """Start every child and wait until all answer their health check."""
        for spec in self.children:
            await self._spawn(spec)
        await asyncio.gather(*(self._wait_healthy(spec) for spec in self.children))
        self._monitor = asyncio.create_task(self._watch(), name="epd-supervisor")

    def pid(self, name: str) -> int | None:
        proc = self.procs.get(name)
        return proc.pid if proc is not None else None

    async def _spawn(self, spec: ChildSpec) -> None:
        env = {**os.environ, **child_env(), **spec.env}
        proc = await asyncio.create_subprocess_exec(
            *die_with_parent(spec.argv),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            start_new_session=spec.own_group,
        )
        self.procs[spec.name] = proc
        if spec.own_group:
            self._groups.add(proc.pid)
        log.info("started %s (pid %d)", spec.name, proc.pid)

    async def _wait_healthy(self, spec: ChildSpec) -> None:
        limit = spec.ready_timeout_s or self.ready_timeout_s
        deadline = time.monotonic() + limit
        connector = aiohttp.UnixConnector(path=spec.uds) if spec.uds else None
        async with aiohttp.ClientSession(connector=connector) as session:
            while True:
                proc = self.procs[spec.name]
                if proc.returncode is not None:
                    raise ChildFailed(f"{spec.name} exited with code {proc.returncode} during start-up")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    async with session.get(spec.health_url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                        if resp.status == 200:
                            return
                if time.monotonic() > deadline:
                    raise ChildFailed(f"{spec.name} did not become healthy within {limit:.0f}s")
                await asyncio.sleep(0.1)

    async def _watch(self) -> None:
        waits = {spec.name: asyncio.create_task(self.procs[spec.name].wait()) for spec in self.children}
        by_name = {spec.name: spec for spec in self.children}
        while not self._stopping:
            done, _ = await asyncio.wait(waits.values(), return_when=asyncio.FIRST_COMPLETED)
            if self._stopping:
                break
            for task in done:
                name = next(n for n, t in waits.items() if t is task)
                spec = by_name[name]
                log.warning("%s exited with code %s; restarting", name, task.result())
                gone = self.procs[name].pid
                if gone in self._groups:  # what it left of its group (a lone child is reaped)
                    self._signal(gone, signal.SIGKILL)
                    self._groups.discard(gone)
                await _call(self.on_down, spec)
                self.restarts[name] += 1
                await asyncio.sleep(self.restart_backoff_s)
                try:
                    await self._spawn(spec)
                    await self._wait_healthy(spec)
                except (ChildFailed, OSError) as exc:
                    log.error("restart of %s failed: %s", name, exc)
                else:
                    await _call(self.on_up, spec)
                waits[name] = asyncio.create_task(self.procs[name].wait())

    async def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child, give them ``grace_s`` to drain, then SIGKILL what is left."""
        self._stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        for proc in self.procs.values():
            if proc.returncode is None:
                self._signal(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name, proc in self.procs.items():
            remaining = max(0.0, deadline - time.monotonic())
            try:
                await asyncio.wait_for(proc.wait(), timeout=remaining)
            except TimeoutError:
                log.warning("%s did not stop in time; killing it", name)
                self._signal(proc.pid, signal.SIGKILL)
                await proc.wait()
        for pid in self._groups:  # the group's other processes, however its leader ended
            await self._drain_group(pid, deadline)

    def _signal(self, pid: int, sig: int) -> None:
        """``sig`` to the child, or to its whole group when it leads one."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if pid in self._groups:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)

    async def _drain_group(self, pgid: int, deadline: float) -> None:
        """Wait for group ``pgid`` to empty until ``deadline``, then SIGKILL what is left."""
        while group_alive(pgid):
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                return
            await asyncio.sleep(0.1)


def group_alive(pgid: int) -> bool:
    """Whether any process is left in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def _call(cb: Callback | None, spec: ChildSpec) -> None:
    if cb is None:
        return
    result = cb(spec)
    if asyncio.iscoroutine(result):
        await result


def python_argv(*args: str) -> tuple[str, ...]:
    """argv that runs ``epd`` with the current interpreter (works from a venv without PATH)."""
    return (sys.executable, "-m", "epd.cli", *args)
