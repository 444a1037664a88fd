"""Protocol versions and their negotiation.

Version 1 is the base protocol. Version 2 adds the must-understand partial-layout flag
(``!partial``) on peer write requests.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvcr_protocol.errors import ErrorCode, ProtocolError

BASE_VERSION = 1
CURRENT_VERSION = 2
SUPPORTED_VERSIONS: tuple[int, ...] = (1, 2)

PARTIAL_LAYOUT_VERSION = 2
"""The first version whose peer write requests may name a subset of a layout."""


def supported_up_to(max_version: int) -> tuple[int, ...]:
    """The versions an endpoint told to speak at most ``max_version`` supports."""
    if max_version not in SUPPORTED_VERSIONS:
        raise ValueError(
            f"max_version: {max_version} is not one of {list(SUPPORTED_VERSIONS)}"
        )
    return tuple(v for v in SUPPORTED_VERSIONS if v <= max_version)


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
