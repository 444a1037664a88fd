"""Local benchmark: a kvcr node and a client on one host, each against its raw anchor.

Measured in one run, in one process tree:

1. deliver of a 64 MiB object of 64 KiB spans through the node, against a raw NIXL WRITE
   of the same descriptors from a bare NIXL process into the same kind of client buffer
   (timed in the writer, and end to end with a raw ZeroMQ trigger);
2. query round trip against a raw ZeroMQ DEALER/ROUTER msgpack echo, and deposit of the
   same object under new keys against a raw NIXL READ of the same descriptors;
3. admission into a full pool as evictable objects in an unrelated pool grow 1k..100k;
4. the node's CPU use while idle, and index memory per stored object at 100,000 objects.

Run: ``python bench/local.py`` (about a minute). Ratios matter, not absolute times.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))

from admission import index_bytes_per_object, measure_admission
from procs import process_group, spawn
from stats import fmt_gbps, fmt_us, summary

from kvcr_client import Client, Span
from kvcr_io.agent import load_nixl

SPAN = 64 << 10
SPANS = 1024
OBJECT = SPAN * SPANS  # 64 MiB


# --------------------------------------------------------------------------- raw anchors


def raw_writer(endpoint: str) -> None:
    """A bare NIXL process: a page-aligned pool registered once, WRITEs on request."""
    nixl = load_nixl()
    agent = nixl.nixl_agent("raw-writer", nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    buf = mmap.mmap(-1, OBJECT, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pool = np.frombuffer(buf, dtype=np.uint8)
    pool[:] = (np.arange(OBJECT, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8) | 1
    base = pool.ctypes.data
    agent.register_memory([(base, OBJECT, 0, "")], "DRAM")
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(base + i * SPAN, SPAN, 0) for i in range(SPANS)], "DRAM")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    remote = None
    remote_name, msg_addr = "", 0
    print("ready", flush=True)
    while True:
        ident, frame = sock.recv_multipart()
        msg = msgpack.unpackb(frame)
        if msg["t"] == "setup":
            remote_name = agent.add_remote_agent(msg["md"])
            msg_addr = msg["addr"]
            remote = agent.prep_xfer_dlist(remote_name, [(msg_addr + i * SPAN, SPAN, 0) for i in range(SPANS)], "DRAM")
            sock.send_multipart([ident, msgpack.packb({"t": "ok"})])
        elif msg["t"] == "write":
            # The first ``n`` descriptors (all by default), one NIXL request.
            n = msg.get("n", SPANS)
            t0 = time.perf_counter()
            if msg.get("merged"):
                # The same bytes as one descriptor each side, built per request (what kvcr
                # posts after merging contiguous spans).
                ldesc = agent.get_xfer_descs(np.array([(base, n * SPAN, 0)], dtype=np.uint64), "DRAM")
                rdesc = agent.get_xfer_descs(np.array([(msg_addr, n * SPAN, 0)], dtype=np.uint64), "DRAM")
                handle = agent.initialize_xfer("WRITE", ldesc, rdesc, remote_name)
            else:
                # READ pulls the client's bytes into the pool (what a deposit does).
                op = "READ" if msg.get("read") else "WRITE"
                handle = agent.make_prepped_xfer(op, local, list(range(n)), remote, list(range(n)))
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            agent.release_xfer_handle(handle)
            sock.send_multipart([ident, msgpack.packb({"t": "done", "s": time.perf_counter() - t0, "state": state})])
        elif msg["t"] == "echo":
            sock.send_multipart([ident, msgpack.packb({"t": "echo", "id": msg["id"], "v": 2})])
        elif msg["t"] == "quit":
            sock.send_multipart([ident, msgpack.packb({"t": "bye"})])
            break
    sock.close(0)
    ctx.term()


def bench_raw(endpoint: str, reps: int) -> dict[str, Any]:
    """Raw NIXL WRITE of 1024 x 64 KiB into a buffer of this process, and a raw ZeroMQ echo."""
    nixl = load_nixl()
    agent = nixl.nixl_agent("raw-client", nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    dst = np.zeros(OBJECT, dtype=np.uint8)
    agent.register_memory([(dst.ctypes.data, OBJECT, 0, "")], "DRAM")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send(msgpack.packb({"t": "setup", "md": agent.get_agent_metadata(), "addr": dst.ctypes.data}))
    assert msgpack.unpackb(sock.recv())["t"] == "ok"
    in_writer, end_to_end, merged = [], [], []
    for i in range(2 * reps):
        t0 = time.perf_counter()
        sock.send(msgpack.packb({"t": "write", "merged": i % 2 == 1}))
        # The target side needs progress too (architecture §6): progress while waiting.
        while not sock.poll(0):
            agent.get_new_notifs()
        reply = msgpack.unpackb(sock.recv())
        assert reply["state"] == "DONE", reply
        if i % 2:
            merged.append(reply["s"])
        else:
            end_to_end.append(time.perf_counter() - t0)
            in_writer.append(reply["s"])
    reads = []
    for _ in range(reps):
        sock.send(msgpack.packb({"t": "write", "read": True}))
        while not sock.poll(0):
            agent.get_new_notifs()
        reply = msgpack.unpackb(sock.recv())
        assert reply["state"] == "DONE", reply
        reads.append(reply["s"])
    echo = []
    for i in range(2000):
        t0 = time.perf_counter()
        sock.send(msgpack.packb({"v": 2, "t": "echo", "id": i, "keys": [b"k" * 32]}))
        reply = msgpack.unpackb(sock.recv())
        echo.append(time.perf_counter() - t0)
        assert reply["id"] == i
    sock.send(msgpack.packb({"t": "quit"}))
    sock.recv()
    sock.close(0)
    ctx.term()
    return {"write": summary(in_writer), "write_e2e": summary(end_to_end), "write_merged": summary(merged),
            "read": summary(reads),
            "echo": summary(echo[200:]), "dst": dst}


# --------------------------------------------------------------------------- kvcr


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_kvcr(endpoint: str, node_pid: int, reps: int, idle_s: float) -> dict[str, Any]:
    src = (np.arange(OBJECT, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8) | 1
    dst = np.zeros(OBJECT, dtype=np.uint8)
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
        times: dict[str, list[float]] = {"list": [], "prepared": []}
        for _ in range(reps):
            for how, dest in dests.items():
                t0 = time.perf_counter()
                res = client.deliver(dest).result(30)
                times[how].append(time.perf_counter() - t0)
                assert res[b"obj"].ok, res
        queries = []
        for _ in range(2000):
            t0 = time.perf_counter()
            client.query([b"obj"]).result(5)
            queries.append(time.perf_counter() - t0)
        # Deposits of the same 64 MiB under new keys: each evicts the oldest object (FIFO).
        sources = [Span(f"L{i}", rs, i * SPAN, SPAN, "kv") for i in range(SPANS)]
        deposits = []
        for i in range(reps):
            t0 = time.perf_counter()
            res = client.deposit({f"dep{i}".encode(): sources}).result(30)
            deposits.append(time.perf_counter() - t0)
            assert res.all_ok, res
        dst[:] = 0
        last = f"dep{reps - 1}".encode()
        assert client.deliver({last: spans}).result(30)[last].ok
        if not np.array_equal(src, dst):
            raise AssertionError("a deposit's bytes differ when delivered back")
        # Idle: a client connected, nothing in flight.
        c0, t0 = cpu_seconds(node_pid), time.monotonic()
        time.sleep(idle_s)
        idle = (cpu_seconds(node_pid) - c0) / (time.monotonic() - t0)
        client_cpu0, t1 = cpu_seconds(os.getpid()), time.monotonic()
        time.sleep(1.0)
        client_idle = (cpu_seconds(os.getpid()) - client_cpu0) / (time.monotonic() - t1)
        stats = client.stats().result(5)
        assert stats["invariants"] == [], stats["invariants"]
    return {"deliver": summary(times["list"]), "deliver_prepared": summary(times["prepared"]),
            "deposit": summary(deposits), "query": summary(queries[200:]), "idle_cpu": idle, "client_idle_cpu": client_idle}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--raw-writer", help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, smaller admission sweep")
    args = parser.parse_args()
    if args.raw_writer:
        raw_writer(args.raw_writer)
        return 0
    reps = 8 if args.quick else args.reps
    with process_group("bench") as (run, procs):
        procs.append(node := spawn("-m", "kvcr_node.cli", "--endpoint", f"ipc://{run}/node.sock",
                                   "--pool", f"kv:64KiB:{2 * SPANS}", "--log-level", "WARNING"))
        procs.append(spawn(__file__, "--raw-writer", f"ipc://{run}/raw.sock"))
        k = bench_kvcr(f"ipc://{run}/node.sock", node.pid, reps, 1.0 if args.quick else args.idle_seconds)
        r = bench_raw(f"ipc://{run}/raw.sock", reps)

    print(f"deliver of a {OBJECT >> 20} MiB object, {SPANS} spans of {SPAN >> 10} KiB, DRAM -> DRAM, separate processes")
    print(f"  kvcr deliver, list of spans      {fmt_gbps(OBJECT, k['deliver'])}")
    print(f"  kvcr deliver, prepared dest.     {fmt_gbps(OBJECT, k['deliver_prepared'])}")
    print(f"  raw NIXL WRITE (in the writer)   {fmt_gbps(OBJECT, r['write'])}")
    print(f"  raw NIXL WRITE + ZeroMQ trigger  {fmt_gbps(OBJECT, r['write_e2e'])}")
    print(f"  raw NIXL WRITE, one merged desc  {fmt_gbps(OBJECT, r['write_merged'])}")
    for label, name in (("list of spans", "deliver"), ("prepared destination", "deliver_prepared")):
        ratio = r["write"]["median"] / k[name]["median"]
        ratio_e2e = r["write_e2e"]["median"] / k[name]["median"]
        print(f"  ratio kvcr / raw NIXL, {label}: {ratio:.2f} (goal >= 0.85); against raw NIXL + trigger: {ratio_e2e:.2f}")
    print("deposit of the same object under a new key (evicting one), against raw NIXL READ")
    print(f"  kvcr deposit, list of spans      {fmt_gbps(OBJECT, k['deposit'])}")
    print(f"  raw NIXL READ (in the reader)    {fmt_gbps(OBJECT, r['read'])}")
    print(f"  ratio kvcr / raw NIXL: {r['read']['median'] / k['deposit']['median']:.2f}")
    print("query round trip")
    print(f"  kvcr query        {fmt_us(k['query'])}")
    print(f"  raw ZeroMQ echo   {fmt_us(r['echo'])}")
    print(f"  ratio kvcr / raw echo p50: {k['query']['median'] / r['echo']['median']:.2f} (goal <= 1.3)")
    print("admission into a full pool B, evicting one object of B each (FIFO)")
    sweep = (1_000, 10_000) if args.quick else (1_000, 10_000, 100_000)
    adm = {n: measure_admission(n) for n in sweep}
    for n, m in adm.items():
        print(f"  {n:>7,} evictable objects in unrelated pool A: median {m['median_s'] * 1e6:6.2f} us/admission, {int(m['visits'])} candidates visited for 64 admissions")
    print(f"  ratio {sweep[-1] // 1000}k/1k: {adm[sweep[-1]]['median_s'] / adm[1_000]['median_s']:.2f} (goal <= 1.5)")
    print(f"node CPU while idle with a client connected: {k['idle_cpu'] * 100:.2f}% of a core (goal < 1%)")
    print(f"client process CPU while idle: {k['client_idle_cpu'] * 100:.2f}% of a core")
    n_index = 10_000 if args.quick else 100_000
    print(f"index memory per stored object at {n_index:,} objects: 1 span {index_bytes_per_object(n_index, 1):.0f} B, "
          f"64 spans {index_bytes_per_object(n_index, 64):.0f} B (goal < 1024 B)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
