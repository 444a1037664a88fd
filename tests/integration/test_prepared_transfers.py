"""Transfers prepared with NIXL once and posted again and again (``kvcr_io.agent.PreparedLists``,
``Agent.prepare``), each post naming its entries by index (``Entries`` through
``Agent.start_listed``, as a client's plan posts each group; ``Agent.post_prepared``, as a
node's planned deliver does), with real NIXL between two agents of this process.

Prepared lists move exactly the bytes their rows name, every time they are posted; once
the remote agent was removed and loaded again (its metadata anew, as after a reconnect),
NIXL refuses them and the post is made from the rows of its entries, which NIXL resolves
against the agent as it is now: the bytes still arrive, byte for byte. With the remote
agent gone, the post fails with ``TransferError``, never a crash or bytes from elsewhere.
Lists let go of while their request runs leave the request to finish. Entries posted by
index move only their own bytes; lists kept without rows (a node's) fail once NIXL
refuses them, and are let go of once however often asked."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvcr_io.agent import Agent, Entries, PreparedLists, TransferError, XferStatus
from kvcr_protocol import MemoryKind

SPAN = 64 << 10
SPANS = 16
WAIT_S = 10.0
"""The longest a transfer of a few MiB between two agents of one process may take."""


def finish(reader: Agent, holder: Agent, handle: object) -> XferStatus:
    """Progress both agents until the request is terminal (bounded), then release it."""
    end = time.monotonic() + WAIT_S
    state = reader.state(handle)
    while state is XferStatus.RUNNING and time.monotonic() < end:
        holder.progress()
        state = reader.state(handle)
    reader.release(handle)
    return state


@pytest.fixture
def agents() -> Iterator[tuple[Agent, Agent, np.ndarray, np.ndarray, str]]:
    """A reader and a holder agent; the holder's memory patterned, the reader's zeroed, each
    registered; the holder loaded into the reader."""
    reader, holder = Agent(f"prep-reader-{os.getpid()}"), Agent(f"prep-holder-{os.getpid()}")
    src = (np.arange(SPAN * SPANS, dtype=np.uint64) * 2654435761 >> 7).astype(np.uint8)
    dst = np.zeros(SPAN * SPANS, np.uint8)
    held = holder.register(MemoryKind.DRAM, src.ctypes.data, src.nbytes, 0)
    mine = reader.register(MemoryKind.DRAM, dst.ctypes.data, dst.nbytes, 0)
    name = reader.add_remote(holder.metadata())
    yield reader, holder, src, dst, name
    reader.deregister(mine)
    holder.deregister(held)


def rows(base: int, order: list[int]) -> list[tuple[int, int, int]]:
    return [(base + i * SPAN, SPAN, 0) for i in order]


def whole(lists: PreparedLists | None, count: int) -> Entries:
    """Every entry of ``lists`` (``count`` of them), as one post."""
    assert type(lists) is PreparedLists
    return Entries(lists, np.arange(count, dtype=np.int32), count * SPAN)


def test_prepared_lists_move_the_bytes_their_rows_name_every_time_they_are_posted(
    agents: tuple[Agent, Agent, np.ndarray, np.ndarray, str],
) -> None:
    reader, holder, src, dst, name = agents
    order = [3, 1, 0, 7, 15, 8]  # out of order, not contiguous: no two rows merge
    entries = whole(reader.prepare(MemoryKind.DRAM, rows(dst.ctypes.data, list(range(len(order)))),
                                   MemoryKind.DRAM, rows(src.ctypes.data, order), name), len(order))
    for _ in range(3):
        dst[:] = 0
        handle, _ = reader.start_listed("READ", MemoryKind.DRAM, entries, MemoryKind.DRAM, entries, name)
        assert finish(reader, holder, handle) is XferStatus.DONE
        for at, i in enumerate(order):
            assert np.array_equal(dst[at * SPAN:(at + 1) * SPAN], src[i * SPAN:(i + 1) * SPAN]), (at, i)
        assert not dst[len(order) * SPAN:].any(), "bytes past the rows were written"


def test_after_the_remote_agent_is_loaded_anew_prepared_lists_are_posted_from_their_rows(
    agents: tuple[Agent, Agent, np.ndarray, np.ndarray, str],
) -> None:
    reader, holder, src, dst, name = agents
    entries = whole(reader.prepare(MemoryKind.DRAM, rows(dst.ctypes.data, [0, 1]),
                                   MemoryKind.DRAM, rows(src.ctypes.data, [5, 9]), name), 2)
    reader.remove_remote(name)
    assert reader.add_remote(holder.metadata()) == name
    handle, _ = reader.start_listed("READ", MemoryKind.DRAM, entries, MemoryKind.DRAM, entries, name)
    assert finish(reader, holder, handle) is XferStatus.DONE
    assert np.array_equal(dst[:SPAN], src[5 * SPAN:6 * SPAN])
    assert np.array_equal(dst[SPAN:2 * SPAN], src[9 * SPAN:10 * SPAN])


def test_with_the_remote_agent_gone_a_prepared_post_fails_as_a_transfer_error(
    agents: tuple[Agent, Agent, np.ndarray, np.ndarray, str],
) -> None:
    reader, holder, src, dst, name = agents
    entries = whole(reader.prepare(MemoryKind.DRAM, rows(dst.ctypes.data, [0]),
                                   MemoryKind.DRAM, rows(src.ctypes.data, [2]), name), 1)
    reader.remove_remote(name)
    with pytest.raises(TransferError):
        reader.start_listed("READ", MemoryKind.DRAM, entries, MemoryKind.DRAM, entries, name)
    assert not dst.any()
    reader.add_remote(holder.metadata())  # the fixture's teardown finds it loaded, as it left it


def test_lists_let_go_of_while_their_request_runs_leave_the_request_to_finish(
    agents: tuple[Agent, Agent, np.ndarray, np.ndarray, str],
) -> None:
    reader, holder, src, dst, name = agents
    every = list(range(SPANS))
    entries = whole(reader.prepare(MemoryKind.DRAM, rows(dst.ctypes.data, every),
                                   MemoryKind.DRAM, rows(src.ctypes.data, every), name), SPANS)
    handle, _ = reader.start_listed("READ", MemoryKind.DRAM, entries, MemoryKind.DRAM, entries, name)
    del entries  # the last reference: NIXL frees the prepared lists now
    assert finish(reader, holder, handle) is XferStatus.DONE
    assert np.array_equal(dst, src)


def test_rows_nixl_cannot_prepare_are_left_as_they_are(
    agents: tuple[Agent, Agent, np.ndarray, np.ndarray, str],
) -> None:
    """The remote agent unknown: nothing is prepared, and a post of the rows names the failure."""
    reader, _, src, dst, _ = agents
    local, remote = rows(dst.ctypes.data, [0]), rows(src.ctypes.data, [0])
    assert reader.prepare(MemoryKind.DRAM, local, MemoryKind.DRAM, remote, "no-such-agent") is None
    assert reader.prepare(MemoryKind.DRAM, local, MemoryKind.DRAM, remote + remote, "no-such-agent") is None
    with pytest.raises(TransferError):
        reader.start_listed("READ", MemoryKind.DRAM, local, MemoryKind.DRAM, remote, "no-such-agent")
    assert not dst.any()


def test_entries_of_prepared_lists_move_alone_and_from_their_rows_after_a_reload(
    agents: tuple[Agent, Agent, np.ndarray, np.ndarray, str],
) -> None:
    reader, holder, src, dst, name = agents
    order = [3, 1, 0, 7, 15, 8]
    lists = reader.prepare(MemoryKind.DRAM, rows(dst.ctypes.data, list(range(len(order)))),
                           MemoryKind.DRAM, rows(src.ctypes.data, order), name)
    assert type(lists) is PreparedLists

    def landed(entries: list[int]) -> None:
        for at in range(len(order)):
            got = dst[at * SPAN:(at + 1) * SPAN]
            if at in entries:
                assert np.array_equal(got, src[order[at] * SPAN:(order[at] + 1) * SPAN]), at
            else:
                assert not got.any(), f"entry {at} was not posted, yet written"

    handle, _ = reader.post_prepared("READ", lists, [1, 4], [1, 4])
    assert finish(reader, holder, handle) is XferStatus.DONE
    landed([1, 4])
    dst[:] = 0
    reader.remove_remote(name)
    assert reader.add_remote(holder.metadata()) == name
    handle, _ = reader.post_prepared("READ", lists, np.array([5, 2], dtype=np.int32), np.array([5, 2], dtype=np.int32))
    assert finish(reader, holder, handle) is XferStatus.DONE, "posted from the rows of those entries"
    landed([2, 5])


def test_prepared_lists_without_rows_fail_once_the_agent_is_loaded_anew_and_are_let_go_of_once(
    agents: tuple[Agent, Agent, np.ndarray, np.ndarray, str],
) -> None:
    """A node's lists keep no rows: a post NIXL refuses is a ``TransferError``, nothing written."""
    reader, holder, src, dst, name = agents
    local = reader.prep_local(MemoryKind.DRAM, rows(dst.ctypes.data, [0, 1]))
    lists = PreparedLists(name, local, reader.prep_remote(name, MemoryKind.DRAM, rows(src.ctypes.data, [4, 6])))
    handle, _ = reader.post_prepared("READ", lists, [1], [1])
    assert finish(reader, holder, handle) is XferStatus.DONE
    assert np.array_equal(dst[SPAN:2 * SPAN], src[6 * SPAN:7 * SPAN]) and not dst[:SPAN].any()
    reader.remove_remote(name)
    reader.add_remote(holder.metadata())
    dst[:] = 0
    with pytest.raises(TransferError):
        reader.post_prepared("READ", lists, [0], [0])
    assert not dst.any()
    reader.release_lists(lists)
    reader.release_lists(lists)
    assert lists.released
