"""Hostile use of the disk tier (architecture §9): clients that ask for far more disk-only keys
than the memory pools hold, at once and over and over, leasing and delivering. Each key is
served byte for byte or missed, never other bytes; and once they stop, the node's claims,
slots, tables, descriptors and memory are back within bounds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvcr_client import Client, KeyStatus, LeaseStatus, Span
from kvcr_protocol import ErrorCode
from kvcr_testing.health import DISK_SETTLE_S, assert_clean, disk_tier, stats, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Registrar, plain_layout
from kvcr_testing.measure import fd_count, rss_kib, thread_count
from kvcr_testing.nodes import NodeProcess
from kvcr_testing.patterns import KiB, pattern

SLOT = 16 * KiB
MEMORY_SLOTS = 16
DISK_SLOTS = 256
LAYOUT = plain_layout(2, "kv", SLOT)
OBJECTS = 100
"""Objects of two slots: eight fit the memory pool, every one fits the disk pool."""
ROUNDS = 12
RSS_SLACK_KIB = 24 << 10
FD_SLACK = 4


def at_rest(client: Client) -> bool:
    figures = disk_tier(client)
    return bool(figures["demoting"] == 0 and figures["promoting"] == 0 and stats(client)["operations_pending"] == 0)


def test_more_disk_keys_than_memory_holds_are_served_or_missed_and_nothing_leaks(
        node_factory: Callable[..., NodeProcess], tmp_path: Path) -> None:
    node = node_factory("--pool", f"kv:{SLOT // KiB}KiB:{MEMORY_SLOTS}",
                        "--pool", f"kv-disk:{SLOT // KiB}KiB:{DISK_SLOTS}:disk:{tmp_path}", "--disk-demote-mark", "1")
    pid = node.proc.pid
    src = pattern(LAYOUT.nbytes * OBJECTS, 41)
    keys = [b"t/%d" % i for i in range(OBJECTS)]
    with Client(node.endpoint, name="thrash") as client:
        register = Registrar(client)
        region = register(src)
        for i, key in enumerate(keys):  # one by one, each copy written before the next evicts
            res = client.deposit({key: LAYOUT.source_spans(region, i * LAYOUT.nbytes)}).result(RESULT_TIMEOUT_S)
            assert res[key].status is KeyStatus.STORED
            assert wait_until(lambda: at_rest(client), DISK_SETTLE_S)
        answers = client.query(keys).result(RESULT_TIMEOUT_S)
        assert sum(answers[k].tier == "disk" for k in keys) >= OBJECTS - MEMORY_SLOTS // 2
        dst = np.zeros(LAYOUT.nbytes * OBJECTS, np.uint8)
        sink = register(dst)
        spans = {k: [Span(name, sink, i * LAYOUT.nbytes + off, SLOT)
                     for name, off in zip(LAYOUT.names, LAYOUT.offsets, strict=True)] for i, k in enumerate(keys)}
        base = {"fds": fd_count(pid), "threads": thread_count(pid), "rss": 0}
        served = missed = 0
        for round_ in range(ROUNDS):
            # Every key at once, a dozen times the memory pool: read backs that find no room
            # are misses; what is delivered is exactly its bytes.
            dst[:] = 0
            results = client.deliver(spans).result(RESULT_TIMEOUT_S)
            for i, key in enumerate(keys):
                got = dst[i * LAYOUT.nbytes:(i + 1) * LAYOUT.nbytes]
                if results[key].ok:
                    assert np.array_equal(got, src[i * LAYOUT.nbytes:(i + 1) * LAYOUT.nbytes]), (round_, key)
                    served += 1
                else:
                    assert results[key].code == ErrorCode.NOT_FOUND, results[key]
                    assert not got.any(), (round_, key, "bytes of a missed key")
                    missed += 1
            # Then a lease of every key: the disk-only ones are read back (PENDING), the others
            # held; released at once.
            lease = client.lease(keys, ttl_ms=30_000).result(RESULT_TIMEOUT_S)
            statuses = {lease.status(k) for k in keys}
            assert statuses <= {LeaseStatus.LEASED, LeaseStatus.PENDING, LeaseStatus.MISS, LeaseStatus.LEASE_LIMIT}, statuses
            if lease.held:
                lease.release().result(RESULT_TIMEOUT_S)
            assert wait_until(lambda: at_rest(client), DISK_SETTLE_S)
            if round_ == 1:
                base["rss"] = rss_kib(pid)  # after the first rounds grew what a round needs
        figures = disk_tier(client)
        assert served > 0 and missed > 0, (served, missed)
        assert figures["mismatched"] == 0 and figures["promotions_failed"] == 0, figures
        st = assert_clean(client)
        assert all(n <= 2 * OBJECTS for n in st["tables"].values()), st["tables"]
        assert fd_count(pid) <= base["fds"] + FD_SLACK and thread_count(pid) <= base["threads"]
        assert rss_kib(pid) <= base["rss"] + RSS_SLACK_KIB, (base["rss"], rss_kib(pid))
        register.close()
