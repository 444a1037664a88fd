"""Protocol versions and their negotiation (spec section 7).

Version 1 is the base protocol. Version 2 adds the must-understand partial-layout flag
(``!partial``) on peer write requests. Version 3 adds span columns, layer plans with
per-group progress, NIXL completion notifications, query columns and prefix queries.
Version 4 adds leases: ``lease``, ``lease_reply``, ``renew``, ``unlease`` and ``lease_end``.
Version 5 is opened by ``peer_forget`` (a target tells a source that a client it announced
left) and adds read grants under leases (``read``, ``node_md``, ``held``, ``grant``).

``PROTOCOL_VERSIONS`` names every version the protocol defines; this package encodes and
decodes each, and the reference node and client offer them all by default (up to
``CURRENT_VERSION``; an endpoint told to speak less offers ``supported_up_to(its cap)``).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvcr_protocol.errors import ErrorCode, ProtocolError

BASE_VERSION = 1
PARTIAL_LAYOUT_VERSION = 2
"""The first version whose peer write requests may name a subset of a layout."""
COLUMNS_VERSION = 3
"""The first version with span columns, layer plans, progress, notifications, query
columns and prefix queries."""

LEASES_VERSION = 4
"""The first version with leases (spec section 6.11), on client and peer sessions."""

GRANTS_VERSION = 5
"""The first version with read grants (spec section 6.12): ``read`` and ``node_md`` on
``lease``, ``held`` and ``grant`` on ``lease_reply``."""

CLIENT_GONE_VERSION = 5
"""The first version with ``peer_forget`` (spec section 5.3): a target tells a source that a
client it announced left, so the source forgets it at once instead of at its
``max_peer_clients`` bound."""

AUDIT_VERSION = 5
"""The first version whose ``stats`` may ask for the node's accounting check (``audit``, spec
section 6.4): below it a node runs the check on every ``stats``, as nodes before the field did."""

PROTOCOL_VERSIONS: tuple[int, ...] = (1, 2, 3, 4, 5)
"""Every version the protocol defines: this package encodes and decodes each, and the
reference node and client speak each."""
CURRENT_VERSION = PROTOCOL_VERSIONS[-1]
"""The newest version: what the reference endpoints offer up to by default."""


def supported_up_to(max_version: int) -> tuple[int, ...]:
    """The versions an endpoint told to speak at most ``max_version`` supports."""
    if max_version not in PROTOCOL_VERSIONS:
        raise ValueError(f"max_version: {max_version} is not one of {list(PROTOCOL_VERSIONS)}")
    return tuple(v for v in PROTOCOL_VERSIONS if v <= max_version)


def negotiate(ours: Iterable[int], theirs: Iterable[int]) -> int:
    """The highest version both sides support.

    Raises ``ProtocolError(UNSUPPORTED_VERSION)`` when the sets do not meet.
    """
    ours_set, theirs_set = set(ours), set(theirs)
    common = ours_set & theirs_set
    if not common:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"no common version: ours {sorted(ours_set)}, theirs {sorted(theirs_set)}",
            "versions",
        )
    return max(common)
