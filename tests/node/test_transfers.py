"""The remote descriptor lists of transfers, against a model of how NIXL resolves them.

``Registrations`` resolves a list the way NIXL 1.5.1 does (architecture §6): registrations
sorted by (device, address, length); a descriptor keeps the entry that resolved the one
before it while that entry covers it, else it is looked up by binary search and only the
entry found and the one before it are tried (the next ones, when the list goes up). The
byte-checked test against real NIXL is ``test_region_over_memory_registered_before`` in
tests/integration/test_local.py.
"""

from __future__ import annotations

import bisect
import itertools
import random
import time
from typing import Any

import numpy as np

from kvcr_io.agent import Agent, Desc, XferStatus
from kvcr_node.transfers import RUN_MOVES_NUMPY_FROM, anchored, array_moves, list_moves, run_moves
from kvcr_protocol import MemoryKind, Region

DEV = 0
SLOT = 4096


def covers(entry: Desc, desc: Desc) -> bool:
    return entry[2] == desc[2] and entry[0] <= desc[0] and entry[0] + entry[1] >= desc[0] + desc[1]


def order(desc: Desc) -> tuple[int, int, int]:
    return desc[2], desc[0], desc[1]


class Registrations:
    """A remote agent's registrations as NIXL holds them: everything its metadata ever carried."""

    def __init__(self, regs: list[Desc]) -> None:
        self.regs = sorted(regs, key=order)
        self.keys = [order(r) for r in self.regs]

    def _lookup(self, desc: Desc) -> int | None:
        i = bisect.bisect_left(self.keys, order(desc))
        if i < len(self.regs) and covers(self.regs[i], desc):
            return i
        if i > 0 and covers(self.regs[i - 1], desc):
            return i - 1
        return None

    def resolve(self, descs: list[Desc]) -> list[Desc] | None:
        """The registration each descriptor resolves to; None where NIXL refuses the list."""
        at = self._lookup(descs[0])
        if at is None:
            return None
        out = [self.regs[at]]
        for prev, desc in itertools.pairwise(descs):
            if not covers(self.regs[at], desc):
                if order(desc) < order(prev):
                    at = self._lookup(desc)
                    if at is None:
                        return None
                else:
                    at = next((j for j in range(at, len(self.regs)) if covers(self.regs[j], desc)), None)
                    if at is None:
                        return None
            out.append(self.regs[at])
        return out


def region(slot: int, slots: int) -> Desc:
    return (slot * SLOT, slots * SLOT, DEV)


def spans(reg: Desc, slots: list[int]) -> list[Desc]:
    return [(reg[0] + s * SLOT, SLOT, DEV) for s in slots]


def blocks_of(pairs: list[tuple[Desc, list[Desc]]]) -> dict[tuple[int, int], tuple[list[int], list[Desc]]]:
    out: dict[tuple[int, int], tuple[list[int], list[Desc]]] = {}
    n = 0
    for reg, descs in pairs:
        idx, ds = out.setdefault((reg[0], reg[1]), ([], []))
        for d in descs:
            idx.append(n)
            ds.append(d)
            n += 1
    return out


def check(nixl: Registrations, pairs: list[tuple[Desc, list[Desc]]]) -> None:
    """The anchored list moves each descriptor once, paired with its local index, and
    resolves it to its own region (or a live region that holds it: regions may overlap)."""
    flat = [(d, reg) for reg, descs in pairs for d in descs]  # local index -> (descriptor, region)
    local_idx, remote, remote_idx = anchored(blocks_of(pairs), DEV)
    resolved = nixl.resolve(remote)
    assert resolved is not None, remote
    assert sorted(local_idx) == list(range(len(flat)))
    live = {reg for reg, _ in pairs}
    for i, j in zip(local_idx, remote_idx, strict=True):
        desc, own = flat[i]
        assert remote[j] == desc
        assert resolved[j] == own or (resolved[j] in live and covers(resolved[j], desc)), (desc, resolved[j], own)


def test_an_older_registration_inside_the_region_no_longer_hides_it() -> None:
    live = region(100, 13)
    stale = region(102, 2)  # registered earlier, withdrawn, its memory now part of ``live``
    nixl = Registrations([live, stale])
    forward = spans(live, list(range(5, 13)))
    backwards = forward[::-1]
    # Without the anchor: the lookup lands next to the stale registration and fails.
    assert nixl.resolve(forward) is None
    assert nixl.resolve(backwards) is None
    for descs in (forward, backwards, [(live[0] + 5 * SLOT, 8 * SLOT, DEV)]):
        check(nixl, [(live, descs)])


def test_an_older_registration_around_the_region_is_not_used() -> None:
    a, b = region(100, 4), region(120, 4)
    stale = region(110, 20)  # covers all of ``b``: unanchored, an upward list resolved ``b`` to it
    nixl = Registrations([a, b, stale])
    unanchored = nixl.resolve([*spans(a, [0, 1]), *spans(b, [0, 1])])
    assert unanchored is not None and unanchored[-1] == stale
    check(nixl, [(a, spans(a, [0, 1])), (b, spans(b, [0, 1]))])


def test_random_layouts_of_live_and_withdrawn_registrations() -> None:
    rng = random.Random(20261201)
    for _ in range(300):
        regs = list({region(rng.randrange(0, 200), rng.randrange(1, 30)) for _ in range(rng.randrange(1, 8))})
        live = rng.sample(regs, rng.randrange(1, len(regs) + 1))
        nixl = Registrations(regs)
        pairs = []
        for reg in live:
            slots = rng.sample(range(reg[1] // SLOT), rng.randrange(1, reg[1] // SLOT + 1))
            pairs.append((reg, spans(reg, slots)))
        rng.shuffle(pairs)
        check(nixl, pairs)


def test_a_plan_groups_moves_match_the_column_form() -> None:
    """``list_moves`` (a layer plan's small groups, and ``run_moves`` below
    ``RUN_MOVES_NUMPY_FROM`` spans) cuts the same runs as the numpy form (``array_moves``):
    a run goes on while the next span is the next slot and the next bytes of the region."""
    region = Region(1, MemoryKind.DRAM, DEV, 1 << 30, 1 << 26)
    rng = random.Random(7)
    for _ in range(2000):
        size = rng.choice((SLOT, 2 * SLOT))
        offsets: list[int] = []
        slots: list[int] = []
        offset, slot = rng.randrange(16) * size, rng.randrange(8)
        for _ in range(rng.choice((rng.randint(1, 12), rng.randint(1, 2 * RUN_MOVES_NUMPY_FROM)))):
            offsets.append(offset)
            slots.append(slot)
            offset += size if rng.random() < 0.6 else size * rng.randint(2, 4)
            slot += 1 if rng.random() < 0.6 else rng.randint(2, 3)
        columns = np.array(offsets, np.uint64), np.array(slots, np.uint32)
        expected = array_moves("kv", size, region, *columns)
        assert list_moves("kv", size, region, offsets, slots) == expected
        assert run_moves("kv", size, region, *columns) == expected
    assert list_moves("kv", SLOT, region, [], []) == []


class Scripted(Agent):
    """An agent whose transfers report the states ``script`` lists, one per look (no NIXL)."""

    def __init__(self, script: dict[int, list[XferStatus]]) -> None:  # no NIXL agent behind it
        self.script = script
        self.looks = 0

    def state(self, handle: Any) -> XferStatus:
        self.looks += 1
        states = self.script[handle]
        return states.pop(0) if len(states) > 1 else states[0]


def test_drain_waits_for_running_transfers_and_stops_at_its_bound() -> None:
    """What a closing owner waits for before it lets go of memory: every transfer ended, or
    the bound passed with some still running (reported RUNNING)."""
    R, D, F = XferStatus.RUNNING, XferStatus.DONE, XferStatus.FAILED
    agent = Scripted({1: [R, R, D], 2: [F], 3: [R, D]})
    assert agent.drain([1, 2, 3], 5.0) == [D, F, D]
    forever = Scripted({1: [D], 2: [R]})
    start = time.monotonic()
    assert forever.drain([1, 2], 0.05) == [D, R]
    assert time.monotonic() - start >= 0.05 and forever.looks > 2
    assert Scripted({}).drain([], 5.0) == []


class Recording(Agent):
    """An agent that keeps the lists it prepared and the transfers it posted (no NIXL)."""

    def __init__(self) -> None:  # no NIXL agent behind it
        self.lists: dict[int, list[Desc]] = {}
        self.ids = itertools.count(100)
        self.posted: list[tuple[int, list[int], int, list[int], bytes]] = []
        self.released: list[int] = []

    def prep_local(self, kind: MemoryKind, descs: Any) -> Any:
        handle = next(self.ids)
        self.lists[handle] = list(descs)
        return handle

    def prep_remote(self, agent: str, kind: MemoryKind, descs: Any) -> Any:
        return self.prep_local(kind, descs)

    def post_prepared(self, op: str, lists: Any, local_idx: Any, remote_idx: Any, notif: bytes = b"") -> Any:
        self.posted.append((lists.local, list(local_idx), lists.remote, list(remote_idx), notif))
        return len(self.posted), XferStatus.DONE

    def state(self, handle: Any) -> XferStatus:
        return XferStatus.DONE

    def release(self, handle: Any) -> None:
        pass

    def release_dlist(self, dlist: Any) -> None:
        self.released.append(dlist)

    def progress(self) -> None:
        pass


POOL_AT = 1 << 20


def recording_transfers() -> tuple[Recording, Any]:
    from kvcr_node.transfers import LocalLists, Transfers

    agent = Recording()
    local = LocalLists.__new__(LocalLists)
    slots = [(POOL_AT + i * SLOT, SLOT, DEV) for i in range(64)]
    local.lists = {(MemoryKind.DRAM, DEV): agent.prep_local(MemoryKind.DRAM, slots)}
    local.pools = {"kv": ((MemoryKind.DRAM, DEV), 0, POOL_AT, SLOT)}
    return agent, Transfers(agent, local)


def pairs_posted(agent: Recording, post: tuple[int, list[int], int, list[int], bytes]) -> set[tuple[int, int]]:
    """(local address, remote address) of every slot-sized piece a posted request moves."""
    local, li, remote, ri, _ = post
    out = set()
    for i, j in zip(li, ri, strict=True):
        (la, length, _), (ra, rlength, _) = agent.lists[local][i], agent.lists[remote][j]
        assert length == rlength
        out |= {(la + k, ra + k) for k in range(0, length, SLOT)}
    return out


def pairs_of(moves: list[Any]) -> set[tuple[int, int]]:
    return {(POOL_AT + (slot + k) * SLOT, address + k * SLOT)
            for _, slot, address, length, _, count in moves for k in range(count)}


def test_prepared_lists_move_each_entry_alone_or_with_others() -> None:
    """A planned deliver's groups share one local and one remote list (anchored), prepared
    once: posting any entries moves exactly their spans, merged runs or slot by slot, and
    the lists go only when the owner lets go of them (``start``'s own lists with its transfer)."""
    region = Region(1, MemoryKind.DRAM, DEV, 1 << 30, 1 << 24)
    other = Region(2, MemoryKind.DRAM, DEV, 1 << 29, 1 << 24)
    rng = random.Random(11)
    for _ in range(200):
        agent, transfers = recording_transfers()
        entries = []
        for _ in range(rng.randint(1, 6)):
            moves = []
            for _ in range(rng.randint(1, 5)):
                count = rng.randint(1, 4)
                reg = rng.choice((region, other))
                moves.append(("kv", rng.randrange(60), reg.address + rng.randrange(1000) * SLOT, count * SLOT, reg, count))
            entries.append(moves)
        prepared = transfers.prepare("client", entries)
        made = sum(1 + lists.owns_local for lists in prepared.requests)
        assert made in (1, 2)  # the remote list, and a merged local list when merging pays
        picked = sorted(rng.sample(range(len(entries)), rng.randint(1, len(entries))))
        done: list[bool] = []
        transfers.start_prepared("WRITE", prepared, picked, done.append)
        [post] = agent.posted
        assert pairs_posted(agent, post) == set().union(*(pairs_of(entries[e]) for e in picked))
        transfers.poll()
        assert done == [True] and agent.released == []  # the owner's lists stay
        assert transfers.prepared == 1
        transfers.release_prepared(prepared)
        transfers.release_prepared(prepared)  # once or more
        assert len(agent.released) == made and transfers.prepared == 0
        assert all(lists.released for lists in prepared.requests)


def test_a_transfer_of_its_own_releases_its_lists_and_carries_one_notification() -> None:
    region = Region(1, MemoryKind.DRAM, DEV, 1 << 30, 1 << 24)
    agent, transfers = recording_transfers()
    moves = [("kv", 0, region.address, 4 * SLOT, region, 4), ("kv", 8, region.address + 8 * SLOT, SLOT, region, 1)]
    done: list[bool] = []
    transfers.start("WRITE", "client", moves, done.append, [b"landed"])
    [post] = agent.posted
    assert post[4] == b"landed" and pairs_posted(agent, post) == pairs_of(moves)
    remote = agent.lists[post[2]]
    assert remote[0] == (region.address, region.length, DEV), "the region's own descriptor anchors the list"
    transfers.poll()
    assert done == [True] and len(agent.released) == 2  # merged local list (5 spans in 2 runs) and remote list
    assert transfers.prepared == 0 and transfers.inflight == []
