"""The files behind a node's disk pools (architecture §9).

A disk pool keeps ``slot_count`` slots of ``slot_size`` bytes in one file, allocated in full
when the pool is opened (``posix_fallocate``: a disk too small refuses the pool, naming it,
rather than failing a later write), and registered with the node's agent as ``FILE`` memory
(NIXL's POSIX backend, ``kvcr_io.agent.Agent(files=True)``). Its bytes move to and from the
node's memory pools as every other byte does, through ``kvcr_node.transfers.Transfers`` with
the node's own agent as the other side: the pool's file is the remote ``Region`` of such a
transfer (``region``), and slot ``s`` of it is at file offset ``s * slot_size``.

The pools' files outlive the node: a state directory beside them (``STATE_DIR`` in the
first disk pool's directory, ``kvcr_node.state_dir``) holds the journal of the copies they
hold, its lock (one live node at a time) and the pools' layout, so that the next node started
on them with the same disk pools takes the copies back (``kvcr_node.recovery``).

This module owns the files: where they are, that each has its pool's size, their
registration, their state directory, and letting go of all of it.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcr_io.agent import FILE, Agent, Kind
from kvcr_node.memory import PoolAllocationError
from kvcr_node.poolspec import PoolSpec, disk_directory
from kvcr_node.state_dir import StateDir

__all__ = ["DiskPool", "DiskPools", "FileRegion", "disk_directory", "pool_file"]

FILE_SUFFIX = ".kvcr-pool"
STATE_DIR = "kvcr-disk-tier"
"""The disk tier's state directory, in the directory of the node's first disk pool."""


def pool_file(spec: PoolSpec, directory: Path) -> Path:
    """Where ``spec``'s slots are kept under ``directory``."""
    return directory / f"{spec.name}{FILE_SUFFIX}"


@dataclass(frozen=True, slots=True)
class FileRegion:
    """A disk pool's file as the remote side of a transfer (``kvcr_node.transfers.Remote``):
    descriptors of (file offset, length, fd), the whole file its one registration."""

    device: int
    """The file's descriptor (NIXL's ``FILE`` descriptors carry it where memory has a device)."""
    length: int
    kind: Kind = FILE
    address: int = 0


class DiskPool:
    """One disk pool's file, open and registered with ``agent`` for as long as the node runs."""

    def __init__(self, spec: PoolSpec, path: Path, agent: Agent) -> None:
        """Open (or make) ``path`` as ``spec``'s file: one of the pool's size is kept as it is;
        an empty or new one is allocated in full; one of another size is refused, naming it,
        since its bytes belong to another pool layout."""
        self.spec = spec
        self.path = path
        self._agent = agent
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise PoolAllocationError(spec, exc) from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # one live node per file; the lock goes with it
            except BlockingIOError:
                raise PoolAllocationError(spec, BlockingIOError(f"{path} is in use by another live node")) from None
            size = os.fstat(fd).st_size
            if size not in (0, spec.size):
                raise PoolAllocationError(spec, ValueError(f"{path} has {size} bytes, not the pool's {spec.size}"))
            # Every block allocated now: a full disk refuses the pool here, by name.
            os.posix_fallocate(fd, 0, spec.size)
            self._registration: Any = agent.register_file(fd, spec.size)
        except PoolAllocationError:
            os.close(fd)
            raise
        except (OSError, OverflowError, ValueError, RuntimeError) as exc:
            os.close(fd)
            raise PoolAllocationError(spec, exc) from exc
        self.fd = fd
        self.region = FileRegion(fd, spec.size)
        """The file as the remote side of a transfer of the node's agent with itself."""

    def close(self) -> None:
        """Let go of the registration and the file (no transfer of it may still run)."""
        if self.fd < 0:
            return
        self._agent.deregister(self._registration)
        os.close(self.fd)
        self.fd = -1


class DiskPools:
    """A node's disk pools: their state directory (locked, layout checked) and their files,
    open and registered with ``agent`` for as long as the node runs."""

    def __init__(self, specs: Sequence[PoolSpec], agent: Agent, incarnation: int) -> None:
        """Refuses, with one line naming why (``StateDirError``, ``PoolAllocationError``), a
        directory locked by a live node, written with other disk pools, or a file that
        cannot be made."""
        paths = {}
        for spec in specs:
            directory = disk_directory(spec.memory)
            assert directory is not None  # validated
            paths[spec.name] = pool_file(spec, directory)
        first = disk_directory(specs[0].memory)
        assert first is not None
        # Before the files are opened: a pool file the state cannot vouch for is made anew.
        self.state = StateDir(first / STATE_DIR, specs, str(first), incarnation, files=paths)
        self.files: list[DiskPool] = []
        try:
            for spec in specs:
                self.files.append(DiskPool(spec, paths[spec.name], agent))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Let go of the files and then of the state directory (no transfer may still run)."""
        for pool in self.files:
            pool.close()
        self.state.close()
