"""Which instant a grant read's lease check uses (spec section 6.12, Validity), in process.

A ``GrantRead`` runs against a fake agent whose posts take time on a fake clock, as a CMA
copy does inside NIXL's post, and a fake validity that holds each lease until a fixed
instant. A group is checked at a time read after its READs were seen complete, per job:
never at the turn's ``now``, read before the posts. Before this rule two planned delivers
in one turn, the first with a large group, had the second's lease checked before its
copy, and a key came back ``OK`` with the bytes of whatever the slot held after expiry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcr_client.counters import Counters
from kvcr_client.reads import TURN_READ_BYTES, GrantRead, Reads
from kvcr_io.agent import XferStatus
from kvcr_protocol import DeliverItem, ErrorCode, GroupEvent, GroupLedger, GroupState, KeyResult, KeyStatus, MemoryKind


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class CopyingAgent:
    """Posts copy inside the post (as UCX's CMA does): each READ advances the clock by the
    time its peer's copy takes."""

    clock: Clock
    copy_s: dict[str, float]
    posted: list[str] = field(default_factory=list)

    def start_listed(self, op: str, local_kind: MemoryKind, local: Any, remote_kind: MemoryKind, remote: Any,
                     remote_agent: str) -> tuple[Any, XferStatus]:
        self.clock.t += self.copy_s[remote_agent]
        self.posted.append(remote_agent)
        return object(), XferStatus.DONE

    def state(self, handle: Any) -> XferStatus:
        return XferStatus.DONE

    def drain(self, handles: Sequence[Any], timeout_s: float) -> list[XferStatus]:
        return [XferStatus.DONE for _ in handles]

    def release(self, handle: Any) -> None:
        pass


class Lease:
    def __init__(self, until: float) -> None:
        self.until = until

    def lost_key(self, key: bytes) -> bool:
        return False


@dataclass(frozen=True)
class Granted:
    lease: Lease


class HeldUntil:
    """Validity: a lease held while ``now < lease.until``; expired after."""

    def __init__(self) -> None:
        self.mismatches: list[bytes] = []
        self.counters = Counters()

    def check(self, items: Sequence[DeliverItem], granted: Sequence[Any], members: list[int],
              now: float) -> dict[int, int | None]:
        return {k: 0 if now < granted[k].lease.until else ErrorCode.LEASE_EXPIRED for k in members}

    def confirm(self, lease: Any, now: float, then: Callable[[int], None]) -> None:
        raise AssertionError("no confirmation in these cases")

    def mismatch(self, granted: Any, key: bytes) -> None:
        self.mismatches.append(key)


def job(clock: Clock, agent: CopyingAgent, peer: str, until: float, groups: int,
        out: list[list[KeyResult]]) -> GrantRead:
    """One key of ``groups`` groups read from ``peer``, its lease held until ``until``."""
    posts = [(g, MemoryKind.DRAM, [(0, 1, 0)], MemoryKind.DRAM, [(0, 1, 0)], [0], peer) for g in range(groups)]

    def finished(results: list[KeyResult] | BaseException, done: list[int]) -> None:
        assert isinstance(results, list)
        out.append(results)

    return GrantRead(HeldUntil(), agent, [DeliverItem(b"k", ())], [Granted(Lease(until))], [groups], posts, [0],
                     deadline=100.0, report=None, finished=finished, quiet=lambda: None, clock=clock)


def test_two_delivers_in_one_turn_each_check_after_their_own_copy() -> None:
    clock = Clock()
    agent = CopyingAgent(clock, {"big": 0.001, "small": 0.001})
    big_out: list[list[KeyResult]] = []
    small_out: list[list[KeyResult]] = []
    reads = Reads()
    big = job(clock, agent, "big", until=50.0, groups=2, out=big_out)
    small = job(clock, agent, "small", until=0.5, groups=2, out=small_out)
    # Group 0 of both, posted and checked well inside the small one's lease.
    for j in (big, small):
        reads.start(j)
    assert clock.t < 0.5
    agent.copy_s["big"] = 1.0
    # One turn posts group 1 of each: the big copy runs first and takes 1 s, so the small
    # deliver's group 1 is read after its lease ended, though the turn began before.
    reads.step(clock.t)
    assert agent.posted == ["big", "small", "big", "small"]
    assert big_out and big_out[0][0].status is KeyStatus.OK
    assert small_out and small_out[0][0].status is KeyStatus.FAILED
    assert small_out[0][0].code == ErrorCode.LEASE_EXPIRED


def test_a_group_copied_past_expiry_fails_though_its_turn_began_before() -> None:
    clock = Clock()
    agent = CopyingAgent(clock, {"node": 0.0})
    out: list[list[KeyResult]] = []
    read = job(clock, agent, "node", until=1.0, groups=3, out=out)
    reads = Reads()
    reads.start(read)
    turn = clock.t
    agent.copy_s["node"] = 2.0  # the reader stalls inside group 1's copy, past the lease
    reads.step(turn)
    reads.step(clock.t)
    assert out and out[0][0].status is KeyStatus.FAILED and out[0][0].code == ErrorCode.LEASE_EXPIRED
    assert read.ledger.delivered == [1], "group 0 was checked in time and counts; group 1 does not"


def test_groups_read_inside_the_lease_are_ok() -> None:
    clock = Clock()
    agent = CopyingAgent(clock, {"node": 0.1})
    out: list[list[KeyResult]] = []
    reads = Reads()
    reads.start(job(clock, agent, "node", until=10.0, groups=4, out=out))
    while not out:
        reads.step(clock.t)
    assert out[0][0].status is KeyStatus.OK


def test_the_handles_ledger_moves_with_the_reads_and_a_failed_group_is_told_when_it_fails() -> None:
    """A deliver and its handle keep one ``GroupLedger``: each turn reports the group events that
    moved it, and a group whose lease check fails is failed for the handle in that turn, not
    when the last group is over."""
    clock = Clock()
    agent = CopyingAgent(clock, {"node": 0.1})
    ledger = GroupLedger([3, 3])
    events: list[list[GroupEvent]] = []
    out: list[list[KeyResult]] = []

    def finished(results: list[KeyResult] | BaseException, done: list[int]) -> None:
        assert isinstance(results, list)
        out.append(results)

    # Groups of TURN_READ_BYTES: one a turn.
    row = [(0, TURN_READ_BYTES, 0)]
    posts = [(g, MemoryKind.DRAM, row, MemoryKind.DRAM, row, [0, 1], "node") for g in range(3)]
    # Key 1's lease ends between its group 0 (checked at 0.1) and group 1 (checked at 0.2).
    read = GrantRead(HeldUntil(), agent, [DeliverItem(b"a", ()), DeliverItem(b"b", ())],
                     [Granted(Lease(50.0)), Granted(Lease(0.15))], [3, 3], posts, [0, 0], deadline=100.0,
                     report=events.append, finished=finished, quiet=lambda: None, clock=clock, ledger=ledger)
    reads = Reads()
    reads.start(read)
    assert events == [[GroupEvent(0, 0, GroupState.DELIVERED), GroupEvent(1, 0, GroupState.DELIVERED)]]
    assert ledger.group_state(0) is GroupState.DELIVERED and read.ledger is ledger
    reads.step(clock())
    expired = int(ErrorCode.LEASE_EXPIRED)
    assert events[1] == [GroupEvent(0, 1, GroupState.DELIVERED), GroupEvent(1, 1, GroupState.FAILED, expired),
                         GroupEvent(1, 2, GroupState.FAILED, expired)], "told in the turn that found it"
    assert ledger.group_state(1) is GroupState.FAILED and ledger.group_state(2) is GroupState.FAILED
    assert not out, "the deliver itself is not over: key a's group 2 is still to read"
    reads.step(clock())
    assert events[2] == [GroupEvent(0, 2, GroupState.DELIVERED)]
    assert [r.status for r in out[0]] == [KeyStatus.OK, KeyStatus.FAILED] and out[0][1].code == expired
    assert ledger.delivered == [3, 1] and not reads.running


def test_a_turn_posts_groups_up_to_its_bytes_and_checks_each_after_every_copy_of_the_turn() -> None:
    """Groups of a quarter of ``TURN_READ_BYTES`` go four a turn (the first always), copied
    back to back and checked at a time read after the last of them: a lease that ends
    during the turn's third copy fails every group of the turn, the two copied in time too
    (a later check only ever refuses more). A group larger than a turn's bytes still goes,
    alone, as the first of its turn."""
    clock = Clock()
    agent = CopyingAgent(clock, {"node": 0.1})
    quarter = [(0, TURN_READ_BYTES // 4, 0)]
    posts = [(g, MemoryKind.DRAM, quarter, MemoryKind.DRAM, quarter, [0, 1], "node") for g in range(9)]
    posts.append((9, MemoryKind.DRAM, [(0, 2 * TURN_READ_BYTES, 0)], MemoryKind.DRAM, [(0, 1, 0)], [0, 1], "node"))
    events: list[list[GroupEvent]] = []
    out: list[list[KeyResult]] = []

    def finished(results: list[KeyResult] | BaseException, done: list[int]) -> None:
        assert isinstance(results, list)
        out.append(results)

    # Key 1's lease ends at 0.35: during the turn that copies groups 1-4 (clock 0.1 -> 0.5).
    read = GrantRead(HeldUntil(), agent, [DeliverItem(b"a", ()), DeliverItem(b"b", ())],
                     [Granted(Lease(50.0)), Granted(Lease(0.35))], [10, 10], posts, [0, 0], deadline=100.0,
                     report=events.append, finished=finished, quiet=lambda: None, clock=clock)
    reads = Reads()
    reads.start(read)
    assert len(agent.posted) == 1 and clock() == 0.1, "group 0 alone"
    reads.step(clock())
    assert len(agent.posted) == 5 and clock() == 0.5, "groups 1-4 in one turn"
    expired = int(ErrorCode.LEASE_EXPIRED)
    assert [e for e in events[1] if e.item == 0] == [GroupEvent(0, g, GroupState.DELIVERED) for g in range(1, 5)]
    assert [e for e in events[1] if e.item == 1] == [GroupEvent(1, g, GroupState.FAILED, expired)
                                                     for g in range(1, 10)], "checked after the turn's last copy"
    reads.step(clock())
    assert len(agent.posted) == 9, "groups 5-8"
    reads.step(clock())
    assert len(agent.posted) == 10, "group 9 alone, though larger than a turn's bytes"
    assert [r.status for r in out[0]] == [KeyStatus.OK, KeyStatus.FAILED] and not reads.running
