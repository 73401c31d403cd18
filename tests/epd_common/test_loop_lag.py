"""The event-loop stall watcher (epd_common/loop_lag.py) measures a blocking call's length."""

from __future__ import annotations

import asyncio
import time

from epd_common.loop_lag import LoopLag


def test_a_blocking_call_on_the_loop_is_measured_as_its_length() -> None:
    async def go() -> tuple[float, float, float]:
        lag = LoopLag(interval_s=0.01)
        lag.start()
        await asyncio.sleep(0.05)
        quiet = lag.worst_s
        time.sleep(0.3)  # a stall: work run on the loop
        await asyncio.sleep(0.05)
        await lag.stop()
        return quiet, lag.worst_s, lag.recent_worst_s(5.0)

    quiet, worst, recent = asyncio.run(go())
    assert quiet < 0.25  # nothing blocked yet (scheduling noise only)
    assert 0.28 <= worst < 1.0 and recent == worst
