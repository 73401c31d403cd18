import asyncio
import os
import signal
import socket
import sys

import pytest

from epd.supervisor import ChildFailed, ChildSpec, Supervisor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http_child(name: str) -> ChildSpec:
    port = _free_port()
    argv = (sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1")
    return ChildSpec(name=name, argv=argv, health_url=f"http://127.0.0.1:{port}/")


def test_restarts_a_killed_child_and_reports_down_and_up() -> None:
    async def scenario() -> None:
        events: list[tuple[str, str]] = []
        up = asyncio.Event()

        def on_down(spec: ChildSpec) -> None:
            events.append(("down", spec.name))

        def on_up(spec: ChildSpec) -> None:
            events.append(("up", spec.name))
            up.set()

        sup = Supervisor(
            [_http_child("a"), _http_child("b")], on_down=on_down, on_up=on_up, restart_backoff_s=0.05
        )
        await sup.start()
        try:
            old_pid = sup.pid("a")
            assert old_pid is not None
            os.kill(old_pid, signal.SIGKILL)
            await asyncio.wait_for(up.wait(), timeout=30)
            assert events == [("down", "a"), ("up", "a")]
            assert sup.pid("a") != old_pid
            assert sup.restarts == {"a": 1, "b": 0}
        finally:
            await sup.stop(grace_s=5)
        assert all(p.returncode is not None for p in sup.procs.values())

    asyncio.run(scenario())


def test_child_that_exits_during_start_is_reported() -> None:
    spec = ChildSpec(
        name="bad", argv=(sys.executable, "-c", "raise SystemExit(3)"), health_url="http://127.0.0.1:9/"
    )

    async def scenario() -> None:
        sup = Supervisor([spec], ready_timeout_s=10)
        with pytest.raises(ChildFailed, match="bad exited with code 3"):
            await sup.start()
        await sup.stop(grace_s=1)

    asyncio.run(scenario())
