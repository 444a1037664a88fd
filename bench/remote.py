"""Remote benchmark: a client on node A receives objects held by node B (two processes).

Measured in one run:

1. time to first layer: an object of 32 layers of 1 MiB (256 tokens x 8 KV heads x 128 x
   K and V x 2 bytes) delivered with a layer plan of one group per layer; the first layer
   has landed when ``handle.wait(0)`` returns (a NIXL notification from B's agent, or B's
   progress passed on by A). Against the anchor: a raw NIXL WRITE of one 1 MiB span from
   a bare NIXL process plus one raw ZeroMQ round trip; and against the whole object;
2. remote deliver throughput (1024 spans of 64 KiB, 64 MiB) against raw NIXL WRITE of
   the same descriptors;
3. inline against deferred submission on the source (first layer; a source node started
   through ``deferred_source.py``, which submits peer writes late in the turn).

Run: ``python bench/remote.py`` (under a minute); ``--json`` adds one line with
``ttfl_ratio``, ``first_layer_fraction`` and ``remote_deliver_ratio``. Ratios matter, not
absolute times. Progress goes to stderr (``--quiet``: none); ``--plot FILE`` writes a PNG of
each measurement's distribution beside its raw anchors (``bench/plots.py``).
"""

from __future__ import annotations

import argparse
import json
import os
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
from stats import Progress, fmt_gbps, fmt_us, summary

from kvcr_client import Client, Span
from kvcr_io.agent import load_nixl

LAYERS = 32
LAYER = 256 * 8 * 128 * 2 * 2
"""One layer of the object: 256 tokens x 8 KV heads x head size 128 x K and V x 2 bytes (1 MiB)."""
assert LAYER == 1 << 20
LAYER_PLAN = [[f"L{i}"] for i in range(LAYERS)]
"""One group per layer."""


def node_flags() -> list[str]:
    return ["--pool", f"kv:64KiB:{SPANS + 8}", "--pool", f"layer:1MiB:{LAYERS + 4}", "--log-level", "WARNING"]


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

    def write(n: int, merged: bool = False) -> tuple[float, float]:
        t0 = time.perf_counter()
        sock.send(msgpack.packb({"t": "write", "n": n, "merged": merged}))
        while not sock.poll(0):
            agent.get_new_notifs()
        reply = msgpack.unpackb(sock.recv())
        assert reply["state"] == "DONE", reply
        return time.perf_counter() - t0, reply["s"]

    one = [write(LAYER // SPAN, merged=True) for _ in range(reps * 4)]  # one descriptor of 1 MiB
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
    samples = {"one_span_e2e": [e for e, _ in one], "one_span_xfer": [x for _, x in one],
               "whole_xfer": [x for _, x in whole], "rtt": rtt[50:]}
    return {**{name: summary(values) for name, values in samples.items()}, "samples": samples}


def bench_kvcr(a: str, b: str, b_defer: str, reps: int, progress: Progress) -> dict[str, Any]:
    layered = (np.arange(LAYERS * LAYER, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8) | 1
    big = (np.arange(SPANS * SPAN, dtype=np.uint64) * 40503 >> 7).astype(np.uint8) | 1
    out: dict[str, Any] = {}
    with Client(b, name="owner") as owner, Client(b_defer, name="owner-deferred") as owner2, Client(a, name="engine") as eng:
        for client in (owner, owner2):
            rs, rb = client.register(layered), client.register(big)
            res = client.deposit({
                b"layers": [Span(f"L{i}", rs, i * LAYER, LAYER, "layer") for i in range(LAYERS)],
                b"big": [Span(f"L{i}", rb, i * SPAN, SPAN, "kv") for i in range(SPANS)],
            }).result(30)
            assert res.all_ok, res
        dst_layers = np.zeros(LAYERS * LAYER, dtype=np.uint8)
        dst = np.zeros(SPANS * SPAN, dtype=np.uint8)
        rl, rd = eng.register(dst_layers), eng.register(dst)
        eng.submit_hint("bench", b, [b"layers", b"big"]).result(5)
        eng.submit_hint("bench-deferred", b_defer, [b"layers", b"big"]).result(5)
        layers = eng.destination([Span(f"L{i}", rl, i * LAYER, LAYER) for i in range(LAYERS)])

        def planned(request_id: str) -> tuple[float, float]:
            """(first layer landed, every layer landed), from the call."""
            t0 = time.perf_counter()
            handle = eng.deliver({b"layers": layers}, request_id=request_id, plan=LAYER_PLAN)
            handle.wait(0, 10)
            t_first = time.perf_counter() - t0
            assert handle.result(10)[b"layers"].ok
            return t_first, time.perf_counter() - t0

        def whole(key: bytes, spans: Any, request_id: str = "bench") -> float:
            t0 = time.perf_counter()
            res = eng.deliver({key: spans}, request_id=request_id).result(30)
            assert res[key].ok, res
            return time.perf_counter() - t0

        for _ in range(5):  # warm the peer session and both paths
            planned("bench")
            planned("bench-deferred")
        progress.step(f"time to first layer, inline and deferred source, {reps * 2} times each")
        runs, deferred = [], []
        for i in range(reps * 2):  # interleaved: both see the same machine load
            progress.tick("planned deliveries", i, reps * 2)
            runs.append(planned("bench"))
            deferred.append(planned("bench-deferred"))
        if not np.array_equal(dst_layers, layered):
            raise AssertionError("delivered bytes differ (layered object)")
        progress.step(f"whole objects: {LAYERS} MiB without a plan, {SPANS * SPAN >> 20} MiB of {SPAN >> 10} KiB spans")
        whole_layers = [whole(b"layers", layers) for _ in range(reps * 2)]
        big_spans = [Span(f"L{i}", rd, i * SPAN, SPAN) for i in range(SPANS)]
        prepared = eng.destination(big_spans)
        whole_big, whole_big_prepared = [], []
        for _ in range(reps):
            whole_big.append(whole(b"big", big_spans))
            whole_big_prepared.append(whole(b"big", prepared))
        if not np.array_equal(dst, big):
            raise AssertionError("delivered bytes differ (big object)")
        stats_b = owner.stats().result(5)
        assert stats_b["invariants"] == [] and stats_b["claims"]["total"] == 0, stats_b
        samples = {"first": [f for f, _ in runs], "planned_all": [t for _, t in runs],
                   "first_deferred": [f for f, _ in deferred], "whole_layers": whole_layers, "whole_big": whole_big,
                   "whole_big_prepared": whole_big_prepared}
        out.update({name: summary(values) for name, values in samples.items()})
        out["samples"] = samples
        out["inline_writes"] = stats_b["counters"].get("writes_inline", 0)
        out["notified"] = stats_b["transfers"].get("notified", 0)
        out["matched"] = eng.core.notifications["matched"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="also print one JSON object of the ratios")
    parser.add_argument("--plot", type=Path, metavar="FILE", help="write a PNG of the distributions beside the raw anchors")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args()
    flags = node_flags()
    progress = Progress("remote", 4, enabled=not args.quiet)
    with process_group("rbench") as (run, procs):
        progress.step("start nodes A, B and a deferred-submission B, and the raw NIXL writer")
        for name in ("a", "b"):
            procs.append(spawn("-m", "kvcr_node.cli", *flags, "--endpoint", f"ipc://{run}/{name}.sock"))
        deferred = str(Path(__file__).resolve().parent / "deferred_source.py")
        procs.append(spawn(deferred, *flags, "--endpoint", f"ipc://{run}/bd.sock"))
        procs.append(spawn(str(Path(__file__).resolve().parent / "local.py"), "--raw-writer", f"ipc://{run}/raw.sock"))
        k = bench_kvcr(f"ipc://{run}/a.sock", f"ipc://{run}/b.sock", f"ipc://{run}/bd.sock", args.reps, progress)
        progress.step("raw anchors: NIXL WRITE of one 1 MiB span and of the 64 MiB object, ZeroMQ round trips")
        r = raw_anchor(f"ipc://{run}/raw.sock", args.reps)
    anchor = r["one_span_xfer"]["median"] + r["rtt"]["median"]
    ttfl_ratio = k["first"]["median"] / anchor
    fraction = k["first"]["median"] / k["planned_all"]["median"]
    deliver_ratio = r["whole_xfer"]["median"] / k["whole_big"]["median"]
    print(f"load average {os.getloadavg()[0]:.2f} (cores {os.cpu_count()})")
    print(f"time to first layer: {LAYERS} layers of {LAYER >> 20} MiB on node B, client on node A, one group per layer")
    print(f"  kvcr first layer landed (wait(0))      {fmt_us(k['first'])}")
    print(f"  kvcr every layer landed (same deliver) {fmt_us(k['planned_all'])}")
    print(f"  kvcr whole object, no plan             {fmt_us(k['whole_layers'])}")
    print(f"  raw NIXL one 1 MiB span (in writer)    {fmt_us(r['one_span_xfer'])}")
    print(f"  raw ZeroMQ round trip                  {fmt_us(r['rtt'])}")
    print(f"  raw NIXL one span + ZeroMQ trigger     {fmt_us(r['one_span_e2e'])}")
    print(f"  notifications: B attached {k['notified']}, the client matched {k['matched']}")
    print(f"  ttfl_ratio first layer / (raw 1 MiB write + raw round trip): {ttfl_ratio:.2f}")
    print(f"  first_layer_fraction first layer / whole object: {fraction:.2f}")
    print(f"remote deliver throughput, {SPANS} spans of {SPAN >> 10} KiB ({SPANS * SPAN >> 20} MiB)")
    print(f"  kvcr remote deliver, list of spans     {fmt_gbps(SPANS * SPAN, k['whole_big'])}")
    print(f"  kvcr remote deliver, prepared dest.    {fmt_gbps(SPANS * SPAN, k['whole_big_prepared'])}")
    print(f"  raw NIXL WRITE, same descriptors       {fmt_gbps(SPANS * SPAN, r['whole_xfer'])}")
    print(f"  ratio kvcr / raw NIXL: list of spans {deliver_ratio:.2f}, "
          f"prepared destination {r['whole_xfer']['median'] / k['whole_big_prepared']['median']:.2f}")
    print("inline against deferred submission on the source (first layer of a planned deliver)")
    print(f"  inline    {fmt_us(k['first'])}")
    print(f"  deferred  {fmt_us(k['first_deferred'])}")
    print(f"  ratio deferred / inline: {k['first_deferred']['median'] / k['first']['median']:.2f}  "
          f"(source counted {k['inline_writes']} inline submissions)")
    if args.plot is not None:
        from plots import plot_remote

        plot_remote(k, r, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps({"ttfl_ratio": round(ttfl_ratio, 3), "first_layer_fraction": round(fraction, 3),
                          "remote_deliver_ratio": round(deliver_ratio, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
