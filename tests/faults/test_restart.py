"""A node restarted on its state directory keeps its cache (architecture §8), tried with
real processes: stopped, killed -9 in the middle of a burst of deposits and in the middle of
its journal's compactions, with a record flipped or a pool file cut by hand, and pointed at
a directory another node holds. Every object acknowledged comes back byte for byte; nothing
half-written, changed or unverifiable is ever served.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcr_client import Client, KeyStatus, Presence, Span
from kvcr_client.events import EventStream, InventoryMirror
from kvcr_node.journal import FILE_MAGIC, state_files
from kvcr_testing.health import assert_clean, stats, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Layout, Registrar, plain_layout
from kvcr_testing.measure import fd_count, thread_count
from kvcr_testing.nodes import NodeProcess, start_node
from kvcr_testing.patterns import KiB, pattern

SLOT = 4 * KiB
LAYOUT = plain_layout(2, "kv", SLOT)
FOLLOW_TIMEOUT_S = 15.0


class Site:
    """One node's endpoint, state directory and pool directory, across its restarts."""

    def __init__(self, ipc_dir: Path, tmp_path: Path, slots: int = 1024, *extra: str) -> None:
        self.endpoint = f"ipc://{ipc_dir}/restart.sock"
        self.events = f"ipc://{ipc_dir}/restart-events.sock"
        self.state = tmp_path / "state"
        self.pools = Path("/dev/shm") / f"kvcr-restart-{os.getpid()}-{tmp_path.name}"
        self.pools.mkdir()
        self.args = ("--pool", f"kv:4KiB:{slots}", "--state-dir", str(self.state), "--pool-dir", str(self.pools),
                     "--events-endpoint", self.events, *extra)
        self.nodes: list[NodeProcess] = []

    def start(self, *extra: str) -> NodeProcess:
        node = start_node(self.endpoint, *self.args, *extra)
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for node in self.nodes:
            node.kill()
        shutil.rmtree(self.pools, ignore_errors=True)


@pytest.fixture
def site(ipc_dir: Path, tmp_path: Path) -> Iterator[Site]:
    s = Site(ipc_dir, tmp_path)
    yield s
    s.close()


class Burst:
    """Deposits key after key from one buffer of patterned bytes until the node goes; what
    was acknowledged STORED is kept in order."""

    def __init__(self, client: Client, n: int, tag: str, seed: int) -> None:
        self.src = pattern(LAYOUT.nbytes * n, seed)
        self.region = client.register(self.src)
        self.client = client
        self.keys = [f"{tag}/{i}".encode() for i in range(n)]
        self.acked: list[bytes] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def bytes_of(self, key: bytes) -> bytes:
        i = self.keys.index(key)
        return bytes(self.src[i * LAYOUT.nbytes:(i + 1) * LAYOUT.nbytes])

    def _run(self) -> None:
        for i, key in enumerate(self.keys):
            try:
                out = self.client.deposit({key: LAYOUT.source_spans(self.region, i * LAYOUT.nbytes)}).result(5.0)
            except Exception:
                return
            if out[key].status is not KeyStatus.STORED:
                return
            self.acked.append(key)


def delivered(client: Client, reg: Registrar, keys: list[bytes], layout: Layout = LAYOUT) -> dict[bytes, bytes | None]:
    """Each key delivered into a buffer of its own: its bytes when OK, else None."""
    dst = pattern(layout.nbytes * len(keys), 99)
    region = reg(dst)
    objects = {k: [Span(n, region, i * layout.nbytes + o, s) for (n, _, s), o in zip(layout.spans, layout.offsets, strict=True)]
               for i, k in enumerate(keys)}
    results = client.deliver(objects).result(RESULT_TIMEOUT_S)
    return {k: dst[i * layout.nbytes:(i + 1) * layout.nbytes].tobytes() if results[k].status is KeyStatus.OK else None
            for i, k in enumerate(keys)}


def test_a_stopped_node_comes_back_with_its_objects_and_says_so(site: Site) -> None:
    first = site.start()
    mirror = InventoryMirror()
    src = pattern(LAYOUT.nbytes * 40, 3)
    keys = [b"obj-%d" % i for i in range(40)]
    chain = {keys[i]: keys[i - 1] for i in range(1, 40)}  # one sequence of blocks: each block's parent is the one before
    with EventStream(site.events) as stream:
        with Client(site.endpoint, name="before") as client:
            reg = Registrar(client)
            region = reg(src)
            client.deposit({k: LAYOUT.source_spans(region, i * LAYOUT.nbytes) for i, k in enumerate(keys)},
                           parents=chain).result(RESULT_TIMEOUT_S)
            old = client.node.incarnation if client.node is not None else 0
            assert client.node is not None and client.node.kept == 0
            reg.close()
        assert first.stop() == 0
        second = site.start()
        with Client(site.endpoint, name="after") as client:
            assert client.node is not None and client.node.kept == old != client.node.incarnation
            st = stats(client)
            assert st["recovery"]["recovered"] == 40 and st["recovery"]["dropped"] == {}
            assert all(p.presence is Presence.HIT for p in client.query(keys).result(RESULT_TIMEOUT_S).values())
            reg = Registrar(client)
            got = delivered(client, reg, keys)
            for i, key in enumerate(keys):
                assert got[key] == src[i * LAYOUT.nbytes:(i + 1) * LAYOUT.nbytes].tobytes(), key

            # A subscriber learns of the new incarnation from a batch it receives (PUB drops
            # what goes out before the subscriber has reconnected), then replays it from its
            # start: new objects are stored until one reaches it.
            region = reg(src)
            fresh: list[bytes] = []

            def caught_up() -> bool:
                fresh.append(b"new-%d" % len(fresh))
                client.deposit({fresh[-1]: LAYOUT.source_spans(region, 0)}).result(RESULT_TIMEOUT_S)
                for _, batch in stream.recv(0.2):
                    mirror.apply(batch)
                return mirror.incarnation == client.node.incarnation and set(mirror.keys) == {*keys, *fresh}  # type: ignore[union-attr]

            assert wait_until(caught_up, FOLLOW_TIMEOUT_S), "the new incarnation's cleared and stored"
            assert mirror.parents == chain, "what was taken back is published with its parents"
            reg.close()
            assert_clean(client)
        assert second.stop() == 0


def test_a_subscriber_that_slept_through_a_restart_follows_the_new_incarnation(site: Site) -> None:
    """The subscriber reads nothing while the first incarnation publishes, so its SUB still
    holds that one's batches when it first reads, after the restart: it goes on to the new
    incarnation by replay and must not go back to the old one for a stale batch (it never
    followed it, so it is not among those it left). Seen once in twenty runs of the test above."""
    first = site.start()
    src = pattern(LAYOUT.nbytes, 5)
    with EventStream(site.events) as stream:
        with Client(site.endpoint, name="before") as client:
            reg = Registrar(client)
            region = reg(src)
            n = [0]

            def queued() -> bool:  # a batch of the first incarnation waits, unread, in the SUB
                n[0] += 1
                client.deposit({b"old-%d" % n[0]: LAYOUT.source_spans(region, 0)}).result(RESULT_TIMEOUT_S)
                return bool(stream.sub.poll(200))

            assert wait_until(queued, FOLLOW_TIMEOUT_S), "the SUB never received a batch"
            old = client.node.incarnation if client.node is not None else 0
            reg.close()
        assert first.stop() == 0
        site.start()
        with Client(site.endpoint, name="after") as client:
            assert client.node is not None and client.node.incarnation != old
            new = client.node.incarnation
            reg = Registrar(client)
            region = reg(src)
            client.deposit({b"after": LAYOUT.source_spans(region, 0)}).result(RESULT_TIMEOUT_S)
            mirror = InventoryMirror()
            seen: set[int] = set()

            def caught_up() -> bool:
                for _, batch in stream.recv(0.2):
                    seen.add(batch.incarnation)
                    mirror.apply(batch)
                return mirror.incarnation == new and b"after" in mirror.keys

            assert wait_until(caught_up, FOLLOW_TIMEOUT_S), (seen, old, new, stream.incarnation)
            assert old not in seen and stream.incarnation == new, "a stale batch of the old incarnation came out"
            reg.close()


def check_served(client: Client, burst: Burst, must: list[bytes]) -> int:
    """Every key of ``must`` is served with its bytes, and every other key of the burst is
    either absent or served with its bytes; returns how many were served."""
    reg = Registrar(client)
    try:
        presences = client.query(burst.keys).result(RESULT_TIMEOUT_S)
        held = [k for k in burst.keys if presences[k].presence is Presence.HIT]
        assert set(must) <= set(held), sorted(set(must) - set(held))[:5]
        got = delivered(client, reg, held) if held else {}
        for key in held:
            assert got[key] == burst.bytes_of(key), key
        return len(held)
    finally:
        reg.close()


def test_kill_9_in_a_burst_of_deposits_loses_nothing_acknowledged(site: Site) -> None:
    node = site.start()
    client = Client(site.endpoint, name="burst")
    burst = Burst(client, 800, "burst", 5)
    burst.thread.start()
    assert wait_until(lambda: len(burst.acked) >= 200, 60.0)
    node.kill()
    burst.thread.join(30.0)
    client.close()
    acked = list(burst.acked)
    site.start()
    with Client(site.endpoint, name="after") as after:
        served = check_served(after, burst, acked)
        assert served in (len(acked), len(acked) + 1)  # the deposit in flight may have been stored
        assert stats(after)["recovery"]["recovered"] == served
        assert_clean(after)


def test_kill_9_during_compactions_keeps_the_journal_readable(ipc_dir: Path, tmp_path: Path) -> None:
    """A journal compacted every few kilobytes under FIFO evictions, killed three times
    mid-burst: each time the last objects acknowledged (FIFO keeps the newest) come back."""
    slots = 64
    site = Site(ipc_dir, tmp_path, slots, "--policy", "fifo", "--journal-compact-bytes", "4096")
    try:
        for round_ in range(3):
            node = site.start()
            client = Client(site.endpoint, name=f"round-{round_}")
            burst = Burst(client, 600, f"r{round_}", 10 + round_)
            burst.thread.start()
            assert wait_until(lambda b=burst: len(b.acked) >= 60, 60.0)  # type: ignore[misc]
            early = fd_count(node.proc.pid), thread_count(node.proc.pid)
            least = 150 + 37 * round_
            assert wait_until(lambda b=burst, n=least: len(b.acked) >= n, 60.0)  # type: ignore[misc]
            with Client(site.endpoint, name="look") as look:
                assert stats(look)["journal"]["compactions"] >= 2
            # Compactions come and go: the node's descriptors, threads and files stay bounded.
            assert fd_count(node.proc.pid) <= early[0] + 2 and thread_count(node.proc.pid) <= early[1] + 1
            assert len(list(site.state.iterdir())) <= 6, sorted(p.name for p in site.state.iterdir())
            node.kill()
            burst.thread.join(30.0)
            client.close()
            node = site.start()
            with Client(site.endpoint, name="after") as after:
                # FIFO over 32 two-slot objects: the newest 31 acknowledged are surely held.
                check_served(after, burst, burst.acked[-(slots // 2 - 1):])
                assert_clean(after)
            node.stop()
    finally:
        site.close()


def test_a_flipped_record_and_a_cut_pool_file_are_dropped_and_counted(site: Site) -> None:
    node = site.start()
    with Client(site.endpoint, name="fill") as client:
        burst = Burst(client, 30, "f", 7)
        burst.thread.start()
        burst.thread.join(60.0)
        assert len(burst.acked) == 30
    assert node.stop() == 0
    journal = [p for _, kind, p in state_files(site.state) if kind == "journal"][-1]
    data = bytearray(journal.read_bytes())
    data[len(FILE_MAGIC) + 30] ^= 0x5A
    journal.write_bytes(bytes(data))
    node = site.start()
    with Client(site.endpoint, name="after") as after:
        st = stats(after)
        assert st["recovery"]["dropped"] == {"corrupt": 1} and st["recovery"]["recovered"] == 29
        assert check_served(after, burst, []) == 29
    assert node.stop() == 0
    [pool_file] = list(site.pools.iterdir())
    os.truncate(pool_file, 4096)
    node = site.start()
    with Client(site.endpoint, name="cut") as after:
        st = stats(after)
        assert st["recovery"] == {**st["recovery"], "recovered": 0, "kept": 0, "dropped": {"pool_lost": 29}}
        assert check_served(after, burst, []) == 0
        assert after.node is not None and after.node.kept == 0
    assert node.stop() == 0


def refused(site: Site, *pools: str) -> str:
    """Start a node on ``site``'s directories with ``pools``: it must refuse, in one line."""
    args = [sys.executable, "-m", "kvcr_node.cli", "--endpoint", site.endpoint + ".other", "--state-dir", str(site.state),
            "--pool-dir", str(site.pools), *pools]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_second_node_and_other_pools_are_refused_with_one_line(site: Site) -> None:
    node = site.start()
    assert "is in use by a live node (pid" in refused(site, "--pool", "kv:4KiB:1024")
    assert node.stop() == 0
    assert "was written with other pools" in refused(site, "--pool", "kv:8KiB:16")
    node = site.start()  # the directory is as it was
    assert node.stop() == 0
