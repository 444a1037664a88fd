"""``kvcr-node`` child processes on private endpoints, with bounded starts and stops."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvcr_node.config import NodeConfig
from kvcr_node.node import Node

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0


@dataclass
class NodeProcess:
    """A running ``kvcr-node`` child process."""

    proc: subprocess.Popen[str]
    endpoint: str
    args: list[str]
    output: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None
    """Reads the node's output into ``output`` once it started: a node whose pipe nobody
    reads blocks on its next log line once the pipe buffer is full."""

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Signal the node and wait (bounded) for it to exit; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
        if self.reader is not None:
            self.reader.join(STOP_TIMEOUT_S)
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            if self.reader is None:
                self.output.append(self.proc.stdout.read() or "")
            self.proc.stdout.close()
        return self.proc.returncode

    def read_output(self) -> None:
        """Collect the node's output until it exits (run in ``reader``)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)

    def kill(self) -> None:
        """kill -9: no cleanup at all."""
        self.stop(signal.SIGKILL)


NODE_LAUNCHER = ("-m", "kvcr_node.cli")
"""How ``python`` starts a node: ``kvcr-node`` itself."""


def start_node(
    endpoint: str, *extra: str, prefix: Sequence[str] = (), env: dict[str, str] | None = None,
    launcher: Sequence[str] = NODE_LAUNCHER,
) -> NodeProcess:
    """Start ``kvcr-node`` and wait until it prints the endpoint it bound.

    ``prefix`` runs it under another command (``ip netns exec NS``); ``env`` adds to this
    process's environment; ``launcher`` is what ``python`` runs instead of ``kvcr-node``
    (a script that takes the same flags, such as ``bench/deferred_source.py``).
    """
    args = [*prefix, sys.executable, *launcher, "--endpoint", endpoint, "--log-level", "WARNING", *extra]
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=None if env is None else {**os.environ, **env},
    )
    node = NodeProcess(proc, endpoint, args)
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                continue
            line = proc.stdout.readline()
            if not line:
                break
            node.output.append(line)
            if "listening on" in line:
                node.reader = threading.Thread(target=node.read_output, name="node-output", daemon=True)
                node.reader.start()
                return node
        node.stop(signal.SIGKILL)
        raise RuntimeError(f"kvcr-node did not start: {' '.join(args)}\n{''.join(node.output)}")
    finally:
        sel.close()


@contextmanager
def short_ipc_dir(tag: str) -> Iterator[Path]:
    """A short private directory for ipc socket files (ipc paths are limited to ~107 bytes)."""
    path = Path(f"/tmp/kvcr-{tag}-{os.getpid()}-{time.monotonic_ns() % 10**9}")
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        for p in path.iterdir():
            p.unlink(missing_ok=True)
        path.rmdir()


@contextmanager
def running_node(ipc_dir: Path, name: str, *args: str) -> Iterator[NodeProcess]:
    """A node on ``ipc://<ipc_dir>/<name>.sock``; stopped (SIGTERM, bounded) on exit."""
    node = start_node(f"ipc://{ipc_dir}/{name}.sock", *args)
    try:
        yield node
    finally:
        node.stop()


@contextmanager
def frozen(node: NodeProcess) -> Iterator[None]:
    """SIGSTOP ``node`` for a ``with`` block; SIGCONT afterwards, unless it was killed meanwhile."""
    node.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        if node.proc.poll() is None:
            node.proc.send_signal(signal.SIGCONT)


@contextmanager
def inprocess_node(config: NodeConfig, clock: Callable[[], float] = time.monotonic) -> Iterator[tuple[Node, threading.Thread]]:
    """A node whose progress loop runs in a thread of this process, with the clock given
    (tests pass a fake one); stopped (bounded) on exit."""
    node = Node(config, clock=clock)
    thread = threading.Thread(target=node.run, name=f"node-{config.name}", daemon=True)
    thread.start()
    try:
        yield node, thread
    finally:
        node.request_stop()
        thread.join(STOP_TIMEOUT_S)
        assert not thread.is_alive(), "the node did not stop"
