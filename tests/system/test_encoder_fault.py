"""Encoder fault: kill -9 one of three encoder workers under steady load.

Every request of the load either completes (the router moves it to the next worker of the ring)
or gets a clean 503 with Retry-After; none hangs past its client timeout. The supervisor restarts
the worker on the same port, the ingress marks it up again, later requests routed to it succeed,
and the node cache verifies afterwards (no half-written or orphaned entry from the killed writer).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.epd.conftest import REPO, ServeProcess, http_json, multipart, unique_png, upload
from tests.system.conftest import child_pids, pid_alive, wait_until

CLIENT_TIMEOUT_S = 45.0
RESTART_TIMEOUT_S = 150.0


def _worker_urls(server: ServeProcess) -> dict[int, str]:
    """pid -> base url of each live encoder worker child (its --port is on its command line)."""
    out = {}
    for pid in child_pids(server.proc.pid, "encoder"):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        out[pid] = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    return out


class Load:
    """Closed-loop upload clients in threads; every outcome is kept as (status, seconds, body)."""

    def __init__(self, server: ServeProcess, clients: int) -> None:
        self.server = server
        self.outcomes: list[tuple[int, float, object]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                status, body = http_json(
                    "POST",
                    f"{self.server.url}/v1/encode",
                    *multipart([("p.png", unique_png(56, 56), "image/png")]),
                    timeout=CLIENT_TIMEOUT_S,
                )
            except OSError as exc:  # includes socket timeouts: a hang past the client timeout
                status, body = -1, repr(exc)
            self.outcomes.append((status, time.perf_counter() - t0, body))

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(CLIENT_TIMEOUT_S + 5)
            assert not t.is_alive(), "a load client is still blocked on a request"


@pytest.mark.timeout(240)
def test_kill9_worker_under_load_reroutes_restarts_and_rejoins(fault_svc: ServeProcess) -> None:
    workers = _worker_urls(fault_svc)
    assert len(workers) == 3, workers
    victim_pid, victim_url = next(iter(workers.items()))
    assert http_json("GET", f"{victim_url}/health")[1]["pid"] == victim_pid

    with Load(fault_svc, clients=3) as load:
        wait_until(lambda: len(load.outcomes) >= 3, 60, "the load to get going")
        os.kill(victim_pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(victim_pid), 10, "the killed worker to be reaped")
        # Keep the load on while the supervisor restarts the worker (a model load: seconds).
        wait_until(
            lambda: any(
                url == victim_url and pid != victim_pid for pid, url in _worker_urls(fault_svc).items()
            ),
            RESTART_TIMEOUT_S,
            "the supervisor to start a new worker on the same port",
        )
        wait_until(
            lambda: http_json("GET", f"{fault_svc.url}/ready")[1].get("encoders_up") == 3,
            RESTART_TIMEOUT_S,
            "the restarted worker to rejoin the ring",
            interval_s=0.5,
        )

    outcomes = load.outcomes
    assert outcomes
    hung = [o for o in outcomes if o[0] == -1]
    assert not hung, f"requests hung or were reset: {hung[:3]}"
    bad = [o for o in outcomes if o[0] not in (200, 503)]
    assert not bad, f"neither success nor a clean 503: {bad[:3]}"
    for status, _, body in outcomes:
        if status == 503:
            assert isinstance(body, dict) and body["error"]["type"], body
    assert sum(o[0] == 200 for o in outcomes) >= len(outcomes) // 2, [o[0] for o in outcomes]

    # The new worker answers /health and takes its share of fresh media.
    status, health = http_json("GET", f"{victim_url}/health")
    assert status == 200 and health["pid"] != victim_pid
    batches_before = int(health["batches"])
    # Fresh keys hash uniformly over the ring: 40 of them all missing one of 3 equal workers has
    # probability (2/3)^40 < 1e-7.
    for _ in range(40):
        status, body = upload(fault_svc, [("after.png", unique_png(56, 56), "image/png")])
        assert status == 200, body
        if int(http_json("GET", f"{victim_url}/health")[1]["batches"]) > batches_before:
            break
    else:
        raise AssertionError("no request was routed to the restarted worker")

    verify = subprocess.run(
        [
            sys.executable,
            "-m",
            "epd.cli",
            "cache",
            "verify",
            "--namespace",
            f"serve-{fault_svc.port}",
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    report = json.loads(verify.stdout)
    assert report["ok"] and not report["failures"] and report["checked"] > 0, report
