"""PostedTransfers, the transfers of a client job by group (READs of a deliver under grants,
WRITEs of a put), with a fake agent: posted in group order, polled, let go of."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from kvcr_client.posted import Post, PostedTransfers, side_bytes
from kvcr_io.agent import Entries, Listed, PreparedLists, TransferError, XferStatus
from kvcr_protocol import MemoryKind

DRAM = MemoryKind.DRAM


class Agent:
    """Hands out numbered requests; a test sets their states; ``refuse`` names remote descriptor
    lists NIXL refuses to post."""

    def __init__(self, refuse: Sequence[str] = ()) -> None:
        self.refuse = set(refuse)
        self.states: dict[int, XferStatus] = {}
        self.posted: list[tuple[str, str]] = []
        self.released: list[int] = []

    def start_listed(self, op: str, local_kind: MemoryKind, local: Any, remote_kind: MemoryKind, remote: Any,
                     remote_agent: str) -> tuple[Any, XferStatus]:
        if remote in self.refuse:
            raise TransferError("refused")
        handle = len(self.states)
        self.states[handle] = XferStatus.RUNNING
        self.posted.append((op, remote))
        return handle, XferStatus.RUNNING

    def state(self, handle: Any) -> XferStatus:
        return self.states[handle]

    def drain(self, handles: Sequence[Any], timeout_s: float) -> list[XferStatus]:
        return [self.states[h] for h in handles]

    def release(self, handle: Any) -> None:
        self.released.append(handle)


def post(group: int, remote: str, owners: list[int], peer: str = "node") -> Post:
    return (group, DRAM, [], DRAM, remote, owners, peer)


def test_groups_are_posted_in_order_one_at_a_time_and_each_is_looked_at_alone() -> None:
    agent = Agent()
    posts = [post(1, "g1", [0, 1]), post(0, "g0a", [0]), post(0, "g0b", [1], "source")]
    transfers = PostedTransfers(agent, "READ", posts, 2)
    assert transfers.remotes == {"node", "source"}
    assert transfers.next_group == 0 and transfers.post_group() == []
    assert agent.posted == [("READ", "g0a"), ("READ", "g0b")] and transfers.posted == 1
    assert not transfers.over(0) and not transfers.over(1)
    agent.states[0] = XferStatus.DONE
    transfers.poll()
    assert not transfers.over(0), "one of group 0's READs still runs"
    agent.states[1] = XferStatus.DONE
    transfers.poll()
    assert transfers.over(0) and transfers.landed(0) and not transfers.running
    assert not transfers.over(1), "group 1 is not posted yet"
    assert transfers.post_group() == [] and transfers.posted == 2 and not transfers.left
    agent.states[2] = XferStatus.FAILED
    transfers.poll()
    assert transfers.over(1) and not transfers.landed(1)
    transfers.release()
    assert agent.released == [0, 1, 2] and not transfers.by_group


def test_a_refused_post_names_the_items_it_carried_and_the_rest_of_its_group_still_goes() -> None:
    agent = Agent(refuse=["bad"])
    transfers = PostedTransfers(agent, "WRITE", [post(0, "bad", [0, 2]), post(0, "good", [1])], 1)
    assert transfers.post_group() == [0, 2]
    assert agent.posted == [("WRITE", "good")] and transfers.posted == 1
    assert transfers.post_group() == [] and transfers.posted == 1, "nothing left: every group counts as posted"


def test_a_group_without_transfers_is_over_and_landed_once_posted() -> None:
    transfers = PostedTransfers(Agent(), "READ", [post(1, "g1", [0])], 2)
    assert not transfers.over(0)
    transfers.post_group()
    assert transfers.over(0) and transfers.landed(0), "group 0 had nothing to move"


@pytest.mark.parametrize("ends", [True, False])
def test_drain_lets_go_of_every_request_and_says_whether_one_still_ran(ends: bool) -> None:
    agent = Agent()
    transfers = PostedTransfers(agent, "WRITE", [post(0, "a", [0]), post(0, "b", [0])], 1)
    transfers.post_group()
    agent.states[0] = XferStatus.DONE
    if ends:
        agent.states[1] = XferStatus.DONE
    assert transfers.drain() is ends
    assert sorted(agent.released) == [0, 1] and not transfers.running


def test_the_bytes_of_the_next_group_count_its_local_sides_in_every_form() -> None:
    """``next_bytes`` (what a turn's budget spends, ``kvcr_client.reads.TURN_READ_BYTES``) sums
    the local side of each post of the next group: rows, an N x 3 array, or what the agent
    made of them."""
    rows = [(0, 4096, 0), (8192, 512, 0)]
    array = np.array([[0, 1 << 20, 0], [1 << 21, 1 << 20, 0]], dtype=np.uint64)
    listed = Listed(DRAM, object(), rows)
    prepared = Entries(PreparedLists("node", None, None), np.arange(2, dtype=np.int32), 2 << 20)
    assert [side_bytes(side) for side in (rows, array, listed, prepared, [])] == [4608, 2 << 20, 4608, 2 << 20, 0]
    posts = [(0, DRAM, rows, DRAM, "r0", [0], "node"), (0, DRAM, array, DRAM, "r1", [1], "src"),
             (1, DRAM, prepared, DRAM, "r2", [0], "node")]
    transfers = PostedTransfers(Agent(), "READ", posts, 2)
    assert transfers.next_bytes() == 4608 + (2 << 20)
    transfers.post_group()
    assert transfers.next_bytes() == 2 << 20
    transfers.post_group()
    assert transfers.next_bytes() == 0
