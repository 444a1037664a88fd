"""GPU benchmark: kvcr deliver into GPU memory against raw NIXL, on one GPU.

Two processes share the GPU in each measurement, as in production: a node (or a bare NIXL
writer) and this client process. Measured in one run:

1. deliver of a 64 MiB object of 64 KiB spans from an HBM pool into a CuPy buffer
   (HBM -> HBM), and from a DRAM pool into a CuPy buffer (DRAM -> HBM), client-observed;
2. the raw anchors: a bare NIXL process WRITEs the same 1024 descriptors from its own VRAM
   (or DRAM) pool into the same kind of CuPy buffer of this process, timed in the writer,
   and end to end with a raw ZeroMQ trigger; plus the same bytes as one descriptor, which
   is what kvcr posts after merging contiguous spans (architecture §6).

Every transfer's bytes are checked on the host after the timed repetitions. The first
repetitions of each (CUDA IPC mapping, UCX rendezvous set-up) are run but not counted.

Run: ``python bench/gpu.py`` (well under a minute). Needs CuPy and a CUDA GPU. Ratios matter,
not absolute times.
"""

from __future__ import annotations

import argparse
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from anchors import Peer, serve
from procs import stop
from stats import fmt_gbps, summary

from kvcr_client import Client, Span
from kvcr_io.agent import load_nixl
from kvcr_node.memory import advise_huge_pages

SPAN = 64 << 10
SPANS = 1024
OBJECT = SPAN * SPANS  # 64 MiB
DEVICE = 0
KINDS = ("VRAM", "DRAM")
"""Where the source bytes are: an HBM pool or a DRAM pool. The destination is always HBM."""
WRITE_TIMEOUT_S = 30.0


def source_bytes() -> np.ndarray:
    """The object's bytes (never zero), the same in every process."""
    return (np.arange(OBJECT, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8) | 1


def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        sys.exit("bench/gpu.py needs CuPy (the 'gpu' extra) and a CUDA GPU: CuPy is not installed")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        sys.exit(f"bench/gpu.py needs a CUDA GPU: CuPy sees none ({exc})")
    if count <= DEVICE:
        sys.exit(f"bench/gpu.py needs CUDA device {DEVICE}; this machine has {count}")
    return cupy


def on_device(cupy: Any, host: np.ndarray) -> Any:
    with cupy.cuda.Device(DEVICE):
        arr = cupy.asarray(host)
    cupy.cuda.runtime.deviceSynchronize()
    return arr


def check(cupy: Any, dst: Any, expected: np.ndarray, what: str) -> None:
    cupy.cuda.runtime.deviceSynchronize()
    got = cupy.asnumpy(dst)
    if not np.array_equal(got, expected):
        bad = int(np.count_nonzero(got != expected))
        raise AssertionError(f"{what}: {bad} of {expected.size} delivered bytes differ")


def clear(cupy: Any, dst: Any) -> None:
    dst.fill(0)
    cupy.cuda.runtime.deviceSynchronize()


# --------------------------------------------------------------------------- raw anchor


def raw_writer(endpoint: str) -> None:
    """A bare NIXL process: a VRAM pool and a DRAM pool registered once, WRITEs on request."""
    cupy = _cupy()
    nixl = load_nixl()
    agent = nixl.nixl_agent("raw-gpu-writer", nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    host = source_bytes()
    vram = on_device(cupy, host)
    buf = mmap.mmap(-1, OBJECT, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise_huge_pages(buf)  # the memory a node's DRAM pool has (kvcr_node.memory)
    dram = np.frombuffer(buf, dtype=np.uint8)
    dram[:] = host
    bases = {"VRAM": (int(vram.data.ptr), DEVICE), "DRAM": (int(dram.ctypes.data), 0)}
    local, whole = {}, {}
    for kind, (base, dev) in bases.items():
        agent.register_memory([(base, OBJECT, dev, "")], kind)
        local[kind] = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(base + i * SPAN, SPAN, dev) for i in range(SPANS)], kind)
        whole[kind] = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(base, OBJECT, dev)], kind)
    peer: dict[str, Any] = {}

    def setup(msg: dict[str, Any]) -> dict[str, Any]:
        name = agent.add_remote_agent(msg["md"])
        addr, dev = msg["addr"], msg["dev"]
        peer["spans"] = agent.prep_xfer_dlist(name, [(addr + i * SPAN, SPAN, dev) for i in range(SPANS)], "VRAM")
        peer["whole"] = agent.prep_xfer_dlist(name, [(addr, OBJECT, dev)], "VRAM")
        return {"t": "ok"}

    def write(msg: dict[str, Any]) -> dict[str, Any]:
        one = msg["one"]
        src, dst = (whole, peer["whole"]) if one else (local, peer["spans"])
        idx = [0] if one else list(range(SPANS))
        t0 = time.perf_counter()
        handle = agent.make_prepped_xfer("WRITE", src[msg["kind"]], idx, dst, idx)
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
            if time.perf_counter() - t0 > WRITE_TIMEOUT_S:
                state = "TIMEOUT"  # the request stays posted; the run is failing anyway
                break
        else:
            agent.release_xfer_handle(handle)
        return {"t": "done", "s": time.perf_counter() - t0, "state": state}

    serve(endpoint, {"setup": setup, "write": write})


def bench_raw(cupy: Any, endpoint: str, reps: int, warmup: int) -> dict[str, Any]:
    """Raw NIXL WRITEs into a CuPy buffer of this process, triggered over ZeroMQ."""
    nixl = load_nixl()
    agent = nixl.nixl_agent("raw-gpu-client", nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    expected = source_bytes()
    dst = on_device(cupy, np.zeros(OBJECT, dtype=np.uint8))
    agent.register_memory([(int(dst.data.ptr), OBJECT, DEVICE, "")], "VRAM")
    peer = Peer(endpoint)
    assert peer.call({"t": "setup", "md": agent.get_agent_metadata(), "addr": int(dst.data.ptr), "dev": DEVICE})["t"] == "ok"
    out: dict[str, Any] = {}
    for kind in KINDS:
        for one in (False, True):
            clear(cupy, dst)
            in_writer, end_to_end = [], []
            for rep in range(warmup + reps):
                t0 = time.perf_counter()
                reply = peer.call({"t": "write", "kind": kind, "one": one}, agent.get_new_notifs)
                elapsed = time.perf_counter() - t0
                assert reply["state"] == "DONE", reply
                if rep >= warmup:
                    end_to_end.append(elapsed)
                    in_writer.append(reply["s"])
            check(cupy, dst, expected, f"raw NIXL WRITE {kind} -> VRAM{' (one descriptor)' if one else ''}")
            tag = f"{kind}{'-one' if one else ''}"
            out[tag] = summary(in_writer)
            out[f"{tag}-e2e"] = summary(end_to_end)
    peer.close()
    return out


# --------------------------------------------------------------------------- kvcr


def bench_kvcr(cupy: Any, endpoint: str, reps: int, warmup: int) -> dict[str, Any]:
    expected = source_bytes()
    src = on_device(cupy, expected)
    dst = on_device(cupy, np.zeros(OBJECT, dtype=np.uint8))
    out: dict[str, Any] = {}
    with Client(endpoint, name="bench-gpu") as client:
        rs, rd = client.register(src), client.register(dst)
        keys = {"VRAM": (b"obj-hbm", "hbmkv"), "DRAM": (b"obj-dram", "kv")}
        for key, pool in keys.values():
            res = client.deposit({key: [Span(f"L{i}", rs, i * SPAN, SPAN, pool) for i in range(SPANS)]}).result(60)
            assert res[key].ok, res
        for kind, (key, _) in keys.items():
            clear(cupy, dst)
            dest = {key: [Span(f"L{i}", rd, i * SPAN, SPAN) for i in range(SPANS)]}
            times = []
            for rep in range(warmup + reps):
                t0 = time.perf_counter()
                res = client.deliver(dest).result(60)
                elapsed = time.perf_counter() - t0
                assert res[key].ok, res
                if rep >= warmup:
                    times.append(elapsed)
            check(cupy, dst, expected, f"kvcr deliver {kind} pool -> HBM buffer")
            out[kind] = summary(times)
        stats = client.stats(audit=True).result(10)
        assert stats["invariants"] == [], stats["invariants"]
        assert stats["claims"]["total"] == 0, stats["claims"]
    return out


# --------------------------------------------------------------------------- processes


def _spawn(*args: str) -> tuple[subprocess.Popen[str], list[str]]:
    """Start a child, wait for its ready line, then keep draining its output in a thread."""
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen: list[str] = []
    for line in proc.stdout:  # NIXL logs its start-up on stdout: skip to our line
        seen.append(line)
        if line.startswith("ready") or "listening on" in line:
            threading.Thread(target=seen.extend, args=(proc.stdout,), daemon=True).start()
            return proc, seen
    proc.wait(15)
    raise RuntimeError(f"{' '.join(args)} did not start (exit {proc.returncode}): {''.join(seen)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--raw-writer", help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if args.raw_writer:
        raw_writer(args.raw_writer)
        return 0
    cupy = _cupy()
    started = time.monotonic()
    run = Path(f"/tmp/kvcr-bench-gpu-{os.getpid()}")
    run.mkdir(exist_ok=True)
    procs: list[tuple[subprocess.Popen[str], list[str]]] = []
    try:
        procs.append(_spawn(
            "-m", "kvcr_node.cli", "--endpoint", f"ipc://{run}/node.sock", "--log-level", "WARNING",
            "--pool", f"hbmkv:64KiB:{SPANS}:hbm:{DEVICE}", "--pool", f"kv:64KiB:{SPANS}",
        ))
        procs.append(_spawn(__file__, "--raw-writer", f"ipc://{run}/raw.sock"))
        k = bench_kvcr(cupy, f"ipc://{run}/node.sock", args.reps, args.warmup)
        r = bench_raw(cupy, f"ipc://{run}/raw.sock", args.reps, args.warmup)
    except BaseException:
        for proc, seen in procs:
            proc.poll()
            print(f"--- output of {proc.args!r} (exit {proc.returncode}):\n{''.join(seen)}", file=sys.stderr)
        raise
    finally:
        stop([proc for proc, _ in procs])
        for f in run.iterdir():
            f.unlink()
        run.rmdir()

    name = cupy.cuda.runtime.getDeviceProperties(DEVICE)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    print(f"deliver of a {OBJECT >> 20} MiB object, {SPANS} spans of {SPAN >> 10} KiB, into a CuPy buffer on "
          f"device {DEVICE} ({name}); node and client in separate processes; {args.reps} timed, {args.warmup} warm-up")
    for kind, label in (("VRAM", "HBM pool -> HBM buffer"), ("DRAM", "DRAM pool -> HBM buffer")):
        print(label)
        print(f"  kvcr deliver (client-observed)        {fmt_gbps(OBJECT, k[kind])}  spread {k[kind]['spread']:.2f}")
        print(f"  raw NIXL WRITE, {SPANS} descs (writer)   {fmt_gbps(OBJECT, r[kind])}  spread {r[kind]['spread']:.2f}")
        print(f"  raw NIXL WRITE + ZeroMQ trigger       {fmt_gbps(OBJECT, r[kind + '-e2e'])}")
        print(f"  raw NIXL WRITE, 1 desc (writer)       {fmt_gbps(OBJECT, r[kind + '-one'])}")
        print(f"  raw NIXL WRITE, 1 desc + trigger      {fmt_gbps(OBJECT, r[kind + '-one-e2e'])}")
        med = k[kind]["median"]
        print(f"  ratio kvcr / raw NIXL ({SPANS} descs): {r[kind]['median'] / med:.2f} (goal >= 0.85); "
              f"with trigger: {r[kind + '-e2e']['median'] / med:.2f}; "
              f"against 1 desc + trigger: {r[kind + '-one-e2e']['median'] / med:.2f}")
    print(f"bench/gpu.py took {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
