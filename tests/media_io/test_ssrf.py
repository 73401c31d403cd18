"""The SSRF guard: address spellings, special-purpose ranges, resolver vetting, redirects."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterator

import pytest

from media_io.config import FetchConfig
from media_io.errors import FetchRefused
from media_io.fetch import Fetcher
from media_io.ssrf import AddressPolicy, GuardedResolver, non_global_reason, parse_ip_literal
from tests.fixtures.media_server import MediaServer

LOOPBACK_ALLOWED = FetchConfig(allow_cidrs=("127.0.0.0/8", "::1/128"))


@pytest.fixture(scope="module")
def server() -> Iterator[MediaServer]:
    with MediaServer() as s:
        s.add("secret.txt", b"internal data")
        yield s


# -- spellings ----------------------------------------------------------------------------------

LEGACY_SPELLINGS = {
    "127.0.0.1": "127.0.0.1",
    "2130706433": "127.0.0.1",
    "0177.0.0.1": "127.0.0.1",
    "0x7f.0.0.1": "127.0.0.1",
    "0X7F.0X0.0.01": "127.0.0.1",
    "0x7f000001": "127.0.0.1",
    "017700000001": "127.0.0.1",
    "127.1": "127.0.0.1",
    "127.0.1": "127.0.0.1",
    "0": "0.0.0.0",
    "0x0": "0.0.0.0",
    "169.254.43518": "169.254.169.254",
    "0xa9fea9fe": "169.254.169.254",
    "10.1": "10.0.0.1",
    "3232235777": "192.168.1.1",
    "134744072": "8.8.8.8",
}


@pytest.mark.parametrize(("spelling", "expected"), sorted(LEGACY_SPELLINGS.items()))
def test_legacy_ipv4_spellings_parse_like_inet_aton(spelling: str, expected: str) -> None:
    addr = parse_ip_literal(spelling)
    assert addr == ipaddress.IPv4Address(expected)
    # Parity with the C library the resolver would use.
    assert socket.inet_aton(spelling) == addr.packed


@pytest.mark.parametrize(
    "host",
    ["example.com", "1.2.3.4.5", "256.1.1.1", "1.2.3.0x100", "0x100000000", "08.0.0.1", "1..1", "", "a.1"],
)
def test_names_and_invalid_numbers_are_not_literals(host: str) -> None:
    assert parse_ip_literal(host) is None


@pytest.mark.parametrize(
    ("host", "expected"),
    [("[::1]", "::1"), ("::ffff:127.0.0.1", "::ffff:7f00:1"), ("fe80::1%25eth0", "fe80::1"), ("[::]", "::")],
)
def test_ipv6_literals(host: str, expected: str) -> None:
    assert parse_ip_literal(host) == ipaddress.IPv6Address(expected)


# -- ranges ---------------------------------------------------------------------------------------

REFUSED = {
    "127.0.0.1": "loopback",
    "127.255.0.9": "loopback",
    "10.2.3.4": "private",
    "172.16.0.1": "private",
    "172.31.255.255": "private",
    "192.168.1.1": "private",
    "169.254.169.254": "link-local",
    "0.0.0.0": "unspecified",
    "100.64.0.1": "carrier-grade NAT",
    "224.0.0.1": "multicast",
    "239.255.255.250": "multicast",
    "240.0.0.1": "reserved",
    "255.255.255.255": "broadcast",
    "198.18.0.1": "benchmarking",
    "192.0.2.1": "documentation",
    "::1": "loopback",
    "::": "unspecified",
    "fe80::1": "link-local",
    "fc00::1": "unique local",
    "fd12:3456::1": "unique local",
    "ff02::1": "multicast",
    "::ffff:127.0.0.1": "loopback|IPv4-mapped form",
    "::ffff:169.254.169.254": "link-local|IPv4-mapped form",
    "::ffff:10.0.0.1": "private|IPv4-mapped form",
    "::127.0.0.1": "loopback|IPv4-compatible form",
    "64:ff9b::7f00:1": "loopback|NAT64 form",
    "64:ff9b::a9fe:a9fe": "link-local|NAT64 form",
    "64:ff9b:1::1": "local-use NAT64",
    "2002:7f00:1::": "loopback|6to4 form",
    "2002:a9fe:a9fe::1": "link-local|6to4 form",
    "2001:db8::1": "documentation",
}
PUBLIC = [
    "8.8.8.8",
    "1.1.1.1",
    "93.184.216.34",
    "2606:4700:4700::1111",
    "64:ff9b::808:808",
    "2002:808:808::1",
]


@pytest.mark.parametrize(("addr", "reason"), sorted(REFUSED.items()))
def test_special_purpose_addresses_are_refused(addr: str, reason: str) -> None:
    got = non_global_reason(ipaddress.ip_address(addr))
    assert got is not None and all(part in got for part in reason.split("|")), got


@pytest.mark.parametrize("addr", PUBLIC)
def test_public_addresses_are_allowed(addr: str) -> None:
    assert non_global_reason(ipaddress.ip_address(addr)) is None


def test_teredo_is_judged_by_its_embedded_addresses() -> None:
    # Teredo: 2001:0:<server v4>:<flags>:<port ^ ffff>:<client v4 ^ ffffffff>; client 127.0.0.1.
    client = int(ipaddress.IPv4Address("127.0.0.1")) ^ 0xFFFFFFFF
    addr = ipaddress.IPv6Address((0x20010000 << 96) | (int(ipaddress.IPv4Address("8.8.8.8")) << 64) | client)
    assert addr.teredo is not None and addr.teredo[1] == ipaddress.IPv4Address("127.0.0.1")
    got = non_global_reason(addr)
    assert got is not None and "Teredo client" in got


def test_allowlist_admits_only_listed_ranges_and_mapped_forms() -> None:
    policy = AddressPolicy(allow_cidrs=("127.0.0.0/8",))
    assert policy.refusal(ipaddress.ip_address("127.0.0.5")) is None
    assert policy.refusal(ipaddress.ip_address("::ffff:127.0.0.5")) is None
    assert policy.refusal(ipaddress.ip_address("10.0.0.1")) == "private"
    assert policy.refusal(ipaddress.ip_address("::1")) == "loopback"


# -- URL hosts, as the fetcher sees them ---------------------------------------------------------

REFUSED_URLS = [
    "http://127.0.0.1/",
    "http://2130706433/",
    "http://0177.0.0.1/",
    "http://0x7f.0.0.1/",
    "http://0x7f000001/",
    "http://127.1/",
    "http://0/",
    "http://0.0.0.0:8080/",
    "http://[::1]/",
    "http://[::ffff:127.0.0.1]/",
    "http://[::ffff:7f00:1]/",
    "http://[0:0:0:0:0:ffff:127.0.0.1]/",
    "http://[64:ff9b::127.0.0.1]/",
    "http://[2002:7f00:1::]/",
    "http://169.254.169.254/latest/meta-data/",
    "http://[fe80::1%25eth0]/",
    "http://10.0.0.1/",
    "https://192.168.0.1/",
    "http://localhost/",
    "http://user:pass@127.0.0.1/",
]


def test_refused_spellings_never_connect() -> None:
    async def run() -> list[BaseException | bytes]:
        async with Fetcher(FetchConfig(connect_timeout_s=1.0, total_timeout_s=3.0)) as f:
            return await asyncio.gather(*(f.fetch(u) for u in REFUSED_URLS), return_exceptions=True)

    for url, result in zip(REFUSED_URLS, asyncio.run(run()), strict=True):
        assert isinstance(result, FetchRefused), (url, result)
        assert result.status == 400 and "SSRF" in result.message, (url, result.message)
        assert result.item == url


def test_public_address_in_legacy_spelling_is_refused_with_the_canonical_form() -> None:
    with pytest.raises(FetchRefused, match=r"write it as 8\.8\.8\.8"):
        AddressPolicy().check_url_host("134744072")


def test_resolver_vets_every_address_of_a_name() -> None:
    async def resolve(policy: AddressPolicy) -> list[str]:
        results = await GuardedResolver(policy).resolve("localhost", 80, family=socket.AF_UNSPEC)
        return [r["host"] for r in results]

    with pytest.raises(FetchRefused, match=r"resolves to .* loopback"):
        asyncio.run(resolve(AddressPolicy()))
    hosts = asyncio.run(resolve(AddressPolicy(allow_hosts=("LocalHost",))))
    assert "127.0.0.1" in hosts
    hosts = asyncio.run(resolve(AddressPolicy(allow_cidrs=("127.0.0.0/8", "::1/128"))))
    assert hosts and all(parse_ip_literal(h) is not None for h in hosts)


# -- redirects ------------------------------------------------------------------------------------


def _fetch(cfg: FetchConfig, url: str) -> bytes:
    async def run() -> bytes:
        async with Fetcher(cfg) as f:
            return await f.fetch(url)

    return asyncio.run(run())


def test_redirect_from_allowed_host_to_loopback_is_refused_by_default(server: MediaServer) -> None:
    target = server.url("/m/secret.txt")  # http://127.0.0.1:PORT/...
    start = server.base_url.replace("127.0.0.1", "localhost")
    cfg = FetchConfig(allow_hosts=("localhost",))  # the name is vouched for, 127.0.0.1 is not
    before = server.hits["/m/secret.txt"]
    with pytest.raises(FetchRefused, match=r"127\.0\.0\.1 is loopback"):
        _fetch(cfg, f"{start}/redirect?to={target}")
    assert server.hits["/redirect"] >= 1
    assert server.hits["/m/secret.txt"] == before, "the refused hop must never be requested"
    # The same chain is fine once loopback is allowlisted.
    assert _fetch(LOOPBACK_ALLOWED, f"{start}/redirect?to={target}") == b"internal data"


@pytest.mark.parametrize(
    "location",
    [
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]/",
        "http://2130706433/",
        "http://10.0.0.1/",
        "file:///etc/passwd",
        "ftp://example.com/x",
    ],
)
def test_every_redirect_hop_is_rechecked(server: MediaServer, location: str) -> None:
    cfg = FetchConfig(allow_cidrs=("127.0.0.1/32",))
    with pytest.raises(FetchRefused):
        _fetch(cfg, server.url(f"/redirect?to={location}"))
