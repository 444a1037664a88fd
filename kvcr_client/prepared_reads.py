"""A deliver's READs under grants, worked out once and kept (spec section 6.12).

Planning a deliver (its descriptors per group, ``kvcr_client.readplans``; the spans each
group's digests check, and the parts of a whole deliver, ``kvcr_client.digest_checks``)
costs a few hundred microseconds of Python, all of it before group 0 is posted: a large
share of the time to the first layer. What it depends on does not change between delivers
of one destination under one lease: the destination's spans (a prepared ``Destination``
hands the same tuple to every deliver), the grants (the same ``GrantedKey`` objects while
their lease holds) and the layer plan. So ``PreparedReads`` keeps the last few plans by
those, and a repeat posts group 0 with nothing left to work out. A plan holds the spans
and grants it was made of, so their identities cannot be reused while it is kept; a grant
of a new lease simply misses. A list of ``Span`` brings a new tuple each deliver: such a
miss looks the plan up by the spans' content (region ids are never reused within a client,
so equal spans name the same memory), which costs a hash of the spans instead of a plan.
A plan's descriptor rows are prepared with NIXL once, one ``PreparedLists`` per remote agent
and pair of memory kinds for all its groups (``Agent.prepare``), as a node prepares its
planned delivers, and each post keeps its ``Entries``: a post is made by index, nothing
converted or resolved again (10 us and more less per post here, a group's and the first
layer's alike).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcr_client.digest_checks import SpanChecks, parts, span_checks
from kvcr_client.posted import Post
from kvcr_client.readplans import LocalColumns, as_array
from kvcr_client.readplans import plan as plan_reads
from kvcr_client.regions import RegionHandle
from kvcr_io.agent import Entries, PreparedLists
from kvcr_protocol import DeliverItem, MemoryKind

Prepare = Callable[[MemoryKind, Any, MemoryKind, Any, str], PreparedLists | None]
"""Local and remote rows (kinds and N x 3 arrays, pairwise) for one remote agent -> the lists
NIXL prepared of them, or None (the rows are posted as they are)."""

KEPT = 16
"""Plans kept, the least recently used dropped first."""


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """What a deliver posts and checks, group by group."""

    made_of: tuple[Any, ...]
    """The spans tuples and grants it was planned from (kept alive: their ids are its key)."""
    groups: Sequence[tuple[int, ...]] | None
    """Per item its spans' groups: the layer plan's, or the parts of a whole deliver."""
    in_parts: bool
    """A whole deliver read in parts, checked on the digest worker, ending as one group."""
    counts: list[int]
    posts: list[Post]
    codes: tuple[int, ...]
    """Per item 0, or the code planning failed it with (a layout or size that does not fit)."""
    checks: SpanChecks | None
    unchecked: int


class PreparedReads:
    """The plans of recent delivers under grants, by what they were made of."""

    def __init__(self, columns: LocalColumns, prepare: Prepare | None = None) -> None:
        self.columns = columns
        self.prepare = prepare
        """Prepares a plan's rows with NIXL, once (``kvcr_io.agent.Agent.prepare``): a kept plan's
        READs are posted without converting or resolving them again. None: rows as they are."""
        self._kept: collections.OrderedDict[tuple[Any, ...], ReadPlan] = collections.OrderedDict()
        self._by_content: collections.OrderedDict[tuple[Any, ...], ReadPlan] = collections.OrderedDict()
        """The same plans by the spans' content (with the grants' and groups' identity)."""
        self.hits = 0

    def plan(
        self, items: Sequence[DeliverItem], granted: Sequence[Any], groups: Sequence[tuple[int, ...]] | None,
        regions: Mapping[int, RegionHandle],
    ) -> ReadPlan:
        """The READs of a deliver of ``items`` under ``granted`` with ``groups`` (None: whole)."""
        key = (tuple([id(item.spans) for item in items]), tuple([id(g) for g in granted]),
               None if groups is None else tuple(groups))
        kept = self._kept.get(key)
        if kept is not None:
            self._kept.move_to_end(key)
            self.hits += 1
            return kept
        content = (tuple([item.spans for item in items]), key[1], key[2])
        made = self._by_content.get(content)
        if made is not None:
            self._by_content.move_to_end(content)
            self.hits += 1
            return made
        made = self._make(items, granted, groups, regions)
        for table, at in ((self._kept, key), (self._by_content, content)):
            table[at] = made
            if len(table) > KEPT:
                table.popitem(last=False)
        return made

    def _make(
        self, items: Sequence[DeliverItem], granted: Sequence[Any], groups: Sequence[tuple[int, ...]] | None,
        regions: Mapping[int, RegionHandle],
    ) -> ReadPlan:
        columns = self.columns
        # A whole deliver whose digests are checked is read in parts, each hashed on the
        # digest worker while the next is copied (kvcr_client.digest_checks); it still ends
        # as one group.
        in_parts = parts(items, granted, columns) if groups is None else None
        if in_parts is not None:
            groups = in_parts
        counts = [1 + max(g, default=0) for g in groups] if groups is not None else [1] * len(items)
        codes = [0] * len(items)
        posts = [(g, lk, local, rk, remote, owners, peer) for (g, peer, lk, rk), (local, remote, owners)
                 in plan_reads(items, granted, groups, regions, codes, columns).items()]
        posts.sort(key=lambda p: p[0])
        if self.prepare is not None:
            posts = prepared_posts(posts, self.prepare)
        checks, unchecked = span_checks(items, granted, groups, regions, columns)
        made_of = (*[item.spans for item in items], *granted)
        return ReadPlan(made_of, groups, in_parts is not None, counts, posts, tuple(codes), checks, unchecked)

    def clear(self) -> None:
        """Forget every plan (their session ended: its grants are void)."""
        self._kept.clear()
        self._by_content.clear()

    def __len__(self) -> int:
        return len(self._kept)


def prepared_posts(posts: list[Post], prepare: Prepare) -> list[Post]:
    """``posts`` with each one's sides made ``Entries`` of lists prepared once per remote agent
    and pair of memory kinds (every group's rows, in post order); posts whose lists NIXL
    refused keep their rows."""
    by_pair: dict[tuple[str, MemoryKind, MemoryKind], list[int]] = {}
    for n, post in enumerate(posts):
        by_pair.setdefault((post[6], post[1], post[3]), []).append(n)
    out = list(posts)
    for (peer, local_kind, remote_kind), members in by_pair.items():
        local = [as_array(posts[n][2]) for n in members]
        lists = prepare(local_kind, np.concatenate(local), remote_kind,
                        np.concatenate([as_array(posts[n][4]) for n in members]), peer)
        if lists is None:
            continue
        start = 0
        for n, rows in zip(members, local, strict=True):
            end = start + len(rows)
            entries = Entries(lists, np.arange(start, end, dtype=np.int32), int(rows[:, 1].sum()))
            g, _, _, _, _, owners, _ = posts[n]
            out[n] = (g, local_kind, entries, remote_kind, entries, owners, peer)
            start = end
    return out
