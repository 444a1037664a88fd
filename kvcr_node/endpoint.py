"""Binding the node's ROUTER endpoint: at most one live node per ipc path.

ZeroMQ binds an ipc endpoint by unlinking whatever socket file is at the path, so a
second node started on a live node's path would silently take it over: new clients
reach the second node while the first keeps running, unreachable. A node therefore
holds an advisory lock on ``<path>.lock`` for as long as it serves the path, and before
binding it checks that nothing answers on an existing socket file (a node of an older
version holds no lock). A socket file that nobody answers on is stale, left by a node
that died, and is replaced.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
from pathlib import Path
from typing import Any

import zmq

IPC_PREFIX = "ipc://"


class EndpointInUse(ValueError):
    """Another live node serves the endpoint."""


def _ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint[len(IPC_PREFIX) :]) if endpoint.startswith(IPC_PREFIX) else None


def _answers(path: Path) -> bool:
    """Whether a process accepts connections on the unix socket at ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK):
            return False
        raise
    finally:
        probe.close()
    return True


class BoundEndpoint:
    """The endpoint a node bound, and for ipc the lock that keeps a second node off it."""

    def __init__(self, sock: zmq.Socket[Any], endpoint: str) -> None:
        self._lock_fd: int | None = None
        self._path = _ipc_path(endpoint)
        if self._path is not None:
            self._claim_path(self._path, endpoint)
        try:
            sock.bind(endpoint)
        except Exception:
            self.close(unlink=False)
            raise
        bound = sock.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint = bound.decode() if isinstance(bound, bytes) else str(bound)

    def _claim_path(self, path: Path, endpoint: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = path.with_name(path.name + ".lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise EndpointInUse(f"another kvcr-node is serving {endpoint} (it holds {lock})") from None
        self._lock_fd = fd
        if path.exists():
            if _answers(path):
                self.close(unlink=False)
                raise EndpointInUse(f"another process is serving {endpoint}; stop it or choose another endpoint")
            path.unlink()  # stale: left by a node that did not exit cleanly

    def close(self, unlink: bool = True) -> None:
        """Remove the socket file (ipc) and drop the lock; the lock file stays, so a node
        starting meanwhile never locks a file that is about to disappear."""
        if self._path is not None and unlink:
            self._path.unlink(missing_ok=True)
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None
