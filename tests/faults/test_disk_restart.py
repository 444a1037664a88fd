"""A node restarted on its disk pools keeps its disk tier (architecture §9), tried with real
processes: stopped, killed -9 while it copies objects to disk, with its journal's records
or its pool file's bytes changed by hand, and pointed at a directory another node holds or
with other disk pools. Every copy taken back is served byte for byte; nothing torn, changed
or unverifiable is ever served.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcr_client import Client, KeyStatus, Presence, Span
from kvcr_client.events import EventStream, InventoryMirror
from kvcr_node.disk_pools import STATE_DIR
from kvcr_node.journal import FILE_MAGIC, state_files
from kvcr_protocol import ErrorCode
from kvcr_testing.health import DISK_SETTLE_S, assert_clean, stats, wait_until
from kvcr_testing.health import disk_settled as settled
from kvcr_testing.health import disk_tier as tier
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Registrar, plain_layout
from kvcr_testing.nodes import NodeProcess, start_node
from kvcr_testing.patterns import KiB, pattern
from kvcr_testing.scrape import metrics_port, sample
from kvcr_testing.scrape import settled as scrape_settled

SLOT = 16 * KiB
MEMORY_SLOTS = 16
DISK_SLOTS = 128
LAYOUT = plain_layout(2, "kv", SLOT)


class Site:
    """One node's endpoint and disk directory, across its restarts."""

    def __init__(self, ipc_dir: Path, tmp_path: Path) -> None:
        self.endpoint = f"ipc://{ipc_dir}/disk-restart.sock"
        self.events = f"ipc://{ipc_dir}/disk-restart-events.sock"
        self.disk = tmp_path / "disk"
        self.disk.mkdir()
        self.pools = ("--pool", f"kv:{SLOT // KiB}KiB:{MEMORY_SLOTS}",
                      "--pool", f"kv-disk:{SLOT // KiB}KiB:{DISK_SLOTS}:disk:{self.disk}")
        self.nodes: list[NodeProcess] = []

    def start(self, *extra: str) -> NodeProcess:
        node = start_node(self.endpoint, *self.pools, "--events-endpoint", self.events, *extra)
        self.nodes.append(node)
        return node

    def refused(self, *pools: str) -> str:
        """Start a node on the disk directory with ``pools``: it must refuse, in one line."""
        args = [sys.executable, "-m", "kvcr_node.cli", "--endpoint", self.endpoint + ".other", *pools]
        out = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    def close(self) -> None:
        for node in self.nodes:
            node.kill()


@pytest.fixture
def site(ipc_dir: Path, tmp_path: Path) -> Iterator[Site]:
    s = Site(ipc_dir, tmp_path)
    yield s
    s.close()


class Objects:
    """Patterned objects deposited one after another; those acknowledged STORED, in order."""

    def __init__(self, client: Client, n: int, tag: str, seed: int) -> None:
        self.src = pattern(LAYOUT.nbytes * n, seed)
        self.region = client.register(self.src)
        self.client = client
        self.keys = [f"{tag}/{i}".encode() for i in range(n)]
        self.acked: list[bytes] = []

    def bytes_of(self, key: bytes) -> np.ndarray:
        i = self.keys.index(key)
        return self.src[i * LAYOUT.nbytes:(i + 1) * LAYOUT.nbytes]

    def deposit(self, settle: bool = True) -> None:
        """Each in turn; ``settle``: the copies of each turn written before the next deposit."""
        for i, key in enumerate(self.keys):
            try:
                out = self.client.deposit({key: LAYOUT.source_spans(self.region, i * LAYOUT.nbytes)}).result(5.0)
            except Exception:
                return  # the node was killed
            if out[key].status is not KeyStatus.STORED:
                return
            self.acked.append(key)
            if settle:
                settled(self.client)


def deliver(client: Client, register: Registrar, key: bytes) -> tuple[Any, np.ndarray]:
    dst = pattern(LAYOUT.nbytes, 99)
    region = register(dst)
    spans = [Span(name, region, off, SLOT) for name, off in zip(LAYOUT.names, LAYOUT.offsets, strict=True)]
    return client.deliver({key: spans}).result(RESULT_TIMEOUT_S)[key], dst


def served(client: Client, objects: Objects, restarted: bool = True) -> list[bytes]:
    """Every key a query finds is delivered, one at a time, with exactly its bytes; the keys
    served. ``restarted``: the node has just started, so what it holds is on disk and stays
    there (read backs evict nothing a copy does not keep); else a read back may evict, and a
    key found may be gone by its turn (a miss, never other bytes)."""
    register = Registrar(client)
    answers = client.query(objects.keys).result(RESULT_TIMEOUT_S)
    held = [k for k in objects.keys if answers[k].presence is Presence.HIT]
    assert not restarted or all(answers[k].tier == "disk" for k in held), "memory pools start empty"
    out = []
    for key in held:
        outcome, dst = deliver(client, register, key)
        if not restarted and outcome.code == ErrorCode.NOT_FOUND:
            continue
        assert outcome.ok, (key, outcome)
        assert np.array_equal(dst, objects.bytes_of(key)), f"{key!r} came back changed"
        out.append(key)
    register.close()
    return out


def test_a_stopped_node_comes_back_with_its_disk_tier(site: Site) -> None:
    node = site.start()
    with Client(site.endpoint, name="before") as client:
        objects = Objects(client, 24, "a", seed=3)
        objects.deposit()
        before = settled(client)
        assert before["copies"] >= 24 - MEMORY_SLOTS // 2
        answers = client.query(objects.keys).result(RESULT_TIMEOUT_S)
        only_on_disk = [k for k in objects.keys if answers[k].tier == "disk"]
        assert len(only_on_disk) >= 24 - MEMORY_SLOTS // 2
    assert node.stop() == 0
    node = site.start("--metrics-port", "0")
    with Client(site.endpoint, name="after") as client:
        figures = tier(client)
        assert figures["recovery"]["recovered"] == before["copies"] and figures["recovery"]["dropped"] == {}
        assert figures["journal"]["held"] == before["copies"]
        held = served(client, objects)
        assert len(held) == before["copies"] and set(only_on_disk) <= set(held)
        after = settled(client)
        assert after["promoted"] == len(held) and after["mismatched"] == 0
        assert after["moved_bytes"]["promoted"] == len(held) * LAYOUT.nbytes
        port = metrics_port(node)
        scraped = scrape_settled(port, lambda s: sample(s, "kvcr_disk_tier_moves_total", ("outcome", "promoted"))
                                 == len(held))
        assert sample(scraped, "kvcr_disk_tier_recovered") == before["copies"]
        assert sample(scraped, "kvcr_disk_tier_recovery_dropped", ("reason", "torn")) == 0
        assert sample(scraped, "kvcr_disk_tier_moved_bytes_total", ("direction", "promoted")) == len(held) * LAYOUT.nbytes
        assert sample(scraped, "kvcr_disk_tier_transfer_seconds_count", ("op", "read")) >= 1
        assert_clean(client)
    assert node.stop() == 0


def test_kill_9_while_copies_are_written_serves_only_what_was_copied_whole(site: Site) -> None:
    """Deposits as fast as the node takes them keep copies in flight; killed twice, the
    node takes back what its journal committed, every byte of it, and reads back nothing
    that does not match."""
    rounds: list[Objects] = []
    for round_ in range(2):
        node = site.start()
        client = Client(site.endpoint, name=f"burst-{round_}")
        objects = Objects(client, 400, f"r{round_}", seed=10 + round_)
        rounds.append(objects)
        thread = threading.Thread(target=objects.deposit, args=(False,), daemon=True)
        thread.start()
        assert wait_until(lambda o=objects: len(o.acked) >= 60, 60.0)  # type: ignore[misc]
        assert wait_until(lambda c=client: tier(c)["demoting"] > 0 or tier(c)["demoted"] > 40, 60.0)  # type: ignore[misc]
        node.kill()
        thread.join(30.0)
        client.close()
    node = site.start()
    with Client(site.endpoint, name="after") as client:
        figures = tier(client)
        assert figures["recovery"]["recovered"] > 0, figures
        assert set(figures["recovery"]["dropped"]) <= {"torn"}, figures
        held = [key for objects in rounds for key in served(client, objects)]
        assert len(held) == figures["recovery"]["recovered"]
        after = settled(client)
        assert after["mismatched"] == 0 and after["promotions_failed"] == 0, after
        assert_clean(client)
    assert node.stop() == 0


def test_a_flipped_record_is_dropped_and_changed_bytes_are_never_served(site: Site) -> None:
    node = site.start()
    with Client(site.endpoint, name="fill") as client:
        objects = Objects(client, 24, "f", seed=7)
        objects.deposit()
        copies = settled(client)["copies"]
    assert node.stop() == 0
    journal = [p for _, kind, p in state_files(site.disk / STATE_DIR) if kind == "journal"][-1]
    data = bytearray(journal.read_bytes())
    data[len(FILE_MAGIC) + 40] ^= 0x5A
    journal.write_bytes(bytes(data))
    node = site.start()
    with Client(site.endpoint, name="after") as client:
        figures = tier(client)
        assert figures["recovery"]["dropped"] == {"corrupt": 1}
        assert figures["recovery"]["recovered"] == copies - 1
        assert len(served(client, objects)) == copies - 1
        assert_clean(client)
    assert node.stop() == 0
    # Every byte of the pool's file changed by hand: the records vouch for the slots, the
    # digests checked on read back for the bytes, so nothing is served.
    file = site.disk / "kv-disk.kvcr-pool"
    changed = 255 - np.fromfile(file, np.uint8)
    changed.tofile(file)
    node = site.start()
    with Client(site.endpoint, name="changed") as client:
        assert tier(client)["recovery"]["recovered"] > 0
        register = Registrar(client)
        answers = client.query(objects.keys).result(RESULT_TIMEOUT_S)
        for key in [k for k in objects.keys if answers[k].presence is Presence.HIT]:
            outcome, dst = deliver(client, register, key)
            assert not outcome.ok and outcome.code == ErrorCode.NOT_FOUND, (key, outcome)
            assert np.array_equal(dst, pattern(LAYOUT.nbytes, 99)), "nothing of a changed copy reaches the destination"
        after = settled(client)
        assert after["mismatched"] == after["recovery"]["recovered"] and after["promoted"] == 0
        assert after["copies"] == 0
        register.close()
        assert_clean(client)
    assert node.stop() == 0


def test_a_second_node_and_other_disk_pools_are_refused_with_one_line(site: Site) -> None:
    node = site.start()
    assert "is in use by a live node (pid" in site.refused(*site.pools)
    assert node.stop() == 0
    other = (*site.pools[:3], f"kv-disk:{SLOT // KiB}KiB:{2 * DISK_SLOTS}:disk:{site.disk}")
    assert "was written with other pools" in site.refused(*other)
    node = site.start()  # the directory is as it was
    with Client(site.endpoint, name="after") as client:
        assert tier(client)["recovery"]["dropped"] == {}
    assert node.stop() == 0


def follow(stream: EventStream, mirror: InventoryMirror, settled_when: Any) -> bool:
    """Apply what the stream has until ``settled_when()`` holds (bounded)."""
    def caught_up() -> bool:
        for _, batch in stream.recv(0.1):
            mirror.apply(batch)
        return bool(settled_when())
    return wait_until(caught_up, DISK_SETTLE_S)


def test_events_name_each_tier_and_a_restart_publishes_the_copies_it_took_back(site: Site) -> None:
    node = site.start()
    mirror = InventoryMirror()
    with EventStream(site.events) as stream, Client(site.endpoint, name="events") as client:
        objects = Objects(client, 24, "e", seed=5)
        objects.deposit()
        copies = settled(client)["copies"]

        def agrees() -> bool:
            """The mirror says what the node holds: memory where a query says so, disk for
            every copy, and nothing else."""
            answers = client.query(objects.keys).result(RESULT_TIMEOUT_S)
            for key in objects.keys:
                tiers = set(mirror.keys.get(key, {}))
                answer = answers[key]
                if answer.presence is not Presence.HIT:
                    if tiers:
                        return False
                elif ("dram" in tiers) != (answer.tier == "dram") or (answer.tier == "disk" and tiers != {"disk"}):
                    return False
            return sum("disk" in tiers for tiers in mirror.keys.values()) == copies

        assert follow(stream, mirror, agrees), mirror.keys
        assert any(set(tiers) == {"dram", "disk"} for tiers in mirror.keys.values()), "copies of objects in memory"
        assert all(held.pools == ("kv-disk",) for tiers in mirror.keys.values() for t, held in tiers.items()
                   if t == "disk")
    assert node.stop() == 0
    node = site.start()
    mirror = InventoryMirror()
    with EventStream(site.events) as stream, Client(site.endpoint, name="after") as client:
        recovered = tier(client)["recovery"]["recovered"]
        assert recovered == copies
        assert follow(stream, mirror, lambda: len(mirror.keys) == recovered), len(mirror.keys)
        assert all(set(tiers) == {"disk"} for tiers in mirror.keys.values())
        assert set(mirror.keys) <= set(objects.keys)
    assert node.stop() == 0


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs with room for the disk pool's file and 24 KiB more: the journal fills it."""
    mount = tmp_path / "small"
    mount.mkdir()
    size = DISK_SLOTS * SLOT + 24 * KiB
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"a small tmpfs cannot be mounted here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_fails_the_journal_and_the_tier_goes_on(ipc_dir: Path, small_disk: Path) -> None:
    """The copies' space is taken when the pool is opened, so what a full disk refuses is the
    journal's records: each failure is counted, the journal starts again from the copies
    held, and the tier goes on serving; a restart takes back what the last journal holds."""
    site = Site(ipc_dir, small_disk)
    try:
        site.start()
        with Client(site.endpoint, name="fill") as client:
            objects = Objects(client, 300, "full", seed=21)
            objects.deposit()
            figures = settled(client)
            assert figures["journal"]["write_failures"] >= 1, figures["journal"]
            assert figures["demoted"] >= 250 and figures["demotions_failed"] == 0
            held = served(client, objects, restarted=False)
            assert held, "the tier serves on"
            assert_clean(client)
        assert site.nodes[-1].stop() == 0
        site.start()
        with Client(site.endpoint, name="after") as client:
            recovered = tier(client)["recovery"]["recovered"]
            assert len(served(client, objects)) == recovered
            assert settled(client)["mismatched"] == 0
    finally:
        site.close()


def test_the_directory_removed_under_a_running_node(site: Site) -> None:
    """The files stay open, so the copies stay readable; the journal cannot start its next
    file (counted), and the node goes on. A restart on a directory that is gone is refused in
    one line, and on a new one starts empty."""
    node = site.start("--journal-compact-bytes", "4096")
    with Client(site.endpoint, name="removed") as client:
        first = Objects(client, 24, "a", seed=31)
        first.deposit()
        on_disk = [k for k, a in client.query(first.keys).result(RESULT_TIMEOUT_S).items() if a.tier == "disk"]
        assert on_disk
        shutil.rmtree(site.disk)
        second = Objects(client, 60, "b", seed=32)
        second.deposit()
        figures = settled(client)
        assert figures["journal"]["write_failures"] >= 1, figures["journal"]
        assert stats(client)["counters"].get("internal_errors", 0) == 0, "a failure the journal expects"
        register = Registrar(client)
        for key in on_disk[:4]:
            outcome, dst = deliver(client, register, key)
            if outcome.ok:  # or evicted from the disk pool by the later copies: a miss
                assert np.array_equal(dst, first.bytes_of(key)), key
        register.close()
        assert len(served(client, second, restarted=False)) > 0
        assert_clean(client)
    assert node.stop() == 0
    assert "is not a directory" in site.refused(*site.pools)
    site.disk.mkdir()
    site.start()
    with Client(site.endpoint, name="empty") as client:
        assert tier(client)["recovery"] == {**tier(client)["recovery"], "recovered": 0, "dropped": {}}
