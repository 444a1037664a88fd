"""Child processes of a benchmark: started until they say they are ready, always stopped."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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
