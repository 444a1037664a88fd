"""Remote benchmark: a client on node A receives an object held by node B (two processes).

Measured in one run:

1. time to first layer: a deliver of the first of 32 spans of 64 KiB (``partial``), then
   the rest, against a whole-object delivery, and against the anchor: a raw NIXL WRITE
   of one span from a bare NIXL process plus one raw ZeroMQ round trip;
2. remote deliver throughput (1024 spans of 64 KiB, 64 MiB) against raw NIXL WRITE of
   the same descriptors;
3. inline against deferred submission on the source (a source node started through
   ``deferred_source.py``, which submits peer writes a loop turn late).

Run: ``python bench/remote.py`` (under a minute). Ratios matter, not absolute times.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))

from local import SPAN, SPANS
from procs import process_group, spawn
from stats import fmt_gbps, fmt_us, summary

from kvcr_client import Client, Span
from kvcr_io.agent import load_nixl

LAYERS = 32


def raw_anchor(endpoint: str, reps: int) -> dict[str, Any]:
    """Raw NIXL WRITE of one span and of 1024 spans into this process, plus raw ZeroMQ round trips."""
    nixl = load_nixl()
    agent = nixl.nixl_agent("raw-remote-client", nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    dst = np.zeros(SPAN * SPANS, dtype=np.uint8)
    agent.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send(msgpack.packb({"t": "setup", "md": agent.get_agent_metadata(), "addr": dst.ctypes.data}))
    assert msgpack.unpackb(sock.recv())["t"] == "ok"

    def write(n: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        sock.send(msgpack.packb({"t": "write", "n": n}))
        while not sock.poll(0):
            agent.get_new_notifs()
        reply = msgpack.unpackb(sock.recv())
        assert reply["state"] == "DONE", reply
        return time.perf_counter() - t0, reply["s"]

    one = [write(1) for _ in range(reps * 4)]
    whole = [write(SPANS) for _ in range(reps)]
    rtt = []
    for i in range(500):
        t0 = time.perf_counter()
        sock.send(msgpack.packb({"v": 2, "t": "echo", "id": i, "keys": [b"k" * 32]}))
        msgpack.unpackb(sock.recv())
        rtt.append(time.perf_counter() - t0)
    sock.send(msgpack.packb({"t": "quit"}))
    sock.recv()
    sock.close(0)
    ctx.term()
    return {
        "one_span_e2e": summary([e for e, _ in one]),
        "one_span_xfer": summary([x for _, x in one]),
        "whole_xfer": summary([x for _, x in whole]),
        "rtt": summary(rtt[50:]),
    }


def bench_kvcr(a: str, b: str, b_defer: str, reps: int) -> dict[str, Any]:
    small = (np.arange(LAYERS * SPAN, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8) | 1
    big = (np.arange(SPANS * SPAN, dtype=np.uint64) * 40503 >> 7).astype(np.uint8) | 1
    out: dict[str, Any] = {}
    with Client(b, name="owner") as owner, Client(b_defer, name="owner-deferred") as owner2, Client(a, name="engine") as eng:
        for client in (owner, owner2):
            rs, rb = client.register(small), client.register(big)
            res = client.deposit({
                b"small": [Span(f"L{i}", rs, i * SPAN, SPAN, "kv") for i in range(LAYERS)],
                b"big": [Span(f"L{i}", rb, i * SPAN, SPAN, "kv") for i in range(SPANS)],
            }).result(30)
            assert res.all_ok, res
        dst = np.zeros(SPANS * SPAN, dtype=np.uint8)
        rd = eng.register(dst)
        eng.submit_hint("bench", b, [b"small", b"big"]).result(5)
        eng.submit_hint("bench-deferred", b_defer, [b"small", b"big"]).result(5)
        layers = [Span(f"L{i}", rd, i * SPAN, SPAN) for i in range(LAYERS)]

        def first_then_rest(request_id: str) -> tuple[float, float]:
            t0 = time.perf_counter()
            first = eng.deliver({b"small": layers[:1]}, request_id=request_id, partial=True)
            rest = eng.deliver({b"small": layers[1:]}, request_id=request_id, partial=True)
            assert first.result(10)[b"small"].ok
            t_first = time.perf_counter() - t0
            assert rest.result(10)[b"small"].ok
            return t_first, time.perf_counter() - t0

        def whole(key: bytes, spans: list[Span], request_id: str = "bench") -> float:
            t0 = time.perf_counter()
            res = eng.deliver({key: spans}, request_id=request_id).result(30)
            assert res[key].ok, res
            return time.perf_counter() - t0

        for _ in range(5):  # warm the peer session and both paths
            first_then_rest("bench")
            first_then_rest("bench-deferred")
        runs = [first_then_rest("bench") for _ in range(reps * 4)]
        deferred = [first_then_rest("bench-deferred") for _ in range(reps * 4)]
        whole_small = [whole(b"small", layers) for _ in range(reps * 4)]
        if not np.array_equal(dst[: LAYERS * SPAN], small):
            raise AssertionError("delivered bytes differ (small object)")
        big_spans = [Span(f"L{i}", rd, i * SPAN, SPAN) for i in range(SPANS)]
        prepared = eng.destination(big_spans)
        whole_big, whole_big_prepared = [], []
        for _ in range(reps):
            whole_big.append(whole(b"big", big_spans))
            t0 = time.perf_counter()
            res = eng.deliver({b"big": prepared}, request_id="bench").result(30)
            assert res[b"big"].ok, res
            whole_big_prepared.append(time.perf_counter() - t0)
        if not np.array_equal(dst, big):
            raise AssertionError("delivered bytes differ (big object)")
        stats_b = owner.stats().result(5)
        assert stats_b["invariants"] == [] and stats_b["claims"]["total"] == 0, stats_b
        out["first"] = summary([f for f, _ in runs])
        out["first_rest"] = summary([t for _, t in runs])
        out["first_deferred"] = summary([f for f, _ in deferred])
        out["whole_small"] = summary(whole_small)
        out["whole_big"] = summary(whole_big)
        out["whole_big_prepared"] = summary(whole_big_prepared)
        out["inline_writes"] = stats_b["counters"].get("writes_inline", 0)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    flags = ["--pool", f"kv:64KiB:{SPANS + 2 * LAYERS}", "--log-level", "WARNING"]
    with process_group("rbench") as (run, procs):
        for name in ("a", "b"):
            procs.append(spawn("-m", "kvcr_node.cli", *flags, "--endpoint", f"ipc://{run}/{name}.sock"))
        deferred = str(Path(__file__).resolve().parent / "deferred_source.py")
        procs.append(spawn(deferred, *flags, "--endpoint", f"ipc://{run}/bd.sock"))
        procs.append(spawn(str(Path(__file__).resolve().parent / "local.py"), "--raw-writer", f"ipc://{run}/raw.sock"))
        k = bench_kvcr(f"ipc://{run}/a.sock", f"ipc://{run}/b.sock", f"ipc://{run}/bd.sock", args.reps)
        r = raw_anchor(f"ipc://{run}/raw.sock", args.reps)
    anchor = r["one_span_xfer"]["median"] + r["rtt"]["median"]
    print(f"time to first layer: object of {LAYERS} spans of {SPAN >> 10} KiB on node B, client on node A")
    print(f"  kvcr first span (partial deliver)      {fmt_us(k['first'])}")
    print(f"  kvcr first span, then the rest         {fmt_us(k['first_rest'])}")
    print(f"  kvcr whole object                      {fmt_us(k['whole_small'])}")
    print(f"  raw NIXL one span (in the writer)      {fmt_us(r['one_span_xfer'])}")
    print(f"  raw ZeroMQ round trip                  {fmt_us(r['rtt'])}")
    print(f"  raw NIXL one span + ZeroMQ trigger     {fmt_us(r['one_span_e2e'])}")
    print(f"  ratio first layer / whole object: {k['first']['median'] / k['whole_small']['median']:.2f}")
    print(f"  ratio first layer / (raw one span + raw round trip): {k['first']['median'] / anchor:.2f}")
    print(f"remote deliver throughput, {SPANS} spans of {SPAN >> 10} KiB ({SPANS * SPAN >> 20} MiB)")
    print(f"  kvcr remote deliver, list of spans     {fmt_gbps(SPANS * SPAN, k['whole_big'])}")
    print(f"  kvcr remote deliver, prepared dest.    {fmt_gbps(SPANS * SPAN, k['whole_big_prepared'])}")
    print(f"  raw NIXL WRITE, same descriptors       {fmt_gbps(SPANS * SPAN, r['whole_xfer'])}")
    print(f"  ratio kvcr / raw NIXL: list of spans {r['whole_xfer']['median'] / k['whole_big']['median']:.2f}, "
          f"prepared destination {r['whole_xfer']['median'] / k['whole_big_prepared']['median']:.2f}")
    print("inline against deferred submission on the source (first span)")
    print(f"  inline    {fmt_us(k['first'])}")
    print(f"  deferred  {fmt_us(k['first_deferred'])}")
    print(f"  ratio deferred / inline: {k['first_deferred']['median'] / k['first']['median']:.2f}  "
          f"(source counted {k['inline_writes']} inline submissions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
