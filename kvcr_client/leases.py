"""A lease as the client sees it: what it holds per key, how long, and whether it ended.

``Client.lease`` answers a ``LeaseHandle`` (spec section 6.11). The node, or the source a
hint names, holds every key the handle reports held until the lease ends: at ``release``,
at the end of its time to live unless ``renew``ed, with the session, or (for keys a source
holds) when that source restarts or is gone. The node says so with a ``lease_end`` event,
which the client applies to the handle as it reads it (``ended``, ``lost``); the handle
never claims a key is held that the node said is not.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvcr_protocol import HELD, ErrorCode, LeaseColumns, LeaseStatus, code_of


class LeaseHandle:
    """One lease: ``status(key)``, ``held``, ``ended``; ``renew`` and ``release`` it."""

    def __init__(
        self, lease: int, ttl_ms: int, keys: Sequence[bytes], columns: LeaseColumns, granted_at: float,
        renew: Callable[[LeaseHandle, int], Any], release: Callable[[LeaseHandle], Any], live: Callable[[], bool],
    ) -> None:
        self.id = lease
        """The node's lease id; 0 when the lease holds nothing (nothing to renew or release)."""
        self.ttl_ms = ttl_ms
        self.keys = tuple(keys)
        self._columns = columns
        self._index = {key: i for i, key in reversed(list(enumerate(self.keys)))}
        self.expires_at = granted_at + ttl_ms / 1000
        """When the lease ends unless renewed (``time.monotonic``, from when it was asked for:
        the node's own clock ends it no earlier)."""
        self._renew = renew
        self._release = release
        self._live = live
        """Whether the session the lease was granted in is still the client's."""
        self._lock = threading.Lock()
        self._ended: ErrorCode | int | None = None if lease else ErrorCode.OK
        self.end_reason = ""
        self._lost: set[bytes] = set()
        self.released = False
        self.grant = False
        """Whether the node answered with a read grant (spec section 6.12): False when the
        lease did not ask for one, or the node gives none (``client_transfers`` off)."""
        self.granted: frozenset[bytes] = frozenset()
        """The keys a ``deliver`` of this client READs itself while the lease lasts."""

    # ------------------------------------------------------------------ what it holds

    def status(self, key: bytes) -> LeaseStatus:
        """What the lease holds of ``key`` (``KeyError`` for a key it was not asked for); a
        key the node since reported lost reads ``MISS``."""
        status = self._columns.status_of(self._index[key])
        if status in HELD and (self.ended is not None or key in self._lost):
            return LeaseStatus.MISS
        return status

    def tier(self, key: bytes) -> str:
        """The tier a held key is in (``remote`` when a source holds it), else ``""``."""
        return self._columns.tier_of(self._index[key]) if self.status(key) in HELD else ""

    def __getitem__(self, key: bytes) -> LeaseStatus:
        return self.status(key)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def held(self) -> frozenset[bytes]:
        """The keys the lease holds now (none once it ended)."""
        if self.ended is not None:
            return frozenset()
        with self._lock:
            lost = set(self._lost)
        return frozenset(k for k, s in zip(self.keys, self._columns, strict=True) if s in HELD and k not in lost)

    def held_prefix(self) -> int:
        """How many keys in a row, from the first, the lease holds: what an engine can admit."""
        if self.ended is not None:
            return 0
        count = 0
        with self._lock:
            for key, status in zip(self.keys, self._columns, strict=True):
                if status not in HELD or key in self._lost:
                    break
                count += 1
        return count

    @property
    def lost(self) -> frozenset[bytes]:
        """Keys the node said it no longer holds, while the rest of the lease goes on."""
        with self._lock:
            return frozenset(self._lost)

    def lost_key(self, key: bytes) -> bool:
        """Whether the node said it no longer holds ``key`` (no copy of the set: a read under
        a grant asks once per group)."""
        return key in self._lost

    @property
    def ended(self) -> ErrorCode | int | None:
        """None while the lease lasts; else why it ended (``OK`` released or never held,
        ``LEASE_EXPIRED``, ``PEER_RESTARTED``, ``NODE_LOST``, ``SHUTTING_DOWN``, ...)."""
        if self._ended is None and not self._live():
            return ErrorCode.NODE_LOST  # the session it lived in is over, and the lease with it
        return self._ended

    # ------------------------------------------------------------------ ending and renewing

    def renew(self, ttl_ms: int = 0) -> Any:
        """Ask the node to keep the lease ``ttl_ms`` more from now (0: its own time to live);
        the handle (``OpHandle``) resolves to the granted time to live."""
        return self._renew(self, ttl_ms)

    def release(self) -> Any:
        """End the lease now; the handle (``OpHandle``) resolves once the node let go."""
        return self._release(self)

    def renewed(self, ttl_ms: int, asked_at: float) -> None:
        self.ttl_ms = ttl_ms
        self.expires_at = asked_at + ttl_ms / 1000

    def end(self, code: int, reason: str, keys: Sequence[bytes] = ()) -> None:
        """The node ended the lease (``keys`` empty) or stopped holding ``keys``."""
        with self._lock:
            if keys:
                self._lost.update(k for k in keys if k in self._index)
                if self.ended is None and all(s not in HELD or k in self._lost for k, s in zip(self.keys, self._columns, strict=True)):
                    self._ended, self.end_reason = code_of(code), reason
            elif self._ended is None:
                self._ended, self.end_reason = code_of(code), reason

    def __repr__(self) -> str:
        state = "live" if self.ended is None else f"ended {self.ended!r}"
        return f"LeaseHandle(id={self.id}, keys={len(self.keys)}, held={len(self.held)}, ttl_ms={self.ttl_ms}, {state})"
