"""Nodes for tests: ``kvcr-node`` child processes on private endpoints, with bounded starts
and stops; a node whose loop runs in a thread of the test; and a node whose loop never runs,
driven message by message (``NodeDriver``)."""

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
from typing import Any

import numpy as np

from kvcr_io.agent import Agent
from kvcr_node.config import NodeConfig
from kvcr_node.node import Node
from kvcr_node.source import SubmitWrite
from kvcr_protocol import CURRENT_VERSION, Hello, MemoryKind, Message, Region, Welcome, decode, encode

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
TRANSFER_TIMEOUT_S = 10.0
"""A driven node's transfers end within this (bounded wait, never a sleep)."""


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


# --------------------------------------------------------------------------- a node driven by the test


class FakeClock:
    """Protocol time the test moves by hand (a node's thread may read it: hence the lock)."""

    def __init__(self, start: float = 5000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


class NamedAgent:
    """The node's NIXL agent as its remote-agent table sees it, without NIXL: a peer's
    metadata is that peer's agent name, and progress does nothing."""

    def add_remote(self, metadata: bytes) -> str:
        return metadata.decode()

    def remove_remote(self, name: str) -> None:
        pass

    def progress(self) -> None:
        pass


class ClientAgent:
    """A NIXL agent of the test with registered buffers, announced to a node as regions 1, 2, ..."""

    def __init__(self, name: str, *buffers: np.ndarray) -> None:
        self.agent = Agent(name)
        self.name = name
        self.buffers = buffers
        self._regs = [self.agent.register(MemoryKind.DRAM, b.ctypes.data, b.nbytes, 0) for b in buffers]
        self.metadata = self.agent.metadata()
        self.regions = tuple(Region(i + 1, MemoryKind.DRAM, 0, b.ctypes.data, b.nbytes) for i, b in enumerate(buffers))
        self.notifications: list[bytes] = []
        """NIXL notifications this agent received while ``finish_transfers`` progressed it."""

    def close(self) -> None:
        for reg in self._regs:
            self.agent.deregister(reg)
        self._regs.clear()


class NodeDriver:
    """A node whose loop never runs: the test hands its router one message at a time, reads
    what the node would send (its outbox), moves its clock and runs its timed steps.

    Nothing here waits or races: the node's whole request path runs in the test's thread
    (architecture §1, sans-I/O). Only NIXL transfers, where a test starts them, are waited
    for (``finish_transfers``), bounded.
    """

    def __init__(self, node: Node, clock: FakeClock) -> None:
        self.node = node
        self.clock = clock
        self._sent: dict[bytes, list[bytes]] = {}

    def receive(self, identity: bytes, msg: Message, version: int = CURRENT_VERSION) -> list[Message]:
        """Hand the node ``msg`` from ``identity``; returns what it sent to ``identity`` meanwhile."""
        self.node.router.receive([identity, encode(msg, version)])
        return self.sent(identity, version)

    def receive_frames(self, frames: list[bytes]) -> None:
        """Hand the node raw frames (malformed ones included)."""
        self.node.router.receive(frames)

    def sent(self, identity: bytes, version: int = CURRENT_VERSION) -> list[Message]:
        """What the node sent to ``identity`` since last asked, decoded, in order."""
        for to, payload in self.node.outbox.take():
            self._sent.setdefault(to, []).append(payload)
        return [decode(payload, version) for payload in self._sent.pop(identity, [])]

    def tick(self, seconds: float = 0.0) -> None:
        """Move the clock, then run the node's timed steps once, as a loop turn would."""
        self.clock.advance(seconds)
        now = self.clock()
        self.node.links.check(now)
        self.node.operations.check_deadlines(now)
        self.node.sessions.check_liveness(now)
        self.node.leases.check(now)
        self.node.puts.check_puts(now)
        self.node.sessions.flush_capacity_events()

    def finish_transfers(self, *agents: ClientAgent) -> None:
        """Poll the node's transfers (progressing the test's agents too) until none runs."""
        deadline = time.monotonic() + TRANSFER_TIMEOUT_S
        while self.node.transfers.inflight:
            assert time.monotonic() < deadline, "the node's transfers did not end"
            self.node.transfers.poll()
            self.node.operations.flush_progress()
            for agent in agents:
                agent.notifications.extend(agent.agent.progress())

    def hello(self, identity: bytes, agent: ClientAgent, request_id: int = 1, resume: bytes = b"") -> Welcome:
        """Open a client session for ``agent`` with its regions (presenting the resume token
        ``resume``, spec section 5.2); returns the welcome."""
        replies = self.receive(identity, Hello(request_id, (CURRENT_VERSION,), agent.name, agent.name, agent.metadata,
                                               agent.regions, resume))
        assert len(replies) == 1 and isinstance(replies[0], Welcome), replies
        return replies[0]

    def stats(self) -> dict[str, Any]:
        """The node's stats with its accounting check (``invariants``)."""
        return self.node.snapshot(audit=True)


@contextmanager
def node_driver(
    config: NodeConfig, clock: FakeClock | None = None, source_submit: SubmitWrite | None = None
) -> Iterator[NodeDriver]:
    """A ``NodeDriver`` over a node built from ``config`` (``source_submit``: the node's hook for
    peer writes' submissions); shut down (without its loop) on exit."""
    clock = clock or FakeClock()
    node = Node(config, clock=clock, source_submit=source_submit)
    try:
        yield NodeDriver(node, clock)
    finally:
        node.request_stop()
        node.run()  # the loop sees the stop at once and shuts the node down
