"""A deliver's READs planned once and kept (``kvcr_client.prepared_reads``), in process.

The same destination tuple read under the same grants with the same plan gets the plan
made the first time (nothing worked out again before group 0 is posted), and so do equal
spans in a new tuple (a list of ``Span`` checked anew each deliver); other spans, another
grant (a new lease) or another plan is planned anew, and what is kept is bounded. A kept
plan is the plan that would be made now: same posts, counts, codes."""

from __future__ import annotations

from dataclasses import dataclass

from kvcr_client import prepared_reads
from kvcr_client.prepared_reads import PreparedReads
from kvcr_client.readplans import LocalColumns, RemoteSpans, remote_spans
from kvcr_client.regions import RegionHandle
from kvcr_protocol import DeliverItem, DstSpan, MemoryKind

from .test_readplans import Pool

SLOT = 4096
SPANS = 8


@dataclass(frozen=True, eq=False)
class Grant:
    names: tuple[str, ...]
    remote: RemoteSpans
    peer: str = "node"
    digests: bytes = b""


POOL = Pool(MemoryKind.DRAM, 0, 1 << 40, SLOT)
REGIONS = {0: RegionHandle(0, MemoryKind.DRAM, 1 << 36, 1 << 30, 0, None)}


def grant() -> Grant:
    return Grant(tuple(f"L{i}" for i in range(SPANS)), remote_spans([POOL], bytes(SPANS), list(range(SPANS))))


def destination(base: int = 0) -> tuple[DstSpan, ...]:
    return tuple(DstSpan(f"L{i}", 0, base + i * SLOT, SLOT) for i in range(SPANS))


def test_a_repeat_gets_the_kept_plan_and_anything_else_is_planned_anew() -> None:
    reads = PreparedReads(LocalColumns())
    spans, g = destination(), grant()
    layers = [tuple(range(SPANS))]
    first = reads.plan([DeliverItem(b"k", spans)], [g], layers, REGIONS)
    assert len(first.posts) == SPANS and first.counts == [SPANS] and first.codes == (0,)
    again = reads.plan([DeliverItem(b"k", spans)], [g], [tuple(range(SPANS))], REGIONS)
    assert again is first and reads.hits == 1
    assert reads.plan([DeliverItem(b"k", destination())], [g], layers, REGIONS) is first, "equal spans, a new tuple"
    assert reads.hits == 2
    # Other spans, a grant of another lease, another plan, a whole deliver: anew.
    moved = (*spans[:-1], spans[-1]._replace(offset=spans[-1].offset + SLOT))
    for items, granted, groups in (([DeliverItem(b"k", moved)], [g], layers),
                                   ([DeliverItem(b"k", spans)], [grant()], layers),
                                   ([DeliverItem(b"k", spans)], [g], [(0,) * SPANS]),
                                   ([DeliverItem(b"k", spans)], [g], None)):
        other = reads.plan(items, granted, groups, REGIONS)
        assert other is not first
        fresh = PreparedReads(LocalColumns()).plan(items, granted, groups, REGIONS)
        assert (other.posts, other.counts, other.codes) == (fresh.posts, fresh.counts, fresh.codes)
    assert reads.hits == 2


def test_what_is_kept_is_bounded_least_recently_used_first() -> None:
    reads = PreparedReads(LocalColumns())
    g = grant()
    kept = [destination(i * SPANS * SLOT) for i in range(prepared_reads.KEPT + 1)]
    for spans in kept:
        reads.plan([DeliverItem(b"k", spans)], [g], None, REGIONS)
    assert len(reads) == prepared_reads.KEPT
    reads.plan([DeliverItem(b"k", kept[-1])], [g], None, REGIONS)
    assert reads.hits == 1
    reads.plan([DeliverItem(b"k", kept[0])], [g], None, REGIONS)  # dropped first
    assert reads.hits == 1 and len(reads) == prepared_reads.KEPT


def test_a_plan_keeps_its_posts_as_the_agent_prepared_them() -> None:
    """Each post's two sides are handed to ``prepare`` once, when the plan is made, with the
    agent they go to (the agent prepares them with NIXL: ``kvcr_io.agent.Agent.prepare``);
    a repeat posts what it made."""
    made: list[tuple[MemoryKind, object, MemoryKind, object, str]] = []

    def prepare(local_kind: MemoryKind, local: object, remote_kind: MemoryKind, remote: object,
                peer: str) -> tuple[object, object]:
        made.append((local_kind, local, remote_kind, remote, peer))
        return ("local", local_kind, local, peer), ("remote", remote_kind, remote, peer)

    reads = PreparedReads(LocalColumns(), prepare)
    spans, g = destination(), grant()
    layers = [tuple(range(SPANS))]
    first = reads.plan([DeliverItem(b"k", spans)], [g], layers, REGIONS)
    plain = PreparedReads(LocalColumns()).plan([DeliverItem(b"k", spans)], [g], layers, REGIONS)
    assert len(made) == len(first.posts)
    for post, rows in zip(first.posts, plain.posts, strict=True):
        assert post[2] == ("local", rows[1], rows[2], "node") and post[4] == ("remote", rows[3], rows[4], "node")
        assert (post[0], post[1], post[3], post[5], post[6]) == (rows[0], rows[1], rows[3], rows[5], rows[6])
    assert reads.plan([DeliverItem(b"k", spans)], [g], layers, REGIONS) is first
    assert len(made) == len(first.posts), "a repeat prepared its posts again"
