"""Checks of what a caller hands the client, before anything is sent.

Each check returns the value in the form the request carries, or raises ``ArgumentError``
naming the field (``path``) and what is wrong with it; the limits are the protocol's (spec
section 11). ``ack`` checks the one reply a control request expects.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from kvcr_client.errors import ArgumentError
from kvcr_protocol import DEFAULT_LIMITS, Ack, Message, Presence
from kvcr_protocol import prefix_mask as _mask_of

U32_MAX = (1 << 32) - 1
"""Largest ``deadline_ms`` the protocol carries (uint32, spec section 6.4)."""
U64_MAX = (1 << 64) - 1
"""Largest release handle the protocol carries (uint64, spec section 6.4)."""


def z85(key: str | bytes, path: str) -> bytes:
    """A CurveZMQ key as 40 bytes of z85 text (surrounding whitespace dropped)."""
    raw = key.encode() if isinstance(key, str) else key
    if not isinstance(raw, bytes) or len(raw.strip()) != 40:
        raise ArgumentError(path, "expected a 40-character z85 CurveZMQ key")
    return raw.strip()


def uint(value: Any, path: str, maximum: int, minimum: int = 0) -> int:
    """An integer (not a bool) in ``minimum..maximum``, as a plain int."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ArgumentError(path, f"expected an int in {minimum}..{maximum}, got {type(value).__name__}")
    number = operator.index(value)
    if not minimum <= number <= maximum:
        raise ArgumentError(path, f"{number} is outside {minimum}..{maximum}")
    return number


def deadline(value: Any) -> int:
    """Milliseconds the node may spend, counted from receipt; 0: the node's default (spec section 5.1)."""
    return uint(value, "deadline_ms", U32_MAX)


def flag(value: Any, path: str) -> bool:
    """A bool, and nothing merely truthy."""
    if type(value) is not bool:
        raise ArgumentError(path, f"expected a bool, got {type(value).__name__}")
    return value


def text(value: Any, path: str, limit: int, *, empty: bool = True) -> str:
    """A str of at most ``limit`` UTF-8 bytes (the protocol's limits, spec section 11)."""
    if not isinstance(value, str):
        raise ArgumentError(path, f"expected a str, got {type(value).__name__}")
    if not value and not empty:
        raise ArgumentError(path, "must not be empty")
    try:
        size = len(value.encode())
    except UnicodeEncodeError as exc:
        raise ArgumentError(path, f"not encodable as UTF-8: {exc.reason}") from None
    if size > limit:
        raise ArgumentError(path, f"{size} bytes in UTF-8, at most {limit}")
    return value


def request_id(value: Any) -> str:
    """A request id: a non-empty str of at most ``max_text`` bytes."""
    return text(value, "request_id", DEFAULT_LIMITS.max_text, empty=False)


def optional_request_id(value: Any) -> str | None:
    """A request id, or ``None`` for none."""
    return None if value is None else request_id(value)


def timeout(value: Any, path: str = "timeout") -> float:
    """A wait in seconds: a positive finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ArgumentError(path, f"expected a positive number of seconds, got {value!r}")
    return float(value)


def optional_timeout(value: Any, path: str = "timeout") -> float | None:
    """A bound on a wait: ``None`` (none), or a finite number of seconds, 0 or more."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
        raise ArgumentError(path, f"expected None or a finite number of seconds >= 0, got {value!r}")
    return float(value)


def key(value: Any, path: str) -> bytes:
    """One key: bytes, 1..``max_key`` of them."""
    if not isinstance(value, bytes):
        raise ArgumentError(path, f"keys are bytes, got {type(value).__name__}")
    if not 1 <= len(value) <= DEFAULT_LIMITS.max_key:
        raise ArgumentError(path, f"a key has 1..{DEFAULT_LIMITS.max_key} bytes, got {len(value)}")
    return value


def parents(value: Any, keys: Sequence[bytes]) -> tuple[bytes, ...]:
    """A call's ``parents`` (a mapping of key -> its parent key, or None) as the wire column:
    one parent per key of ``keys`` in order, b"" for none; () when none is named. A key it
    names must be one of ``keys``, and not its own parent."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ArgumentError("parents", f"expected a mapping of key -> parent key, got {type(value).__name__}")
    if not value:
        return ()
    known = set(keys)
    for child, parent in value.items():
        path = f"parents[{child!r}]"
        if child not in known:
            raise ArgumentError(path, "names a key the call does not store")
        key(parent, path)
        if parent == child:
            raise ArgumentError(path, "a key is not its own parent")
    return tuple(value.get(k, b"") for k in keys)


def keys(items: Iterable[bytes], what: str) -> tuple[bytes, ...]:
    """A batch of keys (``batch``), each checked as ``key`` checks it: in a few C-level
    passes when all are good, key by key (naming the bad one) otherwise."""
    seq = batch(items, what)
    if set(map(type, seq)) == {bytes}:
        sizes = set(map(len, seq))
        if min(sizes) >= 1 and max(sizes) <= DEFAULT_LIMITS.max_key:
            return tuple(seq)
    return tuple(key(k, f"{what}[{i}]") for i, k in enumerate(seq))


def prefix_mask(presences: Any) -> int:
    """The prefix mask (spec section 6.9) of the presences a prefix query counts."""
    if isinstance(presences, (str, bytes, Presence)) or not isinstance(presences, Iterable):
        raise ArgumentError("presences", f"expected an iterable of Presence, got {type(presences).__name__}")
    counted = list(presences)
    for i, presence in enumerate(counted):
        if not isinstance(presence, Presence):
            raise ArgumentError(f"presences[{i}]", f"expected a Presence, got {type(presence).__name__}")
        if presence is Presence.MISS:
            raise ArgumentError(f"presences[{i}]", "a prefix counts HIT, FETCHING or FETCHABLE keys, never MISS")
    if not counted:
        raise ArgumentError("presences", "count at least one of HIT, FETCHING and FETCHABLE")
    return _mask_of(*counted)


def span_total(items: Sequence[Any], attr: str, what: str) -> None:
    """One message carries at most ``max_spans`` spans over all its keys: refuse more before sending."""
    total = sum(len(getattr(item, attr)) for item in items)
    if total > DEFAULT_LIMITS.max_spans:
        raise ArgumentError(what, f"{total} spans in one call, at most {DEFAULT_LIMITS.max_spans}")


def batch(items: Mapping[bytes, Any] | Iterable[bytes], what: str, mapping: bool = False) -> list[Any]:
    """The items of a call's batch: a mapping of key -> value where ``mapping``, else an iterable of keys."""
    if mapping:
        if not isinstance(items, Mapping):
            raise ArgumentError(what, f"expected a mapping of bytes keys, got {type(items).__name__}")
        seq = list(items.items())
    else:
        if isinstance(items, (str, bytes, bytearray, memoryview)) or not isinstance(items, Iterable):
            raise ArgumentError(what, f"expected an iterable of bytes keys, got {type(items).__name__}")
        seq = list(cast(Iterable[Any], items))
    if not seq:
        raise ArgumentError(what, "the batch is empty")
    if len(seq) > DEFAULT_LIMITS.max_keys:
        raise ArgumentError(what, f"{len(seq)} keys, at most {DEFAULT_LIMITS.max_keys} per call")
    return seq


def handles(values: Any) -> list[int]:
    """A batch of release handles: each an int in 1..2**64-1."""
    if isinstance(values, (str, bytes, bytearray, memoryview)) or not isinstance(values, Iterable):
        raise ArgumentError("handles", f"expected an iterable of int handles, got {type(values).__name__}")
    hs = [uint(h, f"handles[{i}]", U64_MAX, minimum=1) for i, h in enumerate(values)]
    if not hs:
        raise ArgumentError("handles", "the batch is empty")
    if len(hs) > DEFAULT_LIMITS.max_keys:
        raise ArgumentError("handles", f"{len(hs)} handles, at most {DEFAULT_LIMITS.max_keys} per call")
    return hs


def ack(msg: Message) -> None:
    """The reply of a request answered by a bare ``ack`` (anything else is the node's fault)."""
    if not isinstance(msg, Ack):
        raise ValueError(f"expected ack, got {msg.TAG}")
