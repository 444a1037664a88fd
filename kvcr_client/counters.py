"""Every event the client counts, declared once (``Count``), and its tally.

``Operations.counters()`` shows them by name; the parts count members of ``Count``, never
strings or attributes of their own, so a test or a dashboard reads one table instead of
the parts' insides. A counter lists only what was counted.
"""

from __future__ import annotations

import enum

from kvcr_io.tally import Tally


class Count(enum.Enum):
    """The client's event counters, by the name ``counters()`` shows."""

    GRANT_READS = "grant_reads"
    """Delivers served by READs under grants (spec section 6.12)."""
    GRANT_CONFIRMS = "grant_confirms"
    """Lease checks of such READs that needed a ``renew`` to confirm the lease."""
    GRANT_REFUSED = "grant_refused"
    """Keys failed because their lease may not have held for the whole read."""
    SPANS_CHECKED = "spans_checked"
    """Spans whose bytes were checked against the grant's digests (spec section 6.12, "Integrity")."""
    SPANS_UNCHECKED = "spans_unchecked"
    """Spans read under a grant with no digest to check them by (none granted, or GPU memory)."""
    DIGEST_MISMATCHES = "digest_mismatches"
    """Keys failed ``DIGEST_MISMATCH``: their bytes were not what the node stored."""
    SUSPECTS_REPORTED = "suspects_reported"
    """Of those, keys reported to the node (``suspect``), which checks them itself or has
    their source check them."""
    SUSPECTS_DROPPED = "suspects_dropped"
    """Reported keys the node (or their source) found changed and dropped."""
    PUTS = "puts"
    """Deposits that travelled as puts: the client WRITEs the bytes (spec section 6.13)."""
    PUT_FALLBACKS = "put_fallbacks"
    """Puts sent as deposits (the node below version 5, or refusing puts)."""
    PUTS_UNANSWERED = "puts_unanswered"
    """Puts whose ``put_reply`` did not come within their deadline (keys ``TIMEOUT``)."""
    PUTS_HANDED_BACK = "puts_handed_back"
    """Late reservations of those, freed by ``unput``."""
    RESUMES_HELD = "resumes_held"
    """Reconnects that presented no resume token: a WRITE of a put could still land."""


class Counters(Tally[Count]):
    """The client's event counters, shown by ``Count`` value."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(lambda count: count.value)
