"""A self-pipe that wakes a thread blocked in ``poll``/``select`` from another thread or a
signal handler: writes never block (a full pipe already wakes the reader) and reads drain it."""

from __future__ import annotations

import contextlib
import os


class WakePipe:
    """The read end goes into the poller; ``wake`` from anywhere, ``drain`` once woken."""

    __slots__ = ("read_fd", "write_fd")

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)

    def wake(self) -> None:
        """Thread- and signal-safe; a pipe that is full or closed already says enough."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self.write_fd, b"x")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.read_fd, 4096):
                pass

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
