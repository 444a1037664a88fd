"""The disk tier's read backs in flight, in process (``kvcr_node.read_backs``, architecture
§9): how they are cut into pieces, how many bytes are read at once, and when an object is
finished, well or not. The bytes themselves move in ``tests/integration/test_disk_tier.py``."""

from __future__ import annotations

import pytest

from kvcr_io.agent import TransferError
from kvcr_node.disk_pools import FileRegion
from kvcr_node.disk_tier import DiskTier, MemoryListener, Promotion
from kvcr_node.eviction import Layout, make_policy
from kvcr_node.poolspec import PoolSpec
from kvcr_node.read_backs import Piece, ReadBacks
from kvcr_node.store import DepositOutcome, Store
from kvcr_node.tiering import Tiering

SLOT = 4096
FD = 99


def layout(n: int) -> Layout:
    return tuple((f"L{i}", "kv") for i in range(n))


@pytest.fixture
def tier() -> DiskTier:
    memory = Store([PoolSpec("kv", SLOT, 8)], make_policy("lru"))
    spec = PoolSpec("kv-disk", SLOT, 16, "disk:/unused")
    tier = DiskTier(memory, [spec], {"kv-disk": FileRegion(FD, spec.size)}, make_policy("fifo"), mark=1.0)
    memory.listener = MemoryListener(tier)
    return tier


def on_disk(tier: DiskTier, objects: dict[bytes, int]) -> list[Promotion]:
    """``objects`` (key: spans) stored, copied, evicted by fillers, then promoted in order."""
    memory = tier.memory
    for key, spans in objects.items():
        outcome, entry = memory.begin_deposit(key, layout(spans))
        assert outcome is DepositOutcome.NEW and entry is not None
        memory.commit(entry)
    while demotions := tier.next_demotions():
        for demotion in demotions:
            tier.demoted(demotion, True)
    for i in range(8):  # evicts every copied object: each stays on disk only
        outcome, entry = memory.begin_deposit(b"filler%d" % i, layout(1))
        assert entry is not None
        memory.commit(entry)
    promotions = []
    for key in objects:
        assert tier.on_disk_only(key) is not None
        promotion = tier.promote(key)
        assert isinstance(promotion, Promotion)
        promotions.append(promotion)
    return promotions


def covered(tier: DiskTier, piece: Piece) -> list[tuple[int, int, int]]:
    """(memory slot, file offset, bytes) of every span the piece's moves read."""
    out = []
    for promotion, first, end in piece.segments:
        for _, slot, offset, length, _, spans in tier.moves_of(promotion, first, end):
            out += [(slot + j, offset + j * (length // spans), length // spans) for j in range(spans)]
    return out


def test_small_objects_share_a_piece_and_a_large_one_is_cut_in_order(tier: DiskTier) -> None:
    """Pieces are filled in order; each goes once full (the disk reads it while the node
    places the rest), the last once the turn's read backs are all added (``seal``)."""
    a, b, c = on_disk(tier, {b"a": 1, b"b": 5, b"c": 1})
    reads = ReadBacks(tier.span_bytes, chunk_bytes=2 * SLOT, in_flight_bytes=100 * SLOT)
    reads.add([a, b, c])
    full = reads.next()
    assert [p.segments for p in full] == [[(a, 0, 1), (b, 0, 1)], [(b, 1, 3)], [(b, 3, 5)]], "full pieces go at once"
    reads.seal()  # the turn's read backs are all in: the last piece goes as it is
    pieces = [*full, *reads.next()]
    assert [p.segments for p in pieces] == [[(a, 0, 1), (b, 0, 1)], [(b, 1, 3)], [(b, 3, 5)], [(c, 0, 1)]]
    assert [p.size for p in pieces] == [2 * SLOT, 2 * SLOT, 2 * SLOT, SLOT]
    # The pieces read, together, exactly the spans the whole read backs would.
    whole = []
    for promotion in (a, b, c):
        whole += covered(tier, Piece([(promotion, 0, len(promotion.entry.info.layout))]))
    assert sorted(span for piece in pieces for span in covered(tier, piece)) == sorted(whole)
    assert len(reads) == 3


def test_a_span_larger_than_a_piece_goes_alone() -> None:
    sizes = {"big": [10, 3]}
    reads = ReadBacks(lambda p: sizes[p], chunk_bytes=4, in_flight_bytes=4)  # type: ignore[arg-type,index]
    reads.add(["big"])  # type: ignore[list-item]
    reads.seal()
    assert [p.segments for p in reads.next()] == [[("big", 0, 1)]], "one piece at least, over the bound"
    assert reads.next() == [], "the bound holds the next one back"


def test_bytes_in_flight_are_bounded_and_freed_as_pieces_land(tier: DiskTier) -> None:
    [b] = on_disk(tier, {b"b": 6})
    reads = ReadBacks(tier.span_bytes, chunk_bytes=2 * SLOT, in_flight_bytes=4 * SLOT)
    reads.add([b])
    reads.seal()
    first = reads.next()
    assert [p.segments for p in first] == [[(b, 0, 2)], [(b, 2, 4)]] and reads.reading == 4 * SLOT
    assert reads.next() == []
    reads.landed(first[0])
    [third] = reads.next()
    assert third.segments == [(b, 4, 6)] and reads.reading == 4 * SLOT and reads.posted == 2


def test_an_object_finishes_with_its_last_piece_whatever_the_order() -> None:
    sizes = {"a": [1, 1, 1, 1]}
    reads = ReadBacks(lambda p: sizes[p], chunk_bytes=2, in_flight_bytes=4)  # type: ignore[arg-type,index]
    reads.add(["a"])  # type: ignore[list-item]
    reads.seal()
    one, two = reads.next()
    checked: list[tuple[int, int]] = []

    def intact(p: object, first: int, end: int) -> bool:
        checked.append((first, end))
        return True

    reads.landed(two)
    assert reads.ended(two, True, intact) == [] and len(reads) == 1
    reads.landed(one)
    [done] = reads.ended(one, True, intact)
    assert (done.promotion, done.read, done.intact) == ("a", True, True) and len(reads) == 0
    assert sorted(checked) == [(0, 2), (2, 4)], "every piece's spans checked as it landed"


def test_a_failed_or_mismatched_piece_fails_its_object_once_every_piece_ended() -> None:
    sizes = {"a": [1, 1, 1], "b": [1, 1, 1]}
    reads = ReadBacks(lambda p: sizes[p], chunk_bytes=1, in_flight_bytes=6)  # type: ignore[arg-type,index]
    reads.add(["a", "b"])  # type: ignore[list-item]
    reads.seal()
    pieces = reads.next()
    assert len(pieces) == 6
    checked: list[tuple[object, int]] = []

    def intact(p: object, first: int, end: int) -> bool:
        checked.append((p, first))
        return not (p == "b" and first == 0)

    for piece in pieces:
        reads.landed(piece)
    assert reads.ended(pieces[1], False, intact) == [], "a's transfer failed: a is still being read"
    assert reads.ended(pieces[0], True, intact) == []
    [a] = reads.ended(pieces[2], True, intact)
    assert (a.read, a.intact) == (False, False), "a failed read is never served"
    assert ("a", 0) not in checked and ("a", 2) not in checked, "nothing of a failed object is checked"
    assert reads.ended(pieces[3], True, intact) == [] and reads.ended(pieces[4], True, intact) == []
    [b] = reads.ended(pieces[5], True, intact)
    assert (b.read, b.intact) == (True, False), "read, but its first span did not match"
    assert ("b", 1) not in checked and ("b", 2) not in checked, "a mismatch ends the checks of its object"
    assert len(reads) == 0 and reads.reading == 0 and reads.posted == 0


class RefusingTransfers:
    """A node's ``Transfers`` whose every post NIXL refuses."""

    def __init__(self) -> None:
        self.refused = 0

    def start(self, op: str, agent: str, moves: object, on_done: object) -> None:
        self.refused += 1
        raise TransferError("refused")


def test_read_backs_whose_posts_are_all_refused_fail_in_a_loop_and_in_the_turn() -> None:
    """Each refused post leaves the bound at once, so the next is tried: 1,500 pieces of one
    object go one after another in ``_post_pieces``'s loop (a nested call per piece would
    pass the interpreter's recursion limit). They end in the turn's ``step``, never inside
    ``promote``: the operation that asked waits on the key only after ``promote`` returns,
    and a wake before that would leave it waiting. The object fails once, whole."""
    spans = 1500
    memory = Store([PoolSpec("kv", SLOT, spans + 8)], make_policy("lru"))
    spec = PoolSpec("kv-disk", SLOT, 2 * spans, "disk:/unused")
    tier = DiskTier(memory, [spec], {"kv-disk": FileRegion(FD, spec.size)}, make_policy("fifo"), mark=1.0)
    memory.listener = MemoryListener(tier)
    _, entry = memory.begin_deposit(b"big", layout(spans))
    assert entry is not None
    memory.commit(entry)
    [demotion] = tier.next_demotions()
    tier.demoted(demotion, True)
    _, entry = memory.begin_deposit(b"filler", layout(spans + 8))  # evicts big: on disk only
    assert entry is not None and tier.on_disk_only(b"big") is not None
    memory.commit(entry)
    woken: list[bytes] = []
    transfers = RefusingTransfers()
    tiering = Tiering(tier, transfers, "me", None, woken.extend)  # type: ignore[arg-type]
    tiering.read_backs = ReadBacks(tier.span_bytes, chunk_bytes=SLOT, in_flight_bytes=SLOT)
    assert tiering.promote(b"big")
    assert transfers.refused == spans - 1 and woken == [], "full pieces tried at once, none ended yet"
    tiering.step()
    assert transfers.refused >= spans and woken == [b"big"]
    assert tier.counts["promotions_failed"] == 1 and not tier.promoting and len(tiering.read_backs) == 0
    assert memory.lookup(b"big") is None and tier.disk.lookup(b"big") is None, "a copy that could not be read goes"
    assert memory.check_invariants() == [] and tier.check_invariants() == []
