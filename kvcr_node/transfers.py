"""Build, post and poll NIXL transfers between pool slots and a remote agent's memory.

Each pool memory (one per memory kind and device) gets one descriptor list prepared at
start, one descriptor per slot, so a transfer selects slots by index (architecture §6). When
consecutive spans are contiguous on both sides (consecutive slots of one pool into
consecutive bytes of one remote region) they are merged into one descriptor first: small
descriptors are slow, and most objects land in consecutive slots.

The remote side is always a prepared list in which each region's descriptors follow the
whole region, regions highest first (``anchored``): NIXL keeps every registration a remote
agent's metadata ever carried and looks a descriptor up next to its neighbours only, so
without that anchor an older or smaller registration inside the region hides it.
"""

from __future__ import annotations

import builtins
import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvcr_io.agent import Agent, Desc, Kind, PreparedLists, TransferError, XferStatus
from kvcr_io.runs import cut, cut_rows
from kvcr_node.memory import PoolMemory
from kvcr_protocol import MemoryKind, Region


class Remote(Protocol):
    """The other side of a transfer: a client's or peer's registered ``Region``, or one of
    this node's disk pools' files (``kvcr_node.disk_pools.FileRegion``, moved by its own agent)."""

    @property
    def kind(self) -> Kind: ...
    @property
    def device(self) -> int: ...
    @property
    def address(self) -> int: ...
    @property
    def length(self) -> int: ...


Move = tuple[str, int, int, int, Remote, int]
"""(pool, first slot, remote address, length, remote region, spans): ``spans`` consecutive
slots of the pool and as many contiguous spans of remote memory (usually 1)."""

RUN_MOVES_NUMPY_FROM = 64
"""Spans from which ``run_moves`` cuts in numpy: its calls cost about 12 us whatever the
length, a Python loop (``list_moves``) 1.3 us for one span and 10 us for 64 (measured here),
and most objects an engine stores or reads span by span have a few spans each."""


def run_moves(pool: str, size: int, region: Remote, offsets: np.ndarray, slots: np.ndarray) -> list[Move]:
    """Moves for spans of one pool and one remote region, each ``size`` bytes, in order.

    ``offsets`` (uint64) are the spans' offsets in ``region``, already checked to lie in
    it; ``slots`` their slots. A run (``kvcr_io.runs.cut``: slot bytes on this side, the
    region's on the other) continues while the next span is the next slot and the next
    bytes of the region, and becomes one move.
    """
    if len(slots) < RUN_MOVES_NUMPY_FROM:
        return list_moves(pool, size, region, offsets.tolist(), slots.tolist())
    return array_moves(pool, size, region, offsets, slots)


def array_moves(pool: str, size: int, region: Remote, offsets: np.ndarray, slots: np.ndarray) -> list[Move]:
    """``run_moves`` cut in numpy, whatever the length."""
    first = slots.astype(np.uint64)
    starts, sizes = cut(first * np.uint64(size), offsets, size)
    base = region.address
    spans = (sizes // np.uint64(size)).tolist()
    return [
        (pool, slot, base + offset, count * size, region, count)
        for slot, offset, count in zip(first[starts].tolist(), offsets[starts].tolist(), spans, strict=True)
    ]


def list_moves(pool: str, size: int, region: Remote, offsets: Sequence[int], slots: Sequence[int]) -> list[Move]:
    """``run_moves`` for a few spans given as lists (a layer plan's group): a Python loop
    over a handful of spans costs less than the numpy calls that pay off on long lists."""
    base = region.address
    return [
        (pool, first // size, base + offset, length, region, count)
        for _, first, offset, length, count in cut_rows((0, slot * size, offset, size) for offset, slot in zip(
            offsets, slots, strict=True))
    ]


UNIFORM_MIN = 16
"""From this many spans, spans of one region and one length are checked a column at a time."""


def uniform_columns(
    regions: Mapping[int, Region], ids: Sequence[int], offsets: Sequence[int], lengths: Sequence[int],
    size: int | None = None,
) -> tuple[Region, np.ndarray] | None:
    """The region and uint64 offsets of many spans that share one region and one length
    (``size`` when given) and all lie inside that region; None when any of that does not
    hold, and the per-span checks must decide (and name the bad span).

    ``ids``, ``offsets`` and ``lengths`` are the spans' columns.
    """
    if len(ids) < UNIFORM_MIN or len(set(ids)) != 1 or len(set(lengths)) != 1:
        return None
    length = lengths[0]
    region = regions.get(ids[0])
    if region is None or length <= 0 or (size is not None and length != size) or region.length < length:
        return None
    array = np.array(offsets, dtype=np.uint64)
    # Span rule: [offset, offset + length) inside the region's bytes.
    if int(array.max()) > region.length - length:
        return None
    return region, array


def anchored(
    blocks: Mapping[tuple[int, int], tuple[list[int], list[Desc]]], device: int,
) -> tuple[list[int], list[Desc], list[int]]:
    """The remote descriptor list of a transfer, and which local and remote entries it moves.

    ``blocks`` maps each remote region (address, length) to its local indices and remote
    descriptors, pairwise. Every block is preceded by its region's own descriptor, regions
    highest first (NIXL's order: address, then length). NIXL finds a descriptor's
    registration by binary search and then looks at that entry and the one before only,
    while it goes on with the entry it found as long as that entry covers the next
    descriptor. The remote agent's metadata keeps every registration it ever carried (NIXL
    drops them only with the whole agent), so a registration that starts inside the region
    (an earlier buffer whose memory was reused, or a smaller live one) made the lookup of a
    descriptor past it fail or pick that registration. The region's own descriptor is found
    exactly, covers every descriptor of its block, and is lower than the block before it, so
    each region is looked up afresh and by its own registration (architecture §6). The
    anchors themselves are never moved: returns (local indices, remote list, remote indices).
    """
    local_idx: list[int] = []
    remote: list[Desc] = []
    remote_idx: list[int] = []
    for address, length in sorted(blocks, reverse=True):
        idx, descs = blocks[(address, length)]
        remote.append((address, length, device))
        first = len(remote)
        remote.extend(descs)
        remote_idx.extend(range(first, len(remote)))
        local_idx.extend(idx)
    return local_idx, remote, remote_idx


_MERGE_GAIN = 2
"""Merge only when it at least halves the descriptor count; else use the prepared lists."""


class TransferState(enum.Enum):
    """A logical transfer: running until every NIXL request of it is terminal."""

    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


@dataclass
class Transfer:
    """One logical transfer (possibly several NIXL requests); terminal when all are."""

    on_done: Callable[[bool], None]
    bytes: int
    agent: str = ""
    """The remote agent whose memory it touches (kept loaded while it runs)."""
    requests: list[Any] = field(default_factory=list)
    lists: list[PreparedLists] = field(default_factory=list)
    """The lists it posts from, when they are its own (``Transfers.start``): let go of with it."""
    pending: list[Any] = field(default_factory=list)
    state: TransferState = TransferState.RUNNING
    failed: bool = False
    notifs: tuple[builtins.bytes, ...] = ()
    """Notifications still to send to ``agent`` once every part is done (spec section 6.10)."""

    @property
    def running(self) -> bool:
        """Whether a request of it may still touch memory."""
        return self.state is TransferState.RUNNING


class LocalLists:
    """The prepared slot descriptor lists of every pool, grouped by memory kind and device."""

    def __init__(self, agent: Agent, memories: Sequence[PoolMemory]) -> None:
        self.lists: dict[tuple[MemoryKind, int], Any] = {}
        self.pools: dict[str, tuple[tuple[MemoryKind, int], int, int, int]] = {}
        """pool -> (group, index of slot 0 in the group's list, address of slot 0, slot size)"""
        groups: dict[tuple[MemoryKind, int], list[Desc]] = {}
        for mem in memories:
            group = (mem.kind, mem.nixl_device)
            descs = groups.setdefault(group, [])
            size = mem.spec.slot_size
            self.pools[mem.spec.name] = (group, len(descs), mem.address, size)
            descs.extend((mem.address + i * size, size, mem.nixl_device) for i in range(mem.spec.slot_count))
        for group, descs in groups.items():
            self.lists[group] = agent.prep_local(group[0], descs)


@dataclass(eq=False)
class Prepared:
    """Descriptor lists prepared once for several transfers to one agent (the groups of a
    planned deliver): a transfer of some of its entries only selects their indices."""

    agent: str
    entries: list[list[tuple[int, list[int], list[int]]]]
    """Per entry (one list of moves): per request key, (key, local indices, remote indices)."""
    requests: list[PreparedLists]
    """Per request key: the lists of one local memory and one remote memory (a pool's own
    list on the local side, unless merged runs made one of their own)."""
    bytes: list[int]
    """Bytes per entry."""
    held: bool = True
    """Until ``Transfers.release_prepared`` (or the one transfer that owns it ends)."""


class Transfers:
    """Posts transfers and polls them to a terminal state."""

    def __init__(self, agent: Agent, local: LocalLists) -> None:
        self.agent = agent
        self.local = local
        self.inflight: list[Transfer] = []
        self.posted = 0
        self.merged = 0
        self.failed = 0
        self.bytes = 0
        self.notify_failed = 0
        self.notified = 0
        """Notifications attached to transfers or sent on their own (spec section 6.10)."""
        self.prepared = 0
        """Prepared lists held by their owner (not yet let go of with ``release_prepared``)."""

    def start(
        self, op: str, remote_agent: str, moves: Sequence[Move], on_done: Callable[[bool], None],
        notifs: Sequence[bytes] = (),
    ) -> Transfer:
        """Post ``op`` (READ: remote -> slots; WRITE: slots -> remote) for ``moves``.

        Raises ``TransferError`` when NIXL refuses to create or post it; nothing is then
        in flight. Otherwise ``on_done(ok)`` runs exactly once, when every part is terminal.
        ``notifs`` reach the remote agent once the bytes are in place: one notification
        rides on the transfer itself when it is one NIXL request; otherwise each is sent
        on its own once every part is done (spec section 6.10).
        """
        prepared = self.prepare(remote_agent, [moves])
        try:
            transfer = self.start_prepared(op, prepared, (0,), on_done, notifs, owned=True)
        except BaseException:
            self.release_prepared(prepared)
            raise
        prepared.held = False  # the transfer owns the lists now
        self.prepared -= 1
        return transfer

    def prepare(self, remote_agent: str, entries: Sequence[Sequence[Move]]) -> Prepared:
        """The descriptor lists of transfers of ``entries`` (each a list of moves), prepared
        once: ``start_prepared`` then posts any of them, together or apart, with no list of
        its own. ``release_prepared`` lets go of the lists once nothing posted from them runs."""
        pools = self.local.pools
        # Group by (local memory, remote memory); within a group and an entry, merge contiguous runs.
        groups: dict[tuple[tuple[MemoryKind, int], Kind, int], list[tuple[int, list[list[Any]]]]] = {}
        totals: list[int] = []
        for e, moves in enumerate(entries):
            total = 0
            last_pool: str | None = None
            last_region: Remote | None = None
            runs: list[list[Any]] = []
            base = pool_addr = size = 0
            for pool, slot, address, length, region, count in moves:
                total += length
                if pool is not last_pool or region is not last_region:
                    # Consecutive moves mostly share pool and region: look the group up once.
                    group, base, pool_addr, size = pools[pool]
                    key = (group, region.kind, region.device)
                    listed = groups.setdefault(key, [])
                    if not listed or listed[-1][0] != e:
                        listed.append((e, []))
                    runs = listed[-1][1]
                    last_pool, last_region = pool, region
                local_addr = pool_addr + slot * size
                if runs:
                    last = runs[-1]
                    # Only consecutive slots of one pool into one region: pools (and regions) may
                    # sit back to back in memory, and a descriptor must lie in one registration.
                    if (last[5] == pool and last[6] is region and last[0] + last[2] == local_addr
                            and last[1] + last[2] == address):
                        last[2] += length
                        last[3] += count
                        continue
                runs.append([local_addr, address, length, count, base + slot, pool, region])
            totals.append(total)
        prepared = Prepared(remote_agent, [[] for _ in entries], [], totals)
        try:
            for key, listed in groups.items():
                self._prepare_group(prepared, key, listed)
        except BaseException:
            for lists in prepared.requests:
                self.agent.release_lists(lists)
            raise
        self.prepared += 1
        return prepared

    def _prepare_group(
        self, prepared: Prepared, key: tuple[tuple[MemoryKind, int], Kind, int],
        listed: list[tuple[int, list[list[Any]]]],
    ) -> None:
        """One local and one remote list for every entry's runs between one local memory and one remote memory."""
        group, rkind, rdev = key
        spans = sum(r[3] for _, runs in listed for r in runs)
        count_runs = sum(len(runs) for _, runs in listed)
        blocks: dict[tuple[int, int], tuple[list[int], list[Desc]]] = {}
        owner: list[tuple[int, int]] = []
        """Per descriptor moved, in the order given to ``anchored``: (entry, local index)."""
        if count_runs * _MERGE_GAIN <= spans:
            # Merged runs: a local list of their own.
            self.merged += 1
            local_descs: list[Desc] = []
            for e, runs in listed:
                for local_addr, address, length, _, _, _, region in runs:
                    idx, descs = blocks.setdefault((region.address, region.length), ([], []))
                    idx.append(len(owner))
                    owner.append((e, len(local_descs)))
                    descs.append((address, length, rdev))
                    local_descs.append((local_addr, length, group[1]))
            local = self.agent.prep_local(group[0], local_descs)
            owns_local = True
        else:
            owns_local = False
            local = self.local.lists[group]
            for e, runs in listed:
                for _, address, length, count, first, _, region in runs:
                    idx, descs = blocks.setdefault((region.address, region.length), ([], []))
                    size = length // count
                    for k in range(count):
                        idx.append(len(owner))
                        owner.append((e, first + k))
                        descs.append((address + k * size, size, rdev))
        order, remote_descs, remote_idx = anchored(blocks, rdev)
        try:
            rlist = self.agent.prep_remote(prepared.agent, rkind, remote_descs)
        except BaseException:
            if owns_local:
                self.agent.release_dlist(local)
            raise
        r = len(prepared.requests)
        prepared.requests.append(PreparedLists(prepared.agent, local, rlist, owns_local))
        per_entry: dict[int, tuple[list[int], list[int]]] = {}
        for k, j in zip(order, remote_idx, strict=True):
            e, local_index = owner[k]
            li, ri = per_entry.setdefault(e, ([], []))
            li.append(local_index)
            ri.append(j)
        for e, (li, ri) in per_entry.items():
            prepared.entries[e].append((r, li, ri))

    def start_prepared(
        self, op: str, prepared: Prepared, entries: Sequence[int], on_done: Callable[[bool], None],
        notifs: Sequence[bytes] = (), owned: bool = False,
    ) -> Transfer:
        """Post ``op`` for the ``entries`` of ``prepared`` together (as ``start``); with
        ``owned`` the transfer lets go of the prepared lists when it is released."""
        chosen: dict[int, tuple[list[int], list[int]]] = {}
        total = 0
        for e in entries:
            total += prepared.bytes[e]
            for r, li, ri in prepared.entries[e]:
                if r in chosen:
                    chosen[r][0].extend(li)
                    chosen[r][1].extend(ri)
                else:
                    chosen[r] = (li, ri) if len(entries) == 1 else (list(li), list(ri))
        transfer = Transfer(on_done, total, prepared.agent)
        attach = b""
        if len(notifs) == 1 and len(chosen) == 1:
            attach = notifs[0]
            self.notified += 1
        else:
            transfer.notifs = tuple(notifs)
        try:
            for r, (li, ri) in chosen.items():
                handle, state = self.agent.post_prepared(op, prepared.requests[r], li, ri, attach)
                transfer.requests.append(handle)
                if state is XferStatus.FAILED:
                    raise TransferError(f"NIXL failed to post the {op}")
                if state is XferStatus.RUNNING:
                    transfer.pending.append(handle)
        except Exception:
            # Whatever failed, parts already posted may still touch memory.
            self._drain_then_release(transfer)
            raise
        if owned:
            transfer.lists = prepared.requests
        self.posted += 1
        self.bytes += total
        if attach and not transfer.pending:
            # Done as it was posted (the copy ran inside the post): one progress sends the
            # notification now, before anything else is posted behind it.
            self.agent.progress()
        # Terminal or not, it completes in ``poll``: a completion that starts the next
        # transfer never runs inside this one's submission.
        self.inflight.append(transfer)
        return transfer

    def release_prepared(self, prepared: Prepared) -> None:
        """Let go of ``prepared``'s lists (nothing posted from them may still run); once."""
        if not prepared.held:
            return
        prepared.held = False
        for lists in prepared.requests:
            self.agent.release_lists(lists)
        self.prepared -= 1

    def _drain_then_release(self, transfer: Transfer) -> None:
        # Parts already posted may still touch memory: wait for them before freeing.
        for handle in transfer.requests:
            while self.agent.state(handle) is XferStatus.RUNNING:
                self.agent.progress()
        self._release(transfer)

    def _release(self, transfer: Transfer) -> None:
        for handle in transfer.requests:
            self.agent.release(handle)
        for lists in transfer.lists:
            self.agent.release_lists(lists)
        transfer.requests.clear()
        transfer.lists.clear()

    def _finish(self, transfer: Transfer, ok: bool) -> None:
        transfer.state = TransferState.DONE if ok else TransferState.FAILED
        if not ok:
            self.failed += 1
        self._release(transfer)
        if ok:
            self.notify(transfer.agent, transfer.notifs)
        transfer.on_done(ok)

    def notify(self, agent: str, notifs: Sequence[bytes]) -> None:
        """Send notifications of their own to ``agent`` (best effort: the control reply still
        says what landed, spec section 6.10)."""
        for payload in notifs:
            try:
                self.agent.notify(agent, payload)
            except TransferError:
                self.notify_failed += 1
            else:
                self.notified += 1

    def stats(self) -> dict[str, int]:
        return {"in_flight": len(self.inflight), "posted": self.posted, "failed": self.failed, "bytes": self.bytes,
                "notified": self.notified, "notify_failed": self.notify_failed, "prepared": self.prepared}

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
                if state is XferStatus.RUNNING:
                    pending.append(handle)
                elif state is XferStatus.FAILED:
                    t.failed = True
            t.pending = pending
            (still if pending else finished).append(t)
        self.inflight = still
        failure: Exception | None = None
        for t in finished:
            try:
                self._finish(t, ok=not t.failed)
            except Exception as exc:  # one failing callback must not strand the others
                failure = failure or exc
        if failure is not None:
            raise failure
        return len(finished)
