"""Two or more nodes with a client each (spec section 12: cross-node delivery), checked deliveries.

A ``Site`` is one node process and a client connected to it. It remembers what it put in
its node (``resident``: key -> pool of each span), so ``assert_site_clean`` can check the
node's slot accounting exactly: every allocated slot belongs to a key the test knows of,
and no object is left half written. The ``sites`` fixture (tests/conftest.py) gives a test
its ``Sites``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcr_client import Client, ErrorCode, KeyOutcome, KeyStatus, Presence, Span
from kvcr_protocol import CURRENT_VERSION
from kvcr_testing.health import assert_clean, stats, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Layout, Registrar, plan_destination
from kvcr_testing.patterns import assert_bytes_equal, pattern, sentinel_like

OK = KeyStatus.OK
FAILED = KeyStatus.FAILED
STORED = KeyStatus.STORED

# The pools every node of these tests has: a plain one, and the three of a hybrid model.
POOLS = ("--pool", "kv:64KiB:64", "--pool", "full:64KiB:32", "--pool", "swa:16KiB:32", "--pool", "state:1536KiB:4")


# --------------------------------------------------------------------------- sites


@dataclass(eq=False)
class Site:
    """A node and a client of it (the client may speak an older version than the node)."""

    node: Any
    client: Client
    reg: Registrar
    resident: dict[bytes, tuple[str, ...]] = field(default_factory=dict)
    """Keys this test put in the node (deposit or fetch): the pool of each span."""

    @property
    def endpoint(self) -> str:
        return str(self.node.endpoint)

    @property
    def alive(self) -> bool:
        return self.node.proc.poll() is None

    def stats(self) -> dict[str, Any]:
        return stats(self.client)

    def deposit(self, key: bytes, layout: Layout, seed: int) -> np.ndarray:
        """Deposit patterned bytes under ``key``; returns the source bytes (kept registered)."""
        src = pattern(layout.nbytes, seed)
        region = self.reg(src)
        res = self.client.deposit({key: layout.source_spans(region)}).result(RESULT_TIMEOUT_S)
        assert res[key].status is STORED, res[key]
        self.resident[key] = tuple(pool for _, pool, _ in layout.spans)
        return src

    def close(self) -> None:
        try:
            if self.alive and not self.client.core.lost:
                self.reg.close()
        finally:
            self.client.close()


def open_site(node: Any, name: str, max_version: int = CURRENT_VERSION, client_class: type[Client] = Client) -> Site:
    client = client_class(node.endpoint, name=name, max_version=max_version)
    return Site(node, client, Registrar(client))


def assert_site_clean(site: Site, *, expect_peers_idle: bool = True) -> dict[str, Any]:
    """``assert_clean`` plus: slot accounting matches the keys the test knows are resident,
    no write to a peer is outstanding, queued or uncertain."""
    st = assert_clean(site.client)
    keys = list(site.resident)
    present: list[bytes] = []
    if keys:
        res = site.client.query(keys).result(RESULT_TIMEOUT_S)
        present = [k for k in keys if res[k].presence is Presence.HIT]
    expected = {name: 0 for name in st["pools"]}
    for k in present:
        for pool in site.resident[k]:
            expected[pool] += 1
    allocated = {name: p["allocated"] for name, p in st["pools"].items()}
    assert allocated == expected, (allocated, expected, present)
    assert st["objects"] == len(present), (st["objects"], present)
    if expect_peers_idle:
        for endpoint, peer in st["peers"].items():
            assert peer["writes_outstanding"] == 0, (endpoint, peer)
            assert peer["queued"] == 0, (endpoint, peer)
            assert peer["uncertain"] == 0, (endpoint, peer)
    return st


class Sites:
    """Starts nodes (through ``node_factory``) with a client each; checks and closes them all."""

    def __init__(self, node_factory: Callable[..., Any]) -> None:
        self.node_factory = node_factory
        self.sites: list[Site] = []
        self.owned: list[Any] = []
        """Nodes started outside ``node_factory`` that ``close_all`` stops (after the clients)."""

    def __call__(self, name: str, *args: str, pools: Sequence[str] = POOLS, client_version: int = CURRENT_VERSION) -> Site:
        node = self.node_factory(*pools, *args)
        site = open_site(node, name, client_version)
        self.sites.append(site)
        return site

    def start(self, *specs: str | tuple[str, dict[str, Any]]) -> list[Site]:
        """Several sites at once (node and client start-ups overlap).

        A spec is a name, or ``(name, {"pools": ..., "args": ..., "client_version": ...,
        "client_class": ...})``.
        """
        named = [(spec, {}) if isinstance(spec, str) else spec for spec in specs]

        def one(name: str, kw: dict[str, Any]) -> Site:
            node = self.node_factory(*kw.get("pools", POOLS), *kw.get("args", ()))
            return open_site(node, name, kw.get("client_version", CURRENT_VERSION), kw.get("client_class", Client))

        with ThreadPoolExecutor(len(named)) as pool:
            futures = [pool.submit(one, name, kw) for name, kw in named]
        started = [f.result() for f in futures if f.exception() is None]
        self.sites.extend(started)  # closed at the end even if another one failed
        for f in futures:
            if f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        return started

    def adopt(self, node: Any, name: str, client_version: int = CURRENT_VERSION) -> Site:
        """A site for a node started with ``start_node``: stopped by ``close_all``."""
        self.owned.append(node)
        site = open_site(node, name, client_version)
        self.sites.append(site)
        return site

    def check_all(self) -> None:
        for site in self.sites:
            if site.alive:
                assert_site_clean(site)

    def close_all(self) -> None:
        try:
            for site in self.sites:
                site.close()
        finally:
            self.sites.clear()
            for node in self.owned:
                node.stop()
            self.owned.clear()


@contextmanager
def sites_of(node_factory: Callable[..., Any], check: bool = True) -> Iterator[Sites]:
    """``Sites`` for one test: on a clean exit every surviving node must be clean."""
    sites = Sites(node_factory)
    try:
        yield sites
        if check:
            sites.check_all()
    finally:
        sites.close_all()


# --------------------------------------------------------------------------- destinations


class Dest:
    """A sentinel-filled destination for spans ``indices`` of one object, registered with a site."""

    def __init__(self, site: Site, layout: Layout, indices: Sequence[int], seed: int, gap: int = 64,
                 reverse: bool = False) -> None:
        self.layout = layout
        self.indices = list(indices)
        size, self.offsets = plan_destination(layout, self.indices, gap, reverse)
        self.buf = sentinel_like(size, seed)
        self.before = self.buf.copy()
        self.region = site.reg(self.buf)
        self.spans = [
            Span(layout.spans[i][0], self.region, off, layout.spans[i][2])
            for i, off in zip(self.indices, self.offsets, strict=True)
        ]

    def expected(self, src: np.ndarray) -> np.ndarray:
        out = self.before.copy()
        for i, off in zip(self.indices, self.offsets, strict=True):
            size = self.layout.spans[i][2]
            out[off : off + size] = self.layout.src_bytes(src, i)
        return out

    def assert_delivered(self, src: np.ndarray) -> None:
        assert_bytes_equal(self.buf, self.expected(src), f"destination of spans {self.indices}")

    def assert_untouched(self) -> None:
        assert_bytes_equal(self.buf, self.before, "destination of a failed deliver")


def expect(outcome: KeyOutcome, status: KeyStatus, code: ErrorCode | None = None) -> None:
    assert outcome.status is status, outcome
    if code is not None:
        assert outcome.code == code, outcome


def deliver_checked(
    site: Site, key: bytes, layout: Layout, src: np.ndarray | None, indices: Sequence[int], *, seed: int,
    request_id: str | None = None, partial: bool = False, code: ErrorCode | None = None,
    deadline_ms: int = 30_000, reverse: bool = False,
) -> KeyOutcome:
    """Deliver spans ``indices`` of ``key`` into a fresh sentinel buffer.

    ``code`` None: must be OK, every byte checked against ``src``. Otherwise must fail with
    ``code`` and leave the destination untouched.
    """
    dst = Dest(site, layout, indices, seed, reverse=reverse)
    out = site.client.deliver({key: dst.spans}, request_id=request_id, partial=partial,
                              deadline_ms=deadline_ms).result(deadline_ms / 1000 + 10)[key]
    if code is None:
        expect(out, OK)
        assert src is not None
        dst.assert_delivered(src)
    else:
        expect(out, FAILED, code)
        dst.assert_untouched()
    return out


def warm_link(a: Site, b: Site, key: bytes, layout: Layout, src: np.ndarray, rid: str) -> None:
    """Hint ``key`` at B and deliver it once through A, so that A's peer session with B exists
    before the test's fault."""
    a.client.submit_hint(rid, b.endpoint, [key]).result(RESULT_TIMEOUT_S)
    deliver_checked(a, key, layout, src, range(len(layout.spans)), seed=900, request_id=rid)


def peer_of(site: Site, endpoint: str) -> dict[str, Any]:
    """The target-side view of the link from ``site``'s node to ``endpoint``."""
    peers: dict[str, Any] = site.stats()["peers"]
    return dict(peers.get(endpoint, {}))


def poll_stats(site: Site, predicate: Callable[[dict[str, Any]], bool], timeout_s: float, what: str) -> dict[str, Any]:
    """Poll ``site``'s stats until ``predicate`` holds; fail (with the last snapshot) after ``timeout_s``."""
    last: dict[str, Any] = {}

    def check() -> bool:
        nonlocal last
        last = site.stats()
        return predicate(last)

    assert wait_until(check, timeout_s, 0.02), f"{what}: not within {timeout_s}s; last stats {last}"
    return last
