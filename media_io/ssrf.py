"""Address policy for outbound fetches: which hosts a media URL may reach (the SSRF guard).

A media URL comes from a client, so by default it may only reach publicly routable addresses.
Loopback, private, link-local (cloud metadata at 169.254.169.254 included), multicast,
unspecified, reserved and every other special-purpose range are refused, whatever spelling the
URL used for them: ``2130706433``, ``0177.0.0.1``, ``0x7f.0.0.1``, ``127.1``, ``0``,
``[::ffff:127.0.0.1]``, ``[::1]``, and IPv4 addresses embedded in NAT64, 6to4 and Teredo IPv6
addresses.

Two places enforce the policy, and together they leave no gap between "checked" and "connected":

- ``AddressPolicy.check_url_host`` runs before each request (and each redirect hop) on the exact
  host string the HTTP client will use. aiohttp connects to an IP-literal host without calling a
  resolver, so literals must be judged here.
- ``GuardedResolver`` is the aiohttp resolver: it resolves names off the event loop, judges every
  address, and returns only vetted addresses, so the socket connects to exactly what was checked
  (a DNS answer that changes between check and connect cannot slip through).

An explicit allowlist (hostnames, CIDRs) lets operators and tests reach internal hosts.
This module knows nothing of HTTP beyond the aiohttp resolver interface.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable

from aiohttp.abc import AbstractResolver, ResolveResult

from media_io.errors import FetchRefused

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_V4 = ipaddress.IPv4Network
_V6 = ipaddress.IPv6Network

# Special-purpose ranges (IANA registries), most specific names first. Anything not listed that
# Python still considers non-global is refused too, as "not globally routable".
_V4_RANGES: tuple[tuple[IPNetwork, str], ...] = (
    (_V4("0.0.0.0/8"), "unspecified ('this network')"),
    (_V4("10.0.0.0/8"), "private"),
    (_V4("100.64.0.0/10"), "shared address space (carrier-grade NAT)"),
    (_V4("127.0.0.0/8"), "loopback"),
    (_V4("169.254.0.0/16"), "link-local (includes cloud metadata 169.254.169.254)"),
    (_V4("172.16.0.0/12"), "private"),
    (_V4("192.0.0.0/24"), "IETF protocol assignments"),
    (_V4("192.0.2.0/24"), "documentation (TEST-NET-1)"),
    (_V4("192.88.99.0/24"), "6to4 relay anycast"),
    (_V4("192.168.0.0/16"), "private"),
    (_V4("198.18.0.0/15"), "benchmarking"),
    (_V4("198.51.100.0/24"), "documentation (TEST-NET-2)"),
    (_V4("203.0.113.0/24"), "documentation (TEST-NET-3)"),
    (_V4("224.0.0.0/4"), "multicast"),
    (_V4("255.255.255.255/32"), "broadcast"),
    (_V4("240.0.0.0/4"), "reserved"),
)
_V6_RANGES: tuple[tuple[IPNetwork, str], ...] = (
    (_V6("::/128"), "unspecified"),
    (_V6("::1/128"), "loopback"),
    (_V6("64:ff9b:1::/48"), "local-use NAT64"),
    (_V6("100::/64"), "discard-only"),
    (_V6("2001:2::/48"), "benchmarking"),
    (_V6("2001:10::/28"), "ORCHID"),
    (_V6("2001:20::/28"), "ORCHIDv2"),
    (_V6("2001:db8::/32"), "documentation"),
    (_V6("fc00::/7"), "unique local (private)"),
    (_V6("fe80::/10"), "link-local"),
    (_V6("fec0::/10"), "site-local (deprecated)"),
    (_V6("ff00::/8"), "multicast"),
)
_NAT64 = _V6("64:ff9b::/96")
_V4_COMPAT = _V6("::/96")
_SIX_TO_FOUR = _V6("2002::/16")
_TEREDO = _V6("2001::/32")


def parse_ip_literal(host: str) -> IPAddress | None:
    """The address a URL host denotes if it is a numeric literal, else None (a name).

    Accepts every spelling that ``inet_aton``/``getaddrinfo`` would: one to four dot-separated
    parts, each decimal, octal (leading ``0``) or hex (``0x``), the last part filling the
    remaining bytes (``127.1`` is 127.0.0.1, ``2130706433`` is 127.0.0.1, ``0`` is 0.0.0.0);
    IPv6 with or without brackets and zone id.
    """
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if ":" in h:
        h = h.split("%", 1)[0]  # zone id: "fe80::1%eth0" (yarl keeps it percent-encoded too)
        try:
            return ipaddress.IPv6Address(h)
        except ValueError:
            return None
    return _parse_legacy_ipv4(h)


def _parse_legacy_ipv4(host: str) -> ipaddress.IPv4Address | None:
    h = host[:-1] if host.endswith(".") else host  # a trailing root dot does not make it a name
    parts = h.split(".")
    if not 1 <= len(parts) <= 4:
        return None
    values: list[int] = []
    for part in parts:
        value = _parse_ipv4_part(part)
        if value is None:
            return None
        values.append(value)
    # "a.b.c.d" -> 4 bytes; "a.b.c" -> c fills 16 bits; "a.b" -> b fills 24; "a" fills 32.
    #   parts:   [p0] [p1] [p2] [ p_last ............ ]
    #   bytes:    1    1    1   (4 - (len(parts) - 1)) bytes
    *head, last = values
    last_bytes = 4 - len(head)
    if any(v > 0xFF for v in head) or last >= 1 << (8 * last_bytes):
        return None
    number = last
    for i, v in enumerate(head):
        number |= v << (8 * (3 - i))
    return ipaddress.IPv4Address(number)


def _parse_ipv4_part(part: str) -> int | None:
    if not part or not part.isascii():
        return None
    p = part.lower()
    try:
        if p.startswith("0x"):
            return int(p[2:], 16) if p[2:] else 0
        if len(p) > 1 and p.startswith("0"):
            return int(p[1:], 8)
        return int(p, 10) if p.isdigit() else None
    except ValueError:
        return None


def non_global_reason(addr: IPAddress) -> str | None:
    """Why ``addr`` is not a publicly routable unicast address, or None when it is.

    IPv6 addresses that embed an IPv4 address (mapped ``::ffff:a.b.c.d``, compatible ``::a.b.c.d``,
    NAT64 ``64:ff9b::/96``, 6to4 ``2002::/16``, Teredo ``2001::/32``) are judged by the embedded
    address too, because a gateway on the path would deliver them there.
    """
    if isinstance(addr, ipaddress.IPv6Address):
        for kind, inner in _embedded_ipv4(addr):
            reason = non_global_reason(inner)
            if reason is not None:
                return f"{reason} ({kind} of {inner})"
        ranges = _V6_RANGES
    else:
        ranges = _V4_RANGES
    for net, reason in ranges:
        if addr in net:
            return reason
    if not addr.is_global:
        return "not globally routable"
    return None


def _embedded_ipv4(addr: ipaddress.IPv6Address) -> list[tuple[str, ipaddress.IPv4Address]]:
    low32 = ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
    if addr.ipv4_mapped is not None:
        return [("IPv4-mapped form", addr.ipv4_mapped)]
    if addr in _NAT64:
        return [("NAT64 form", low32)]
    if addr in _V4_COMPAT and int(addr) > 1:  # :: and ::1 are judged as themselves
        return [("IPv4-compatible form", low32)]
    if addr in _SIX_TO_FOUR and addr.sixtofour is not None:
        return [("6to4 form", addr.sixtofour)]
    if addr in _TEREDO and addr.teredo is not None:
        server, client = addr.teredo
        return [("Teredo server", server), ("Teredo client", client)]
    return []


class AddressPolicy:
    """Decides whether a host (and each address it resolves to) may be fetched from.

    Invariant: ``allowed_address`` is True only for global unicast addresses or addresses inside
    ``allow_cidrs``; hosts named in ``allow_hosts`` (case-insensitive, trailing dot ignored) skip
    the address check entirely, because the operator vouched for the name.
    """

    def __init__(self, allow_hosts: Iterable[str] = (), allow_cidrs: Iterable[str] = ()) -> None:
        self.allow_hosts = frozenset(_norm_host(h) for h in allow_hosts)
        self.allow_cidrs: tuple[IPNetwork, ...] = tuple(
            ipaddress.ip_network(c, strict=False) for c in allow_cidrs
        )

    def host_allowlisted(self, host: str) -> bool:
        return _norm_host(host) in self.allow_hosts

    def refusal(self, addr: IPAddress) -> str | None:
        """Why a connection to ``addr`` is refused, or None if it is allowed."""
        mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
        if mapped is not None and self._in_allow_cidrs(mapped):
            return None  # an allowlisted 127.0.0.0/8 also admits ::ffff:127.0.0.1 (same destination)
        if self._in_allow_cidrs(addr):
            return None
        return non_global_reason(addr)

    def _in_allow_cidrs(self, addr: IPAddress) -> bool:
        return any(addr.version == net.version and addr in net for net in self.allow_cidrs)

    def check_url_host(self, host: str, item: str | None = None) -> None:
        """Refuse a URL whose host is a numeric literal of a refused address (any spelling).

        Hostnames pass here; their addresses are judged by ``GuardedResolver`` at connect time.
        Raises FetchRefused.
        """
        if self.host_allowlisted(host):
            return
        addr = parse_ip_literal(host)
        if addr is None:
            if _looks_numeric(host):
                # aiohttp would treat it as an address without resolving it; we cannot judge it.
                raise FetchRefused(f"host {host!r} is not a valid IP address", item)
            return
        reason = self.refusal(addr)
        if reason is not None:
            spelled = "" if str(addr) == host.strip("[]") else f" (spelled {host!r})"
            raise FetchRefused(f"address {addr}{spelled} is {reason}; refused by the SSRF guard", item)
        if isinstance(addr, ipaddress.IPv4Address) and str(addr) != host:
            # Legacy spellings of public addresses are refused too: the HTTP client would reject
            # them anyway, and a clear message beats a connector error.
            raise FetchRefused(f"non-canonical IPv4 spelling {host!r}; write it as {addr}", item)

    def vet_addresses(self, host: str, addrs: Iterable[IPAddress]) -> None:
        """Refuse ``host`` if any address it resolved to is refused (a name that resolves to both
        public and internal addresses is treated as internal). Raises FetchRefused."""
        if self.host_allowlisted(host):
            return
        for addr in addrs:
            reason = self.refusal(addr)
            if reason is not None:
                raise FetchRefused(
                    f"host {host!r} resolves to {addr}, which is {reason}; refused by the SSRF guard"
                )


def _norm_host(host: str) -> str:
    return host.strip().strip("[]").rstrip(".").lower()


def _looks_numeric(host: str) -> bool:
    # The same heuristic aiohttp uses to skip DNS (helpers.is_ip_address).
    return ":" in host or host.replace(".", "").isdigit()


class GuardedResolver(AbstractResolver):
    """aiohttp resolver that returns only addresses the policy allows.

    Resolution runs in the event loop's executor (``loop.getaddrinfo``), never blocking the loop.
    Raises FetchRefused when the policy refuses an address; the connector then never dials.
    """

    def __init__(self, policy: AddressPolicy) -> None:
        self.policy = policy

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, family=family)
        results: list[ResolveResult] = []
        addrs: list[IPAddress] = []
        for fam, _type, proto, _canon, sockaddr in infos:
            if fam not in (socket.AF_INET, socket.AF_INET6):
                continue
            ip = str(sockaddr[0])
            addr = parse_ip_literal(ip)
            assert addr is not None, f"getaddrinfo returned a non-address {ip!r}"
            addrs.append(addr)
            results.append(
                ResolveResult(
                    hostname=host,
                    host=ip,
                    port=int(sockaddr[1]),
                    family=fam,
                    proto=proto,
                    flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV,
                )
            )
        if not results:
            raise OSError(f"no IPv4/IPv6 address for {host!r}")
        self.policy.vet_addresses(host, addrs)
        return results

    async def close(self) -> None:
        return None
