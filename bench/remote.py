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
   through ``deferred_source.py``, which submits peer writes late in the turn);
4. the same objects leased with a read grant passed on from B (spec section 6.12, "Across
   nodes"): the client READs B's pools itself. First layer landed (the deliver call to
   group 0 done) against a bare NIXL agent of this process doing the same job on a raw
   writer holding the same bytes: the 32 layers READ one by one (the descriptors built per
   READ, as kvcr builds them), the first READ's time. Each raw run follows the kvcr run it
   anchors, so both see the same machine and the same cache: the layer a deliver reads
   first was evicted by the 31 read after it. (The raw READ of layer 0 repeated, which
   finds it in the cache, is printed too: ``grant_ttfl_ratio_hot``; and the same-memory
   anchor, a READ of B's very pool slot of layer 0 into the deliver's own destination,
   after the same lease renewal as the deliver: ``grant_ttfl_ratio_node``.) The whole planned
   deliver against the raw 32 READs (``grant_planned_vs_raw``); first of 32 layers against
   the whole planned deliver; the 64 MiB of 1024 spans against a raw NIXL READ of the same
   descriptors (prepared once).

Run: ``python bench/remote.py`` (under a minute); ``--json`` adds one line with
``ttfl_ratio``, ``first_layer_fraction``, ``remote_deliver_ratio``, ``grant_ttfl_ratio``
(goal <= 1.3), ``grant_first_layer_fraction`` (goal <= 0.1) and
``grant_remote_deliver_ratio`` (goal >= 0.95). Ratios matter, not absolute times. Progress goes to stderr (``--quiet``: none); ``--plot FILE`` writes a PNG of
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
from kvcr_protocol import DEFAULT_LIMITS, Lease, LeaseReply, ReleaseLease

LAYERS = 32
LAYER = 256 * 8 * 128 * 2 * 2
"""One layer of the object: 256 tokens x 8 KV heads x head size 128 x K and V x 2 bytes (1 MiB)."""
assert LAYER == 1 << 20
LAYER_PLAN = [[f"L{i}"] for i in range(LAYERS)]
"""One group per layer."""


def node_flags() -> list[str]:
    # Leases may pin whole pools: the granted measurements lease both objects at once. The
    # source trusts the target's clients with its pools (peer_grants), so that the grant
    # figures across nodes measure the client's own READs.
    return ["--pool", f"kv:64KiB:{SPANS + 8}", "--pool", f"layer:1MiB:{LAYERS + 4}", "--log-level", "WARNING",
            "--lease-pool-fraction", "1", "--lease-session-fraction", "1", "--peer-grants"]


def raw_read(agent: Any, writer: str, local: Any, remote: Any) -> float:
    """One raw NIXL READ by this process of ``remote`` into ``local`` (descriptor lists, or
    prepared lists as (list, list) handles), polled until done; its time from the post."""
    t0 = time.perf_counter()
    if isinstance(local, tuple):
        handle = agent.make_prepped_xfer("READ", local[0], local[1], remote[0], remote[1])
    else:
        handle = agent.initialize_xfer("READ", local, remote, writer)
    state = agent.transfer(handle)
    give_up = t0 + 30
    while state == "PROC" and time.perf_counter() < give_up:
        state = agent.check_xfer_state(handle)
    elapsed = time.perf_counter() - t0
    agent.release_xfer_handle(handle)
    assert state == "DONE", state
    return elapsed


def raw_anchor(endpoint: str, reps: int) -> dict[str, Any]:
    """Raw NIXL WRITE of one span and of 1024 spans into this process, raw ZeroMQ round trips,
    and this process's raw NIXL READs of the writer's memory: one 1 MiB layer, and 1024 spans."""
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


def _call(sock: zmq.Socket[bytes], msg: dict[str, Any]) -> bytes:
    sock.send(msgpack.packb(msg))
    return sock.recv()


class RawReader:
    """The anchors of reads under grants: a bare NIXL agent of this process READs the raw
    writer's memory into a registered buffer of its own, doing the job kvcr's deliver does
    (the descriptors built per READ, as kvcr builds them), timed rep by rep beside kvcr's
    deliveries so that both see the same machine."""

    def __init__(self, endpoint: str) -> None:
        nixl = load_nixl()
        self.agent = nixl.nixl_agent("raw-remote-reader", nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.dst = np.zeros(SPAN * SPANS, dtype=np.uint8)
        self.agent.register_memory([(self.dst.ctypes.data, self.dst.nbytes, 0, "")], "DRAM")
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(endpoint)
        found = msgpack.unpackb(_call(self.sock, {"t": "md"}))
        self.writer, self.base = self.agent.add_remote_agent(found["md"]), int(found["addr"])
        here, there = self.dst.ctypes.data, self.base
        self.mine = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(here + i * SPAN, SPAN, 0) for i in range(SPANS)], "DRAM")
        self.theirs = self.agent.prep_xfer_dlist(self.writer, [(there + i * SPAN, SPAN, 0) for i in range(SPANS)], "DRAM")
        for _ in range(3):  # the connection's set-up is not the anchor
            self.layer(0)

    def layer(self, i: int) -> float:
        """One READ of layer ``i`` (1 MiB, one descriptor), posted and polled until done."""
        ldesc = self.agent.get_xfer_descs(np.array([(self.dst.ctypes.data + i * LAYER, LAYER, 0)], dtype=np.uint64), "DRAM")
        rdesc = self.agent.get_xfer_descs(np.array([(self.base + i * LAYER, LAYER, 0)], dtype=np.uint64), "DRAM")
        return raw_read(self.agent, self.writer, ldesc, rdesc)

    def layers(self) -> tuple[float, float]:
        """The 32 layers READ one by one, as a planned deliver of one group per layer reads
        them: (the first layer's READ, every layer's)."""
        t0 = time.perf_counter()
        first = self.layer(0)
        for i in range(1, LAYERS):
            self.layer(i)
        return first, time.perf_counter() - t0

    def whole(self) -> float:
        """The 1024 spans of 64 KiB in one READ of prepared descriptors."""
        everything = list(range(SPANS))
        return raw_read(self.agent, self.writer, (self.mine, everything), (self.theirs, everything))

    def reach(self, owner: Client, key: bytes, into: np.ndarray) -> None:
        """Make ready the same-memory anchor of a granted deliver's first layer: B's own pool
        slot of layer 0 of ``key`` (its agent and address, from a lease asked for on the wire
        by ``owner``, a client of B) and layer 0 of ``into``, the deliver's destination,
        registered with this bare agent too. Released at once: nothing evicts the object."""
        core = owner.core
        _, asked = core.request(lambda i: Lease(i, (key,), None, 0, True, True), lambda m: m, 10.0)
        reply = core.wait(asked, 12.0)
        if not isinstance(reply, LeaseReply) or reply.grant is None or reply.grant.node is None or owner.node is None:
            raise AssertionError("B granted no read with its agent (client_transfers off?)")
        node = reply.grant.node
        [(_, _, pools, slots)] = list(reply.grant.keys(DEFAULT_LIMITS))
        pool = node.pools[pools[0]]
        slot_size = owner.node.pools[pool.region].slot_size  # a grant's pool names its index in the welcome
        self.node = self.agent.add_remote_agent(node.agent_md)
        self.agent.register_memory([(into.ctypes.data, into.nbytes, 0, "")], "DRAM")
        self.node_rows = (np.array([(into.ctypes.data, LAYER, 0)], dtype=np.uint64),
                          np.array([(pool.address + slots[0] * slot_size, LAYER, 0)], dtype=np.uint64))
        core.wait(core.request(lambda i: ReleaseLease(i, reply.lease), lambda m: m, 10.0)[1], 12.0)

    def node_layer(self) -> float:
        """One READ of layer 0 from B's pool slot into the deliver's destination (``reach``):
        the very descriptors of the granted deliver's first post, built per READ as it builds them."""
        here, there = self.node_rows
        return raw_read(self.agent, self.node, self.agent.get_xfer_descs(here, "DRAM"),
                        self.agent.get_xfer_descs(there, "DRAM"))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def bench_grants(
    eng: Client, layers: Any, big_spans: Any, layered: np.ndarray, big: np.ndarray, dst_layers: np.ndarray,
    dst: np.ndarray, reps: int, raw: RawReader, progress: Progress,
) -> dict[str, list[float]]:
    """The objects leased at B through A with a read grant: the client READs B's pools. The
    lease is renewed before each timed deliver, outside the timing, so that the clock alone
    vouches for every read (spec section 6.12, "Validity")."""
    progress.step(f"under a read grant from B: first layer and {SPANS * SPAN >> 20} MiB, {reps * 2} times each")
    lease = eng.lease([b"layers", b"big"], request_id="bench", ttl_ms=600_000).result(10)
    grants = eng.grants()
    if not grants.sources or len(grants.keys) != 2:
        raise AssertionError(f"B's grant did not reach the client (client_transfers off, or below version 5?): "
                             f"{len(grants.keys)} keys, {len(grants.sources)} sources, {[lease.status(k) for k in lease.keys]}")
    reads = eng.counters()["grant_reads"]
    times: dict[str, list[float]] = {"grant_first": [], "grant_planned_all": [], "grant_whole_big": [],
                                     "raw_read_first": [], "raw_read_layers": [], "raw_read_whole": [], "raw_read_hot": [],
                                     "raw_node_first": []}

    def planned() -> tuple[float, float]:
        t0 = time.perf_counter()
        handle = eng.deliver({b"layers": layers}, request_id="bench", plan=LAYER_PLAN)
        handle.wait(0, 10)
        t_first = time.perf_counter() - t0
        assert handle.result(10)[b"layers"].ok
        return t_first, time.perf_counter() - t0

    def whole() -> float:
        t0 = time.perf_counter()
        res = eng.deliver({b"big": big_spans}, request_id="bench").result(30)
        assert res[b"big"].ok, res
        return time.perf_counter() - t0

    dst_layers[:] = 0
    dst[:] = 0
    for _ in range(3):
        planned()
        whole()
    if not np.array_equal(dst_layers, layered) or not np.array_equal(dst, big):
        raise AssertionError("bytes read under B's grant differ from the deposited bytes")
    for i in range(reps * 2):
        progress.tick("granted deliveries", i, reps * 2)
        lease.renew().result(10)
        first, every = planned()
        times["grant_first"].append(first)
        times["grant_planned_all"].append(every)
        first, every = raw.layers()
        times["raw_read_first"].append(first)
        times["raw_read_layers"].append(every)
        times["raw_read_hot"] += [raw.layer(0) for _ in range(2)]
        lease.renew().result(10)
        times["raw_node_first"].append(raw.node_layer())
        lease.renew().result(10)
        times["grant_whole_big"].append(whole())
        times["raw_read_whole"].append(raw.whole())
    if eng.counters()["grant_reads"] != reads + 6 + 4 * reps:
        raise AssertionError("a deliver of the leased objects went through the nodes")
    lease.release().result(10)
    return times


def bench_kvcr(a: str, b: str, b_defer: str, raw: RawReader, reps: int, progress: Progress) -> dict[str, Any]:
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
        raw.reach(owner, b"layers", dst_layers)
        granted = bench_grants(eng, layers, big_spans, layered, big, dst_layers, dst, reps, raw, progress)
        stats_b = owner.stats(audit=True).result(5)
        assert stats_b["invariants"] == [] and stats_b["claims"]["total"] == 0, stats_b
        samples = {"first": [f for f, _ in runs], "planned_all": [t for _, t in runs],
                   "first_deferred": [f for f, _ in deferred], "whole_layers": whole_layers, "whole_big": whole_big,
                   "whole_big_prepared": whole_big_prepared, **granted}
        out.update({name: summary(values) for name, values in samples.items()})
        out["samples"] = samples
        out["inline_writes"] = stats_b["counters"].get("writes_inline", 0)
        out["notified"] = stats_b["transfers"].get("notified", 0)
        out["matched"] = eng.core.notifications["matched"]
    return out


def ratios(k: dict[str, Any], r: dict[str, Any]) -> dict[str, float]:
    """The ``--json`` figures from the kvcr and raw summaries (medians; ``_spread`` keys:
    (p90 - p10) / median of the kvcr side of each granted figure)."""
    anchor = r["one_span_xfer"]["median"] + r["rtt"]["median"]
    return {
        "ttfl_ratio": k["first"]["median"] / anchor,
        "first_layer_fraction": k["first"]["median"] / k["planned_all"]["median"],
        "remote_deliver_ratio": r["whole_xfer"]["median"] / k["whole_big"]["median"],
        "grant_ttfl_ratio": k["grant_first"]["median"] / k["raw_read_first"]["median"],
        "grant_ttfl_ratio_hot": k["grant_first"]["median"] / k["raw_read_hot"]["median"],
        "grant_ttfl_ratio_node": k["grant_first"]["median"] / k["raw_node_first"]["median"],
        "grant_first_layer_fraction": k["grant_first"]["median"] / k["grant_planned_all"]["median"],
        "grant_planned_vs_raw": k["grant_planned_all"]["median"] / k["raw_read_layers"]["median"],
        "grant_remote_deliver_ratio": k["raw_read_whole"]["median"] / k["grant_whole_big"]["median"],
        "grant_first_spread": k["grant_first"]["spread"],
        "grant_whole_big_spread": k["grant_whole_big"]["spread"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="also print one JSON object of the ratios")
    parser.add_argument("--plot", type=Path, metavar="FILE", help="write a PNG of the distributions beside the raw anchors")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--no-integrity", action="store_true",
                        help="nodes that take no digests (the goals' condition; bench/integrity.py prices them)")
    args = parser.parse_args()
    flags = [*node_flags(), *(["--no-integrity"] if args.no_integrity else [])]
    progress = Progress("remote", 5, enabled=not args.quiet)
    with process_group("rbench") as (run, procs):
        progress.step("start nodes A, B and a deferred-submission B, and the raw NIXL writer")
        for name in ("a", "b"):
            procs.append(spawn("-m", "kvcr_node.cli", *flags, "--endpoint", f"ipc://{run}/{name}.sock"))
        deferred = str(Path(__file__).resolve().parent / "deferred_source.py")
        procs.append(spawn(deferred, *flags, "--endpoint", f"ipc://{run}/bd.sock"))
        procs.append(spawn(str(Path(__file__).resolve().parent / "local.py"), "--raw-writer", f"ipc://{run}/raw.sock"))
        raw = RawReader(f"ipc://{run}/raw.sock")
        try:
            k = bench_kvcr(f"ipc://{run}/a.sock", f"ipc://{run}/b.sock", f"ipc://{run}/bd.sock", raw, args.reps, progress)
        finally:
            raw.close()
        progress.step("raw anchors: NIXL WRITE of one 1 MiB span and of the 64 MiB object, ZeroMQ round trips")
        r = raw_anchor(f"ipc://{run}/raw.sock", args.reps)
    figures = ratios(k, r)
    ttfl_ratio, fraction, deliver_ratio = figures["ttfl_ratio"], figures["first_layer_fraction"], figures["remote_deliver_ratio"]
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
    print("under a read grant passed on from B (the client READs B's pools itself; spec section 6.12)")
    print(f"  kvcr first layer landed (wait(0))      {fmt_us(k['grant_first'])}")
    print(f"  kvcr every layer landed (same deliver) {fmt_us(k['grant_planned_all'])}")
    print(f"  raw NIXL READ, first of 32 layers      {fmt_us(k['raw_read_first'])}")
    print(f"  raw NIXL READ, 32 layers one by one    {fmt_us(k['raw_read_layers'])}")
    print(f"  raw NIXL READ of layer 0 again (hot)   {fmt_us(k['raw_read_hot'])}")
    print(f"  raw NIXL READ of B's slot of layer 0   {fmt_us(k['raw_node_first'])}")
    print(f"  grant_ttfl_ratio first layer / raw READ of the first layer: {figures['grant_ttfl_ratio']:.2f} (goal <= 1.3); "
          f"against the cache-hot repeat {figures['grant_ttfl_ratio_hot']:.2f}; "
          f"against a READ of B's very slot into the deliver's destination {figures['grant_ttfl_ratio_node']:.2f}")
    print(f"  grant_first_layer_fraction first layer / whole: {figures['grant_first_layer_fraction']:.2f} (goal <= 0.1)")
    print(f"  grant_planned_vs_raw every layer / raw 32 READs: {figures['grant_planned_vs_raw']:.2f}")
    print(f"  kvcr {SPANS * SPAN >> 20} MiB, {SPANS} spans           {fmt_gbps(SPANS * SPAN, k['grant_whole_big'])}")
    print(f"  raw NIXL READ, same descriptors        {fmt_gbps(SPANS * SPAN, k['raw_read_whole'])}")
    print(f"  grant_remote_deliver_ratio raw READ / kvcr: {figures['grant_remote_deliver_ratio']:.2f} (goal >= 0.95)")
    if args.plot is not None:
        from plots import plot_remote

        plot_remote(k, r, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps({name: round(value, 3) for name, value in figures.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
