"""Helpers of the fault, hostile-input and load tests (``tests/faults/test_hostile_*``, ``test_load_*``).

Loads ``tests/integration/integration_helpers.py`` by path (pytest puts only the test
file's own folder on ``sys.path``) and re-exports what these tests use. ``Worker`` runs
``hostile_worker.py`` (a kvcr client in a process of its own) and reads its JSON reports
with bounded waits.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import integration_helpers  # tests/integration, on pytest's pythonpath
import numpy as np

from kvcr_client import Client

_HERE = Path(__file__).resolve().parent
WORKER = _HERE / "hostile_worker.py"


_ih = integration_helpers
KiB: int = _ih.KiB
RESULT_TIMEOUT_S: float = _ih.RESULT_TIMEOUT_S
Layout = _ih.Layout
Registrar = _ih.Registrar
NodeProcess = _ih.NodeProcess
assert_bytes_equal: Callable[..., None] = _ih.assert_bytes_equal
assert_clean: Callable[..., dict[str, Any]] = _ih.assert_clean
pattern: Callable[[int, int], np.ndarray] = _ih.pattern
start_node: Callable[..., Any] = _ih.start_node
stats: Callable[[Client], dict[str, Any]] = _ih.stats
slot_accounting: Callable[[dict[str, Any]], dict[str, tuple[int, int]]] = _ih.slot_accounting
wait_until: Callable[..., bool] = _ih.wait_until
short_ipc_dir = _ih.short_ipc_dir


class Worker:
    """A ``hostile_worker.py`` process; ``expect`` reads its next report (bounded)."""

    def __init__(self, mode: str, endpoint: str, *args: str, prefix: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        cmd = [*prefix, sys.executable, str(WORKER), mode, endpoint, *args]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        """The next report, which must be ``event``; fails after ``timeout`` seconds."""
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"worker: no {event!r} within {timeout} s; output so far: {self.lines}\n{self.stderr()}")
                if not sel.select(timeout=left):
                    continue
                line = self.proc.stdout.readline()
                if not line:
                    self.proc.wait(5)
                    raise AssertionError(f"worker exited ({self.proc.returncode}) before {event!r}: {self.lines}\n{self.stderr()}")
                self.lines.append(line)
                if not line.startswith("{"):
                    continue  # someone else's output (a library's banner)
                report: dict[str, Any] = json.loads(line)
                assert report["event"] == event, (event, report)
                return report
        finally:
            sel.close()

    def say(self, text: str = "go") -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(text + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise AssertionError(f"worker exited ({self.proc.poll()}): {self.lines}\n{self.stderr()}") from None

    def stderr(self) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return ""
        return self.proc.stderr.read()[-4000:]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        """SIGKILL if still running; reap; close the pipes."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process dies of SIGKILL as well, but be tidy
            self.proc.kill()
        try:
            self.proc.wait(15)
        finally:
            for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                if pipe is not None:
                    try:
                        pipe.close()
                    except OSError:
                        pass


def node_stats_ok(client: Client) -> dict[str, Any]:
    """Stats with no invariant breach (the node may be busy)."""
    st = stats(client)
    assert st["invariants"] == [], st["invariants"]
    return st


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values), q))
