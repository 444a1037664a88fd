"""A kvcr client in a process of its own, for the fault, hostile-input and load tests.

Run as ``python hostile_worker.py MODE ENDPOINT [options]``, with ``tests/`` on
``PYTHONPATH`` for the helpers it shares with the tests (``kvcr_testing.hostile.Worker``
sees to both). It reports on stdout, one JSON object a line (``{"event": ...}``), so the
test can wait for each step with a bounded read, then stop, freeze (SIGSTOP) or kill
(SIGKILL) the process at a known point.

Modes:

- ``stall``: deposit ``--held`` small objects with ``no_evict`` (their handles stay held),
  then issue one long operation (``--op deposit`` or ``--op deliver`` of a big object),
  report ``issued`` and stop progressing: the process holds its client's I/O lock, so the
  client neither progresses its NIXL agent nor reads nor heartbeats. The test kills it.
- ``roundtrip``: deposit and deliver patterned objects in a loop, every destination byte
  checked, until a line arrives on stdin (or ``--seconds`` pass); reports ``summary``
  with the wall-clock time of every checked round trip.
- ``load``: ``--clients`` clients, one thread each, mixed deposit/query/deliver for
  ``--seconds``; reports latencies per operation kind and every unexpected outcome.
- ``deposit``: deposit ``--keys`` objects (patterned by ``--seed``), report, exit.
- ``deliver``: (optionally hint ``--source`` for the keys, then) deliver ``--keys`` into a
  sentinel buffer, report ``issued`` once sent and ``result`` with every key's outcome and
  whether the bytes are exact, then (``--linger``) keep the client open a while. With
  ``--pause`` the client makes no progress for that long right after sending.
- ``stats``: print the node's statistics; ``statsloop``: again for every line on stdin.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections import defaultdict
from typing import Any

import numpy as np

from kvcr_client import Client, ErrorCode, KeyStatus, KvcrError, Span
from kvcr_protocol import code_of
from kvcr_testing.patterns import pattern


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}, default=str), flush=True)


def cheap_pattern(n: int, seed: int) -> np.ndarray:
    """Fast patterned bytes for hot loops: differs per seed and per position, never zero."""
    x = (np.arange(n, dtype=np.uint64) + np.uint64((seed * 7919) % (1 << 40))) * np.uint64(2654435761)
    return (((x & np.uint64(0xFFFFFFFF)) >> np.uint64(16)) % np.uint64(255) + np.uint64(1)).astype(np.uint8)


def spans_for(region: Any, names: list[str], pool: str, slot: int, base: int = 0, deposit: bool = True) -> list[Span]:
    return [Span(name, region, base + i * slot, slot, pool if deposit else "") for i, name in enumerate(names)]


def names_of(n: int) -> list[str]:
    return [f"L{i}" for i in range(n)]


# --------------------------------------------------------------------------- stall


def run_stall(args: argparse.Namespace) -> None:
    client = Client(args.endpoint, name=f"stall-{os.getpid()}", timeout=20)
    slot, pool = args.slot, args.pool
    small = pattern(slot * max(1, args.held), 1)
    sreg = client.register(small)
    handles = []
    for i in range(args.held):
        key = f"held-{os.getpid()}-{i}".encode()
        res = client.deposit({key: [Span("L0", sreg, i * slot, slot, pool)]}, no_evict=True).result(20)
        assert res[key].status is KeyStatus.STORED, res[key]
        handles.append(res[key].handle)
    big = pattern(slot * args.spans, 2)
    breg = client.register(big)
    names = names_of(args.spans)
    key = f"big-{os.getpid()}".encode()
    if args.op == "deliver":
        res = client.deposit({key: spans_for(breg, names, pool, slot)}).result(60)
        assert res[key].status is KeyStatus.STORED, res[key]
        dst = np.zeros(slot * args.spans, dtype=np.uint8)
        dreg = client.register(dst)
        handle = client.deliver({key: spans_for(dreg, names, pool, slot, deposit=False)}, deadline_ms=args.deadline_ms)
    else:
        handle = client.deposit({key: spans_for(breg, names, pool, slot)}, deadline_ms=args.deadline_ms)
    core = client.core
    end = time.monotonic() + 5
    while handle.op_id not in core.session.pending and not handle.future.done() and time.monotonic() < end:
        time.sleep(0.001)
    core.io_lock.acquire()  # from here on nothing progresses, reads or heartbeats in this client
    sent = handle.op_id in core.session.pending or handle.future.done()  # future.done(): handle.done() would drive the client
    time.sleep(0.05)  # let ZeroMQ's I/O thread put the request on the wire
    emit("issued", op=args.op, key=key.decode(), held=handles, sent=sent, done=handle.future.done())
    time.sleep(args.linger)
    os._exit(3)  # never reached in the tests: they kill the process first


# --------------------------------------------------------------------------- roundtrip


def run_roundtrip(args: argparse.Namespace) -> None:
    stop = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.readline()
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    slot, pool, most = args.slot, args.pool, args.spans
    ok = 0
    times: list[float] = []
    errors: list[str] = []
    with Client(args.endpoint, name=f"roundtrip-{os.getpid()}", timeout=20) as client:
        src = np.zeros(slot * most, dtype=np.uint8)
        dst = np.zeros(slot * most + 2 * 64, dtype=np.uint8)
        sreg, dreg = client.register(src), client.register(dst)
        rng = random.Random(args.seed)
        emit("ready")
        end = time.monotonic() + args.seconds
        i = 0
        while not stop.is_set() and time.monotonic() < end:
            i += 1
            n = rng.randint(1, most)
            names = names_of(n)
            key = f"rt-{args.seed}-{i}".encode()
            src[: n * slot] = cheap_pattern(n * slot, args.seed * 1_000_003 + i)
            try:
                res = client.deposit({key: spans_for(sreg, names, pool, slot)}).result(20)
                if res[key].status is not KeyStatus.STORED:
                    errors.append(f"deposit {key!r}: {res[key]}")
                    continue
                # The whole object or a subset, 64 bytes into a sentinel-filled buffer.
                chosen = sorted(rng.sample(range(n), rng.randint(1, n)))
                dst[:] = 0xEE
                spans = [Span(names[j], dreg, 64 + k * slot, slot) for k, j in enumerate(chosen)]
                res = client.deliver({key: spans}).result(20)
                if res[key].status is not KeyStatus.OK:
                    errors.append(f"deliver {key!r}: {res[key]}")
                    continue
                expected = np.full_like(dst, 0xEE)
                for k, j in enumerate(chosen):
                    expected[64 + k * slot : 64 + (k + 1) * slot] = src[j * slot : (j + 1) * slot]
                bad = np.flatnonzero(dst != expected)
                if bad.size:
                    errors.append(f"deliver {key!r}: {bad.size} bytes differ, first at {int(bad[0])}")
                    continue
                ok += 1
                times.append(time.time())
            except (KvcrError, TimeoutError) as exc:
                errors.append(f"round trip {i}: {type(exc).__name__}: {exc}")
                if len(errors) > 20:
                    break
    emit("summary", ok=ok, errors=errors, times=times)


# --------------------------------------------------------------------------- load


class LoadClient:
    """One client of the load test: mixed operations, latencies, byte checks on a sample.

    A quarter of its deposits are ``no_evict``: it holds at most two such handles at a time
    (releasing the oldest), and a delivery of a held object must succeed. Other objects may
    be evicted by anyone's deposit: their delivery may find them gone (``NOT_FOUND``).
    """

    def __init__(self, endpoint: str, index: int, args: argparse.Namespace) -> None:
        self.index = index
        self.args = args
        self.client = Client(endpoint, name=f"load-{os.getpid()}-{index}", timeout=30)
        self.slot = args.slot
        self.most = args.spans
        self.src = np.zeros(self.slot * self.most, dtype=np.uint8)
        self.dst = np.zeros(self.slot * self.most, dtype=np.uint8)
        self.sreg = self.client.register(self.src)
        self.dreg = self.client.register(self.dst)
        self.latencies: dict[str, list[float]] = defaultdict(list)
        self.counts: dict[str, int] = defaultdict(int)
        self.failures: list[str] = []
        self.checked = 0
        self.rng = random.Random(args.seed * 1000 + index)
        self.mine: dict[bytes, tuple[int, int]] = {}
        """key -> (spans, pattern seed) of the objects this client stored."""
        self.held: dict[bytes, int] = {}
        """key -> handle of the no_evict objects this client holds (oldest first)."""

    def timed(self, kind: str, handle: Any) -> Any:
        t0 = time.perf_counter()
        result = handle.result(60)
        self.latencies[kind].append(time.perf_counter() - t0)
        return result

    def deposit(self, i: int) -> None:
        n = self.rng.randint(1, self.most)
        key = f"ld-{os.getpid()}-{self.index}-{i}".encode()
        seed = self.args.seed * 7919 + self.index * 104729 + i
        no_evict = self.rng.random() < 0.25
        self.src[: n * self.slot] = cheap_pattern(n * self.slot, seed)
        res = self.timed("deposit", self.client.deposit({key: spans_for(self.sreg, names_of(n), "kv", self.slot)}, no_evict=no_evict))
        outcome = res[key]
        if outcome.status is KeyStatus.STORED:
            self.counts["deposit.STORED"] += 1
            self.mine[key] = (n, seed)
            for old in [k for k in self.mine if k not in self.held][: max(0, len(self.mine) - 16)]:
                del self.mine[old]  # the recent ones are the likely survivors of eviction
            if no_evict:
                if outcome.handle is None:
                    self.failures.append(f"deposit {key!r}: no_evict without a handle")
                    return
                self.held[key] = outcome.handle
                if len(self.held) > 2:
                    self.release(next(iter(self.held)))
        elif outcome.status is KeyStatus.FAILED and outcome.code == ErrorCode.CAPACITY:
            self.counts["deposit.CAPACITY"] += 1
        else:
            self.failures.append(f"deposit {key!r}: {outcome}")

    def release(self, key: bytes) -> None:
        handle = self.held.pop(key)
        res = self.timed("release", self.client.release([handle]))
        outcome = res[handle.to_bytes(8, "big")]
        if outcome.status is KeyStatus.OK:
            self.counts["release.OK"] += 1
        else:
            self.failures.append(f"release {key!r}: {outcome}")

    def query(self) -> None:
        keys = self.rng.sample(sorted(self.mine), min(len(self.mine), self.rng.randint(1, 8)))
        res = self.timed("query", self.client.query(keys))
        for key in keys:
            presence = res[key].presence.value
            self.counts[f"query.{presence}"] += 1
            if key in self.held and presence != "HIT":
                self.failures.append(f"query {key!r}: a held object is {presence}")
            elif presence == "MISS":
                del self.mine[key]  # evicted

    def deliver(self) -> None:
        rng = self.rng
        key = rng.choice(sorted(self.held)) if self.held and rng.random() < 0.4 else rng.choice(sorted(self.mine))
        n, seed = self.mine[key]
        names = names_of(n)
        chosen = sorted(rng.sample(range(n), rng.randint(1, n)))
        check = rng.random() < self.args.check_fraction
        if check:
            self.dst[: len(chosen) * self.slot] = 0
        spans = [Span(names[j], self.dreg, k * self.slot, self.slot) for k, j in enumerate(chosen)]
        res = self.timed("deliver", self.client.deliver({key: spans}))
        outcome = res[key]
        if outcome.status is KeyStatus.OK:
            self.counts["deliver.OK"] += 1
            if check:
                data = cheap_pattern(n * self.slot, seed)
                for k, j in enumerate(chosen):
                    got = self.dst[k * self.slot : (k + 1) * self.slot]
                    if not np.array_equal(got, data[j * self.slot : (j + 1) * self.slot]):
                        self.failures.append(f"deliver {key!r}: span {names[j]} bytes differ")
                self.checked += 1
        elif outcome.status is KeyStatus.FAILED and outcome.code == ErrorCode.NOT_FOUND and key not in self.held:
            # Evicted by someone's deposit since it was stored (the pool is small on purpose).
            self.counts["deliver.NOT_FOUND.evicted"] += 1
            del self.mine[key]
        else:
            self.failures.append(f"deliver {key!r} (held: {key in self.held}): {outcome}")

    def step(self, i: int) -> None:
        roll = self.rng.random()
        if roll < 0.4 or not self.mine:
            self.deposit(i)
        elif roll < 0.6:
            self.query()
        else:
            self.deliver()

    def run(self, end: float, go: threading.Event) -> None:
        go.wait(60)
        i = 0
        try:
            while time.monotonic() < end:
                i += 1
                try:
                    self.step(i)
                except (KvcrError, TimeoutError) as exc:
                    self.failures.append(f"step {i}: {type(exc).__name__}: {exc}")
                    if len(self.failures) > 50:
                        return
            for key in list(self.held):
                try:
                    self.release(key)
                except (KvcrError, TimeoutError) as exc:
                    self.failures.append(f"final release: {type(exc).__name__}: {exc}")
        finally:
            try:
                self.client.close()
            except Exception as exc:
                self.failures.append(f"close: {exc}")


def run_load(args: argparse.Namespace) -> None:
    clients = [LoadClient(args.endpoint, i, args) for i in range(args.clients)]
    emit("ready")
    sys.stdin.readline()  # the test starts every process at once
    go = threading.Event()
    end = time.monotonic() + args.seconds
    threads = [threading.Thread(target=c.run, args=(end, go), daemon=True) for c in clients]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(args.seconds + 120)
    latencies: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, int] = defaultdict(int)
    failures: list[str] = []
    for c in clients:
        for kind, values in c.latencies.items():
            latencies[kind].extend(values)
        for kind, n in c.counts.items():
            counts[kind] += n
        failures.extend(c.failures)
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        failures.append(f"threads still running: {alive}")
    emit("summary", latencies=latencies, counts=counts, failures=failures, checked=sum(c.checked for c in clients))


# --------------------------------------------------------------------------- one-shot steps


def run_deposit(args: argparse.Namespace) -> None:
    slot, n = args.slot, args.spans
    with Client(args.endpoint, name=f"deposit-{os.getpid()}", timeout=20) as client:
        src = np.zeros(slot * n * len(args.keys), dtype=np.uint8)
        reg = client.register(src)
        objects = {}
        for k, key in enumerate(args.keys):
            base = k * slot * n
            src[base : base + slot * n] = pattern(slot * n, args.seed + k)
            objects[key.encode()] = spans_for(reg, names_of(n), args.pool, slot, base)
        res = client.deposit(objects).result(60)
        emit("result", outcomes={k.decode(): [o.status.value, int(o.code)] for k, o in res.items()})


def run_deliver(args: argparse.Namespace) -> None:
    slot, n = args.slot, args.spans
    with Client(args.endpoint, name=f"deliver-{os.getpid()}", timeout=20) as client:
        request_id = None
        if args.source:
            request_id = f"req-{os.getpid()}"
            client.submit_hint(request_id, args.source, [k.encode() for k in args.keys]).result(20)
        dst = np.full(slot * n * len(args.keys), 0xEE, dtype=np.uint8)
        reg = client.register(dst)
        objects = {
            key.encode(): spans_for(reg, names_of(n), args.pool, slot, k * slot * n, deposit=False)
            for k, key in enumerate(args.keys)
        }
        t0 = time.monotonic()
        handle = client.deliver(objects, request_id=request_id, deadline_ms=args.deadline_ms)
        if args.pause:
            # Sent, then no progress for a while: a transfer into our memory stalls (UCX over TCP).
            core = client.core
            end = time.monotonic() + 5
            while handle.op_id not in core.session.pending and not handle.future.done() and time.monotonic() < end:
                time.sleep(0.001)
            with core.io_lock:
                emit("issued")
                time.sleep(args.pause)
        else:
            emit("issued")
        try:
            res = handle.result(args.deadline_ms / 1000 + 30)
        except (KvcrError, TimeoutError) as exc:
            emit("result", error=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - t0)
            return
        seconds = time.monotonic() - t0
        outcomes = {}
        for k, key in enumerate(args.keys):
            o = res[key.encode()]
            base = k * slot * n
            exact = bool(np.array_equal(dst[base : base + slot * n], pattern(slot * n, args.seed + k)))
            outcomes[key] = [o.status.value, getattr(code_of(o.code), "name", int(o.code)), exact]
        emit("result", outcomes=outcomes, seconds=seconds)
        # Keep progressing the agent a while (a write that outlived its deadline may land).
        end = time.monotonic() + args.linger
        while time.monotonic() < end:
            client.core.call(client.core.agent.progress).result(5)
            time.sleep(0.01)


def run_stats(args: argparse.Namespace) -> None:
    with Client(args.endpoint, name=f"stats-{os.getpid()}", timeout=20) as client:
        emit("stats", stats=client.stats(audit=True).result(20))


def run_statsloop(args: argparse.Namespace) -> None:
    """The node's statistics each time a line arrives on stdin; ``quit`` (or EOF) ends it."""
    with Client(args.endpoint, name=f"stats-{os.getpid()}", timeout=20) as client:
        emit("ready")
        while (line := sys.stdin.readline()) and line.strip() != "quit":
            try:
                emit("stats", stats=client.stats(audit=True).result(20))
            except (KvcrError, TimeoutError) as exc:
                emit("stats", error=f"{type(exc).__name__}: {exc}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["stall", "roundtrip", "load", "deposit", "deliver", "stats", "statsloop"])
    p.add_argument("endpoint")
    p.add_argument("--op", choices=["deposit", "deliver"], default="deposit")
    p.add_argument("--pool", default="kv")
    p.add_argument("--slot", type=int, default=64 << 10)
    p.add_argument("--spans", type=int, default=4)
    p.add_argument("--held", type=int, default=0)
    p.add_argument("--deadline-ms", type=int, default=30_000)
    p.add_argument("--linger", type=float, default=0.0)
    p.add_argument("--pause", type=float, default=0.0)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--check-fraction", type=float, default=0.25)
    p.add_argument("--keys", nargs="*", default=[])
    p.add_argument("--source", default="")
    args = p.parse_args()
    {
        "stall": run_stall, "roundtrip": run_roundtrip, "load": run_load,
        "deposit": run_deposit, "deliver": run_deliver, "stats": run_stats, "statsloop": run_statsloop,
    }[args.mode](args)


if __name__ == "__main__":
    main()
