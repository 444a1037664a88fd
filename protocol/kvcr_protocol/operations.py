"""The error codes a node sends for each request, declared once (spec section 10.1).

A node refuses a request whole with an ``error`` reply, and an operation's items end with
per-key results (``complete``, ``write_done``). Every code a node may put in either is
listed here per request; the spec's table says the same (a conformance test compares
them), and a node checks each code it sends against this table, so a code that is not
listed shows up as a breach of its invariants in every test.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvcr_protocol.errors import ErrorCode as E

DECODING: frozenset[E] = frozenset({
    E.MALFORMED, E.NOT_A_MAP, E.MISSING_FIELD, E.WRONG_TYPE, E.OUT_OF_RANGE, E.TOO_LARGE, E.TOO_MANY,
    E.UNKNOWN_TYPE, E.UNSUPPORTED_VERSION, E.MUST_UNDERSTAND,
})
"""The codes of a frame that does not decode (section 4.3)."""

ANY_REQUEST: frozenset[E] = DECODING | {E.BAD_STATE, E.INTERNAL}
"""Codes of an ``error`` reply to any request: it did not decode, it is not allowed now
(no session, a request id already in flight, a message of the other kind of session),
or handling it failed inside the node."""


@dataclass(frozen=True)
class RequestCodes:
    """The codes a node sends for one request, besides ``ANY_REQUEST``."""

    refusals: frozenset[E]
    """Codes of an ``error`` reply that refuses the request whole."""
    results: frozenset[E] = frozenset()
    """Codes of its per-key results (``FAILED`` and ``ABORTED``; success carries 0)."""


def _codes(*codes: E) -> frozenset[E]:
    return frozenset(codes)


_STOPPING = _codes(E.SHUTTING_DOWN)
"""Refused while the node stops: every request but release, stats, heartbeat and bye."""

_WRITE_RESULTS = _codes(
    E.DUPLICATE_KEY, E.NOT_FOUND, E.LAYOUT_SUBSET_INVALID, E.SIZE_MISMATCH, E.BAD_DESCRIPTOR, E.TIMEOUT,
    E.TRANSFER_FAILED, E.ABORTED, E.SHUTTING_DOWN, E.INTERNAL, E.DIGEST_MISMATCH,
)
"""A source's per-key results of a ``write`` (section 5.3)."""

_WRITE_REFUSALS = _codes(E.BUSY, E.SHUTTING_DOWN)

SOURCE_CODES: frozenset[E] = _WRITE_RESULTS | _WRITE_REFUSALS | {E.BAD_STATE, E.INTERNAL}
"""What a target passes on from a source to its client's keys: the source's per-key
results and the codes it refuses a whole ``write`` with. A target turns any other code
from a source into ``TRANSFER_FAILED``."""

_PEER_KEY = _codes(
    E.PEER_UNSUPPORTED, E.PEER_UNREACHABLE, E.PEER_RESTARTED, E.DESTINATION_UNCERTAIN, E.BAD_ENDPOINT, E.PEER_LIMIT,
    E.TRANSFER_FAILED,
)
"""A target's own per-key codes for a key it must get from a peer (section 12)."""

_PUT_RESULTS = _codes(
    E.CAPACITY, E.LAYOUT_MISMATCH, E.SIZE_MISMATCH, E.BAD_DESCRIPTOR, E.UNKNOWN_POOL, E.DUPLICATE_KEY, E.BUSY,
    E.DESTINATION_UNCERTAIN, E.INTERNAL,
)
"""A put's per-key codes: a deposit's checks, ``BUSY`` for a key another writer holds, and
``DESTINATION_UNCERTAIN`` for a source a late write may still change (section 12)."""

REQUEST_CODES: Mapping[str, RequestCodes] = {
    # Client requests (section 5.2).
    "hello": RequestCodes(_codes(E.TOO_MANY_CLIENTS, E.BAD_DESCRIPTOR, E.SHUTTING_DOWN)),
    "regions": RequestCodes(_codes(E.BAD_DESCRIPTOR) | _STOPPING),
    "unregions": RequestCodes(_codes(E.ABORTED) | _STOPPING),
    "deposit": RequestCodes(
        _codes(E.BUSY) | _STOPPING,
        _codes(
            E.CAPACITY, E.LAYOUT_MISMATCH, E.SIZE_MISMATCH, E.BAD_DESCRIPTOR, E.UNKNOWN_POOL, E.DUPLICATE_KEY,
            E.TRANSFER_FAILED, E.TIMEOUT, E.ABORTED, E.SHUTTING_DOWN, E.DESTINATION_UNCERTAIN, E.INTERNAL,
        ),
    ),
    "query": RequestCodes(_STOPPING),
    "deliver": RequestCodes(
        _codes(E.BUSY) | _STOPPING,
        _codes(
            E.NOT_FOUND, E.LAYOUT_SUBSET_INVALID, E.SIZE_MISMATCH, E.BAD_DESCRIPTOR, E.DUPLICATE_KEY,
            E.TRANSFER_FAILED, E.TIMEOUT, E.ABORTED, E.SHUTTING_DOWN,
        ) | _PEER_KEY | SOURCE_CODES,
    ),
    "fetch": RequestCodes(
        _codes(E.BUSY) | _STOPPING,
        _codes(
            E.NOT_FOUND, E.LAYOUT_MISMATCH, E.UNKNOWN_POOL, E.CAPACITY, E.DUPLICATE_KEY, E.TIMEOUT, E.ABORTED,
            E.SHUTTING_DOWN,
        ) | _PEER_KEY | SOURCE_CODES,
    ),
    "release": RequestCodes(_codes(), _codes(E.UNKNOWN_HANDLE)),
    "abort": RequestCodes(_codes(E.UNKNOWN_OP) | _STOPPING),
    "hint": RequestCodes(_codes(E.BAD_ENDPOINT, E.HINT_LIMIT) | _STOPPING),
    "unhint": RequestCodes(_STOPPING),
    "lease": RequestCodes(_codes(E.LEASE_LIMIT, E.BUSY) | _STOPPING),
    "renew": RequestCodes(_codes(E.UNKNOWN_LEASE) | _STOPPING),
    "unlease": RequestCodes(_codes(E.UNKNOWN_LEASE)),
    # Version 5: write grants (section 6.13); a commit's results repeat its put's.
    "put": RequestCodes(_codes(E.BUSY) | _STOPPING, _PUT_RESULTS),
    "commit": RequestCodes(_codes(E.UNKNOWN_PUT, E.TIMEOUT), _PUT_RESULTS),
    "unput": RequestCodes(_codes(E.UNKNOWN_PUT, E.TIMEOUT)),
    # Version 5: a reader's integrity report (section 6.12).
    "suspect": RequestCodes(_STOPPING, _codes(
        E.NOT_FOUND, E.DIGEST_MISMATCH, E.BUSY, E.PEER_UNREACHABLE, E.PEER_RESTARTED, E.PEER_UNSUPPORTED)),
    "stats": RequestCodes(_codes()),
    "heartbeat": RequestCodes(_codes()),
    "bye": RequestCodes(_codes()),
    # Peer requests (section 5.3).
    "peer_hello": RequestCodes(_codes(E.BAD_DESCRIPTOR, E.SHUTTING_DOWN)),
    "peer_client": RequestCodes(_codes(E.BAD_DESCRIPTOR) | _STOPPING),
    "write": RequestCodes(_WRITE_REFUSALS, _WRITE_RESULTS),
    "probe": RequestCodes(_STOPPING),
    "peer_forget": RequestCodes(_codes()),
}
"""Per request tag: the codes of its refusal and of its per-key results."""

EVENT_CODES: Mapping[str, frozenset[E]] = {
    "lease_end": _codes(E.LEASE_EXPIRED, E.LEASE_LIMIT, E.PEER_RESTARTED, E.PEER_UNREACHABLE, E.SHUTTING_DOWN),
}
"""Per event tag: the codes the event carries. Events refuse nothing and answer no request;
``lease_end`` (version 4) is the one event with a code (section 10.1)."""


def allowed_refusal(tag: str | None, code: int) -> bool:
    """Whether a node may refuse request ``tag`` (None: not yet decoded) with ``code``."""
    if code in ANY_REQUEST:
        return True
    codes = REQUEST_CODES.get(tag) if tag is not None else None
    return codes is not None and code in codes.refusals


def allowed_result(tag: str, code: int) -> bool:
    """Whether a per-key result of request ``tag`` may carry ``code`` (0: success)."""
    codes = REQUEST_CODES.get(tag)
    return code == 0 or (codes is not None and code in codes.results)
