"""Build, post and poll NIXL transfers between pool slots and a remote agent's memory.

Each pool memory (one per memory kind and device) gets one descriptor list prepared at
start, one descriptor per slot: a transfer then selects slots by index (DESIGN 9). The
remote side is prepared per transfer from the destination spans.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcr_client.agent import Agent, TransferError
from kvcr_node.memory import PoolMemory
from kvcr_protocol import MemoryKind
from kvcr_protocol.descriptors import Extent


@dataclass(frozen=True, slots=True)
class Move:
    """One span: a slot of a pool, and an extent in the remote agent's memory."""

    pool: str
    slot: int
    remote: Extent
    remote_kind: MemoryKind


@dataclass
class Transfer:
    """One logical transfer (possibly several NIXL requests); terminal when all are."""

    requests: list[Any]
    dlists: list[Any]
    on_done: Callable[[bool], None]
    bytes: int
    state: str = "PROC"
    failed: bool = False
    pending: list[Any] = field(default_factory=list)


class LocalLists:
    """The prepared slot descriptor lists of every pool, grouped by memory kind and device."""

    def __init__(self, agent: Agent, memories: Sequence[PoolMemory]) -> None:
        self.agent = agent
        self.lists: dict[tuple[MemoryKind, int], Any] = {}
        self.base: dict[str, tuple[tuple[MemoryKind, int], int]] = {}
        groups: dict[tuple[MemoryKind, int], list[tuple[int, int, int]]] = {}
        for mem in memories:
            group = (mem.kind, mem.nixl_device)
            descs = groups.setdefault(group, [])
            self.base[mem.spec.name] = (group, len(descs))
            size = mem.spec.slot_size
            descs.extend((mem.address + i * size, size, mem.nixl_device) for i in range(mem.spec.slot_count))
        for group, descs in groups.items():
            self.lists[group] = agent.prep_local(group[0], descs)

    def index(self, pool: str, slot: int) -> tuple[tuple[MemoryKind, int], int]:
        group, base = self.base[pool]
        return group, base + slot


class Transfers:
    """Posts transfers and polls them to a terminal state."""

    def __init__(self, agent: Agent, local: LocalLists) -> None:
        self.agent = agent
        self.local = local
        self.inflight: list[Transfer] = []
        self.posted = 0
        self.failed = 0
        self.bytes = 0

    def start(self, op: str, remote_agent: str, moves: Sequence[Move], on_done: Callable[[bool], None]) -> Transfer:
        """Post ``op`` (READ: remote -> slots; WRITE: slots -> remote) for ``moves``.

        Raises ``TransferError`` when NIXL refuses to create or post it; nothing is then
        in flight. ``on_done(ok)`` runs once when every part is terminal.
        """
        groups: dict[tuple[tuple[MemoryKind, int], MemoryKind, int], tuple[list[int], list[tuple[int, int, int]]]] = {}
        for m in moves:
            group, idx = self.local.index(m.pool, m.slot)
            key = (group, m.remote_kind, m.remote.device)
            local_idx, remote_descs = groups.setdefault(key, ([], []))
            local_idx.append(idx)
            remote_descs.append((m.remote.address, m.remote.length, m.remote.device))
        transfer = Transfer([], [], on_done, sum(m.remote.length for m in moves))
        try:
            for (group, rkind, _), (local_idx, remote_descs) in groups.items():
                remote = self.agent.prep_remote(remote_agent, rkind, remote_descs)
                transfer.dlists.append(remote)
                handle, state = self.agent.start(
                    op, self.local.lists[group], local_idx, remote, range(len(remote_descs))
                )
                transfer.requests.append(handle)
                if state == "ERR":
                    raise TransferError(f"NIXL failed to post the {op}")
                if state == "PROC":
                    transfer.pending.append(handle)
        except TransferError:
            self._drain_then_release(transfer)
            raise
        self.posted += 1
        self.bytes += transfer.bytes
        if not transfer.pending:
            self._finish(transfer, ok=True)
        else:
            self.inflight.append(transfer)
        return transfer

    def _drain_then_release(self, transfer: Transfer) -> None:
        # Parts already posted may still touch memory: wait for them before freeing.
        for handle in transfer.requests:
            while self.agent.state(handle) == "PROC":
                self.agent.progress()
        self._release(transfer)

    def _release(self, transfer: Transfer) -> None:
        for handle in transfer.requests:
            self.agent.release(handle)
        for dlist in transfer.dlists:
            self.agent.release_dlist(dlist)
        transfer.requests.clear()
        transfer.dlists.clear()

    def _finish(self, transfer: Transfer, ok: bool) -> None:
        transfer.state = "DONE" if ok else "ERR"
        if not ok:
            self.failed += 1
        self._release(transfer)
        transfer.on_done(ok)

    def poll(self) -> int:
        """Check every in-flight transfer once; returns how many became terminal."""
        if not self.inflight:
            return 0
        still: list[Transfer] = []
        finished: list[Transfer] = []
        for t in self.inflight:
            pending = []
            for handle in t.pending:
                state = self.agent.state(handle)
                if state == "PROC":
                    pending.append(handle)
                elif state == "ERR":
                    t.failed = True
            t.pending = pending
            (still if pending else finished).append(t)
        self.inflight = still
        for t in finished:
            self._finish(t, ok=not t.failed)
        return len(finished)
