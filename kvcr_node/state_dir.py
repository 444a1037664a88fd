"""The node's state directory: what lets a restarted node keep its cache (architecture §8).

A node started with ``state_dir`` keeps there its journal (``kvcr_node.journal``) and a
description of its pools (``layout.json``), and keeps each DRAM pool in a file of its own
under ``pool_dir`` (``/dev/shm`` unless the operator names a hugetlbfs or other memory
mount), so that the pool's bytes outlive the process. The next node started on the same
directory with the same pools maps those files again and adopts what the journal says
they hold (``kvcr_node.recovery``).

This module owns the directory: its lock (one live node at a time), the layout check, and
where each pool's file is. Everything that refuses a start is a ``StateDirError`` with one
line naming why.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from kvcr_node.config import hbm_device
from kvcr_node.poolspec import PoolSpec

STATE_VERSION = 1
"""The version of ``layout.json`` and of the journal's records; another one is refused."""
LAYOUT_FILE = "layout.json"
LOCK_FILE = "lock"


class StateDirError(ValueError):
    """The state directory cannot be used; the message names it and why, in one line."""


class StateDir:
    """An open, locked state directory. ``previous`` is the incarnation that last wrote it
    (0 for a new directory); ``pool_file`` says where each kept pool lives."""

    def __init__(self, path: str | os.PathLike[str], pools: Sequence[PoolSpec], pool_dir: str, incarnation: int) -> None:
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StateDirError(f"state directory {self.path}: cannot create it: {exc.strerror}") from None
        self._lock_fd = self._lock()
        try:
            real = os.path.realpath(self.path)
            tag = hashlib.sha256(real.encode("utf-8", "surrogatepass")).hexdigest()[:16]
            self.pool_dir = Path(pool_dir)
            self.files = {
                spec.name: self.pool_dir / f"kvcr-{tag}-{spec.name}" for spec in pools if hbm_device(spec.memory) is None
            }
            """Pool name -> its file, for every pool kept (DRAM; HBM dies with its process)."""
            self.previous = self._check_layout(pools)
            self._write_layout(pools, incarnation)
        except BaseException:
            os.close(self._lock_fd)
            raise

    def _lock(self) -> int:
        path = self.path / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StateDirError(f"state directory {self.path}: cannot open its lock: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StateDirError(f"state directory {self.path} is in use by a live node (pid {holder})") from None
            raise StateDirError(f"state directory {self.path}: cannot lock it: {exc.strerror}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        return fd

    def _check_layout(self, pools: Sequence[PoolSpec]) -> int:
        """The incarnation that wrote the directory, after checking that its pools are ours."""
        path = self.path / LAYOUT_FILE
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise StateDirError(f"state directory {self.path}: cannot read {LAYOUT_FILE}: {exc.strerror}") from None
        try:
            layout = json.loads(text)
            version = layout["version"]
            theirs = [PoolSpec(p["name"], p["slot_size"], p["slot_count"], p["memory"]) for p in layout["pools"]]
            previous = int(layout["incarnation"])
        except (ValueError, KeyError, TypeError) as exc:
            raise StateDirError(f"state directory {self.path}: {LAYOUT_FILE} is unreadable ({exc})") from None
        if version != STATE_VERSION:
            raise StateDirError(
                f"state directory {self.path} was written with state version {version!r}; this node reads {STATE_VERSION}")
        if theirs != list(pools):
            raise StateDirError(
                f"state directory {self.path} was written with other pools ({_describe(theirs)}; now {_describe(pools)}): "
                "start with those pools, or on another directory")
        return previous

    def _write_layout(self, pools: Sequence[PoolSpec], incarnation: int) -> None:
        layout = {
            "version": STATE_VERSION,
            "incarnation": incarnation,
            "pools": [{"name": p.name, "slot_size": p.slot_size, "slot_count": p.slot_count, "memory": p.memory}
                      for p in pools],
            "pool_files": {name: str(path) for name, path in self.files.items()},
        }
        tmp = self.path / (LAYOUT_FILE + ".tmp")
        try:
            tmp.write_text(json.dumps(layout, indent=1) + "\n", encoding="utf-8")
            tmp.replace(self.path / LAYOUT_FILE)
        except OSError as exc:
            raise StateDirError(f"state directory {self.path}: cannot write {LAYOUT_FILE}: {exc.strerror}") from None

    def close(self) -> None:
        """Give the lock up (the process's end does the same)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _describe(pools: Sequence[PoolSpec]) -> str:
    return ", ".join(f"{p.name}={p.slot_count}x{p.slot_size}B@{p.memory}" for p in pools)
