"""Lookups at engine scale: query round trips through a node, against a raw ZeroMQ echo.

Measured in one run, with one node and one raw echo process on this host (a few seconds);
the round trips below take turns, one of each per round, so that what is compared sees the
same machine:

- ``query_1_us``: p50 round trip of a one-key query (a hit);
- ``query_1000_us``: p50 round trip of a 1,000-key query, every other key held;
- ``query_1000_ratio``: that p50 over the p50 of a raw ZeroMQ DEALER/ROUTER msgpack echo
  whose request and reply have the byte sizes of the query and its reply (same run);
- ``prefix_1000_us``: p50 of ``query_prefix`` over 1,000 keys whose first key misses;
- ``pipelined_queries_per_s``: 5,000 one-key queries sent at once, then all waited on
  (the median of a few rounds).

``--max-version`` caps the client's protocol version (2: the record form of every
query; 3: query columns and prefix queries, spec section 6.9). ``--metrics`` runs the node
with a Prometheus metrics port (what counting and publishing snapshots cost a lookup).

Run: ``python bench/lookups.py [--json]``; ``--json`` prints one JSON object as the last
line. Ratios matter more than absolute times.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import msgpack
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import process_group, spawn
from stats import fmt_us, summary

import kvcr_protocol as kp
from kvcr_client import Client, Span

KEYS = 1000
"""Keys of one large lookup (a 16k-token prompt in 16-token blocks)."""
KEY_BYTES = 32
SLOT = 4 << 10
PIPELINED = 5000
"""One-key queries in flight at once."""
ROUNDS = {"interleaved": 300, "pipelined": 5}
"""Rounds of the interleaved round trips (each call once a round), and of the in-flight burst."""
WARMUP = {"interleaved": 30}
RESULT_TIMEOUT_S = 30.0


def key(i: int) -> bytes:
    return b"k" + i.to_bytes(KEY_BYTES - 1, "big")


# --------------------------------------------------------------------------- raw anchor


def raw_echo(endpoint: str) -> None:
    """A bare ZeroMQ ROUTER: decodes each request and answers with a reply of the size asked."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    replies: dict[int, bytes] = {}
    print("ready", flush=True)
    while True:
        ident, frame = sock.recv_multipart()
        msg = msgpack.unpackb(frame)
        if msg["t"] == "quit":
            sock.send_multipart([ident, msgpack.packb({"t": "bye"})])
            break
        size = msg["size"]
        reply = replies.get(size)
        if reply is None:
            pad = size - len(msgpack.packb({"v": 3, "t": "echo", "id": 0, "p": b""}))
            reply = replies[size] = msgpack.packb({"v": 3, "t": "echo", "id": 0, "p": b"\0" * max(0, pad - 4)})
        sock.send_multipart([ident, reply])
    sock.close(0)
    ctx.term()


class Echo:
    """A DEALER to the raw echo: one round trip of a msgpack request holding ``keys``, answered
    with ``reply_size`` bytes."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(endpoint)
        self.ids = 0

    def round_trip(self, keys: list[bytes], reply_size: int) -> None:
        self.ids += 1
        self.sock.send(msgpack.packb({"v": 3, "t": "echo", "id": self.ids, "keys": keys, "size": reply_size}))
        msgpack.unpackb(self.sock.recv())

    def close(self) -> None:
        self.sock.send(msgpack.packb({"t": "quit"}))
        self.sock.recv()
        self.sock.close(0)
        self.ctx.term()


# --------------------------------------------------------------------------- kvcr


def interleaved(calls: dict[str, Callable[[], object]], rounds: int, warmup: int) -> dict[str, dict[str, float]]:
    """Each call once per round, in turn, timed: what is compared sees the same machine."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds + warmup):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: summary(samples) for name, samples in times.items()}


def prefix_of(client: Client, keys: list[bytes]) -> int:
    """How many keys in a row, from the first, the node holds (``Client.query_prefix``)."""
    count: int = client.query_prefix(keys).result(RESULT_TIMEOUT_S)
    return count


def bench_kvcr(endpoint: str, echo_endpoint: str, max_version: int) -> dict[str, Any]:
    keys = [key(i) for i in range(KEYS)]
    held = keys[::2]
    buf = np.arange(len(held) * SLOT, dtype=np.uint64).astype(np.uint8)
    echo = Echo(echo_endpoint)
    with Client(endpoint, name="bench-lookups", max_version=max_version) as client:
        region = client.register(buf)
        stored = client.deposit({k: [Span("kv", region, i * SLOT, SLOT, "kv")] for i, k in enumerate(held)}).result(
            RESULT_TIMEOUT_S)
        assert stored.all_ok, stored
        answers = client.query(keys).result(RESULT_TIMEOUT_S)
        hits = sum(answers[k].presence is kp.Presence.HIT for k in keys)
        assert hits == len(held), hits
        misses_first = [key(KEYS + 1), *keys[1:]]
        assert prefix_of(client, misses_first) == 0
        assert prefix_of(client, held) == len(held)
        one = [held[0]]
        version = client.node.version if client.node else 0
        out: dict[str, Any] = {"version": version}
        # The wire sizes of the 1,000-key query and its reply at this session's version.
        out["request_bytes"] = len(kp.encode(kp.Query(1, tuple(keys)), version))
        reply = kp.QueryReply(1, tuple(kp.QueryResult(answers[k].presence, answers[k].tier) for k in keys))
        if version >= kp.COLUMNS_VERSION:
            reply = kp.QueryReply(1, (), reply.view())
        out["reply_bytes"] = reply_bytes = len(kp.encode(reply, version))
        out.update(interleaved({
            "query_1": lambda: client.query(one).result(RESULT_TIMEOUT_S),
            "query_1000": lambda: client.query(keys).result(RESULT_TIMEOUT_S),
            "echo_1000": lambda: echo.round_trip(keys, reply_bytes),
            "prefix_1000": lambda: prefix_of(client, misses_first),
        }, ROUNDS["interleaved"], WARMUP["interleaved"]))
        rates = []
        for _ in range(ROUNDS["pipelined"]):
            t0 = time.perf_counter()
            handles = [client.query(one) for _ in range(PIPELINED)]
            for handle in handles:
                assert handle.result(RESULT_TIMEOUT_S)[one[0]].presence is kp.Presence.HIT
            rates.append(PIPELINED / (time.perf_counter() - t0))
        out["pipelined"] = summary(rates)
        stats = client.stats(audit=True).result(RESULT_TIMEOUT_S)
        assert stats["invariants"] == [], stats["invariants"]
    echo.close()
    return out


def measure(run: Path, procs: list[Any], max_version: int, node_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """Start a node and the raw echo in ``run`` (stopped with ``procs``), measure, return the samples."""
    procs.append(spawn(__file__, "--raw-echo", f"ipc://{run}/lookups-echo.sock"))
    procs.append(spawn("-m", "kvcr_node.cli", "--endpoint", f"ipc://{run}/lookups-node.sock",
                       "--pool", f"kv:{SLOT}:{2 * KEYS}", "--log-level", "WARNING", *node_args))
    return bench_kvcr(f"ipc://{run}/lookups-node.sock", f"ipc://{run}/lookups-echo.sock", max_version)


def figures(k: dict[str, Any]) -> dict[str, float]:
    """The named figures of ``--json`` (issue-level names, also printed by ``bench/local.py``)."""
    return {
        "query_1000_us": k["query_1000"]["median"] * 1e6,
        "query_1000_ratio": k["query_1000"]["median"] / k["echo_1000"]["median"],
        "prefix_1000_us": k["prefix_1000"]["median"] * 1e6,
        "pipelined_queries_per_s": k["pipelined"]["median"],
    }


def report(k: dict[str, Any], out: TextIO) -> None:
    """The human-readable lines, with medians and spread."""
    f = figures(k)
    one = k["query_1"]["median"] * 1e6

    def say(line: str) -> None:
        print(line, file=out)

    say(f"lookups at protocol version {k['version']} ({KEYS} keys of {KEY_BYTES} bytes, every other one held)")
    say(f"  query, 1 key               {fmt_us(k['query_1'])}")
    say(f"  query, {KEYS} keys          {fmt_us(k['query_1000'])}")
    say(f"  raw ZeroMQ echo, same size {fmt_us(k['echo_1000'])}  ({k['request_bytes']} B out, {k['reply_bytes']} B back)")
    say(f"  ratio query / echo p50: {f['query_1000_ratio']:.2f} (goal <= 2.0)")
    say(f"  query_prefix, {KEYS} keys, first misses {fmt_us(k['prefix_1000'])}"
        f" (goal <= 1-key p50 + 100 us = {one + 100:.0f} us)")
    say(f"  {PIPELINED} one-key queries in flight: {f['pipelined_queries_per_s']:,.0f} queries/s, "
        f"median of {ROUNDS['pipelined']} (p10 {k['pipelined']['p10']:,.0f}, p90 {k['pipelined']['p90']:,.0f}; goal >= 20,000)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--raw-echo", help=argparse.SUPPRESS)
    parser.add_argument("--max-version", type=int, default=kp.CURRENT_VERSION, help="the client's highest protocol version")
    parser.add_argument("--json", action="store_true", help="the report to stderr, one JSON object to stdout")
    parser.add_argument("--metrics", action="store_true", help="the node serves Prometheus metrics (--metrics-port 0)")
    args = parser.parse_args()
    if args.raw_echo:
        raw_echo(args.raw_echo)
        return 0
    with process_group("lookups") as (run, procs):
        k = measure(run, procs, args.max_version, ("--metrics-port", "0") if args.metrics else ())
    report(k, sys.stderr if args.json else sys.stdout)
    if args.json:
        out = {"version": k["version"], "query_1_us": k["query_1"]["median"] * 1e6, **figures(k)}
        print(json.dumps({name: round(value, 3) if isinstance(value, float) else value for name, value in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
