"""The disk tier (architecture §9): its copies and read backs against raw NIXL POSIX
transfers of the same bytes, in the same run.

The raw anchor is the faster of two agents of this process, one with the POSIX backend's
default (Linux AIO) and one with io_uring, as the node makes its own where the kernel allows
it (``kvcr_io.agent.create_posix_backend``): the floor of the machine, whichever way NIXL
moves the bytes.

A node with a DRAM pool and a disk pool of 64 KiB slots, told to copy everything evictable
(``--disk-demote-mark 1``), under three measurements per round:

- ``disk_write_ratio``: 1,000 objects of one 64 KiB span deposited in one call; the time
  from the deposit's answer until the node's last copy of them ended (``copied_at`` in its
  stats: ``time.monotonic``, one clock on one host; asked every 100 ms, without the
  accounting check), against this process's own agent WRITEing the same bytes from a registered
  buffer into a file of its own in the same directory, one transfer per object, as many in
  flight as the node allows (``DEMOTIONS_IN_FLIGHT``): raw time / kvcr time (goal >= 0.9).
- ``disk_read_ratio``: the same objects evicted (another 1,000 deposited over them), the
  pool's file dropped from the page cache (``fsync``, ``POSIX_FADV_DONTNEED``), then one
  deliver of all of them into a client buffer (read back from the file into memory, checked
  against their digests, then delivered), against this process's agent READing the same
  bytes from its own file, dropped from the cache the same way, one transfer per object, all
  posted at once: raw time / kvcr time. kvcr's time includes the deliver itself (a copy of
  the same bytes into the client's buffer) and a digest of each span: a ratio, not a goal
  met by a copy alone. The bytes delivered are checked after the timing.
- ``disk_write_ratio_32mib`` and ``disk_read_ratio_32mib``: the same two for objects of 32
  MiB (512 spans of 64 KiB), four a round, at a second node whose DRAM pool holds four:
  the copies against raw WRITEs of the same 512 descriptors per object, as many objects in
  flight as the node's byte bound allows (``DEMOTION_BYTES_IN_FLIGHT``); the read backs and
  deliver against raw READs of them, all posted at once.
- ``demotion_query_ratio``: the median of one-key queries asked back to back by a second
  client while the copies of the thousand deposited over a round's objects are written (the
  node asked for its stats every 100 ms meanwhile), over the same with the node idle
  (goal <= 1.3: the node's loop never waits on a disk).

    uv run python bench/disk.py [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import process_group, spawn, stop
from stats import Progress, summary

from kvcr_client import Client, KeyStatus, Span
from kvcr_io.agent import create_posix_backend, load_nixl
from kvcr_node.disk_tier import DEMOTION_BYTES_IN_FLIGHT, DEMOTIONS_IN_FLIGHT

SPAN = 64 * 1024
OBJECTS = 1000
POLL_S = 0.1
"""How often the node is asked whether its copies are written (a ``stats`` without ``audit``: its
counters, well under a millisecond of the node's loop)."""
WAIT_S = 120.0
LARGE = 4
"""Objects of 32 MiB a round of the large-object measurement."""
LARGE_SPANS = 512


def wait_demoted(client: Client, count: int) -> dict[str, Any]:
    """The tier once ``count`` copies in all were written (bounded)."""
    end = time.monotonic() + WAIT_S
    while (figures := tier(client))["demoted"] < count and time.monotonic() < end:
        time.sleep(POLL_S)
    if figures["demoted"] < count:
        raise AssertionError(f"copies not written within {WAIT_S} s: {figures}")
    return figures


def large_objects(run: Path, directory: Path, rounds: int, progress: Progress) -> dict[str, list[float]]:
    """Copies and read backs of 32 MiB objects at a node of their own, beside raw NIXL."""
    samples: dict[str, list[float]] = {"kvcr_write_32mib": [], "raw_write_32mib": [], "kvcr_read_32mib": [],
                                       "raw_read_32mib": []}
    endpoint = f"ipc://{run}/large.sock"
    directory = directory / "large"  # a disk tier of its own (its own state directory and lock)
    directory.mkdir()
    pool_slots = LARGE * LARGE_SPANS
    node = spawn("-m", "kvcr_node.cli", "--endpoint", endpoint, "--log-level", "WARNING",
                 "--pool", f"kv:64KiB:{pool_slots}", "--pool", f"kv-large:64KiB:{4 * pool_slots}:disk:{directory}",
                 "--disk-demote-mark", "1")
    raw = RawFloor(directory, LARGE, LARGE_SPANS, "-large")
    try:
        size = LARGE_SPANS * SPAN
        names = [f"L{j}" for j in range(LARGE_SPANS)]
        with Client(endpoint, name="disk-bench-large") as client:
            src = (np.arange(2 * LARGE * size, dtype=np.uint64) * 40503 >> 5).astype(np.uint8)
            dst = np.zeros(LARGE * size, np.uint8)
            source, sink = client.register(src), client.register(dst)

            def spans(region: Any, at: int, pool: str = "") -> list[Span]:
                return [Span(name, region, at + j * SPAN, SPAN, pool) for j, name in enumerate(names)]

            for r in range(rounds + 1):  # the first round warms up: not kept
                progress.step(f"32 MiB round {r}: {LARGE} copies written, evicted, read back")
                keys = [b"big%d-%d" % (r, i) for i in range(LARGE)]
                filler = [b"fill%d-%d" % (r, i) for i in range(LARGE)]
                demoted = tier(client)["demoted"]
                res = client.deposit({k: spans(source, i * size, "kv") for i, k in enumerate(keys)}).result(WAIT_S)
                start = time.monotonic()
                if not all(res[k].status is KeyStatus.STORED for k in keys):
                    raise AssertionError(f"a deposit failed: {res}")
                kvcr_write = wait_demoted(client, demoted + LARGE)["copied_at"] - start
                res = client.deposit({k: spans(source, (LARGE + i) * size, "kv")
                                      for i, k in enumerate(filler)}).result(WAIT_S)
                if not all(res[k].status is KeyStatus.STORED for k in filler):
                    raise AssertionError("a filler deposit failed")
                wait_demoted(client, demoted + 2 * LARGE)
                answers = client.query(keys).result(WAIT_S)
                if any(answers[k].tier != "disk" for k in keys):
                    raise AssertionError("an object is not on disk only")
                raw_write = raw.move("WRITE", max(1, DEMOTION_BYTES_IN_FLIGHT // size))
                drop_cache(directory / "kv-large.kvcr-pool")
                dst[:] = 0
                start = time.perf_counter()
                results = client.deliver({k: spans(sink, i * size) for i, k in enumerate(keys)}).result(WAIT_S)
                kvcr_read = time.perf_counter() - start
                if not all(results[k].ok for k in keys):
                    raise AssertionError(f"an object was not read back: {results}")
                if not np.array_equal(dst, src[:LARGE * size]):
                    raise AssertionError("the objects read back differ from the deposited bytes")
                raw_read = raw.move("READ", LARGE)
                if r:
                    for name, value in (("kvcr_write", kvcr_write), ("raw_write", raw_write),
                                        ("kvcr_read", kvcr_read), ("raw_read", raw_read)):
                        samples[f"{name}_32mib"].append(value)
    finally:
        raw.close()
        stop([node])
    return samples


def tier(client: Client) -> dict[str, Any]:
    result: dict[str, Any] = client.stats().result(30)["disk_tier"]
    return result


def drop_cache(path: Path) -> None:
    """Write ``path``'s dirty pages and drop it from the page cache: the next read is the disk's."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class RawFloor:
    """The floor of raw NIXL POSIX transfers: the same objects moved by an agent with the
    backend's default (Linux AIO) and by one with io_uring where the kernel allows it (the
    node's own choice, ``kvcr_io.agent.create_posix_backend``); each move is the faster of
    the two, a READ from a file just dropped from the page cache."""

    def __init__(self, directory: Path, objects: int = OBJECTS, spans: int = 1, tag: str = "") -> None:
        self.raws = [RawFiles(directory, objects, spans, f"{tag}-aio", uring=False)]
        uring = RawFiles(directory, objects, spans, f"{tag}-uring", uring=True)
        if uring.backend == "uring":
            self.raws.append(uring)
        else:
            uring.close()

    def move(self, op: str, in_flight: int) -> float:
        times = []
        for raw in self.raws:
            if op == "READ":
                drop_cache(raw.path)
            times.append(raw.move(op, in_flight))
        return min(times)

    def close(self) -> None:
        for raw in self.raws:
            raw.close()


class RawFiles:
    """This process's own agent with NIXL's POSIX backend: a registered buffer and a file of
    its own, moved one transfer per object (a descriptor per 64 KiB span), as the node moves
    its copies."""

    def __init__(self, directory: Path, objects: int, spans: int, tag: str, uring: bool) -> None:
        nixl = load_nixl()
        self.name = f"raw-disk{tag}-{os.getpid()}"
        self.agent = nixl.nixl_agent(self.name, nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        if uring:
            self.backend = create_posix_backend(self.agent)
        else:
            self.agent.create_backend("POSIX")
            self.backend = "aio"
        self.objects, self.spans = objects, spans
        self.buffer = (np.arange(objects * spans * SPAN, dtype=np.uint64) * 2654435761 >> 11).astype(np.uint8)
        self.agent.register_memory([(self.buffer.ctypes.data, self.buffer.nbytes, 0, "")], "DRAM")
        self.path = directory / f"raw{tag}.file"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.posix_fallocate(self.fd, 0, self.buffer.nbytes)
        self.agent.register_memory([(0, self.buffer.nbytes, self.fd, "")], "FILE")

    def move(self, op: str, in_flight: int) -> float:
        """Seconds to move every object, ``in_flight`` requests at once."""
        agent, base, spans = self.agent, self.buffer.ctypes.data, self.spans
        pending = list(range(self.objects))
        running: list[Any] = []
        start = time.perf_counter()
        while pending or running:
            while pending and len(running) < in_flight:
                i = pending.pop(0)
                at = np.arange(i * spans, (i + 1) * spans, dtype=np.uint64) * SPAN
                size = np.full(spans, SPAN, dtype=np.uint64)
                local = agent.get_xfer_descs(np.stack([base + at, size, np.zeros(spans, np.uint64)], axis=1), "DRAM")
                remote = agent.get_xfer_descs(np.stack([at, size, np.full(spans, self.fd, np.uint64)], axis=1), "FILE")
                handle = agent.initialize_xfer(op, local, remote, self.name)
                state = agent.transfer(handle)
                if state == "ERR":
                    raise RuntimeError(f"raw {op} failed")
                running.append(handle)
            still = []
            for handle in running:
                state = agent.check_xfer_state(handle)
                if state == "PROC":
                    still.append(handle)
                elif state == "DONE":
                    agent.release_xfer_handle(handle)
                else:
                    raise RuntimeError(f"raw {op} failed: {state}")
            running = still
        return time.perf_counter() - start

    def close(self) -> None:
        os.close(self.fd)


class Asker(threading.Thread):
    """Queries one key back to back, keeping each round trip, until stopped."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.client = Client(endpoint, name="asker")
        self.times: list[float] = []
        self.running = threading.Event()
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            if not self.running.wait(0.05):
                continue
            start = time.perf_counter()
            self.client.query([b"nothing"]).result(30)
            self.times.append(time.perf_counter() - start)

    def window(self, seconds: float | None = None) -> list[float]:
        """Round trips asked while ``running`` (for ``seconds``, when given)."""
        self.times = []
        self.running.set()
        if seconds is not None:
            time.sleep(seconds)
            self.running.clear()
        return self.times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of copies and read backs")
    parser.add_argument("--json", action="store_true", help="also print one JSON object of the figures")
    args = parser.parse_args()
    progress = Progress("disk", 4 + 2 * args.rounds)
    directory = Path(tempfile.mkdtemp(prefix="kvcr-bench-disk-", dir="/var/tmp"))
    samples: dict[str, list[float]] = {"kvcr_write": [], "raw_write": [], "kvcr_read": [], "raw_read": [],
                                       "busy_query": [], "idle_query": []}
    try:
        with process_group("disk") as (run, procs):
            progress.step("start a node with a disk pool, and the raw agent")
            endpoint = f"ipc://{run}/node.sock"
            procs.append(spawn("-m", "kvcr_node.cli", "--endpoint", endpoint, "--log-level", "WARNING",
                               "--pool", f"kv:64KiB:{OBJECTS}",
                               "--pool", f"kv-disk:64KiB:{4 * OBJECTS}:disk:{directory}",
                               "--disk-demote-mark", "1"))
            raw = RawFloor(directory)
            pool_file = directory / "kv-disk.kvcr-pool"
            asker = Asker(endpoint)
            asker.start()
            with Client(endpoint, name="disk-bench") as client:
                src = (np.arange(2 * OBJECTS * SPAN, dtype=np.uint64) * 40503 >> 5).astype(np.uint8)
                dst = np.zeros(OBJECTS * SPAN, np.uint8)
                source, sink = client.register(src), client.register(dst)
                progress.step("idle queries")
                asker.window(1.0)
                samples["idle_query"] += asker.times[20:]
                for r in range(args.rounds + 1):  # the first round warms up: not kept
                    progress.step(f"round {r}: {OBJECTS} copies written, evicted, read back")
                    keys = [b"r%d-%d" % (r, i) for i in range(OBJECTS)]
                    filler = [b"f%d-%d" % (r, i) for i in range(OBJECTS)]
                    end = time.monotonic() + WAIT_S  # copies in flight hold their objects: let them end
                    while tier(client)["demoting"] and time.monotonic() < end:
                        time.sleep(POLL_S)
                    before = tier(client)["demoted"]
                    out = client.deposit({k: [Span("L0", source, i * SPAN, SPAN, "kv")] for i, k in enumerate(keys)})
                    res = out.result(WAIT_S)
                    start = time.monotonic()
                    failed = [(k, res[k]) for k in keys if res[k].status is not KeyStatus.STORED]
                    if failed:
                        raise AssertionError(f"{len(failed)} deposits failed, e.g. {failed[0]}: {tier(client)}")
                    end = start + WAIT_S
                    while (figures := tier(client))["demoted"] < before + OBJECTS and time.monotonic() < end:
                        time.sleep(POLL_S)
                    if figures["demoted"] < before + OBJECTS:
                        raise AssertionError(f"copies not written within {WAIT_S} s: {figures}")
                    kvcr_write = figures["copied_at"] - start  # the node's clock: one clock on one host
                    # Evict them all: another thousand over them, whose copies are written while
                    # the asker's queries are timed (the node asked for its stats rarely meanwhile).
                    at = OBJECTS * SPAN
                    before = tier(client)["demoted"]
                    res = client.deposit({k: [Span("L0", source, at + i * SPAN, SPAN, "kv")]
                                          for i, k in enumerate(filler)}).result(WAIT_S)
                    busy = asker.window()
                    if not all(res[k].status is KeyStatus.STORED for k in filler):
                        raise AssertionError("a filler deposit failed")
                    end = time.monotonic() + WAIT_S
                    while tier(client)["demoted"] < before + OBJECTS and time.monotonic() < end:
                        time.sleep(POLL_S)
                    asker.running.clear()
                    answers = client.query(keys).result(WAIT_S)
                    if any(answers[k].tier != "disk" for k in keys):
                        raise AssertionError("an object is not on disk only")
                    raw_write = raw.move("WRITE", DEMOTIONS_IN_FLIGHT)
                    drop_cache(pool_file)
                    dst[:] = 0
                    start = time.perf_counter()
                    got = client.deliver({k: [Span("L0", sink, i * SPAN, SPAN)] for i, k in enumerate(keys)})
                    results = got.result(WAIT_S)
                    kvcr_read = time.perf_counter() - start
                    failed = [(k, results[k]) for k in keys if not results[k].ok]
                    if failed:
                        raise AssertionError(f"{len(failed)} objects not read back, e.g. {failed[0]}: {tier(client)}")
                    if not np.array_equal(dst, src[:OBJECTS * SPAN]):
                        raise AssertionError("the objects read back differ from the deposited bytes")
                    raw_read = raw.move("READ", OBJECTS)
                    if r:
                        samples["kvcr_write"].append(kvcr_write)
                        samples["raw_write"].append(raw_write)
                        samples["kvcr_read"].append(kvcr_read)
                        samples["raw_read"].append(raw_read)
                        samples["busy_query"] += busy
            asker.stop_event.set()
            asker.running.set()
            asker.join(30)
            asker.client.close()
            raw.close()
            samples.update(large_objects(run, directory, args.rounds, progress))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    figures = {name: summary(values) for name, values in samples.items()}
    ratios = {
        "disk_write_ratio": figures["raw_write"]["median"] / figures["kvcr_write"]["median"],
        "disk_read_ratio": figures["raw_read"]["median"] / figures["kvcr_read"]["median"],
        "demotion_query_ratio": figures["busy_query"]["median"] / figures["idle_query"]["median"],
        "disk_write_ratio_32mib": figures["raw_write_32mib"]["median"] / figures["kvcr_write_32mib"]["median"],
        "disk_read_ratio_32mib": figures["raw_read_32mib"]["median"] / figures["kvcr_read_32mib"]["median"],
    }
    mb = OBJECTS * SPAN / 1e6
    print(f"disk tier, {OBJECTS} objects of 64 KiB ({mb:.0f} MB) a round, {args.rounds} rounds:")
    for name in ("kvcr_write", "raw_write", "kvcr_read", "raw_read"):
        s = figures[name]
        print(f"  {name:12s} median {s['median'] * 1e3:8.1f} ms  ({mb / s['median']:7.0f} MB/s)  "
              f"p10 {s['p10'] * 1e3:8.1f}  p90 {s['p90'] * 1e3:8.1f}  spread {s['spread']:.2f}")
    mb_large = LARGE * LARGE_SPANS * SPAN / 1e6
    print(f"  and {LARGE} objects of 32 MiB ({mb_large:.0f} MB) a round:")
    for name in ("kvcr_write_32mib", "raw_write_32mib", "kvcr_read_32mib", "raw_read_32mib"):
        s = figures[name]
        print(f"  {name:16s} median {s['median'] * 1e3:8.1f} ms  ({mb_large / s['median']:7.0f} MB/s)  "
              f"p10 {s['p10'] * 1e3:8.1f}  p90 {s['p90'] * 1e3:8.1f}  spread {s['spread']:.2f}")
    for name in ("idle_query", "busy_query"):
        s = figures[name]
        print(f"  {name:12s} median {s['median'] * 1e6:8.1f} us  p90 {s['p90'] * 1e6:8.1f}  (n={int(s['n'])})")
    print(f"  disk_write_ratio raw WRITE / kvcr copies: {ratios['disk_write_ratio']:.2f} (goal >= 0.9)")
    print(f"  disk_read_ratio raw READ / kvcr read back and deliver: {ratios['disk_read_ratio']:.2f}")
    print(f"  disk_write_ratio_32mib {ratios['disk_write_ratio_32mib']:.2f}, disk_read_ratio_32mib "
          f"{ratios['disk_read_ratio_32mib']:.2f}")
    print(f"  demotion_query_ratio query while copying / idle: {ratios['demotion_query_ratio']:.2f} (goal <= 1.3)")
    if args.json:
        report = {**ratios, **{f"{name}_ms": figures[name]["median"] * 1e3 for name in
                               ("kvcr_write", "raw_write", "kvcr_read", "raw_read", "kvcr_write_32mib",
                                "raw_write_32mib", "kvcr_read_32mib", "raw_read_32mib")},
                  "idle_query_us": figures["idle_query"]["median"] * 1e6,
                  "busy_query_us": figures["busy_query"]["median"] * 1e6,
                  **{f"{name}_spread": figures[name]["spread"] for name in figures}}
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
