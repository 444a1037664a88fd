"""Local benchmark: a kvcr node and a client on one host, each against its raw anchor.

Measured in one run, in one process tree, each kvcr measurement followed by its raw
anchor's, so that both see the same machine (other work on it shifts both):

1. deliver of a 64 MiB object of 64 KiB spans through the node, against a raw NIXL WRITE
   of the same descriptors from a bare NIXL process into the same kind of client buffer
   (timed in the writer, and end to end with a raw ZeroMQ trigger);
2. deliver of the same object leased with a read grant (spec section 6.12): the client READs
   the node's pools itself, against a raw NIXL READ of the same descriptors by a bare agent in
   this process from the raw writer's registered buffer (prepared once, and as one descriptor
   built per request: kvcr merges contiguous slots);
3. deposit of the same object under new keys against a raw NIXL READ of the same descriptors,
   and put of it under new keys (spec section 6.13: the client WRITEs the slots the node
   reserved, then commits) against a raw NIXL WRITE of the same descriptors by a bare agent;
4. query round trips against a raw ZeroMQ DEALER/ROUTER msgpack echo: one key with the blocking
   ``Client`` and with ``AsyncClient``; then ``bench/lookups.py``'s lookups at engine scale
   (1,000 keys against an echo of the same sizes, a prefix query, 5,000 queries in flight);
5. admission into a full pool as evictable objects in an unrelated pool grow 1k..100k;
6. the CPU use of the node and of an idle client process while it is connected, holding
   no grant (the anchor) and then 64 read-granted leases (/proc schedstat of every thread), and
   index memory per stored object at 100,000 objects;
7. with ``--plot`` or ``--sweep``: deliver throughput against span size (4 KiB .. 1 MiB
   spans, 16 MiB each) against a raw NIXL WRITE of the same descriptors.

Run: ``python bench/local.py`` (under a minute; ``--quick``: about 15 s). Ratios matter,
not absolute times. Progress goes to stderr (``--quiet``: none). ``--plot FILE`` writes a
PNG (``bench/plots.py``): the latency distributions of each kvcr measurement beside its raw
anchor, and throughput against span size. With ``--json`` the report goes to stderr and
stdout carries one JSON object: ``query_ratio`` and ``query_ratio_async`` (query p50 / echo p50), ``deliver_ratio``
(raw NIXL WRITE p50 / kvcr deliver p50, list of spans), ``grant_deliver_ratio`` (raw NIXL READ
p50 of the same 1024 descriptors, the node's slots of the object, by a bare agent / kvcr deliver
p50 under a read grant; ``_writer``: the same READ shape from a raw writer process's buffer
instead, which copies faster here than any live node's pool; ``_merged``: from that buffer, one
descriptor), ``grant_deliver_prepared_ratio`` (the same anchor / the deliver to a prepared
``Destination``, which skips checking and converting 1024 ``Span``: docs/performance.md), ``grant_deliver_small_us`` and ``grant_deliver_small_ratio`` (a granted whole deliver
of one 64 KiB span, p50, and over a bare agent's READ of its slot), ``grant_deliver_ms``, ``raw_grant_read_ms`` and ``raw_writer_read_ms`` (their medians) and
``grant_deliver_spread`` and ``raw_grant_read_spread`` ((p90 - p10) / median), ``deposit_ratio`` (raw NIXL READ p50
/ kvcr deposit p50), ``planned_vs_whole_local`` (the same object delivered by the node in 32
groups of a layer plan, p50 / whole, both to the prepared destination; ``planned_vs_whole_raw``: the
same for raw NIXL, the object as 32 WRITEs in order, each with a notification, / one WRITE, the
floor of the former; ``planned_deliver_ratio``: those 32 raw WRITEs p50 / kvcr's planned deliver p50), ``put_deposit_ratio`` (raw NIXL WRITE p50 of the same 1024 descriptors by a bare
agent / kvcr put p50 under a write grant, put, WRITE and commit included; ``_merged``: against one
descriptor; ``put_ms``, ``raw_put_write_ms`` and their ``_spread``), ``put_node_ratio`` and
``raw_node_write_ms`` (the same WRITE by a bare agent into the node's very slots the put wrote,
so the pool's memory is in the anchor too), ``put_written_ratio`` (the same
anchor / the put's ``written``, once its WRITE is done and before its commit's reply: when an
engine may reuse its buffer) and ``put_written_ms``, ``idle_cpu_percent`` (node and an idle client process holding 64 read-granted
leases together, % of a core, past the node's fast progress after a grant; ``idle_node_cpu_percent``:
the node alone) and its anchor of the same run, ``idle_cpu_percent_no_grants`` and
``idle_node_cpu_percent_no_grants`` (the same node and an idle client that holds no grant),
``query_1000_us``, ``query_1000_ratio``, ``prefix_1000_us`` and ``pipelined_queries_per_s``
(from ``bench/lookups.py``); after a sweep also ``deliver_ratio_<N>k`` per span size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TextIO

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lookups
from admission import index_bytes_per_object, measure_admission
from anchors import Peer, echo, serve
from buffers import aligned
from procs import process_group, spawn, stop
from stats import Progress, fmt_gbps, fmt_us, summary

from kvcr_client import AsyncClient, Client, Span
from kvcr_io.agent import load_nixl
from kvcr_node.grant_progress import GRANT_BURST_S
from kvcr_protocol import CURRENT_VERSION, DEFAULT_LIMITS, Lease, LeaseReply, ReleaseLease

SPAN = 64 << 10
SPANS = 1024
OBJECT = SPAN * SPANS  # 64 MiB
LAYERS = [[f"L{i}" for i in range(g * SPANS // 32, (g + 1) * SPANS // 32)] for g in range(32)]
"""A layer plan of 32 groups over the object's spans, in order (``planned_vs_whole_local``)."""
SMALL_PER_REP = 20
"""Granted delivers of the one-span object per repetition (each a few tens of microseconds)."""
IDLE_CLIENT_S = 3600.0
"""How long the idle client process waits to be stopped (it always is, long before)."""
IDLE_SETTLE_S = 0.2
IDLE_GRANTS = 64
"""Read-granted leases the idle client holds while the node's idle CPU is measured with grants."""
IDLE_LEASE_TTL_MS = 600_000
WARMUP = 200
"""Round trips run before the timed ones (allocator, caches, socket buffers)."""
SWEEP_SPANS = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20)
"""Span sizes of the throughput sweep."""
SWEEP_BYTES = 16 << 20
"""Bytes of each object of the sweep (4096 spans of 4 KiB .. 16 of 1 MiB)."""


def sweep_pool(span: int) -> str:
    return f"s{span >> 10}k"


# --------------------------------------------------------------------------- raw anchors


def raw_writer(endpoint: str) -> None:
    """A bare NIXL process: a page-aligned pool registered once, WRITEs on request, and the echo."""
    nixl = load_nixl()
    agent = nixl.nixl_agent("raw-writer", nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    pool = aligned(OBJECT)  # the memory a node's DRAM pool has (kvcr_node.memory)
    pool[:] = (np.arange(OBJECT, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8) | 1
    base = pool.ctypes.data
    agent.register_memory([(base, OBJECT, 0, "")], "DRAM")
    local = {SPAN: agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(base + i * SPAN, SPAN, 0) for i in range(SPANS)], "DRAM")}
    peer: dict[str, Any] = {}

    def setup(msg: dict[str, Any]) -> dict[str, Any]:
        peer["name"] = agent.add_remote_agent(msg["md"])
        peer["addr"] = msg["addr"]
        peer["dlist"] = {SPAN: agent.prep_xfer_dlist(peer["name"], [(msg["addr"] + i * SPAN, SPAN, 0) for i in range(SPANS)], "DRAM")}
        # The client's source buffer, when it names one: a READ of it is a deposit's anchor
        # (bench/remote.py's anchor only WRITEs into this process).
        if "src" in msg:
            peer["src"] = agent.prep_xfer_dlist(peer["name"], [(msg["src"] + i * SPAN, SPAN, 0) for i in range(SPANS)],
                                                "DRAM")
        return {"t": "ok"}

    def dlists(span: int) -> tuple[Any, Any]:
        """Both sides' descriptor lists of ``span``-byte descriptors over the whole buffer, prepared once."""
        if span not in local:
            count = OBJECT // span
            local[span] = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(base + i * span, span, 0) for i in range(count)], "DRAM")
            peer["dlist"][span] = agent.prep_xfer_dlist(
                peer["name"], [(peer["addr"] + i * span, span, 0) for i in range(count)], "DRAM")
        return local[span], peer["dlist"][span]

    def md(msg: dict[str, Any]) -> dict[str, Any]:
        """This agent's metadata and the pool's address: a consumer READs the pool with them."""
        return {"t": "md", "md": agent.get_agent_metadata(), "addr": base}

    def write(msg: dict[str, Any]) -> dict[str, Any]:
        # The first ``n`` descriptors (all by default) of ``span`` bytes, one NIXL request.
        n = msg.get("n", SPANS)
        span = msg.get("span", SPAN)
        t0 = time.perf_counter()
        if msg.get("groups"):
            return write_groups(msg["groups"], t0)
        if msg.get("merged"):
            # The same bytes as one descriptor each side, built per request (what kvcr
            # posts after merging contiguous spans).
            ldesc = agent.get_xfer_descs(np.array([(base, n * span, 0)], dtype=np.uint64), "DRAM")
            rdesc = agent.get_xfer_descs(np.array([(peer["addr"], n * span, 0)], dtype=np.uint64), "DRAM")
            handle = agent.initialize_xfer("WRITE", ldesc, rdesc, peer["name"])
        else:
            # READ pulls the client's bytes into the pool (what a deposit does).
            op = "READ" if msg.get("read") else "WRITE"
            mine, theirs = dlists(span)
            if op == "READ":
                theirs = peer["src"]
            handle = agent.make_prepped_xfer(op, mine, list(range(n)), theirs, list(range(n)))
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        return {"t": "done", "s": time.perf_counter() - t0, "state": state}

    def write_groups(groups: int, t0: float) -> dict[str, Any]:
        """The object as ``groups`` WRITEs in order, each of its descriptors with a notification,
        each posted once the one before is done: what a node's planned deliver asks of NIXL."""
        mine, theirs = dlists(SPAN)
        per = SPANS // groups
        state = "DONE"
        for g in range(groups):
            rows = list(range(g * per, (g + 1) * per))
            handle = agent.make_prepped_xfer("WRITE", mine, rows, theirs, rows, f"g{g}".encode())
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            agent.release_xfer_handle(handle)
            if state != "DONE":
                break
        return {"t": "done", "s": time.perf_counter() - t0, "state": state}

    serve(endpoint, {"setup": setup, "write": write, "md": md, "echo": echo}, idle=agent.get_new_notifs)


class RawNixl:
    """This process's side of the raw NIXL anchors: a bare agent with kvcr's own two buffers
    registered (``src``, the deposits' and puts' source; ``dst``, the deliveries'
    destination), so each anchor moves the very memory kvcr moves. The raw writer WRITEs into
    ``dst`` and READs ``src``, 1024 x 64 KiB per request, timed in the writer; the consumer
    anchors READ into ``dst`` and WRITE from ``src``, timed here."""

    def __init__(self, peer: Peer, src: np.ndarray, dst: np.ndarray) -> None:
        nixl = load_nixl()
        logging.getLogger("nixl").setLevel(logging.WARNING)  # its start-up lines at INFO
        self.peer = peer
        self.agent = nixl.nixl_agent("raw-client", nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.src, self.dst = src, dst
        self.agent.register_memory([(src.ctypes.data, OBJECT, 0, ""), (dst.ctypes.data, OBJECT, 0, "")], "DRAM")
        assert peer.call({"t": "setup", "md": self.agent.get_agent_metadata(), "addr": dst.ctypes.data,
                          "src": src.ctypes.data})["t"] == "ok"
        self.runs: dict[str, list[float]] = {"write": [], "write_e2e": [], "write_merged": [], "write_planned": [], "read": [],
                                             "consumer_read": [], "consumer_read_merged": [], "consumer_write": [],
                                             "consumer_write_merged": [], "node_read": [], "node_read_small": [], "node_write": []}
        found = peer.call({"t": "md"})
        self.writer = self.agent.add_remote_agent(found["md"])
        self.writer_addr = int(found["addr"])
        self.mine = {buf.ctypes.data: self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", [(buf.ctypes.data + i * SPAN, SPAN, 0) for i in range(SPANS)], "DRAM") for buf in (src, dst)}
        self.theirs = self.agent.prep_xfer_dlist(
            self.writer, [(self.writer_addr + i * SPAN, SPAN, 0) for i in range(SPANS)], "DRAM")
        self.sweep: dict[int, list[float]] = {}
        """Span size -> raw NIXL WRITE times of ``SWEEP_BYTES`` in spans of that size."""
        self.node = ""
        self.node_slots: Any = None
        self.small_slot: Any = None
        """The node's one slot of the one-span object (``reach_node``), for ``node_read_small``."""

    def run(self, kind: str) -> None:
        """One timed request: ``write``, ``write_merged``, ``write_planned`` (the object in the
        32 groups of ``LAYERS``, one WRITE each) or ``read``."""
        t0 = time.perf_counter()
        reply = self.peer.call({"t": "write", "merged": kind == "write_merged", "read": kind == "read",
                                "groups": len(LAYERS) if kind == "write_planned" else 0}, self.agent.get_new_notifs)
        assert reply["state"] == "DONE", reply
        self.runs[kind].append(reply["s"])
        if kind == "write":
            self.runs["write_e2e"].append(time.perf_counter() - t0)

    def consumer_read(self, merged: bool) -> None:
        """The raw anchor of a deliver under a read grant: one timed READ, by this process, of the
        writer's 1024 x 64 KiB into ``dst`` (prepared lists, or one descriptor per side built for
        the request)."""
        self._consumer("READ", merged)

    def consumer_write(self, merged: bool) -> None:
        """The raw anchor of a put under a write grant: one timed WRITE, by this process, of
        ``dst`` into the writer's 1024 x 64 KiB (prepared lists, or one descriptor per side)."""
        self._consumer("WRITE", merged)

    def _consumer(self, op: str, merged: bool) -> None:
        agent = self.agent
        base = (self.dst if op == "READ" else self.src).ctypes.data
        t0 = time.perf_counter()
        if merged:
            ldesc = agent.get_xfer_descs(np.array([(base, OBJECT, 0)], dtype=np.uint64), "DRAM")
            rdesc = agent.get_xfer_descs(np.array([(self.writer_addr, OBJECT, 0)], dtype=np.uint64), "DRAM")
            handle = agent.initialize_xfer(op, ldesc, rdesc, self.writer)
        else:
            handle = agent.make_prepped_xfer(op, self.mine[base], list(range(SPANS)), self.theirs, list(range(SPANS)))
        name = "consumer_read" if op == "READ" else "consumer_write"
        self._finish(handle, t0, f"{name}_merged" if merged else name)

    def _finish(self, handle: Any, t0: float, name: str) -> None:
        """Post ``handle``, wait for it (bounded), release it, and record its time since ``t0`` as ``name``."""
        agent = self.agent
        state = agent.transfer(handle)
        give_up = t0 + 30
        while state == "PROC" and time.perf_counter() < give_up:
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        assert state == "DONE", state
        self.runs[name].append(time.perf_counter() - t0)

    def reach_node(self, client: Client, key: bytes, small: bool = False) -> Any:
        """Make ready the anchor of a deliver under a read grant that reads what the deliver
        reads: the node's own pool slots holding ``key`` (its agent and their addresses, from
        a lease asked for here with the node's agent metadata), into ``dst``. Released at once:
        the benchmark's own lease keeps the object in place."""
        _, asked = client.core.request(lambda i: Lease(i, (key,), None, 0, True, True), lambda m: m, 10.0)
        reply = client.core.wait(asked, 12.0)
        if not isinstance(reply, LeaseReply) or reply.grant is None or reply.grant.node is None:
            raise AssertionError("the node granted no read with its agent (client_transfers off?)")
        grant = reply.grant
        node = self.agent.add_remote_agent(grant.node.agent_md)
        slot_size = client.pools["kv"].slot_size
        [(_, _, pools, slots)] = list(grant.keys(DEFAULT_LIMITS))
        addresses = [grant.node.pools[p].address + s * slot_size for p, s in zip(pools, slots, strict=True)]
        self.node = node
        dlist = self.agent.prep_xfer_dlist(node, [(a, SPAN, 0) for a in addresses], "DRAM")
        if small:
            self.small_slot = dlist
        else:
            self.node_slots = dlist
        client.core.wait(client.core.request(lambda i: ReleaseLease(i, reply.lease), lambda m: m, 10.0)[1], 12.0)
        return dlist

    def node_read(self) -> None:
        """The anchor of a deliver under a read grant: one timed READ, by this bare agent, of
        the node's 1024 slots of the object into ``dst`` (``reach_node``): the same
        descriptors, in the same memory, as the deliver's."""
        t0 = time.perf_counter()
        handle = self.agent.make_prepped_xfer("READ", self.mine[self.dst.ctypes.data], list(range(SPANS)),
                                              self.node_slots, list(range(SPANS)))
        self._finish(handle, t0, "node_read")

    def node_write(self, client: Client, key: bytes) -> None:
        """The same-memory anchor of a put under a write grant: one timed WRITE, by this bare
        agent, of ``src`` into the node's slots of the object the put just stored under
        ``key`` (found untimed, ``reach_node``): the very memory the put wrote, and the very
        bytes, so the stored object stays as it is."""
        slots = self.reach_node(client, key)
        t0 = time.perf_counter()
        handle = self.agent.make_prepped_xfer("WRITE", self.mine[self.src.ctypes.data], list(range(SPANS)),
                                              slots, list(range(SPANS)))
        self._finish(handle, t0, "node_write")
        self.agent.release_dlist_handle(slots)

    def node_read_small(self) -> None:
        """The anchor of the granted deliver of the one-span object: one timed READ of its
        node slot into the first span of ``dst`` (the deliver's destination)."""
        t0 = time.perf_counter()
        handle = self.agent.make_prepped_xfer("READ", self.mine[self.dst.ctypes.data], [0], self.small_slot, [0])
        self._finish(handle, t0, "node_read_small")

    def run_span(self, span: int) -> None:
        """One timed WRITE of ``SWEEP_BYTES`` in descriptors of ``span`` bytes."""
        reply = self.peer.call({"t": "write", "span": span, "n": SWEEP_BYTES // span}, self.agent.get_new_notifs)
        assert reply["state"] == "DONE", reply
        self.sweep.setdefault(span, []).append(reply["s"])

    def summaries(self) -> dict[str, dict[str, float]]:
        return {name: summary(samples) for name, samples in self.runs.items()}


# --------------------------------------------------------------------------- kvcr


def bench_grants(
    client: Client, raw: RawNixl, dests: dict[str, Any], src: np.ndarray, dst: np.ndarray, reps: int, progress: Progress,
) -> dict[str, list[float]]:
    """Deliveries of the object under a read grant (the client READs the node's pools), each
    followed by the raw consumer READs of the same descriptors; the kvcr times per form."""
    progress.step(f"deliver {OBJECT >> 20} MiB under a read grant against raw NIXL READ, {reps} times")
    small = dests.pop("small")
    lease = client.lease([b"obj", b"small"]).result(30)
    if client.tables()["granted_keys"] != 2:
        raise AssertionError("the node granted no read of the leased objects (client_transfers off?)")
    reads = client.counters()["grant_reads"]
    raw.reach_node(client, b"obj")
    raw.reach_node(client, b"small", small=True)
    for how, dest in dests.items():
        dst[:] = 0
        assert client.deliver(dest).result(30)[b"obj"].ok
        if not np.array_equal(src, dst):
            raise AssertionError(f"bytes read under the grant differ from the deposited bytes ({how})")
    dst[:] = 0
    raw.node_read()
    if not np.array_equal(src, dst):
        raise AssertionError("the anchor's READ of the node's slots did not read the object")
    raw.runs["node_read"].clear()
    dst[:SPAN] = 0
    assert client.deliver(small).result(30)[b"small"].ok
    raw.node_read_small()
    if not np.array_equal(src[:SPAN], dst[:SPAN]):
        raise AssertionError("bytes read under the grant differ from the deposited bytes (one span)")
    raw.runs["node_read_small"].clear()
    times: dict[str, list[float]] = {"list": [], "prepared": [], "small": []}
    for rep in range(reps):
        progress.tick("grant deliveries", rep, reps)
        for how, dest in dests.items():
            t0 = time.perf_counter()
            res = client.deliver(dest).result(30)
            times[how].append(time.perf_counter() - t0)
            assert res[b"obj"].ok, res
        raw.node_read()
        raw.consumer_read(merged=False)
        raw.consumer_read(merged=True)
        for _ in range(SMALL_PER_REP):
            t0 = time.perf_counter()
            res = client.deliver(small).result(30)
            times["small"].append(time.perf_counter() - t0)
            assert res[b"small"].ok, res
            raw.node_read_small()
    if client.counters()["grant_reads"] != reads + 3 + (2 + SMALL_PER_REP) * reps:
        raise AssertionError("a deliver of the leased object went to the node")
    lease.release().result(30)
    return times


def bench_puts(client: Client, raw: RawNixl, rs: Any, spans: list[Span], src: np.ndarray, dst: np.ndarray, reps: int,
               progress: Progress) -> tuple[list[float], list[float]]:
    """Puts of the object under new keys (spec section 6.13: the client WRITEs the node's pool
    itself, then commits), each followed by the raw consumer WRITEs of the same descriptors:
    each put's seconds to its commit's reply, and to its ``written`` (the caller's memory free)."""
    progress.step(f"put {OBJECT >> 20} MiB under a write grant against raw NIXL WRITE, {reps} times")
    sources = [Span(f"L{i}", rs, i * SPAN, SPAN, "kv") for i in range(SPANS)]
    puts = client.counters()["puts"]
    times, written = [], []
    for i in range(reps):
        progress.tick("puts", i, reps)
        t0 = time.perf_counter()
        handle = client.put({f"put{i}".encode(): sources})
        handle.written.result(30)
        written.append(time.perf_counter() - t0)
        res = handle.result(30)
        times.append(time.perf_counter() - t0)
        assert res.all_ok, res
        raw.consumer_write(merged=False)
        raw.consumer_write(merged=True)
        raw.node_write(client, f"put{i}".encode())
    if client.counters()["puts"] != puts + reps:
        raise AssertionError("a put went to the node as a deposit (client_transfers off?)")
    dst[:] = 0
    last = f"put{reps - 1}".encode()
    assert client.deliver({last: spans}).result(30)[last].ok
    if not np.array_equal(src, dst):
        raise AssertionError("a put's bytes differ when delivered back")
    return times, written


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of process ``pid`` so far, in ns resolution (``schedstat``, not clock ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def paired(kvcr: Callable[[int], object], raw: Callable[[int], object], n: int) -> tuple[list[float], list[float]]:
    """Alternate one kvcr call and one raw call ``n`` times after a warm-up; both sides' samples."""
    ours, theirs = [], []
    clock = time.perf_counter
    for i in range(WARMUP + n):
        t0 = clock()
        kvcr(i)
        t1 = clock()
        raw(i)
        t2 = clock()
        if i >= WARMUP:
            ours.append(t1 - t0)
            theirs.append(t2 - t1)
    return ours, theirs


async def paired_async(kvcr: Callable[[int], Awaitable[object]], raw: Callable[[int], object], n: int) -> list[float]:
    """As ``paired``, with an awaited kvcr call; the samples of the kvcr side."""
    ours = []
    clock = time.perf_counter
    for i in range(WARMUP + n):
        t0 = clock()
        await kvcr(i)
        t1 = clock()
        raw(i)
        if i >= WARMUP:
            ours.append(t1 - t0)
    return ours


def small_echo(peer: Peer) -> Callable[[int], object]:
    return lambda i: peer.call({"v": 2, "t": "echo", "id": i, "keys": [b"k" * 32]})


def bench_queries(client: Client, endpoint: str, peer: Peer, n: int) -> dict[str, list[float]]:
    """One-key query round trips against the raw echo, one after the other (see the module's point 3): samples."""
    out: dict[str, list[float]] = {}
    key = [b"obj"]
    out["query"], out["echo"] = paired(lambda i: client.query(key).result(5), small_echo(peer), n)

    async def run_async() -> list[float]:
        async with await AsyncClient.connect(endpoint, name="bench-async") as aclient:
            return await paired_async(lambda i: aclient.query(key), small_echo(peer), n)

    out["query_async"] = asyncio.run(run_async())
    return out


def bench_sweep(client: Client, raw: RawNixl, rs: Any, rd: Any, reps: int, progress: Progress) -> dict[int, list[float]]:
    """Deliver ``SWEEP_BYTES`` in spans of each ``SWEEP_SPANS`` size, each followed by the raw
    NIXL WRITE of the same descriptors; the kvcr samples by span size (the raw ones in ``raw.sweep``)."""
    out: dict[int, list[float]] = {}
    for j, span in enumerate(SWEEP_SPANS):
        progress.tick("span sizes", j, len(SWEEP_SPANS))
        n = SWEEP_BYTES // span
        key = f"sweep{span}".encode()
        stored = client.deposit({key: [Span(f"L{i}", rs, i * span, span, sweep_pool(span)) for i in range(n)]}).result(30)
        assert stored[key].ok, stored
        dest = {key: [Span(f"L{i}", rd, i * span, span) for i in range(n)]}
        assert client.deliver(dest).result(30)[key].ok  # warm: the raw side prepares its lists on first use
        raw.run_span(span)
        raw.sweep[span].clear()
        times = out[span] = []
        for _ in range(reps):
            t0 = time.perf_counter()
            res = client.deliver(dest).result(30)
            times.append(time.perf_counter() - t0)
            assert res[key].ok, res
            raw.run_span(span)
    return out


def bench_kvcr(endpoint: str, peer: Peer, reps: int, queries: int, sweep: bool, progress: Progress) -> dict[str, Any]:
    """Every kvcr measurement; each transfer is followed by its raw anchor's, so both see the same machine.

    The summaries by name, and under ``samples`` every per-iteration time (seconds) for plots."""
    progress.step(f"deliver {OBJECT >> 20} MiB against raw NIXL WRITE, {reps} times")
    src = aligned(OBJECT)
    src[:] = (np.arange(OBJECT, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8) | 1
    dst = aligned(OBJECT)
    raw = RawNixl(peer, src, dst)
    with Client(endpoint, name="bench") as client:
        rs, rd = client.register(src), client.register(dst)
        out = client.deposit({b"obj": [Span(f"L{i}", rs, i * SPAN, SPAN, "kv") for i in range(SPANS)]}).result(30)
        assert out[b"obj"].ok, out
        spans = [Span(f"L{i}", rd, i * SPAN, SPAN) for i in range(SPANS)]
        # The same destination as a list of spans (checked per call) and prepared once.
        dests = {"list": {b"obj": spans}, "prepared": {b"obj": client.destination(spans)}}
        for how, dest in dests.items():
            dst[:] = 0
            assert client.deliver(dest).result(30)[b"obj"].ok
            if not np.array_equal(src, dst):
                raise AssertionError(f"delivered bytes differ from the deposited bytes ({how})")
        dst[:] = 0
        assert client.deliver(dests["prepared"], plan=LAYERS).result(30)[b"obj"].ok
        if not np.array_equal(src, dst):
            raise AssertionError("delivered bytes differ from the deposited bytes (planned)")
        times: dict[str, list[float]] = {"list": [], "prepared": [], "planned": []}
        for rep in range(reps):
            progress.tick("deliveries", rep, reps)
            for how, dest in dests.items():
                t0 = time.perf_counter()
                res = client.deliver(dest).result(30)
                times[how].append(time.perf_counter() - t0)
                assert res[b"obj"].ok, res
            t0 = time.perf_counter()
            res = client.deliver(dests["prepared"], plan=LAYERS).result(30)
            times["planned"].append(time.perf_counter() - t0)
            assert res[b"obj"].ok, res
            raw.run("write")
            raw.run("write_merged")
            raw.run("write_planned")
        # One span of the object under a key of its own: a small granted deliver, whole.
        assert client.deposit({b"small": [Span("L0", rs, 0, SPAN, "kv")]}).result(30)[b"small"].ok
        granted = bench_grants(client, raw, {**dests, "small": {b"small": client.destination(spans[:1])}}, src, dst,
                               reps, progress)
        progress.step(f"one-key queries against a raw ZeroMQ echo, {queries} each with Client and AsyncClient")
        queried = bench_queries(client, endpoint, peer, queries)
        # Deposits of the same 64 MiB under new keys: each evicts the oldest object (FIFO).
        progress.step(f"deposit {OBJECT >> 20} MiB against raw NIXL READ, {reps} times")
        sources = [Span(f"L{i}", rs, i * SPAN, SPAN, "kv") for i in range(SPANS)]
        deposits = []
        for i in range(reps):
            progress.tick("deposits", i, reps)
            t0 = time.perf_counter()
            res = client.deposit({f"dep{i}".encode(): sources}).result(30)
            deposits.append(time.perf_counter() - t0)
            assert res.all_ok, res
            raw.run("read")
        dst[:] = 0
        last = f"dep{reps - 1}".encode()
        assert client.deliver({last: spans}).result(30)[last].ok
        if not np.array_equal(src, dst):
            raise AssertionError("a deposit's bytes differ when delivered back")
        put_times, put_written = bench_puts(client, raw, rs, spans, src, dst, reps, progress)
        swept: dict[int, list[float]] = {}
        if sweep:
            progress.step(f"deliver throughput against span size ({', '.join(f'{s >> 10} KiB' for s in SWEEP_SPANS)})")
            swept = bench_sweep(client, raw, rs, rd, reps, progress)
        stats = client.stats(audit=True).result(5)
        assert stats["invariants"] == [], stats["invariants"]
    samples = {**queried, "deliver": times["list"], "deliver_prepared": times["prepared"], "deliver_planned": times["planned"], "deposit": deposits, "put": put_times,
               "put_written": put_written, "grant_deliver": granted["list"], "grant_deliver_prepared": granted["prepared"],
               "grant_deliver_small": granted["small"],
               **{f"raw_{name}": runs for name, runs in raw.runs.items()}}
    return {**{name: summary(queried[name]) for name in queried}, "deliver": summary(times["list"]),
            "grant_deliver": summary(granted["list"]), "grant_deliver_prepared": summary(granted["prepared"]),
            "grant_deliver_small": summary(granted["small"]), "deliver_prepared": summary(times["prepared"]), "deliver_planned": summary(times["planned"]), "deposit": summary(deposits), "put": summary(put_times),
            "put_written": summary(put_written), "raw": raw.summaries(),
            "samples": samples, "sweep": {span: {"kvcr": swept[span], "raw": raw.sweep[span]} for span in swept}}


def idle_client(endpoint: str, grants: int) -> None:
    """A client process of its own, connected and idle after one query, until stopped; with
    ``grants``, holding that many read-granted leases (one small object each), ready once
    the node's fast progress after the last grant is over (spec section 6.12)."""
    with Client(endpoint, name=f"bench-idle-{grants}") as client:
        client.query([b"obj"]).result(5)
        if grants:
            src = np.full(SPAN, 7, np.uint8)
            region = client.register(src)
            leases = []
            for i in range(grants):
                key = f"idle{i}".encode()
                assert client.deposit({key: [Span("L0", region, 0, SPAN, "kv")]}).result(30).all_ok
                leases.append(client.lease([key], ttl_ms=IDLE_LEASE_TTL_MS).result(30))
            if client.tables()["granted_keys"] != grants or client.stats().result(5)["leases"]["with_grants"] != grants:
                raise AssertionError("the node granted fewer reads than leases were taken")
            time.sleep(GRANT_BURST_S + IDLE_SETTLE_S)  # the fast pace after the last grant is over
        print("ready", flush=True)
        time.sleep(IDLE_CLIENT_S)


def bench_idle(node_pid: int, client_pid: int, idle_s: float) -> dict[str, float]:
    """CPU use of the node and of an idle client process over the same interval (fractions of a core)."""
    time.sleep(IDLE_SETTLE_S)  # the client's start-up is over
    node0, client0, t0 = cpu_seconds(node_pid), cpu_seconds(client_pid), time.monotonic()
    time.sleep(idle_s)
    elapsed = time.monotonic() - t0
    return {"idle_cpu": (cpu_seconds(node_pid) - node0) / elapsed,
            "client_idle_cpu": (cpu_seconds(client_pid) - client0) / elapsed}


def report(k: dict[str, Any], quick: bool, out: TextIO, progress: Progress) -> dict[str, float]:
    """Print the human-readable report to ``out``; the figures of ``--json``."""
    r = k["raw"]
    figures: dict[str, float] = {
        "query_ratio": k["query"]["median"] / k["echo"]["median"],
        "query_ratio_async": k["query_async"]["median"] / k["echo"]["median"],
        "deliver_ratio": r["write"]["median"] / k["deliver"]["median"],
        "deposit_ratio": r["read"]["median"] / k["deposit"]["median"],
        "planned_vs_whole_local": k["deliver_planned"]["median"] / k["deliver_prepared"]["median"],
        "planned_vs_whole_raw": r["write_planned"]["median"] / r["write"]["median"],
        "planned_deliver_ratio": r["write_planned"]["median"] / k["deliver_planned"]["median"],
        "grant_deliver_ratio": r["node_read"]["median"] / k["grant_deliver"]["median"],
        "grant_deliver_ratio_writer": r["consumer_read"]["median"] / k["grant_deliver"]["median"],
        "grant_deliver_ratio_merged": r["consumer_read_merged"]["median"] / k["grant_deliver"]["median"],
        "grant_deliver_prepared_ratio": r["node_read"]["median"] / k["grant_deliver_prepared"]["median"],
        "grant_deliver_small_us": k["grant_deliver_small"]["median"] * 1e6,
        "grant_deliver_small_ratio": k["grant_deliver_small"]["median"] / r["node_read_small"]["median"],
        "grant_deliver_ms": k["grant_deliver"]["median"] * 1e3,
        "grant_deliver_spread": k["grant_deliver"]["spread"],
        "raw_grant_read_ms": r["node_read"]["median"] * 1e3,
        "raw_grant_read_spread": r["node_read"]["spread"],
        "raw_writer_read_ms": r["consumer_read"]["median"] * 1e3,
        "put_deposit_ratio": r["consumer_write"]["median"] / k["put"]["median"],
        "put_deposit_ratio_merged": r["consumer_write_merged"]["median"] / k["put"]["median"],
        "put_node_ratio": r["node_write"]["median"] / k["put"]["median"],
        "raw_node_write_ms": r["node_write"]["median"] * 1e3,
        "put_ms": k["put"]["median"] * 1e3,
        "put_written_ms": k["put_written"]["median"] * 1e3,
        "put_written_ratio": r["consumer_write"]["median"] / k["put_written"]["median"],
        "put_spread": k["put"]["spread"],
        "raw_put_write_ms": r["consumer_write"]["median"] * 1e3,
        "raw_put_write_spread": r["consumer_write"]["spread"],
        "idle_cpu_percent": (k["idle_cpu"] + k["client_idle_cpu"]) * 100,
        "idle_node_cpu_percent": k["idle_cpu"] * 100,
        "idle_cpu_percent_no_grants": (k["idle_cpu_no_grants"] + k["client_idle_cpu_no_grants"]) * 100,
        "idle_node_cpu_percent_no_grants": k["idle_cpu_no_grants"] * 100,
        **lookups.figures(k["lookups"]),
    }

    def say(line: str) -> None:
        print(line, file=out)

    say(f"load average at the end: {Path('/proc/loadavg').read_text().strip()}")
    say(f"deliver of a {OBJECT >> 20} MiB object, {SPANS} spans of {SPAN >> 10} KiB, DRAM -> DRAM, separate processes")
    say(f"  kvcr deliver, list of spans      {fmt_gbps(OBJECT, k['deliver'])}")
    say(f"  kvcr deliver, prepared dest.     {fmt_gbps(OBJECT, k['deliver_prepared'])}")
    say(f"  raw NIXL WRITE (in the writer)   {fmt_gbps(OBJECT, r['write'])}")
    say(f"  raw NIXL WRITE + ZeroMQ trigger  {fmt_gbps(OBJECT, r['write_e2e'])}")
    say(f"  raw NIXL WRITE, one merged desc  {fmt_gbps(OBJECT, r['write_merged'])}")
    for label, name in (("list of spans", "deliver"), ("prepared destination", "deliver_prepared")):
        ratio = r["write"]["median"] / k[name]["median"]
        ratio_e2e = r["write_e2e"]["median"] / k[name]["median"]
        say(f"  ratio kvcr / raw NIXL, {label}: {ratio:.2f} (goal >= 0.9); against raw NIXL + trigger: {ratio_e2e:.2f}")
    say(f"  kvcr deliver, {len(LAYERS)} layers      {fmt_gbps(OBJECT, k['deliver_planned'])}")
    say(f"  raw NIXL, {len(LAYERS)} WRITEs in order {fmt_gbps(OBJECT, r['write_planned'])}")
    say(f"  planned / whole (prepared dest.): {figures['planned_vs_whole_local']:.2f} (goal <= 1.2); "
        f"raw NIXL the same way: {figures['planned_vs_whole_raw']:.2f}; "
        f"raw {len(LAYERS)} WRITEs / kvcr planned: {figures['planned_deliver_ratio']:.2f}")
    say("deliver of the same object under a read grant (the client READs the node's pool), against raw NIXL READ")
    say(f"  kvcr deliver, list of spans      {fmt_gbps(OBJECT, k['grant_deliver'])}")
    say(f"  kvcr deliver, prepared dest.     {fmt_gbps(OBJECT, k['grant_deliver_prepared'])}")
    say(f"  raw NIXL READ of the node's slots {fmt_gbps(OBJECT, r['node_read'])}")
    say(f"  raw NIXL READ, a writer's buffer {fmt_gbps(OBJECT, r['consumer_read'])}")
    say(f"  ... one merged desc              {fmt_gbps(OBJECT, r['consumer_read_merged'])}")
    say(f"  ratio kvcr / raw NIXL READ of the node's slots: {figures['grant_deliver_ratio']:.2f} (goal >= 0.95); "
        f"of a writer's buffer: {figures['grant_deliver_ratio_writer']:.2f}, one merged descriptor: "
        f"{figures['grant_deliver_ratio_merged']:.2f}; a prepared destination against the node's slots: "
        f"{figures['grant_deliver_prepared_ratio']:.2f}")
    say(f"one span of {SPAN >> 10} KiB under a read grant, whole: kvcr {fmt_us(k['grant_deliver_small'])}, "
        f"raw NIXL READ of its slot {fmt_us(r['node_read_small'])}, "
        f"kvcr / raw {figures['grant_deliver_small_ratio']:.2f}")
    say("deposit of the same object under a new key (evicting one), against raw NIXL READ")
    say(f"  kvcr deposit, list of spans      {fmt_gbps(OBJECT, k['deposit'])}")
    say(f"  raw NIXL READ (in the reader)    {fmt_gbps(OBJECT, r['read'])}")
    say(f"  ratio kvcr / raw NIXL: {figures['deposit_ratio']:.2f} (goal >= 0.85)")
    say("put of the same object under a new key (the client WRITEs the node's pool, then commits), against raw NIXL WRITE")
    say(f"  kvcr put, list of spans          {fmt_gbps(OBJECT, k['put'])}")
    say(f"  kvcr put written (memory free)   {fmt_gbps(OBJECT, k['put_written'])}")
    say(f"  raw NIXL WRITE, 1024 descriptors {fmt_gbps(OBJECT, r['consumer_write'])}")
    say(f"  raw NIXL WRITE, one merged desc  {fmt_gbps(OBJECT, r['consumer_write_merged'])}")
    say(f"  raw NIXL WRITE of the node's slots {fmt_gbps(OBJECT, r['node_write'])}")
    say(f"  ratio kvcr / raw NIXL WRITE: {figures['put_deposit_ratio']:.2f} (goal >= 0.95); "
        f"against one merged descriptor: {figures['put_deposit_ratio_merged']:.2f}; "
        f"to the put's written: {figures['put_written_ratio']:.2f}; "
        f"against a raw WRITE of the slots it wrote: {figures['put_node_ratio']:.2f}")
    say("query round trip, each kvcr query followed by one raw echo")
    say(f"  kvcr query, Client         {fmt_us(k['query'])}")
    say(f"  kvcr query, AsyncClient    {fmt_us(k['query_async'])}")
    say(f"  raw ZeroMQ msgpack echo    {fmt_us(k['echo'])}")
    say(f"  ratio kvcr / raw echo p50: Client {figures['query_ratio']:.2f} (goal <= 1.5), "
        f"AsyncClient {figures['query_ratio_async']:.2f} (goal <= 2.0)")
    if k["sweep"]:
        say(f"deliver throughput against span size ({SWEEP_BYTES >> 20} MiB per object), against raw NIXL WRITE")
        for span, runs in k["sweep"].items():
            ours, theirs = summary(runs["kvcr"]), summary(runs["raw"])
            figures[f"deliver_ratio_{span >> 10}k"] = theirs["median"] / ours["median"]
            say(f"  {span >> 10:>5} KiB x {SWEEP_BYTES // span:>5}: kvcr {SWEEP_BYTES / ours['median'] / 1e9:6.2f} GB/s, "
                f"raw NIXL {SWEEP_BYTES / theirs['median'] / 1e9:6.2f} GB/s, ratio {theirs['median'] / ours['median']:.2f}")
    lookups.report(k["lookups"], out)
    sweep = (1_000, 10_000) if quick else (1_000, 10_000, 100_000)
    progress.step(f"admission with {', '.join(f'{n:,}' for n in sweep)} evictable objects in another pool")
    say("admission into a full pool B, evicting one object of B each (FIFO)")
    adm = {n: measure_admission(n) for n in sweep}
    for n, m in adm.items():
        say(f"  {n:>7,} evictable objects in unrelated pool A: median {m['median_s'] * 1e6:6.2f} us/admission, "
            f"{int(m['visits'])} candidates visited for 64 admissions")
    say(f"  ratio {sweep[-1] // 1000}k/1k: {adm[sweep[-1]]['median_s'] / adm[1_000]['median_s']:.2f} (goal <= 1.5)")
    say("CPU while idle with a client connected, % of a core (goal: node and client together < 1%)")
    say(f"  no grants (anchor):           node {k['idle_cpu_no_grants'] * 100:.2f}%, "
        f"idle client {k['client_idle_cpu_no_grants'] * 100:.2f}%")
    say(f"  {IDLE_GRANTS} read-granted leases held: node {k['idle_cpu'] * 100:.2f}%, "
        f"idle client {k['client_idle_cpu'] * 100:.2f}% (past the node's fast window after a grant)")
    n_index = 10_000 if quick else 100_000
    progress.step(f"index memory at {n_index:,} objects")
    say(f"index memory per stored object at {n_index:,} objects: 1 span {index_bytes_per_object(n_index, 1):.0f} B, "
        f"64 spans {index_bytes_per_object(n_index, 64):.0f} B (goal < 1024 B)")
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--raw-writer", help=argparse.SUPPRESS)
    parser.add_argument("--idle-client", help=argparse.SUPPRESS)
    parser.add_argument("--idle-grants", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--queries", type=int, default=2000, help="timed one-key query round trips per client")
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, smaller admission sweep")
    parser.add_argument("--json", action="store_true", help="the report to stderr, one JSON object to stdout")
    parser.add_argument("--plot", type=Path, metavar="FILE",
                        help="write a PNG of latency distributions and throughput against span size (runs --sweep)")
    parser.add_argument("--sweep", action="store_true", help="measure deliver throughput against span size too")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--no-integrity", action="store_true",
                        help="a node that takes no digests (the goals' condition; bench/integrity.py prices them)")
    args = parser.parse_args()
    if args.raw_writer:
        raw_writer(args.raw_writer)
        return 0
    if args.idle_client:
        idle_client(args.idle_client, args.idle_grants)
        return 0
    reps = 8 if args.quick else args.reps
    queries = 1000 if args.quick else args.queries
    sweep = args.sweep or args.plot is not None
    progress = Progress("local", 8 + sweep, enabled=not args.quiet)
    pools = ["--pool", f"kv:64KiB:{2 * SPANS + 8}"]  # the object twice, and the one-span object
    if sweep:
        pools += [arg for span in SWEEP_SPANS for arg in ("--pool", f"{sweep_pool(span)}:{span}:{SWEEP_BYTES // span}")]
    with process_group("bench") as (run, procs):
        procs.append(node := spawn("-m", "kvcr_node.cli", "--endpoint", f"ipc://{run}/node.sock", *pools,
                                   "--log-level", "WARNING", *(["--no-integrity"] if args.no_integrity else [])))
        procs.append(spawn(__file__, "--raw-writer", f"ipc://{run}/raw.sock"))
        peer = Peer(f"ipc://{run}/raw.sock")
        try:
            k = bench_kvcr(f"ipc://{run}/node.sock", peer, reps, queries, sweep, progress)
        finally:
            peer.close()
        # Idle: a client of its own connected, nothing in flight (this process holds more than a client).
        procs.append(idle := spawn(__file__, "--idle-client", f"ipc://{run}/node.sock"))
        progress.step("lookups at engine scale (bench/lookups.py)")
        k["lookups"] = lookups.measure(run, procs, CURRENT_VERSION)
        idle_s = 1.0 if args.quick else args.idle_seconds
        progress.step(f"CPU while idle, {idle_s:g} s without grants, then {idle_s:g} s with {IDLE_GRANTS} held")
        k.update({f"{name}_no_grants": value for name, value in bench_idle(node.pid, idle.pid, idle_s).items()})
        stop([idle])
        procs.append(idle := spawn(__file__, "--idle-client", f"ipc://{run}/node.sock", "--idle-grants", str(IDLE_GRANTS)))
        k.update(bench_idle(node.pid, idle.pid, idle_s))
    figures = report(k, args.quick, sys.stderr if args.json else sys.stdout, progress)
    if args.plot is not None:
        from plots import plot_local

        plot_local(k, args.plot, quick=args.quick)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps({name: round(value, 4) for name, value in figures.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
