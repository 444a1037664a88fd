"""Leases (version 4, spec section 6.11): what a lease holds, key by key, as columns.

A lease reserves objects from a lookup through every delivery of them: while it lasts, a
leased object cannot be evicted or removed, so a request an engine admitted on its
answers does not fail half-loaded. A ``lease_reply`` says per key what the lease holds
(``LeaseStatus``), as one byte per key plus the tier the key is held in, like query
columns (spec section 6.9).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from kvcr_protocol.columns import check_code_columns
from kvcr_protocol.limits import Limits
from kvcr_protocol.records import NAME
from kvcr_protocol.wire import Field, Packed, Record, Seq


class LeaseStatus(enum.IntEnum):
    """What a lease holds of one key; the value is its code in a ``status`` column."""

    MISS = 0
    """Not held here, and no hint names a source that holds it."""
    LEASED = 1
    """Held here under the lease, in the tier the reply names."""
    LEASED_REMOTE = 2
    """Held under the lease by the source the session's hint names (tier ``remote``)."""
    PENDING = 3
    """Being written (WRITING) here or at the source: not held; ask again once it is READY."""
    LEASE_LIMIT = 4
    """Held, but leasing it would pass a lease limit of the node or the source: not held,
    treat it as a miss."""
    ADVISORY = 5
    """The hinted source may hold it but speaks no leases (a version below 4): nothing is
    reserved, as with a query's ``FETCHABLE``."""
    UNREACHABLE = 6
    """The hinted source could not be asked in time: not held."""


HELD: frozenset[LeaseStatus] = frozenset({LeaseStatus.LEASED, LeaseStatus.LEASED_REMOTE})
"""The statuses of keys a lease holds."""
_VALID = bytes(range(len(LeaseStatus)))
_BY_CODE: tuple[LeaseStatus, ...] = tuple(LeaseStatus)


@dataclass(frozen=True, slots=True)
class LeaseColumns(Record):
    """A lease's answers as columns: ``status`` one ``LeaseStatus`` code per key, ``tier``
    one index per key into the table ``tiers``."""

    status: bytes
    tier: bytes
    tiers: tuple[str, ...]
    CHECKED: ClassVar[bool] = True
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("status", Packed(1, "max_keys")), Field("tier", Packed(1, "max_keys")),
        Field("tiers", Seq(NAME, "max_tiers")),
    )

    def __len__(self) -> int:
        return len(self.status)

    def __iter__(self) -> Iterator[LeaseStatus]:
        return (_BY_CODE[code] for code in self.status)

    def status_of(self, index: int) -> LeaseStatus:
        return _BY_CODE[self.status[index]]

    def tier_of(self, index: int) -> str:
        return self.tiers[self.tier[index]]

    def held_count(self) -> int:
        """How many keys the lease holds (here or at a source)."""
        return self.status.count(LeaseStatus.LEASED) + self.status.count(LeaseStatus.LEASED_REMOTE)

    def check(self, limits: Limits) -> None:
        check_code_columns(self.status, self.tier, self.tiers, _VALID, "status")
