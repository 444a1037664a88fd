"""The disk tier against a real ``kvcr-node`` (architecture §9): a node with a memory pool
and a disk pool of the same slot size copies what it would evict next to the disk pool's
file through NIXL's POSIX backend, so that objects the memory pool evicts stay held; a
query names their tier ``disk``, and a deliver reads them back into memory and lands byte
for byte. Bytes changed in the file by hand are found by their digests when read back, and
never served; a key deposited anew replaces its copy; the node's claims, slots and tables
are back at rest after every test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcr_client import Client, KeyStatus, LeaseStatus, Presence, Span
from kvcr_node.config import ConfigError, NodeConfig
from kvcr_node.poolspec import PoolSpec
from kvcr_node.read_backs import READ_BACK_CHUNK_BYTES
from kvcr_testing.health import DISK_SETTLE_S, assert_clean, disk_tier, stats, wait_until
from kvcr_testing.health import disk_settled as settled
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Layout, Registrar, plain_layout
from kvcr_testing.nodes import NodeProcess
from kvcr_testing.patterns import KiB, pattern
from kvcr_testing.scrape import metrics_port, sample
from kvcr_testing.scrape import settled as scraped

SLOT = 16 * KiB
MEMORY_SLOTS = 16
DISK_SLOTS = 64
LAYOUT = plain_layout(2, "kv", SLOT)
OBJECTS = 20
"""Objects of two slots deposited into a pool of 16 slots: the first dozen are evicted."""


@pytest.fixture(params=["integrity", "no-integrity"])
def disk_node(node_factory: Callable[..., NodeProcess], tmp_path: Path,
              request: pytest.FixtureRequest) -> Iterator[tuple[NodeProcess, Path]]:
    """A node with a disk tier; with ``integrity`` off too: its copies get digests all the same."""
    node = node_factory("--pool", f"kv:{SLOT // KiB}KiB:{MEMORY_SLOTS}",
                        "--pool", f"kv-disk:{SLOT // KiB}KiB:{DISK_SLOTS}:disk:{tmp_path}", f"--{request.param}")
    yield node, tmp_path / "kv-disk.kvcr-pool"


def deposit_all(client: Client, register: Registrar, tag: str, seed: int) -> tuple[list[bytes], np.ndarray]:
    """Deposit ``OBJECTS`` objects one by one, letting the copies of each turn be written
    before the next deposit evicts (a node fed faster evicts some uncopied: a miss, no harm)."""
    src = pattern(LAYOUT.nbytes * OBJECTS, seed)
    region = register(src)
    keys = [f"{tag}/{i}".encode() for i in range(OBJECTS)]
    for i, key in enumerate(keys):
        res = client.deposit({key: LAYOUT.source_spans(region, i * LAYOUT.nbytes)}).result(RESULT_TIMEOUT_S)
        assert res[key].status is KeyStatus.STORED, res
        settled(client)
    return keys, src


def on_disk(client: Client, keys: list[bytes]) -> list[bytes]:
    """The keys a query finds held in the disk tier only."""
    answers = client.query(keys).result(RESULT_TIMEOUT_S)
    return [k for k in keys if answers[k].tier == "disk"]


def deliver(client: Client, register: Registrar, key: bytes) -> tuple[Any, np.ndarray]:
    dst = np.zeros(LAYOUT.nbytes, np.uint8)
    region = register(dst)
    res = client.deliver({key: [Span(name, region, off, SLOT) for name, off in zip(LAYOUT.names, LAYOUT.offsets,
                                                                                   strict=True)]})
    return res.result(RESULT_TIMEOUT_S)[key], dst


def deliver_together(client: Client, register: Registrar, layout: Layout, wanted: list[bytes], keys: list[bytes],
                     src: np.ndarray) -> None:
    """Deliver ``wanted`` in one call into one buffer, every key ``OK`` and byte for byte
    what was deposited (``src``, the objects of ``keys`` one after another)."""
    size = layout.nbytes
    dst = np.zeros(size * len(wanted), np.uint8)
    region = register(dst)
    res = client.deliver({
        key: [Span(name, region, j * size + offset, length) for (name, _, length), offset in zip(
            layout.spans, layout.offsets, strict=True)]
        for j, key in enumerate(wanted)}).result(RESULT_TIMEOUT_S)
    assert res.all_ok, dict(res)
    for j, key in enumerate(wanted):
        i = keys.index(key)
        assert np.array_equal(dst[j * size:(j + 1) * size], src[i * size:(i + 1) * size]), f"{key!r} came back changed"


def test_evicted_objects_stay_on_disk_and_come_back_byte_for_byte(
    disk_node: tuple[NodeProcess, Path],
) -> None:
    node, _ = disk_node
    with Client(node.endpoint, name="disk-tier") as client:
        register = Registrar(client)
        keys, src = deposit_all(client, register, "t", seed=3)
        st = stats(client)
        assert st["pools"]["kv"]["free"] + st["pools"]["kv"]["allocated"] == MEMORY_SLOTS
        assert sum(st["evictions"].values()) >= OBJECTS - MEMORY_SLOTS // 2
        assert "kv-disk" not in st["pools"], "a disk pool is not one clients may name"
        answers = client.query(keys).result(RESULT_TIMEOUT_S)
        on_disk = [k for k in keys if answers[k].tier == "disk"]
        in_memory = [k for k in keys if answers[k].tier == "dram"]
        assert all(answers[k].presence is Presence.HIT for k in keys), dict(answers)
        assert len(on_disk) >= OBJECTS - MEMORY_SLOTS // 2 and len(on_disk) + len(in_memory) == OBJECTS

        for key in on_disk[:6]:
            outcome, dst = deliver(client, register, key)
            assert outcome.ok, outcome
            i = keys.index(key)
            assert np.array_equal(dst, src[i * LAYOUT.nbytes:(i + 1) * LAYOUT.nbytes]), f"{key!r} came back changed"
            assert client.query([key]).result(RESULT_TIMEOUT_S)[key].tier == "dram", "read back into memory"
        figures = settled(client)
        assert figures["promoted"] == 6 and figures["mismatched"] == 0 and figures["promotions_failed"] == 0
        assert figures["dropped"] == 0, "a copy read back stays: a later eviction needs no second write"
        assert figures["demoted"] >= len(on_disk)
        # io_uring where the kernel allows it (this machine's does), else Linux AIO: named either way.
        assert figures["io"] in ("uring", "aio"), figures
        assert_clean(client)


def test_bytes_changed_on_disk_are_never_served(
    disk_node: tuple[NodeProcess, Path],
) -> None:
    node, file = disk_node
    with Client(node.endpoint, name="disk-tamper") as client:
        register = Registrar(client)
        keys, _ = deposit_all(client, register, "x", seed=5)
        evicted = on_disk(client, keys)
        assert evicted
        changed = 255 - np.fromfile(file, np.uint8)  # every copy's bytes changed in place, by hand
        with open(file, "r+b") as f:
            f.write(changed.tobytes())
        assert file.stat().st_size == DISK_SLOTS * SLOT
        for key in evicted:
            outcome, dst = deliver(client, register, key)
            assert not outcome.ok, f"{key!r} served from a changed file"
            assert outcome.code.name == "NOT_FOUND", outcome
            assert not dst.any(), "nothing of a changed copy reaches the destination"
        figures = settled(client)
        assert figures["mismatched"] == len(evicted) and figures["promoted"] == 0
        answers = client.query(evicted).result(RESULT_TIMEOUT_S)
        assert all(answers[k].presence is Presence.MISS for k in evicted), "a dropped copy is not held"
        assert_clean(client)


def test_a_key_deposited_anew_replaces_its_copy(
    disk_node: tuple[NodeProcess, Path],
) -> None:
    node, _ = disk_node
    with Client(node.endpoint, name="disk-anew") as client:
        register = Registrar(client)
        keys, _ = deposit_all(client, register, "n", seed=7)
        key = on_disk(client, keys)[0]
        fresh = pattern(LAYOUT.nbytes, 99)
        region = register(fresh)
        res = client.deposit({key: LAYOUT.source_spans(region)}).result(RESULT_TIMEOUT_S)
        assert res[key].status is KeyStatus.STORED, res
        before = settled(client)["dropped"]
        assert before >= 1, "the old copy stays"
        outcome, dst = deliver(client, register, key)
        assert outcome.ok and np.array_equal(dst, fresh), "the bytes stored last are served"
        settled(client)
        assert_clean(client)


def test_a_disk_pool_is_checked_before_the_node_starts(tmp_path: Path) -> None:
    memory = (PoolSpec("kv", SLOT, MEMORY_SLOTS),)
    for disk, field, why in (
        (PoolSpec("d", 2 * SLOT, 4, f"disk:{tmp_path}"), "disk_pools[0].slot_size", "no DRAM pool has slots"),
        (PoolSpec("d", SLOT, 4, f"disk:{tmp_path / 'absent'}"), "disk_pools[0].memory", "is not a directory"),
        (PoolSpec("kv", SLOT, 4, f"disk:{tmp_path}"), "disk_pools[0].name", "declared twice"),
    ):
        with pytest.raises(ConfigError, match=why) as caught:
            NodeConfig(pools=memory, disk_pools=(disk,)).validated()
        assert caught.value.field == field
    gpu = (PoolSpec("kv", SLOT, MEMORY_SLOTS, "hbm:0"),)
    with pytest.raises(ConfigError, match="no DRAM pool"):
        NodeConfig(pools=gpu, disk_pools=(PoolSpec("d", SLOT, 4, f"disk:{tmp_path}"),)).validated()
    for mark in (0, 1.5, True):
        with pytest.raises(ConfigError) as caught:
            NodeConfig(pools=memory, disk_demote_mark=mark).validated()
        assert caught.value.field == "disk_demote_mark"


def test_a_lease_reads_a_key_back_and_a_later_lease_holds_it(disk_node: tuple[NodeProcess, Path]) -> None:
    """An engine leases before it delivers: a key held only on disk answers ``PENDING`` while
    it is read back (spec section 6.11), and the next lease holds it and grants its slots,
    which the client READs itself, byte for byte."""
    node, _ = disk_node
    with Client(node.endpoint, name="disk-lease") as client:
        register = Registrar(client)
        keys, src = deposit_all(client, register, "l", seed=11)
        key = on_disk(client, keys)[0]
        lease = client.lease([key], ttl_ms=30_000).result(RESULT_TIMEOUT_S)
        assert lease.status(key) is LeaseStatus.PENDING  # holding nothing, the lease is over at once
        settled(client)
        lease = client.lease([key], ttl_ms=30_000).result(RESULT_TIMEOUT_S)
        assert lease.status(key) is LeaseStatus.LEASED
        reads = client.counters()["grant_reads"]
        outcome, dst = deliver(client, register, key)
        i = keys.index(key)
        assert outcome.ok and np.array_equal(dst, src[i * LAYOUT.nbytes:(i + 1) * LAYOUT.nbytes])
        assert client.counters()["grant_reads"] == reads + 1, "read under the lease's grant"
        lease.release().result(RESULT_TIMEOUT_S)
        assert_clean(client)


def test_a_deliver_that_reads_keys_back_keeps_its_own_keys_in_memory(disk_node: tuple[NodeProcess, Path]) -> None:
    """One deliver names a key in memory that eviction would take next and keys held on disk
    only: reading those back makes room by eviction, which must take other objects, not the
    key the same deliver is about to send (it would fail ``NOT_FOUND`` though it was held)."""
    node, _ = disk_node
    with Client(node.endpoint, name="disk-own-keys") as client:
        register = Registrar(client)
        keys, src = deposit_all(client, register, "own", seed=9)
        answers = client.query(keys).result(RESULT_TIMEOUT_S)
        in_memory = [k for k in keys if answers[k].tier == "dram"]
        evicted = [k for k in keys if answers[k].tier == "disk"]
        assert len(in_memory) == MEMORY_SLOTS // 2 and len(evicted) >= 4, dict(answers)
        # Deposited first and never read since: the least recently used, eviction's next.
        wanted = [in_memory[0], *evicted[:4]]
        deliver_together(client, register, LAYOUT, wanted, keys, src)
        figures = settled(client)
        assert figures["promoted"] == 4 and figures["mismatched"] == 0
        assert_clean(client)


def test_with_promotion_off_what_is_read_back_is_read_through(
    node_factory: Callable[..., NodeProcess], tmp_path: Path,
) -> None:
    """``--no-disk-promote``: a key read back from disk for a deliver or a lease is served byte
    for byte, then leaves memory again (its copy stays on disk, so it is read back each time),
    and takes no room from the objects that are in memory."""
    node = node_factory("--pool", f"kv:{SLOT // KiB}KiB:{MEMORY_SLOTS}",
                        "--pool", f"kv-disk:{SLOT // KiB}KiB:{DISK_SLOTS}:disk:{tmp_path}", "--no-disk-promote")
    with Client(node.endpoint, name="disk-read-through") as client:
        register = Registrar(client)
        keys, src = deposit_all(client, register, "rt", seed=13)
        key = on_disk(client, keys)[0]
        i = keys.index(key)
        for _ in range(2):
            outcome, dst = deliver(client, register, key)
            assert outcome.ok and np.array_equal(dst, src[i * LAYOUT.nbytes:(i + 1) * LAYOUT.nbytes]), outcome
            assert client.query([key]).result(RESULT_TIMEOUT_S)[key].tier == "disk", "read through, not kept"
        lease = client.lease([key], ttl_ms=30_000).result(RESULT_TIMEOUT_S)
        assert lease.status(key) is LeaseStatus.PENDING
        settled(client)
        lease = client.lease([key], ttl_ms=30_000).result(RESULT_TIMEOUT_S)
        assert lease.status(key) is LeaseStatus.LEASED, "read back, it stays for the reader that comes next"
        outcome, dst = deliver(client, register, key)
        assert outcome.ok and np.array_equal(dst, src[i * LAYOUT.nbytes:(i + 1) * LAYOUT.nbytes]), outcome
        lease.release().result(RESULT_TIMEOUT_S)
        assert client.query([key]).result(RESULT_TIMEOUT_S)[key].tier == "disk", "gone from memory with the lease"
        figures = settled(client)
        assert figures["promoted"] == 3 and figures["mismatched"] == 0 and figures["dropped"] == 0
        assert_clean(client)


def test_a_deliver_of_many_objects_on_disk_is_read_back_in_several_transfers(
    node_factory: Callable[..., NodeProcess], tmp_path: Path,
) -> None:
    """A deliver whose objects on disk add up to more than ``READ_BACK_CHUNK_BYTES`` reads them
    back in several transfers, each one's objects checked and delivered as it ends (while the
    later ones are still read): every byte lands, and the node is at rest after."""
    slot = 512 * KiB
    layout = plain_layout(2, "kv", slot)
    objects, memory_objects = 20, 8
    node = node_factory("--pool", f"kv:{slot // KiB}KiB:{2 * memory_objects}",
                        "--pool", f"kv-disk:{slot // KiB}KiB:{2 * objects}:disk:{tmp_path}", "--metrics-port", "0")
    port = metrics_port(node)
    with Client(node.endpoint, name="disk-chunks") as client:
        register = Registrar(client)
        src = pattern(layout.nbytes * objects, 17)
        region = register(src)
        keys = [f"c/{i}".encode() for i in range(objects)]
        for i, key in enumerate(keys):
            assert client.deposit({key: layout.source_spans(region, i * layout.nbytes)}).result(RESULT_TIMEOUT_S).all_ok
            settled(client)
        wanted = on_disk(client, keys)[:memory_objects]
        assert len(wanted) * layout.nbytes > READ_BACK_CHUNK_BYTES, "the read backs need more than one transfer"
        deliver_together(client, register, layout, wanted, keys, src)
        chunks = -(-len(wanted) * layout.nbytes // READ_BACK_CHUNK_BYTES)
        scraped(port, lambda s: sample(s, "kvcr_disk_tier_transfer_seconds_count", ("op", "read")) == chunks)
        figures = settled(client)
        assert figures["promoted"] == len(wanted) and figures["mismatched"] == 0
        assert_clean(client)


def test_a_large_object_is_read_back_in_pieces_and_a_change_in_its_last_one_is_never_served(
    node_factory: Callable[..., NodeProcess], tmp_path: Path,
) -> None:
    """An object larger than ``READ_BACK_CHUNK_BYTES`` is read back as several transfers, each
    one's spans checked as it lands (``kvcr_node.read_backs``): it lands byte for byte. Another
    whose last span was changed on disk by hand passes the checks of its first pieces, and is
    still never served: nothing of it reaches the destination, and its copy is dropped."""
    slot = 1 << 20
    spans = 10
    layout = plain_layout(spans, "kv", slot)
    pieces = -(-layout.nbytes // READ_BACK_CHUNK_BYTES)
    assert pieces >= 3
    node = node_factory("--pool", f"kv:1MiB:{spans + 2}", "--pool", f"kv-disk:1MiB:{4 * spans}:disk:{tmp_path}",
                        "--metrics-port", "0")
    port = metrics_port(node)
    file = tmp_path / "kv-disk.kvcr-pool"
    with Client(node.endpoint, name="disk-pieces") as client:
        register = Registrar(client)
        src = pattern(layout.nbytes * 3, 29)
        region = register(src)
        keys = [b"big/0", b"big/1", b"big/2"]
        for i, key in enumerate(keys):  # each deposit evicts the one before: copied, it stays on disk
            assert client.deposit({key: layout.source_spans(region, i * layout.nbytes)}).result(RESULT_TIMEOUT_S).all_ok
            # The pool holds one object: the next deposit finds no room while this one's copy
            # is written (claimed), so wait for the copy itself, not only for a tier at rest,
            # which it also is in the turns before the copy starts.
            assert wait_until(lambda n=i + 1: disk_tier(client)["demoted"] == n, DISK_SETTLE_S), disk_tier(client)
            settled(client)
        assert on_disk(client, keys) == keys[:2]
        # Change big/1's last span in the file, found there by its bytes.
        last = src[2 * layout.nbytes - slot:2 * layout.nbytes]
        on_file = np.fromfile(file, np.uint8).reshape(-1, slot)
        [at] = [j for j in range(len(on_file)) if np.array_equal(on_file[j], last)]
        with open(file, "r+b") as f:
            f.seek(at * slot)
            f.write((255 - last).tobytes())
        deliver_together(client, register, layout, [b"big/0"], keys, src)
        scraped(port, lambda s: sample(s, "kvcr_disk_tier_transfer_seconds_count", ("op", "read")) == pieces)
        dst = np.zeros(layout.nbytes, np.uint8)
        sink = register(dst)
        outcome = client.deliver({b"big/1": [Span(name, sink, off, slot) for name, off in zip(
            layout.names, layout.offsets, strict=True)]}).result(RESULT_TIMEOUT_S)[b"big/1"]
        assert not outcome.ok and outcome.code.name == "NOT_FOUND", outcome
        assert not dst.any(), "nothing of a changed copy reaches the destination"
        figures = settled(client)
        assert figures["mismatched"] == 1 and figures["promoted"] == 1 and figures["promotions_failed"] == 1
        assert client.query([b"big/1"]).result(RESULT_TIMEOUT_S)[b"big/1"].presence is Presence.MISS
        assert_clean(client)
