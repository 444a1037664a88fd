"""A DRAM pool's memory: a running node's pools are mappings the kernel may back with
transparent huge pages (``madvise`` mode grants them only to mappings that ask), which the
kernel reports per mapping (``THPeligible`` in ``/proc/PID/smaps``)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcr_client import Client
from kvcr_node.memory import PoolAllocationError, PoolMemory
from kvcr_node.poolspec import PoolSpec

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
POOL_KIB = 16 * 1024


def thp_mode() -> str:
    try:
        return re.search(r"\[(\w+)\]", THP.read_text()).group(1)  # type: ignore[union-attr]
    except (OSError, AttributeError):
        return "absent"


def mappings(pid: int, size_kib: int) -> list[dict[str, str]]:
    """The mappings of ``size_kib`` in process ``pid``, each as its smaps fields."""
    out, current = [], None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            current = {}
            out.append(current)
        elif current is not None and ":" in line:
            name, _, value = line.partition(":")
            current[name] = value.strip()
    return [m for m in out if m.get("Size") == f"{size_kib} kB"]


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"), reason=f"transparent huge pages are {thp_mode()} here")
def test_a_nodes_dram_pool_may_be_backed_by_huge_pages(node_factory: Callable[..., Any]) -> None:
    node = node_factory("--pool", f"kv:64KiB:{POOL_KIB // 64}")
    with Client(node.endpoint, name="thp") as client:
        assert client.stats(audit=True).result(10)["invariants"] == []
    pools = mappings(node.proc.pid, POOL_KIB)
    assert pools, "no mapping of the pool's size in the node"
    assert all(m.get("THPeligible") == "1" for m in pools), pools


def test_a_nodes_dram_pool_is_resident_from_the_start(node_factory: Callable[..., Any]) -> None:
    """Every page of a pool is faulted in at start: no transfer pays a page's first fault."""
    node = node_factory("--pool", f"kv:64KiB:{POOL_KIB // 64}")
    with Client(node.endpoint, name="resident") as client:
        assert client.stats(audit=True).result(10)["invariants"] == []
    pools = mappings(node.proc.pid, POOL_KIB)
    assert pools, "no mapping of the pool's size in the node"
    assert all(m.get("Rss") == f"{POOL_KIB} kB" for m in pools), pools


def test_a_pool_larger_than_the_memory_left_is_refused_by_name() -> None:
    """The pools share what the host has: one past it is refused, naming it, before any page
    is faulted in (the kernel would otherwise end the process midway)."""
    spec = PoolSpec("big", 64 * 1024, 65)
    with pytest.raises(PoolAllocationError, match=r"pool 'big' .*4194304 bytes available"):
        PoolMemory(spec, available=4 * 1024 * 1024)
    small = PoolMemory(PoolSpec("small", 64 * 1024, 64), available=4 * 1024 * 1024)
    try:
        assert int(small.array[:: 4096].sum()) == 0  # resident and still zero
    finally:
        small.close()
