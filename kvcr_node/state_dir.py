"""The node's state directory: what lets a restarted node keep its cache (architecture §8).

A node started with ``state_dir`` keeps there its journal (``kvcr_node.journal``) and a
description of its pools (``layout.json``), and keeps each DRAM pool in a file of its own
under ``pool_dir`` (``/dev/shm`` unless the operator names a hugetlbfs or other memory
mount), so that the pool's bytes outlive the process. The next node started on the same
directory with the same pools maps those files again and adopts what the journal says
they hold (``kvcr_node.recovery``).

The disk tier (architecture §9) keeps its journal the same way, in a state directory of its
own beside its disk pools' files (``kvcr_node.disk_pools``): a ``StateDir`` told where each
pool's file is (``files``) rather than ``pool_dir``.

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
import secrets
from collections.abc import Mapping, Sequence
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
    """An open, locked state directory whose pool files are ready to map.

    ``previous`` is the incarnation that last wrote it (0 for a new directory); ``files``
    says where each kept pool lives, ``epochs`` names each pool file's contents, and
    ``kept`` lists the pools whose files were found whole.

    A pool's epoch is a random number drawn whenever its file is made anew (missing, or of
    another size): every journal file says the epochs it was written under, so a record of
    bytes in an earlier file of that pool is never taken for what the new file holds. The new
    epoch is written to ``layout.json`` before the file is made, so a node killed between
    the two leaves a directory that still reads right.
    """

    def __init__(
        self, path: str | os.PathLike[str], pools: Sequence[PoolSpec], pool_dir: str, incarnation: int,
        files: Mapping[str, Path] | None = None,
    ) -> None:
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
            self.files = dict(files) if files is not None else {
                spec.name: self.pool_dir / f"kvcr-{tag}-{spec.name}" for spec in pools if hbm_device(spec.memory) is None
            }
            """Pool name -> its file, for every pool kept (DRAM and disk; HBM dies with its process)."""
            self.previous, epochs = self._check_layout(pools)
            sizes = {spec.name: spec.size for spec in pools}
            self.kept = {name for name, file in self.files.items() if name in epochs and _size(file) == sizes[name]}
            """The pools whose files were found whole: what they hold may be taken back."""
            self.epochs = {name: epochs[name] if name in self.kept else secrets.randbits(63) | 1 for name in self.files}
            """Pool name -> the epoch of its file's contents."""
            self._write_layout(pools, incarnation)
            for name, file in self.files.items():
                if name not in self.kept:
                    _make_file(file, sizes[name])
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

    def _check_layout(self, pools: Sequence[PoolSpec]) -> tuple[int, dict[str, int]]:
        """The incarnation that wrote the directory and its pools' epochs, after checking
        that its pools are ours."""
        path = self.path / LAYOUT_FILE
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return 0, {}
        except OSError as exc:
            raise StateDirError(f"state directory {self.path}: cannot read {LAYOUT_FILE}: {exc.strerror}") from None
        try:
            layout = json.loads(text)
            version = layout["version"]
            theirs = [PoolSpec(p["name"], p["slot_size"], p["slot_count"], p["memory"]) for p in layout["pools"]]
            previous = int(layout["incarnation"])
            epochs = {str(name): int(epoch) for name, epoch in layout.get("epochs", {}).items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StateDirError(f"state directory {self.path}: {LAYOUT_FILE} is unreadable ({exc})") from None
        if version != STATE_VERSION:
            raise StateDirError(
                f"state directory {self.path} was written with state version {version!r}; this node reads {STATE_VERSION}")
        if theirs != list(pools):
            raise StateDirError(
                f"state directory {self.path} was written with other pools ({_describe(theirs)}; now {_describe(pools)}): "
                "start with those pools, or on another directory")
        return previous, epochs

    def _write_layout(self, pools: Sequence[PoolSpec], incarnation: int) -> None:
        layout = {
            "version": STATE_VERSION,
            "incarnation": incarnation,
            "pools": [{"name": p.name, "slot_size": p.slot_size, "slot_count": p.slot_count, "memory": p.memory}
                      for p in pools],
            "pool_files": {name: str(path) for name, path in self.files.items()},
            "epochs": self.epochs,
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


def _size(file: Path) -> int:
    try:
        return file.stat().st_size
    except OSError:
        return -1


def _make_file(file: Path, size: int) -> None:
    """``file`` anew, ``size`` bytes of zeros (its old contents, if any, are gone)."""
    try:
        file.unlink(missing_ok=True)
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise StateDirError(f"pool file {file}: cannot make it: {exc.strerror}") from None
    try:
        os.ftruncate(fd, size)
    except OSError as exc:
        raise StateDirError(f"pool file {file}: cannot size it to {size} bytes: {exc.strerror}") from None
    finally:
        os.close(fd)


def _describe(pools: Sequence[PoolSpec]) -> str:
    return ", ".join(f"{p.name}={p.slot_count}x{p.slot_size}B@{p.memory}" for p in pools)
