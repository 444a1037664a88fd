"""Child processes of a benchmark: started until they say they are ready, always stopped.

Importing this module keeps UCX on loopback (``UCX_NET_DEVICES=lo``) for the benchmark's
own NIXL agents and for every process it starts, which inherit it: UCX (under NIXL) opens
a TCP listener for its wireup on every network device it may use, by default the host's
external interface too, though a benchmark's processes are all on one host. Every benchmark
that makes an agent or starts a node imports this module before it does
(tests/test_bench_procs.py checks that). An environment that sets UCX_NET_DEVICES keeps it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

UCX_NET_DEVICES = os.environ.setdefault("UCX_NET_DEVICES", "lo")


def spawn(*args: str) -> subprocess.Popen[str]:
    """Start ``python ARGS`` and wait for its ``ready`` or ``listening on`` line."""
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # NIXL logs its start-up on stdout: skip to our line
        seen.append(line)
        if line.startswith("ready") or "listening on" in line:
            return proc
    proc.kill()
    raise RuntimeError(f"{args[0]} did not start: {''.join(seen)}")


def stop(procs: list[subprocess.Popen[str]]) -> None:
    """Terminate each process, killing any that does not exit within 15 s."""
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)


@contextmanager
def process_group(name: str) -> Iterator[tuple[Path, list[subprocess.Popen[str]]]]:
    """A private run folder for ipc endpoints and a list of processes stopped on exit."""
    run = Path(f"/tmp/kvcr-{name}-{os.getpid()}")
    run.mkdir(exist_ok=True)
    procs: list[subprocess.Popen[str]] = []
    try:
        yield run, procs
    finally:
        stop(procs)
        for f in run.iterdir():
            f.unlink()
        run.rmdir()
