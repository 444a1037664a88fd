"""Two network namespaces joined by a veth pair, made and removed by the test itself.

Needs root and iproute2 (``ip netns``); ``namespaces`` skips the test with the reason
otherwise. The names carry this process's id, so two test processes do not collide; the
namespaces (and with them the veth pair) are removed afterwards whatever happens. A process
a test starts in a namespace takes its UCX settings from ``Pair.ucx``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from kvcr_testing.fabric import ip


@dataclass(frozen=True)
class Pair:
    """Namespaces ``a`` and ``b``, the veth end in each, and each end's address."""

    a: str
    b: str
    veth_a: str
    veth_b: str
    addr_a: str
    addr_b: str

    def ucx(self, ns: str) -> dict[str, str]:
        """UCX's settings for a process in namespace ``ns`` (``self.a`` or ``self.b``): TCP
        only (across namespaces of one host shared memory or CMA would still work, and hide
        TCP), on that namespace's veth end. The suite's own ``UCX_NET_DEVICES=lo``
        (tests/conftest.py) would keep UCX off the veth pair, out of the other namespace's
        reach."""
        veth = {self.a: self.veth_a, self.b: self.veth_b}[ns]
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": veth}

    def tx_bytes(self, side: str = "a") -> int:
        """Bytes the veth end in namespace ``side`` sent so far (its kernel counter)."""
        ns, veth = (self.a, self.veth_a) if side == "a" else (self.b, self.veth_b)
        info = json.loads(ip("-n", ns, "-s", "-j", "link", "show", veth).stdout)
        return int(info[0]["stats64"]["tx"]["bytes"])


@contextmanager
def namespaces(tag: str, subnet: str) -> Iterator[Pair]:
    """Namespaces ``kvcr<pid><tag>a``/``b`` with ``subnet``.1 and ``subnet``.2 (a /24 of the
    test's own choosing, such as ``10.201.0``) on the two ends of a veth pair."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (the ip command) is not installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    pid = f"{os.getpid() % 100000}"
    pair = Pair(f"kvcr{pid}{tag}a", f"kvcr{pid}{tag}b", f"kva{pid}{tag}", f"kvb{pid}{tag}", f"{subnet}.1", f"{subnet}.2")
    made: list[str] = []
    try:
        done = ip("netns", "add", pair.a, check=False)
        if done.returncode != 0:
            pytest.skip(f"cannot create a network namespace: {done.stderr.strip()}")
        made.append(pair.a)
        ip("netns", "add", pair.b)
        made.append(pair.b)
        ip("link", "add", pair.veth_a, "type", "veth", "peer", "name", pair.veth_b)
        ip("link", "set", pair.veth_a, "netns", pair.a)
        ip("link", "set", pair.veth_b, "netns", pair.b)
        for ns, veth, addr in ((pair.a, pair.veth_a, pair.addr_a), (pair.b, pair.veth_b, pair.addr_b)):
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", veth, "up")
        yield pair
    finally:
        for ns in made:
            ip("netns", "del", ns, check=False)  # takes its end of the veth pair, and so the pair, along
        ip("link", "del", pair.veth_a, check=False)  # in case it never left the root namespace
