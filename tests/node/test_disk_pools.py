"""A disk pool's file, moved to and from a memory pool by the node's own transfer engine
(architecture §9): ``kvcr_node.transfers.Transfers`` posts a WRITE of DRAM pool slots into
the file's slots and a READ back, with the node's agent as the other side (NIXL's POSIX
backend), and every byte that lands, in the file and back in memory, is the byte that left.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvcr_io.agent import FILE, Agent
from kvcr_node.disk_pools import DiskPool, FileRegion, disk_directory, pool_file
from kvcr_node.memory import PoolAllocationError, PoolMemory
from kvcr_node.poolspec import PoolSpec
from kvcr_node.transfers import LocalLists, Transfers, list_moves, run_moves
from kvcr_protocol import MemoryKind

SLOT = 16 * 1024
MEMORY_SLOTS = 32
DISK_SLOTS = 24
WAIT_S = 30.0


@pytest.fixture
def agent() -> Iterator[Agent]:
    yield Agent(f"disk-pool-test-{os.getpid()}", files=True)


@pytest.fixture
def memory(agent: Agent) -> Iterator[PoolMemory]:
    mem = PoolMemory(PoolSpec("kv", SLOT, MEMORY_SLOTS))
    handle = agent.register(MemoryKind.DRAM, mem.address, mem.spec.size, 0)
    yield mem
    agent.deregister(handle)
    mem.close()


@pytest.fixture
def disk(agent: Agent, tmp_path: Path) -> Iterator[DiskPool]:
    spec = PoolSpec("kv-disk", SLOT, DISK_SLOTS, f"disk:{tmp_path}")
    directory = disk_directory(spec.memory)
    assert directory == tmp_path
    pool = DiskPool(spec, pool_file(spec, directory), agent)
    yield pool
    pool.close()


def move(transfers: Transfers, agent: Agent, op: str, moves: list[tuple[str, int, int, int, FileRegion, int]]) -> bool:
    """Post ``op`` of ``moves`` with the agent itself as the other side; poll it, bounded, to its end."""
    outcome: list[bool] = []
    transfers.start(op, agent.name, moves, outcome.append)
    end = time.monotonic() + WAIT_S
    while not outcome and time.monotonic() < end:
        transfers.poll()
    assert outcome, f"the {op} did not end within {WAIT_S} s"
    return outcome[0]


def slot_bytes(mem: PoolMemory, slot: int) -> np.ndarray:
    return mem.array[slot * SLOT:(slot + 1) * SLOT]


def file_slot(disk: DiskPool, slot: int) -> bytes:
    return os.pread(disk.fd, SLOT, slot * SLOT)


def test_slots_written_to_the_file_and_read_back_are_the_bytes_that_left(
    agent: Agent, memory: PoolMemory, disk: DiskPool,
) -> None:
    rng = np.random.default_rng(7)
    memory.array[:] = rng.integers(0, 256, memory.spec.size, dtype=np.uint8)
    transfers = Transfers(agent, LocalLists(agent, [memory]))
    # Scattered memory slots into scattered disk slots, and a consecutive run into a
    # consecutive run (merged into one descriptor).
    pairs = [(3, 20), (4, 0), (9, 7), (10, 8), (11, 9), (12, 10), (31, 23)]
    moves = list_moves("kv", SLOT, disk.region, [d * SLOT for _, d in pairs], [m for m, _ in pairs])
    assert any(count > 1 for *_, count in moves), "no run was merged"
    assert move(transfers, agent, "WRITE", moves)
    for m, d in pairs:
        assert file_slot(disk, d) == slot_bytes(memory, m).tobytes(), f"memory slot {m} -> disk slot {d}"

    # Back, into other memory slots (zeroed first).
    back = [(d, 16 + i) for i, (_, d) in enumerate(pairs)]
    for _, m in back:
        slot_bytes(memory, m)[:] = 0
    moves = run_moves("kv", SLOT, disk.region, np.array([d * SLOT for d, _ in back], dtype=np.uint64),
                      np.array([m for _, m in back], dtype=np.uint64))
    assert move(transfers, agent, "READ", moves)
    for (m, _), (_, again) in zip(pairs, back, strict=True):
        assert np.array_equal(slot_bytes(memory, again), slot_bytes(memory, m)), f"slot {m} back as slot {again}"
    assert transfers.stats()["in_flight"] == 0 and transfers.stats()["failed"] == 0


def test_a_pools_file_is_kept_at_its_size_and_another_size_is_refused(agent: Agent, tmp_path: Path) -> None:
    spec = PoolSpec("kept", SLOT, 4, f"disk:{tmp_path}")
    path = pool_file(spec, tmp_path)
    pool = DiskPool(spec, path, agent)
    assert path.stat().st_size == spec.size and pool.region.kind == FILE and pool.region.length == spec.size
    os.pwrite(pool.fd, b"kept", SLOT)
    pool.close()
    pool.close()  # a second close does nothing
    again = DiskPool(spec, path, agent)  # the same layout: its bytes are kept as they are
    assert os.pread(again.fd, 4, SLOT) == b"kept"
    again.close()

    other = PoolSpec("kept", SLOT, 8, f"disk:{tmp_path}")
    with pytest.raises(PoolAllocationError, match=r"pool 'kept'.*has 65536 bytes, not the pool's 131072"):
        DiskPool(other, path, agent)
    assert path.stat().st_size == spec.size, "a refused file was changed"


def test_a_pool_under_a_missing_directory_is_refused_naming_it(agent: Agent, tmp_path: Path) -> None:
    spec = PoolSpec("lost", SLOT, 4, f"disk:{tmp_path / 'absent'}")
    with pytest.raises(PoolAllocationError, match=r"pool 'lost'.*No such file or directory"):
        DiskPool(spec, pool_file(spec, tmp_path / "absent"), agent)


def test_only_disk_memories_name_a_directory() -> None:
    assert disk_directory("disk:/var/cache/kvcr") == Path("/var/cache/kvcr")
    assert disk_directory("dram") is None and disk_directory("hbm:0") is None


def test_a_pools_file_in_use_by_a_live_node_is_refused(agent: Agent, tmp_path: Path) -> None:
    """One live node per disk pool file: a second opening (another node started on the same
    directory and pool) is refused by name, and the first goes on; once it lets go, it opens."""
    spec = PoolSpec("shared", SLOT, 4, f"disk:{tmp_path}")
    path = pool_file(spec, tmp_path)
    first = DiskPool(spec, path, agent)
    with pytest.raises(PoolAllocationError, match=r"pool 'shared'.*in use by another live node"):
        DiskPool(spec, path, agent)
    os.pwrite(first.fd, b"still mine", 0)
    first.close()
    again = DiskPool(spec, path, agent)
    assert os.pread(again.fd, 10, 0) == b"still mine"
    again.close()
