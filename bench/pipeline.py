"""Pipeline benchmark: an engine loop that computes on layer i as soon as it has landed.

An object of 32 layers of 1 MiB is delivered with a layer plan (one group per layer), and
the engine runs a fixed CPU-bound kernel per layer, calibrated to cost about one layer's
transfer time. Progressive: ``handle.wait(i)`` then the kernel on layer i, for each i.
Whole then compute: wait for the whole object, then the 32 kernels. ``overlap_speedup`` =
whole-then-compute time / progressive time (2.0 is the ideal when compute equals
transfer), measured across nodes by the nodes (client on node A, object on node B, no
lease: B writes into the client), across nodes under a read grant (the object leased
through A at the source a hint names, with ``read=True``: B's grant passed on by A, and the
client READs B's pools itself, spec section 6.12 "Across nodes"), locally by the node
(client on B, no lease) and locally under a read grant (client on B).

The anchor runs in the same run: a raw NIXL progressive pipeline between two bare
processes. A holder registers the same 32 layers of 1 MiB (the same bytes); this process
READs them with a bare agent of its own into a registered buffer, layer by layer, and
runs the same kernel with the same cost per layer on each layer once it landed. Two raw
forms are timed, and the faster is the anchor: an I/O thread that posts one READ per
layer in turn while the engine computes, and the 32 READs posted at once, then waited
one by one. Each raw run follows the kvcr run it anchors, so both see the same machine.
Each raw form is checked alone once (the raw buffer zeroed, one run, compared byte for
byte with the pattern), and the buffer is compared again after the timed runs.
``pipeline_vs_raw`` = kvcr progressive time / raw progressive time (1.0: kvcr costs
nothing over the bare transport).

Run: ``python bench/pipeline.py`` (about a minute); ``--json`` prints one JSON object of
the figures after the report: ``overlap_speedup`` (across nodes), ``overlap_speedup_local``
(the node delivers, locally), ``grant_overlap_speedup`` (locally under a read grant),
``grant_overlap_speedup_remote`` and ``pipeline_vs_raw_grant`` (across nodes under a read
grant; ``grant_used_remote`` as ``grant_used``),
``raw_overlap_speedup`` (the raw pipeline's whole-then-compute / progressive, with the
kernel of the grant run), ``pipeline_vs_raw`` (across nodes), ``pipeline_vs_raw_local``
(under a read grant; by the node where it grants none), ``pipeline_vs_raw_local_node``
(locally by the node), ``progressive_ms``, ``raw_progressive_ms`` and their spreads
((p90 - p10) / median) per run, suffixed as the ratios, and ``grant_used`` (1 when the
local node granted the read and every timed deliver read the pools itself). Ratios
matter, not absolute times.

``--digests`` adds, in the same run, the local run under a read grant from a third node
started with ``--no-integrity`` (the same object, no digests to check): its figures are
suffixed ``_local_nodigest`` (``pipeline_vs_raw_local_nodigest``, ``grant_used_nodigest``),
and ``pipeline_digest_cost`` = the granted progressive time with digests / without, both
with the kernel calibrated for the run with digests (spec section 6.12, "Integrity": the
reader checks each group as it lands).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import mmap
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from anchors import Peer, serve
from procs import process_group, spawn
from remote import LAYER, LAYER_PLAN, LAYERS, node_flags
from stats import fmt_us, summary

from kvcr_client import Client, Span
from kvcr_io.agent import load_nixl
from kvcr_node.memory import advise_huge_pages

OBJECT = LAYERS * LAYER
LEASE_TTL_MS = 120_000
"""The grant run's lease: held through all its deliveries (well under a minute)."""
RAW_TIMEOUT_S = 10.0
"""How long one raw transfer may take before the anchor fails."""
RAW_FORMS = {"raw_thread": "an I/O thread READs layer by layer", "raw_posted": "32 READs posted at once"}
"""The raw progressive forms; the fastest of them in a run is its anchor."""


def pattern() -> np.ndarray:
    """The object's bytes, the same in kvcr's deposit and in the raw holder's buffer (never zero)."""
    return (np.arange(OBJECT, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8) | 1


def kernel(layer: np.ndarray, words: int) -> int:
    """A fixed CPU-bound kernel: passes over the layer's first ``words`` 32-bit words, wrapping
    round (numpy, so the client's I/O thread can run). Its cost grows in steps of a few
    microseconds, so it can be matched to one layer's transfer time."""
    view = layer.view(np.uint32)
    acc = 0
    while words > 0:
        part = view[: min(words, view.size)]
        acc ^= int(np.add.reduce(part ^ 0x5A5A5A5A, dtype=np.uint64))
        words -= part.size
    return acc


def calibrate(target_s: float) -> int:
    """Kernel words that cost about ``target_s`` on this machine now (the median of a few
    timings, refined once at the estimate)."""
    layer = np.ones(LAYER, dtype=np.uint8)
    words = LAYER // 4

    def cost(n: int) -> float:
        kernel(layer, n)  # warm
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            kernel(layer, n)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    for _ in range(2):
        words = max(1024, round(words * target_s / cost(words)))
    return words


# --------------------------------------------------------------------------- raw anchor


def raw_holder(endpoint: str) -> None:
    """A bare NIXL process holding the object's 32 layers, registered once, for a consumer to READ."""
    nixl = load_nixl()
    agent = nixl.nixl_agent("raw-holder", nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    buf = mmap.mmap(-1, OBJECT, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise_huge_pages(buf)  # the memory a node's DRAM pool has (kvcr_node.memory)
    pool = np.frombuffer(buf, dtype=np.uint8)
    pool[:] = pattern()
    agent.register_memory([(pool.ctypes.data, OBJECT, 0, "")], "DRAM")

    def setup(msg: dict[str, Any]) -> dict[str, Any]:
        agent.add_remote_agent(msg["md"])
        return {"t": "md", "md": agent.get_agent_metadata(), "addr": pool.ctypes.data}

    # The target of a READ is progressed too (architecture §6), as a node with grants out is.
    serve(endpoint, {"setup": setup}, idle=agent.get_new_notifs)


class RawPipeline:
    """This process's side of the raw anchor: a bare agent READing the holder's layers into
    a registered buffer of its own, one prepared descriptor per layer on each side."""

    def __init__(self, peer: Peer) -> None:
        nixl = load_nixl()
        logging.getLogger("nixl").setLevel(logging.WARNING)  # its start-up lines at INFO
        self.agent = agent = nixl.nixl_agent("raw-consumer", nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.dst = np.zeros(OBJECT, dtype=np.uint8)
        base = self.dst.ctypes.data
        agent.register_memory([(base, OBJECT, 0, "")], "DRAM")
        found = peer.call({"t": "setup", "md": agent.get_agent_metadata()}, agent.get_new_notifs)
        holder = agent.add_remote_agent(found["md"])
        addr = int(found["addr"])
        self.mine = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(base + i * LAYER, LAYER, 0) for i in range(LAYERS)], "DRAM")
        self.theirs = agent.prep_xfer_dlist(holder, [(addr + i * LAYER, LAYER, 0) for i in range(LAYERS)], "DRAM")
        self.views = [self.dst[i * LAYER : (i + 1) * LAYER] for i in range(LAYERS)]

    def post(self, layers: list[int]) -> Any:
        """Post one READ of ``layers``; its handle."""
        handle = self.agent.make_prepped_xfer("READ", self.mine, layers, self.theirs, layers)
        state = self.agent.transfer(handle)
        if state == "ERR":
            raise RuntimeError("raw NIXL READ failed to post")
        return handle

    def finish(self, handle: Any) -> None:
        """Wait for one READ to complete, then release it."""
        state = self.agent.check_xfer_state(handle)
        give_up = time.perf_counter() + RAW_TIMEOUT_S
        while state == "PROC" and time.perf_counter() < give_up:
            state = self.agent.check_xfer_state(handle)
        self.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ ended {state}")

    def transfer(self) -> None:
        """The whole object, one READ of the 32 descriptors."""
        self.finish(self.post(list(range(LAYERS))))

    def whole_then_compute(self, kwords: int) -> float:
        t0 = time.perf_counter()
        self.transfer()
        for view in self.views:
            kernel(view, kwords)
        return time.perf_counter() - t0

    def progressive_posted(self, kwords: int) -> float:
        """The 32 READs posted at once, then each waited for and computed on in order."""
        t0 = time.perf_counter()
        handles = [self.post([i]) for i in range(LAYERS)]
        for i, handle in enumerate(handles):
            self.finish(handle)
            kernel(self.views[i], kwords)
        return time.perf_counter() - t0

    def progressive_thread(self, kwords: int) -> float:
        """An I/O thread posts one READ per layer in turn and says when each completed; the
        engine computes on layer i once it landed (NIXL's post releases the GIL)."""
        landed = [threading.Event() for _ in range(LAYERS)]
        failed: list[BaseException] = []

        def io() -> None:
            try:
                for i in range(LAYERS):
                    self.finish(self.post([i]))
                    landed[i].set()
            except BaseException as exc:  # passed to the engine thread, which raises it
                failed.append(exc)
                for event in landed:
                    event.set()

        t0 = time.perf_counter()
        thread = threading.Thread(target=io, name="raw-io")
        thread.start()
        for i in range(LAYERS):
            if not landed[i].wait(RAW_TIMEOUT_S):
                failed.append(TimeoutError(f"raw layer {i} did not land"))
            if failed:
                break
            kernel(self.views[i], kwords)
        thread.join(RAW_TIMEOUT_S)
        if failed:
            raise failed[0]
        return time.perf_counter() - t0


# --------------------------------------------------------------------------- kvcr


def measure(client: Client, dst: np.ndarray, layers: Any, request_id: str | None, runs: int,
            raw: RawPipeline, kwords: int | None = None) -> dict[str, Any]:
    """The kvcr progressive and whole-then-compute runs, each followed by the raw pipeline's
    with the same kernel; the kernel is matched to one layer of kvcr's transfer, or is
    ``kwords`` (another run's, so that the two compare with the same compute)."""

    def transfer_only() -> float:
        t0 = time.perf_counter()
        assert client.deliver({b"layers": layers}, request_id=request_id).result(10).all_ok
        return time.perf_counter() - t0

    for _ in range(3):
        transfer_only()
    t_transfer = statistics.median(transfer_only() for _ in range(runs))
    raw_transfer = []
    for _ in range(runs):
        t0 = time.perf_counter()
        raw.transfer()
        raw_transfer.append(time.perf_counter() - t0)
    if kwords is None:
        kwords = calibrate(t_transfer / LAYERS)
    views = [dst[i * LAYER : (i + 1) * LAYER] for i in range(LAYERS)]

    def progressive() -> float:
        t0 = time.perf_counter()
        handle = client.deliver({b"layers": layers}, request_id=request_id, plan=LAYER_PLAN)
        for i in range(LAYERS):
            handle.wait(i, 10)
            kernel(views[i], kwords)
        assert handle.result(10).all_ok
        return time.perf_counter() - t0

    def whole_then_compute() -> float:
        t0 = time.perf_counter()
        assert client.deliver({b"layers": layers}, request_id=request_id).result(10).all_ok
        for i in range(LAYERS):
            kernel(views[i], kwords)
        return time.perf_counter() - t0

    compute = []
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(LAYERS):
            kernel(views[i], kwords)
        compute.append(time.perf_counter() - t0)
    forms: dict[str, Callable[[], float]] = {
        "progressive": progressive, "whole": whole_then_compute,
        "raw_thread": lambda: raw.progressive_thread(kwords), "raw_posted": lambda: raw.progressive_posted(kwords),
        "raw_whole": lambda: raw.whole_then_compute(kwords),
    }
    expected = pattern()
    for name, form in forms.items():  # warm (the first raw READs connect), and each raw form checked alone
        raw.dst[:] = 0
        form()
        if name.startswith("raw_") and not np.array_equal(raw.dst, expected):
            raise AssertionError(f"the raw anchor's {name} did not move the holder's bytes")
    raw.dst[:] = 0
    samples: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(runs):  # interleaved: every form sees the same machine load
        for name, form in forms.items():
            samples[name].append(form())
    if not np.array_equal(raw.dst, expected):
        raise AssertionError("the raw anchor's timed runs did not move the holder's bytes")
    s = {name: summary(times) for name, times in samples.items()}
    return {"transfer": t_transfer, "raw_transfer": summary(raw_transfer), "compute": statistics.median(compute),
            "kernel_words": kwords, **s, **ratios(s)}


def ratios(s: dict[str, dict[str, float]]) -> dict[str, Any]:
    """From the summaries of one run's forms: the raw anchor (the fastest raw progressive
    form), ``speedup`` (kvcr whole-then-compute / progressive), ``raw_speedup`` (the same of
    the raw pipeline, against its anchor) and ``vs_raw`` (kvcr progressive / the anchor), by medians."""
    raw_form = min(RAW_FORMS, key=lambda name: s[name]["median"])
    return {"raw": raw_form, "speedup": s["whole"]["median"] / s["progressive"]["median"],
            "raw_speedup": s["raw_whole"]["median"] / s[raw_form]["median"],
            "vs_raw": s["progressive"]["median"] / s[raw_form]["median"]}


def measure_granted(
    client: Client, dst: np.ndarray, layers: Any, request_id: str | None, runs: int, raw: RawPipeline,
    kwords: int | None = None,
) -> dict[str, Any]:
    """``measure`` with the object leased for a read grant first (at the source the hint of
    ``request_id`` names, or at the client's own node); the result says whether a grant
    came and every timed deliver READ the pools itself."""
    lease = client.lease([b"layers"], request_id=request_id, ttl_ms=LEASE_TTL_MS, read=True).result(10)
    if b"layers" not in lease.held:
        raise AssertionError(f"the object was not leased: {lease[b'layers']!r}")
    try:
        granted = client.tables()["granted_keys"] == 1
        reads = client.counters()["grant_reads"]
        result = measure(client, dst, layers, request_id, runs, raw, kwords)
        # Warm-up and timed: 3 + runs transfers, 1 + runs progressive, 1 + runs whole.
        result["granted"] = granted and client.counters()["grant_reads"] == reads + 5 + 3 * runs
    finally:
        lease.release().result(10)
    return result


NO_DIGESTS = "local, under a read grant, no digests"
"""The run ``--digests`` adds: a node with ``--no-integrity``."""
RUNS = {"across nodes": "", "across nodes, under a read grant": "_grant", "local, by the node": "_local_node",
        "local, under a read grant": "_local", NO_DIGESTS: "_local_nodigest"}
"""Each measured run and the suffix of its ``--json`` figures (the last only with ``--digests``)."""


def figures(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {
        "overlap_speedup": results["across nodes"]["speedup"],
        "overlap_speedup_local": results["local, by the node"]["speedup"],
        "grant_overlap_speedup": results["local, under a read grant"]["speedup"],
        "raw_overlap_speedup": results["local, under a read grant"]["raw_speedup"],
        "grant_used": float(results["local, under a read grant"]["granted"]),
        "grant_overlap_speedup_remote": results["across nodes, under a read grant"]["speedup"],
        "grant_used_remote": float(results["across nodes, under a read grant"]["granted"]),
    }
    if NO_DIGESTS in results:
        out["grant_used_nodigest"] = float(results[NO_DIGESTS]["granted"])
        out["pipeline_digest_cost"] = (results["local, under a read grant"]["progressive"]["median"]
                                       / results[NO_DIGESTS]["progressive"]["median"])
    for where, suffix in RUNS.items():
        if where not in results:
            continue
        r = results[where]
        out[f"pipeline_vs_raw{suffix}"] = r["vs_raw"]
        out[f"progressive_ms{suffix}"] = r["progressive"]["median"] * 1e3
        out[f"progressive_spread{suffix}"] = r["progressive"]["spread"]
        out[f"raw_progressive_ms{suffix}"] = r[r["raw"]]["median"] * 1e3
        out[f"raw_progressive_spread{suffix}"] = r[r["raw"]]["spread"]
    return out


def report(results: dict[str, dict[str, Any]]) -> None:
    print(f"load average {os.getloadavg()[0]:.2f} (cores {os.cpu_count()})")
    for where, r in results.items():
        print(f"{where}: {LAYERS} layers of {LAYER >> 20} MiB, transfer {r['transfer'] * 1e3:.2f} ms "
              f"(raw NIXL READ {r['raw_transfer']['median'] * 1e3:.2f} ms), compute {r['compute'] * 1e3:.2f} ms "
              f"(kernel over {r['kernel_words'] * 4 / LAYER:.2f} layers' bytes per layer)")
        if where == "across nodes":
            print("  node-driven: B writes into the client (no lease)")
        elif "granted" in r:
            print("  " + ("the client READs B's pools under the lease's read grant" + (" (passed on by A)" if "across" in where else "") if r["granted"] else
                          "B granted no read (client_transfers off, or a deliver went by the node): node-driven"))
        print(f"  kvcr progressive (compute on layer i once it landed)  {fmt_us(r['progressive'])}  spread {r['progressive']['spread']:.2f}")
        print(f"  kvcr whole object, then compute                       {fmt_us(r['whole'])}  spread {r['whole']['spread']:.2f}")
        for form, what in RAW_FORMS.items():
            print(f"  raw progressive, {what:<37}{fmt_us(r[form])}  spread {r[form]['spread']:.2f}")
        print(f"  raw whole object (one READ), then compute             {fmt_us(r['raw_whole'])}  spread {r['raw_whole']['spread']:.2f}")
        print(f"  overlap_speedup {r['speedup']:.2f} (raw {r['raw_speedup']:.2f}); pipeline_vs_raw {r['vs_raw']:.2f} "
              f"(goal <= 1.15; anchor: raw, {RAW_FORMS[r['raw']]})")
    if NO_DIGESTS in results:
        cost = results["local, under a read grant"]["progressive"]["median"] / results[NO_DIGESTS]["progressive"]["median"]
        print(f"pipeline_digest_cost {cost:.3f} (granted progressive, digests checked / none)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--raw-holder", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=20, help="timed runs of each form (interleaved)")
    parser.add_argument("--json", action="store_true", help="also print one JSON object of the figures")
    parser.add_argument("--digests", action="store_true",
                        help="also measure the local granted run from a node without digests (--no-integrity)")
    args = parser.parse_args()
    if args.raw_holder:
        raw_holder(args.raw_holder)
        return 0
    src = pattern()
    # The grant run leases all 32 layers of the layer pool.
    flags = [*node_flags(), "--lease-pool-fraction", "1", "--lease-session-fraction", "1"]
    with process_group("pbench") as (run, procs):
        for name in ("a", "b"):
            procs.append(spawn("-m", "kvcr_node.cli", *flags, "--endpoint", f"ipc://{run}/{name}.sock"))
        if args.digests:
            procs.append(spawn("-m", "kvcr_node.cli", *flags, "--no-integrity", "--endpoint", f"ipc://{run}/c.sock"))
        procs.append(spawn(__file__, "--raw-holder", f"ipc://{run}/raw.sock"))
        a, b = f"ipc://{run}/a.sock", f"ipc://{run}/b.sock"
        peer = Peer(f"ipc://{run}/raw.sock")
        try:
            raw = RawPipeline(peer)
            with Client(b, name="owner") as owner, Client(a, name="engine") as eng, contextlib.ExitStack() as stack:
                plain = stack.enter_context(Client(f"ipc://{run}/c.sock", name="plain")) if args.digests else None
                for client in (owner, plain):
                    if client is None:
                        continue
                    region = client.register(src)
                    spans = [Span(f"L{i}", region, i * LAYER, LAYER, "layer") for i in range(LAYERS)]
                    assert client.deposit({b"layers": spans}).result(30).all_ok
                eng.submit_hint("pipe", b, [b"layers"]).result(5)
                results = {}
                runs = [("across nodes", eng, "pipe"), ("across nodes, under a read grant", eng, "pipe"),
                        ("local, by the node", owner, None), ("local, under a read grant", owner, None)]
                if plain is not None:
                    runs.append((NO_DIGESTS, plain, None))
                for where, client, rid in runs:
                    dst = np.zeros(OBJECT, dtype=np.uint8)
                    rd = client.register(dst)
                    layers = client.destination([Span(f"L{i}", rd, i * LAYER, LAYER) for i in range(LAYERS)])
                    if where == NO_DIGESTS:  # the kernel of the run with digests: the same compute
                        kwords = results["local, under a read grant"]["kernel_words"]
                        results[where] = measure_granted(client, dst, layers, rid, args.runs, raw, kwords)
                    elif "grant" in where:
                        results[where] = measure_granted(client, dst, layers, rid, args.runs, raw)
                    else:
                        results[where] = measure(client, dst, layers, rid, args.runs, raw)
                    if not np.array_equal(dst, src):
                        raise AssertionError(f"delivered bytes differ ({where})")
        finally:
            peer.close()
    report(results)
    if args.json:
        print(json.dumps({name: round(value, 3) for name, value in figures(results).items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
