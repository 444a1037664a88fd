"""The I/O layer that node and client share: the NIXL agent wrapper (``agent``), the
pacing of transfer polls (``pacing``), ZeroMQ flags as plain ints (``zmq_flags``) and
the self-pipe that wakes a thread blocked in a poll (``wake``).

It imports neither ``kvcr_node`` nor ``kvcr_client``; both import it, so imports run
one way: protocol <- io <- node, client.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    """The installed kvcr version ("unknown" when run from a tree that is not installed)."""
    try:
        return version("kvcr-runner")
    except PackageNotFoundError:
        return "unknown"
