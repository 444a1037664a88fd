"""A deliver's READs planned once and kept (``kvcr_client.prepared_reads``), in process.

The same destination tuple read under the same grants with the same plan gets the plan
made the first time (nothing worked out again before group 0 is posted), and so do equal
spans in a new tuple (a list of ``Span`` checked anew each deliver); other spans, another
grant (a new lease) or another plan is planned anew, and what is kept is bounded. A kept
plan is the plan that would be made now: same posts, counts, codes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvcr_client import prepared_reads
from kvcr_client.prepared_reads import PreparedReads
from kvcr_client.readplans import LocalColumns, RemoteSpans, remote_spans
from kvcr_client.regions import RegionHandle
from kvcr_io.agent import Entries, PreparedLists
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


def test_a_plan_keeps_its_posts_as_entries_of_lists_the_agent_prepared_once() -> None:
    """A plan's rows are handed to ``prepare`` once, when the plan is made: every group's, one
    call per remote agent and pair of memory kinds, pairwise in post order (the agent
    prepares them with NIXL: ``kvcr_io.agent.Agent.prepare``). Each post keeps its own entries
    of those lists, and a repeat posts what it made."""
    made: list[tuple[MemoryKind, np.ndarray, MemoryKind, np.ndarray, str]] = []

    def prepare(local_kind: MemoryKind, local: np.ndarray, remote_kind: MemoryKind, remote: np.ndarray,
                peer: str) -> PreparedLists:
        made.append((local_kind, local, remote_kind, remote, peer))
        return PreparedLists(peer, "local", "remote")

    reads = PreparedReads(LocalColumns(), prepare)
    spans, g = destination(), grant()
    layers = [tuple(range(SPANS))]
    first = reads.plan([DeliverItem(b"k", spans)], [g], layers, REGIONS)
    plain = PreparedReads(LocalColumns()).plan([DeliverItem(b"k", spans)], [g], layers, REGIONS)
    assert len(first.posts) > 1 and len(made) == 1, "one preparation for the plan's every post"
    local_kind, local, remote_kind, remote, peer = made[0]
    assert (local_kind, remote_kind, peer) == (MemoryKind.DRAM, MemoryKind.DRAM, "node")
    assert local.shape == remote.shape and local.shape[1] == 3
    at = 0
    for post, rows in zip(first.posts, plain.posts, strict=True):
        entries = post[2]
        assert type(entries) is Entries and post[4] is entries and entries.lists.remote_agent == "node"
        mine = np.array(rows[2], dtype=np.uint64).reshape(-1, 3)
        assert entries.index.tolist() == list(range(at, at + len(mine)))
        assert np.array_equal(local[entries.index], mine)
        assert np.array_equal(remote[entries.index], np.array(rows[4], dtype=np.uint64).reshape(-1, 3))
        assert entries.bytes == int(mine[:, 1].sum())
        assert (post[0], post[1], post[3], post[5], post[6]) == (rows[0], rows[1], rows[3], rows[5], rows[6])
        at += len(mine)
    assert at == len(local)
    assert reads.plan([DeliverItem(b"k", spans)], [g], layers, REGIONS) is first
    assert len(made) == 1, "a repeat prepared its posts again"


def test_posts_whose_lists_nixl_refused_keep_their_rows() -> None:
    reads = PreparedReads(LocalColumns(), lambda *args: None)
    spans, g = destination(), grant()
    layers = [tuple(range(SPANS))]
    refused = reads.plan([DeliverItem(b"k", spans)], [g], layers, REGIONS)
    plain = PreparedReads(LocalColumns()).plan([DeliverItem(b"k", spans)], [g], layers, REGIONS)
    assert len(refused.posts) == len(plain.posts)
    for post, rows in zip(refused.posts, plain.posts, strict=True):
        assert post[2] is rows[2] or np.array_equal(np.asarray(post[2]), np.asarray(rows[2]))
