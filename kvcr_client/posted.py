"""The NIXL transfers of one client job, by group: posted in group order, polled, let go of.

A deliver read under grants (``kvcr_client.reads.GrantRead``) and a put
(``kvcr_client.put_jobs.PutJob``) move bytes the same way: each has a list of posts (a group,
the descriptors on both sides, the items each carries, the remote agent), posts one group's
transfers at a time, polls only those not yet terminal, looks at a group once each of its
transfers is, and lets go of every request at the end, waiting (bounded) for those still
running when the client closes. ``PostedTransfers`` is that, for READs and WRITEs alike;
what the bytes mean (leases, digests, a commit) stays with the job. It runs with the core's
I/O lock held, in whichever thread takes the turn.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvcr_io.agent import Desc, Entries, Listed, TransferError, XferStatus
from kvcr_protocol import MemoryKind

CLOSE_DRAIN_S = 5.0
"""How long a closing client waits for transfers still running before it lets go of them."""

Post = tuple[int, MemoryKind, list[Desc] | Any, MemoryKind, list[Desc] | Any, list[int], str]
"""One transfer to post: its group, local kind and descriptors, remote kind and descriptors
(rows, or an N x 3 array: ``kvcr_client.readplans``), the items it carries, and the remote
agent (the node's, or a source's: spec section 6.12)."""

Gate = Callable[[str], Any]
"""A test's gate on a job's transfers, made with the job and called in the turn, lock held:
a read under grants calls it before and after each group's post (``posting G``, ``posted
G``), a put once its WRITEs are terminal, before ``commit`` (``written``); ``False`` from
``posting G`` or ``written`` defers the rest to a later turn. Tests freeze a reader, kill a
source or hold a group or a commit back there; a gated job takes the same path as any.
Not a setting of the product."""

_GROUP = operator.itemgetter(0)


def side_bytes(side: Any) -> int:
    """The bytes one side of a post names: rows of (address, length, device), an N x 3 array,
    or what the agent made of them (``kvcr_io.agent.Listed``, ``Entries``)."""
    if type(side) is Entries:
        return side.bytes
    if type(side) is Listed:
        side = side.rows
    if isinstance(side, np.ndarray):
        return int(side[:, 1].sum()) if len(side) else 0
    return sum(row[1] for row in side)


class Poster(Protocol):
    """What posting needs of an agent (``kvcr_io.agent.Agent``; tests pass a fake one)."""

    def start_listed(self, op: str, local_kind: MemoryKind, local: Any, remote_kind: MemoryKind, remote: Any,
                     remote_agent: str) -> tuple[Any, XferStatus]: ...
    def state(self, handle: Any) -> XferStatus: ...
    def drain(self, handles: Sequence[Any], timeout_s: float) -> list[XferStatus]: ...
    def release(self, handle: Any) -> None: ...


@dataclass(eq=False)
class _Transfer:
    """One posted transfer: the group it belongs to, its NIXL request, its last state."""

    group: int
    handle: Any
    state: XferStatus


class PostedTransfers:
    """The transfers of one job (``op``: ``"READ"`` or ``"WRITE"``) over ``groups`` groups."""

    def __init__(self, agent: Poster, op: str, posts: Sequence[Post], groups: int) -> None:
        self.agent = agent
        self.op = op
        self.posts = sorted(posts, key=_GROUP)  # in group order already, mostly: one pass
        self.groups = groups
        self.next = 0
        """The next post (an index into ``posts``)."""
        self.posted = 0
        """Groups posted so far (every group below this number; all once no post is left)."""
        self.transfers: list[_Transfer] = []
        self.by_group: dict[int, list[_Transfer]] = {}
        """The transfers posted for each group (a group is looked at by its own alone)."""
        self.running: list[_Transfer] = []
        """The transfers not yet terminal: the only ones a poll looks at."""

    @property
    def left(self) -> bool:
        """Whether posts are left."""
        return self.next < len(self.posts)

    @property
    def next_group(self) -> int:
        """The group the next ``post_group`` posts (only while posts are ``left``)."""
        return self.posts[self.next][0]

    @property
    def remotes(self) -> set[str]:
        """The remote agents these transfers go to (to stay loaded while they run)."""
        return {post[6] for post in self.posts}

    def next_bytes(self) -> int:
        """The bytes the next ``post_group`` moves (0 once no post is left)."""
        posts, at = self.posts, self.next
        if at >= len(posts):
            return 0
        group, size = posts[at][0], 0
        while at < len(posts) and posts[at][0] == group:
            size += side_bytes(posts[at][2])
            at += 1
        return size

    def post_group(self) -> list[int]:
        """Post every transfer of the next group (one per pair of memory kinds and remote
        agent); returns the items of those NIXL refused to post (the job fails them)."""
        if not self.left:
            self.posted = self.groups
            return []
        group = self.next_group
        refused: list[int] = []
        while self.next < len(self.posts) and self.posts[self.next][0] == group:
            g, local_kind, local, remote_kind, remote, owners, peer = self.posts[self.next]
            self.next += 1
            try:
                handle, state = self.agent.start_listed(self.op, local_kind, local, remote_kind, remote, peer)
            except TransferError:
                refused.extend(owners)
                continue
            transfer = _Transfer(g, handle, state)
            self.transfers.append(transfer)
            self.by_group.setdefault(g, []).append(transfer)
            if state is XferStatus.RUNNING:
                self.running.append(transfer)
        self.posted = group + 1 if self.left else self.groups
        return refused

    def poll(self) -> None:
        """Look at the transfers still running (polling also progresses the agent)."""
        if not self.running:
            return
        agent = self.agent
        for t in self.running:
            t.state = agent.state(t.handle)
        self.running = [t for t in self.running if t.state is XferStatus.RUNNING]

    def over(self, group: int) -> bool:
        """Whether ``group`` is posted and none of its transfers runs."""
        return self.posted > group and all(t.state is not XferStatus.RUNNING for t in self.by_group.get(group, ()))

    def landed(self, group: int) -> bool:
        """Whether every transfer of ``group`` completed (none failed; a group with none did)."""
        return all(t.state is XferStatus.DONE for t in self.by_group.get(group, ()))

    def release(self) -> None:
        """Let go of every request (none may still run, or the job let go of its memory)."""
        for t in self.transfers:
            self.agent.release(t.handle)
        self.transfers.clear()
        self.by_group.clear()
        self.running.clear()

    def drain(self) -> bool:
        """The client closes: wait (bounded) for the transfers still running, then let go of
        every request; whether none still ran (the memory is free)."""
        running = self.running
        for t, state in zip(running, self.agent.drain([t.handle for t in running], CLOSE_DRAIN_S), strict=True):
            t.state = state
        quiet = all(t.state is not XferStatus.RUNNING for t in running)
        self.release()
        return quiet
