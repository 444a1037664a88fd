"""A node restart that keeps its cache: what comes back, how fast, and what the journal costs.

Three measurements, each against its anchor in the same run (architecture §8):

- ``restart_kept_fraction``: a client deposits objects (two 4 KiB spans each, patterned)
  one after another into a node with a state directory; the node is killed with SIGKILL in
  the middle of the burst and started again on the same directory. The objects acknowledged
  STORED before the kill that the new node serves, byte for byte, over those acknowledged
  (goal 1.0). Any other key of the burst the node serves must carry its own bytes too.
- ``restart_s_per_100k``: a node holding 10,000 and then 100,000 objects (one 4 KiB span
  each, digests on) is stopped and started again; the time from the new process's start
  until a query finds every object, per 100,000 objects (goal <= 2 s), beside
  ``empty_start_s``, the same node started on an empty directory and answering its first
  query (the anchor: the interpreter, NIXL and the pools' registration). ``restart_s_10k``
  and ``restart_s_100k`` are the raw times; growth is linear or better when
  ``restart_s_100k - empty_start_s`` is under ten times ``restart_s_10k - empty_start_s``.
- ``journal_deposit_cost``: the round trip of one deposit (two 4 KiB spans) at a node with
  a state directory over the same at a node without, interleaved, the pool small enough that
  every deposit evicts (so each records a removal too); medians (goal <= 1.1).
- ``recovery_s_per_100k``: the same for a node's disk tier (architecture §9): a node with a
  DRAM pool of 8,192 slots and a disk pool of 4 KiB slots, no state directory, copying
  everything evictable (``--disk-demote-mark 1``), given 10,000 and then 100,000 objects
  (each deposit's copies written before the next, so that every object evicted has its
  copy), is stopped and started again on the same directory; the time from the new
  process's start until a query finds every copy in tier ``disk`` and a deliver of a sample
  of them succeeds (read back, checked against their digests), for 100,000 copies.
  ``disk_restart_s_10k`` is the same at 10,000; ``disk_take_back_s_10k`` and
  ``disk_take_back_s_100k`` are the start's own share (its journal read and the copies
  adopted: ``disk_tier`` ``recovery`` ``seconds`` in its stats); ``disk_recovery_growth``
  is that share per copy at 100,000 over the same at 10,000 (1.0: linear). (The time to
  serving less an empty start is too small at 10,000 to divide by: the empty start's spread
  is larger.)

    uv run python bench/restart.py [--runs 2000] [--json]

``--json`` prints one object of the figures named above, plus the spreads and
``deposit_us`` / ``deposit_journal_us``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import process_group, spawn
from stats import summary

from kvcr_client import Client, KeyStatus, Presence, Span

SPAN = 4096
BURST = 3000
KILL_AFTER = 1000
BULK = 1024
"""Keys per deposit while filling a node for the restart timing."""
QUERY_KEYS = 4096
"""Keys per query (the protocol's ``max_keys``); a restarted node is asked for all its objects in such queries at once."""


DISK_MEMORY_SLOTS = 8192
DISK_SAMPLE = 256
"""Copies delivered (read back from the file) once a restarted node finds them all."""


class StateSite:
    """A state directory and a pool directory under /dev/shm, removed at the end."""

    def __init__(self, run: Path, name: str, pools: str) -> None:
        self.endpoint = f"ipc://{run}/{name}.sock"
        self.state = Path(tempfile.mkdtemp(prefix=f"kvcr-bench-{name}-"))
        self.pools = Path(tempfile.mkdtemp(prefix=f"kvcr-bench-{name}-", dir="/dev/shm"))
        self.args = ("-m", "kvcr_node.cli", "--endpoint", self.endpoint, "--pool", pools, "--log-level", "WARNING",
                     "--state-dir", str(self.state), "--pool-dir", str(self.pools))

    def start(self) -> subprocess.Popen[str]:
        return spawn(*self.args)

    def close(self) -> None:
        shutil.rmtree(self.state, ignore_errors=True)
        shutil.rmtree(self.pools, ignore_errors=True)


def two_spans(region: object, at: int) -> list[Span]:
    return [Span(f"L{i}", region, at + i * SPAN, SPAN, "kv") for i in range(2)]  # type: ignore[arg-type]


def kept_fraction(run: Path) -> tuple[float, int, int]:
    """Acknowledged objects served after a kill -9 and restart / acknowledged; and the counts."""
    site = StateSite(run, "burst", f"kv:4KiB:{2 * BURST + 64}")
    try:
        node = site.start()
        src = (np.arange(BURST * 2 * SPAN, dtype=np.uint64) * 2654435761 >> 7).astype(np.uint8)
        keys = [b"burst-%d" % i for i in range(BURST)]
        acked: list[bytes] = []
        client = Client(site.endpoint, name="burst")
        region = client.register(src)

        def burst() -> None:
            for i, key in enumerate(keys):
                try:
                    out = client.deposit({key: two_spans(region, i * 2 * SPAN)}).result(5.0)
                except Exception:
                    return
                if out[key].status is not KeyStatus.STORED:
                    return
                acked.append(key)

        thread = threading.Thread(target=burst, daemon=True)
        thread.start()
        deadline = time.monotonic() + 120
        while len(acked) < KILL_AFTER and time.monotonic() < deadline:
            time.sleep(0.001)
        node.send_signal(signal.SIGKILL)
        node.wait(30)
        thread.join(30)
        client.close()
        before = list(acked)
        node = site.start()
        with Client(site.endpoint, name="after") as after:
            dst = np.zeros_like(src)
            dregion = after.register(dst)
            presences = after.query(keys).result(60)
            held = [k for k in keys if presences[k].presence is Presence.HIT]
            results = after.deliver({k: two_spans(dregion, keys.index(k) * 2 * SPAN) for k in held}).result(60)
            served = set()
            for key in held:
                at = keys.index(key) * 2 * SPAN
                if results[key].status is KeyStatus.OK:
                    if not np.array_equal(dst[at:at + 2 * SPAN], src[at:at + 2 * SPAN]):
                        raise AssertionError(f"{key!r} served with bytes not its own")
                    served.add(key)
        node.terminate()
        node.wait(30)
        return sum(1 for k in before if k in served) / len(before), len(before), len(served)
    finally:
        site.close()


def fill(endpoint: str, count: int, copied: bool = False) -> list[bytes]:
    """Deposit ``count`` one-span objects in bulk; their keys. ``copied``: each bulk's copies
    to the node's disk tier are written before the next bulk evicts them."""
    keys = [b"obj-%08d" % i for i in range(count)]
    src = (np.arange(BULK * SPAN, dtype=np.uint64) * 40503 >> 3).astype(np.uint8)
    with Client(endpoint, name="fill") as client:
        region = client.register(src)
        for first in range(0, count, BULK):
            batch = keys[first:first + BULK]
            out = client.deposit({k: [Span("L0", region, i * SPAN, SPAN, "kv")] for i, k in enumerate(batch)}).result(120)
            assert all(out[k].status is KeyStatus.STORED for k in batch), "a fill deposit failed"
            deadline = time.monotonic() + 120
            while copied and disk_tier(client)["demoting"] and time.monotonic() < deadline:
                time.sleep(0.05)
    return keys


def until_served(endpoint: str, keys: list[bytes], started: float) -> float:
    """Seconds from ``started`` until one query finds every key."""
    with Client(endpoint, name="probe") as client:
        if not keys:
            client.query([b"anything"]).result(120)
            return time.monotonic() - started
        while True:
            handles = [(chunk, client.query(chunk)) for chunk in chunks(keys)]
            if all(handle.result(120)[k].presence is Presence.HIT for chunk, handle in handles for k in chunk):
                return time.monotonic() - started


def chunks(keys: list[bytes], size: int = QUERY_KEYS) -> list[list[bytes]]:
    return [keys[at:at + size] for at in range(0, len(keys), size)]


def restart_time(run: Path, count: int) -> float:
    """Seconds from a restarted node's process start until it serves ``count`` recovered objects."""
    site = StateSite(run, f"fill{count}", f"kv:4KiB:{count + 16}")
    try:
        node = site.start()
        keys = fill(site.endpoint, count)
        node.terminate()
        node.wait(60)
        started = time.monotonic()
        node = site.start()
        seconds = until_served(site.endpoint, keys, started)
        node.terminate()
        node.wait(60)
        return seconds
    finally:
        site.close()


def empty_start(run: Path, count: int) -> float:
    """The anchor: a node with the same pools on an empty directory, to its first answer."""
    site = StateSite(run, "empty", f"kv:4KiB:{count + 16}")
    try:
        started = time.monotonic()
        node = site.start()
        seconds = until_served(site.endpoint, [], started)
        node.terminate()
        node.wait(60)
        return seconds
    finally:
        site.close()


class DiskSite:
    """A directory for disk pools under /var/tmp (a disk, not memory), removed at the end."""

    def __init__(self, run: Path, name: str, copies: int) -> None:
        self.endpoint = f"ipc://{run}/{name}.sock"
        self.directory = Path(tempfile.mkdtemp(prefix=f"kvcr-bench-{name}-", dir="/var/tmp"))
        self.args = ("-m", "kvcr_node.cli", "--endpoint", self.endpoint, "--log-level", "WARNING",
                     "--pool", f"kv:4KiB:{DISK_MEMORY_SLOTS}",
                     "--pool", f"kv-disk:4KiB:{copies + DISK_MEMORY_SLOTS}:disk:{self.directory}",
                     "--disk-demote-mark", "1")

    def start(self) -> subprocess.Popen[str]:
        return spawn(*self.args)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def disk_tier(client: Client) -> dict[str, Any]:
    result: dict[str, Any] = client.stats().result(120)["disk_tier"]
    return result


def held_on_disk(endpoint: str, keys: list[bytes]) -> list[bytes]:
    """The keys of ``keys`` a node holds in its disk tier only."""
    with Client(endpoint, name="look") as client:
        handles = [client.query(chunk) for chunk in chunks(keys)]
        return [k for handle in handles for k, answer in handle.result(120).items() if answer.tier == "disk"]


def disk_restart_time(run: Path, count: int) -> tuple[float, float, int]:
    """Seconds from a restarted node's process start until it serves ``count`` recovered copies
    (found on disk, a sample delivered), the start's own taking back, and the copies."""
    site = DiskSite(run, f"disk{count}", count)
    try:
        node = site.start()
        on_disk = held_on_disk(site.endpoint, fill(site.endpoint, count + DISK_MEMORY_SLOTS, copied=True))[:count]
        node.terminate()
        node.wait(60)
        started = time.monotonic()
        node = site.start()
        with Client(site.endpoint, name="probe") as client:
            handles = [(chunk, client.query(chunk)) for chunk in chunks(on_disk)]
            answers = {k: a for _, handle in handles for k, a in handle.result(120).items()}
            assert all(answers[k].tier == "disk" for k in on_disk), "a copy was not taken back"
            sample = on_disk[::max(1, len(on_disk) // DISK_SAMPLE)][:DISK_SAMPLE]
            dst = np.zeros(len(sample) * SPAN, np.uint8)
            region = client.register(dst)
            got = client.deliver({k: [Span("L0", region, i * SPAN, SPAN)] for i, k in enumerate(sample)}).result(120)
            seconds = time.monotonic() - started
            assert all(got[k].ok for k in sample), "a recovered copy was not served"
            # Every object was deposited from the same buffer: each copy's bytes are its own slice of it.
            src = (np.arange(BULK * SPAN, dtype=np.uint64) * 40503 >> 3).astype(np.uint8)
            for i, k in enumerate(sample):
                at = (int(k[4:]) % BULK) * SPAN
                assert np.array_equal(dst[i * SPAN:(i + 1) * SPAN], src[at:at + SPAN]), f"{k!r} came back changed"
            take_back = float(disk_tier(client)["recovery"]["seconds"])
        node.terminate()
        node.wait(60)
        return seconds, take_back, len(on_disk)
    finally:
        site.close()


def deposit_cost(run: Path, runs: int) -> dict[str, dict[str, float]]:
    """One deposit's round trip with a state directory and without, interleaved."""
    site = StateSite(run, "journal", "kv:4KiB:64")
    plain = f"ipc://{run}/plain.sock"
    procs = [site.start(), spawn("-m", "kvcr_node.cli", "--endpoint", plain, "--pool", "kv:4KiB:64", "--log-level", "WARNING")]
    samples: dict[str, list[float]] = {"journal": [], "plain": []}
    try:
        src = (np.arange(2 * SPAN, dtype=np.uint64) * 97).astype(np.uint8)
        with Client(site.endpoint, name="j") as journaled, Client(plain, name="p") as bare:
            regions = {"journal": journaled.register(src), "plain": bare.register(src)}
            clients = {"journal": journaled, "plain": bare}
            for i in range(runs + 100):
                for name in ("journal", "plain"):
                    key = b"d-%d" % i
                    start = time.perf_counter()
                    out = clients[name].deposit({key: two_spans(regions[name], 0)}).result(30)
                    took = time.perf_counter() - start
                    assert out[key].status is KeyStatus.STORED
                    if i >= 100:  # warm: connections, the pool's first evictions
                        samples[name].append(took)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
        site.close()
    return {name: summary(values) for name, values in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2000, help="timed deposits at each node (interleaved)")
    parser.add_argument("--json", action="store_true", help="also print one JSON object of the figures")
    args = parser.parse_args()
    with process_group("restart") as (run, _):
        fraction, acked, served = kept_fraction(run)
        empty = empty_start(run, 100_000)
        t10k = restart_time(run, 10_000)
        t100k = restart_time(run, 100_000)
        cost = deposit_cost(run, args.runs)
        d10k, take10k, copies10k = disk_restart_time(run, 10_000)
        d100k, take100k, copies100k = disk_restart_time(run, 100_000)
    figures = {
        "restart_kept_fraction": fraction,
        "restart_acked": acked,
        "restart_served": served,
        "restart_s_per_100k": t100k,
        "restart_s_10k": t10k,
        "restart_s_100k": t100k,
        "empty_start_s": empty,
        "journal_deposit_cost": cost["journal"]["median"] / cost["plain"]["median"],
        "deposit_us": cost["plain"]["median"] * 1e6,
        "deposit_journal_us": cost["journal"]["median"] * 1e6,
        "deposit_spread": cost["plain"]["spread"],
        "deposit_journal_spread": cost["journal"]["spread"],
        "recovery_s_per_100k": d100k * 100_000 / copies100k,
        "disk_restart_s_10k": d10k,
        "disk_restart_s_100k": d100k,
        "disk_take_back_s_10k": take10k,
        "disk_take_back_s_100k": take100k,
        "disk_recovery_growth": (take100k / copies100k) / (take10k / copies10k),
        "disk_copies_10k": copies10k,
        "disk_copies_100k": copies100k,
    }
    print(f"kill -9 after {acked} acknowledged deposits: {served} served after the restart, "
          f"restart_kept_fraction {fraction:.4f} (goal 1.0)")
    print(f"restart to serving: 10,000 objects {t10k:.2f} s, 100,000 objects {t100k:.2f} s "
          f"(goal <= 2 s per 100,000); an empty node starts in {empty:.2f} s")
    print(f"deposit round trip: {figures['deposit_journal_us']:.0f} us with a journal, {figures['deposit_us']:.0f} us "
          f"without (spreads {figures['deposit_journal_spread']:.2f}, {figures['deposit_spread']:.2f}): "
          f"journal_deposit_cost {figures['journal_deposit_cost']:.3f} (goal <= 1.1)")
    print(f"disk tier restart to serving: {copies10k} copies {d10k:.2f} s (taking back {take10k:.3f} s), "
          f"{copies100k} copies {d100k:.2f} s (taking back {take100k:.3f} s); recovery_s_per_100k "
          f"{figures['recovery_s_per_100k']:.2f}, growth of the taking back per copy 10k -> 100k "
          f"{figures['disk_recovery_growth']:.2f} (1.0: linear)")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    sys.exit(main())
