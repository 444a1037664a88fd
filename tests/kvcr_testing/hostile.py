"""Clients in processes of their own, for the fault, hostile-input and load tests.

``Worker`` runs ``tests/faults/hostile_worker.py`` (a kvcr client in a process of its own,
which the test can stop, freeze or kill at a known point), or with mode ``grants``
``tests/faults/grant_worker.py`` (a client holding read grants, driven command by command),
and reads its JSON reports with bounded waits.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

TESTS_DIR = Path(__file__).resolve().parents[1]
WORKER = TESTS_DIR / "faults" / "hostile_worker.py"
GRANT_WORKER = TESTS_DIR / "faults" / "grant_worker.py"


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus ``extra``, with ``tests/`` first on ``PYTHONPATH`` so
    that a worker imports ``kvcr_testing`` by name, as the tests do."""
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), env.get("PYTHONPATH", "")) if p)
    return env


class Worker:
    """A ``hostile_worker.py`` process; ``expect`` reads its next report (bounded)."""

    def __init__(self, mode: str, endpoint: str, *args: str, prefix: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        script = [str(GRANT_WORKER)] if mode == "grants" else [str(WORKER), mode]  # grant_worker.py has no modes
        cmd = [*prefix, sys.executable, *script, endpoint, *args]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=worker_env(env),
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

    def ask(self, command: str, timeout: float = 60) -> dict[str, Any]:
        """Send one command line (``grant_worker.py``) and read its report, named by its first word."""
        self.say(command)
        return self.expect(command.split()[0], timeout)

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


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values), q))
