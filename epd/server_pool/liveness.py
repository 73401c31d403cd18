"""Which servers are in the routing set.

A mark (a call that could not connect, the supervisor restarting a process, a server failing the
server's check) flips a server at once. Health checks flip it after ``fall_after`` failures or
``rise_after`` passes in a row, so one lost probe need not move a server's keys.

Use from one thread (the event loop).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

log = logging.getLogger("epd.server_pool")

# (url, up) after every mark and health report, changed or not: a gauge may be set from it
Listener = Callable[[str, bool], None]


class Liveness:
    """Up or down per server url, in the order the servers were listed."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        label: str,
        fall_after: int = 1,
        rise_after: int = 1,
        initially_up: bool = True,
    ) -> None:
        """``label``: what the logs call a server ("encoder worker"); ``initially_up``: the state
        of a server nothing has been heard from yet."""
        if fall_after < 1 or rise_after < 1:
            raise ValueError(f"fall_after and rise_after must be >= 1, got {fall_after}, {rise_after}")
        self.label = label
        self.fall_after = fall_after
        self.rise_after = rise_after
        self.initially_up = initially_up
        self._up: dict[str, bool] = {}
        self._fails: dict[str, int] = {}
        self._passes: dict[str, int] = {}
        self._listeners: list[Listener] = []
        self.set_members(urls)

    # -- membership ----------------------------------------------------------------------------
    def set_members(self, urls: Sequence[str]) -> None:
        """Replace the servers: a new one starts as ``initially_up``; a kept one keeps its state."""
        if len(set(urls)) != len(urls):
            raise ValueError(f"a {self.label} is listed twice: {list(urls)}")
        self._up = {u: self._up.get(u, self.initially_up) for u in urls}
        self._fails = {u: n for u, n in self._fails.items() if u in self._up}
        self._passes = {u: n for u, n in self._passes.items() if u in self._up}

    @property
    def members(self) -> list[str]:
        return list(self._up)

    def __contains__(self, url: object) -> bool:
        return url in self._up

    def is_up(self, url: str) -> bool:
        return self._up.get(url, False)

    def up_among(self, urls: Sequence[str]) -> list[str]:
        """The live ones of ``urls``, in their order."""
        return [u for u in urls if self._up.get(u, False)]

    @property
    def states(self) -> dict[str, bool]:
        return dict(self._up)

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    # -- marks ---------------------------------------------------------------------------------
    def set(self, url: str, up: bool) -> None:
        """Put ``url`` in (``up``) or out of the routing set now; KeyError when it is no member."""
        if url not in self._up:
            raise KeyError(f"{url!r} is not one of the {self.label}s {list(self._up)}")
        if self._up[url] != up:
            log.log(
                logging.INFO if up else logging.WARNING,
                "%s %s marked %s",
                self.label,
                url,
                "up" if up else "down",
            )
        self._up[url] = up
        for listener in self._listeners:
            listener(url, up)

    # -- health checks -------------------------------------------------------------------------
    def report(self, url: str, healthy: bool) -> None:
        """Feed one health-check result; ``fall_after`` / ``rise_after`` in a row flip the state.
        A url that is no member (removed meanwhile) is ignored."""
        if url not in self._up:
            return
        if healthy:
            self._fails[url] = 0
            self._passes[url] = self._passes.get(url, 0) + 1
            up = self._up[url] or self._passes[url] >= self.rise_after
        else:
            self._passes[url] = 0
            self._fails[url] = self._fails.get(url, 0) + 1
            up = self._up[url] and self._fails[url] < self.fall_after
        self.set(url, up)  # the listeners hear every result

    async def check_all(
        self, check: Callable[[str], Awaitable[bool]], timeout_s: float | None = 2.0
    ) -> dict[str, bool]:
        """Run ``check`` on every server at once (an error or a timeout is a failure) and feed
        the results. ``timeout_s``: None when ``check`` bounds its own time."""
        urls = list(self._up)

        async def one(url: str) -> bool:
            try:
                return bool(await asyncio.wait_for(check(url), timeout_s))
            except Exception:
                return False

        results = dict(zip(urls, await asyncio.gather(*(one(u) for u in urls)), strict=True))
        for url, ok in results.items():
            self.report(url, ok)
        return results
