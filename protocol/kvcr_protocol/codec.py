"""Message <-> msgpack frame. Pure: no sockets, no clock, no threads.

A frame is one msgpack map: ``v`` (version), ``t`` (type tag), then the message's fields
in declared order. Encoding is canonical: the same message at the same version always
gives the same bytes (the conformance vectors in ``spec/vectors`` pin them).
"""

from __future__ import annotations

from typing import Any

import msgpack

from kvcr_protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from kvcr_protocol.limits import DEFAULT_LIMITS, Limits
from kvcr_protocol.messages import BASE_ENCODED, MESSAGE_BY_TAG, Message
from kvcr_protocol.versions import BASE_VERSION, CURRENT_VERSION, PROTOCOL_VERSIONS
from kvcr_protocol.wire import Opt, RecordType, Seq, WireType

_VERSION_KEY = "v"
_TAG_KEY = "t"


def encode(message: Message, version: int = CURRENT_VERSION) -> bytes:
    """Encode ``message`` at ``version``.

    Raises ``LocalProtocolError`` when the message cannot be expressed at that version
    (a must-understand field set at a version that lacks it) or is otherwise invalid.
    """
    cls = type(message)
    if getattr(cls, "TAG", None) not in MESSAGE_BY_TAG:
        raise LocalProtocolError(ErrorCode.UNKNOWN_TYPE, f"{cls.__name__} is not a protocol message", "t")
    if version not in PROTOCOL_VERSIONS:
        raise LocalProtocolError(ErrorCode.UNSUPPORTED_VERSION, f"cannot encode at version {version}", "v")
    if cls in BASE_ENCODED:
        version = BASE_VERSION
    if cls.SINCE > version:
        raise LocalProtocolError(ErrorCode.UNSUPPORTED_VERSION, f"{cls.TAG} needs version {cls.SINCE}, encoding at {version}", "t")
    _check_local(message)
    out: dict[str, Any] = {_VERSION_KEY: version, _TAG_KEY: cls.TAG}
    for f in cls.FIELDS:
        value = getattr(message, f.name)
        if f.since > version:
            if value != f.default:
                raise LocalProtocolError(
                    ErrorCode.UNSUPPORTED_VERSION,
                    f"{cls.TAG}.{f.name} needs version {f.since}, encoding at {version}",
                    f.name,
                )
            continue
        if (f.must_understand or f.sparse) and value == f.default:
            # A must-understand field travels only when set, so that a receiver that
            # lacks it still accepts every message that does not use it (a sparse one, so
            # that a message that does not use it is the frame it was before the field).
            continue
        try:
            out[f.key] = f.type.dump(value)
        except (AttributeError, TypeError, ValueError) as exc:
            raise LocalProtocolError(ErrorCode.WRONG_TYPE, f"cannot encode: {exc}", f.name) from exc
    try:
        frame: bytes = msgpack.packb(out, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as exc:
        # A value msgpack cannot carry (an int beyond 64 bits, an arbitrary object).
        raise LocalProtocolError(ErrorCode.WRONG_TYPE, f"cannot encode: {exc}", "") from exc
    return frame


_CHECKED_FIELDS: dict[type[Message], tuple[str, ...]] = {}


def _checked_fields(cls: type[Message]) -> tuple[str, ...]:
    """The fields of ``cls`` that hold records whose fields must agree (computed once)."""
    names = _CHECKED_FIELDS.get(cls)
    if names is None:
        names = tuple(f.name for f in cls.FIELDS if _holds_checked(f.type))
        _CHECKED_FIELDS[cls] = names
    return names


def _holds_checked(wt: WireType[Any]) -> bool:
    if isinstance(wt, (Seq, Opt)):
        return _holds_checked(wt.item if isinstance(wt, Seq) else wt.inner)
    return isinstance(wt, RecordType) and wt.cls.CHECKED


def _check_local(message: Message) -> None:
    """The checks a receiver makes across fields, made before sending: a message this side
    built wrongly is a ``LocalProtocolError``, not a refusal from the peer."""
    try:
        for name in _checked_fields(type(message)):
            value = getattr(message, name)
            for record in value if type(value) is tuple else (value,):
                if record is not None:
                    record.check(DEFAULT_LIMITS)
        message.check(DEFAULT_LIMITS)
    except RemoteProtocolError as exc:
        raise LocalProtocolError(exc.code, exc.reason, exc.path) from None


def _no_ext(code: int, data: bytes) -> Any:
    # Extension types are never valid; max_ext_len=0 alone still lets a 0-byte ext through.
    raise ValueError(f"extension type {code}")


def _unique_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    # A map with a repeated key is ambiguous (first or last wins?): refuse it.
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a map repeats a key")
    return out


def unpack_frame(frame: bytes, limits: Limits) -> Any:
    """One msgpack object of at most ``max_frame`` bytes, parsed strictly (section 4.3, steps 1 and 2)."""
    if len(frame) > limits.max_frame:
        raise RemoteProtocolError(ErrorCode.TOO_LARGE, f"frame of {len(frame)} bytes, limit {limits.max_frame}")
    try:
        return msgpack.unpackb(
            frame,
            raw=False,
            use_list=True,
            strict_map_key=False,
            max_str_len=limits.max_frame,
            max_bin_len=limits.max_frame,
            max_array_len=limits.max_spans + 16,
            max_map_len=4096,
            max_ext_len=0,
            ext_hook=_no_ext,
            object_pairs_hook=_unique_map,
        )
    except (ValueError, msgpack.UnpackException, msgpack.ExtraData, TypeError, RecursionError) as exc:
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"not a single msgpack object: {type(exc).__name__}") from exc


def peek_id(frame: bytes) -> int:
    """Best-effort request id of a frame that failed to decode (0 when unreadable).

    Lets a receiver address an error reply to the request it refuses.
    """
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception:
        return 0
    if isinstance(obj, dict):
        rid = obj.get("id")
        if type(rid) is int and 0 <= rid < (1 << 64):
            return rid
    return 0


def decode(frame: bytes, max_version: int = CURRENT_VERSION, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode and validate one frame from a peer that may speak up to ``max_version``.

    Every failure is a ``RemoteProtocolError`` with an error code and the field's path.
    """
    if type(frame) is not bytes:
        frame = bytes(frame)
    obj = unpack_frame(frame, limits)
    if type(obj) is not dict:
        raise RemoteProtocolError(ErrorCode.NOT_A_MAP, "the frame is not a map")
    version = obj.get(_VERSION_KEY)
    if type(version) is not int:
        raise RemoteProtocolError(
            ErrorCode.MISSING_FIELD if version is None else ErrorCode.WRONG_TYPE,
            "the version must be an unsigned integer", _VERSION_KEY,
        )
    tag = obj.get(_TAG_KEY)
    if type(tag) is not str:
        raise RemoteProtocolError(
            ErrorCode.MISSING_FIELD if tag is None else ErrorCode.WRONG_TYPE,
            "the type tag must be a str", _TAG_KEY,
        )
    cls = MESSAGE_BY_TAG.get(tag)
    if cls is None or cls.SINCE > max_version:
        raise RemoteProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown type {tag[:64]!r}", _TAG_KEY)
    if version < BASE_VERSION or version > max_version or version not in PROTOCOL_VERSIONS:
        if cls not in BASE_ENCODED:
            raise RemoteProtocolError(
                ErrorCode.UNSUPPORTED_VERSION, f"version {version} (this side speaks up to {max_version})", _VERSION_KEY
            )
        version = BASE_VERSION
    if cls.SINCE > version:
        raise RemoteProtocolError(ErrorCode.UNKNOWN_TYPE, f"{tag} does not exist at version {version}", _TAG_KEY)
    return _load_fields(cls, obj, version, limits)


_Plan = tuple[tuple[tuple[str, str, Any, Any, bool], ...], frozenset[str]]
_PLANS: dict[tuple[type[Message], int], _Plan] = {}


def _plan(cls: type[Message], version: int) -> _Plan:
    """The fields of ``cls`` known at ``version`` as plain tuples, and every known key.

    Computed once per (class, version), so a decode does no per-field attribute lookups.
    """
    plan = _PLANS.get((cls, version))
    if plan is not None:
        return plan
    fields = tuple(
        (f.name, f.key, f.type.load, f.default, f.required) for f in cls.FIELDS if f.since <= version
    )
    known = frozenset({_VERSION_KEY, _TAG_KEY, *(key for _, key, _, _, _ in fields)})
    _PLANS[cls, version] = (fields, known)
    return fields, known


def _load_fields(cls: type[Message], obj: dict[Any, Any], version: int, limits: Limits) -> Message:
    fields, known = _plan(cls, version)
    args: dict[str, Any] = {}
    for name, key, load, default, required in fields:
        if key in obj:
            args[name] = load(obj[key], name, limits)
        elif required:
            raise RemoteProtocolError(ErrorCode.MISSING_FIELD, f"{cls.TAG} needs {name}", name)
        else:
            args[name] = default
    if len(obj) > len(known) or not known.issuperset(obj):
        for key in obj:
            if key in known:
                continue
            if type(key) is not str:
                raise RemoteProtocolError(ErrorCode.WRONG_TYPE, "map keys must be str", "")
            if key.startswith("!"):
                # Must-understand rule: a field whose key begins with "!" that this side
                # does not know at this version makes the whole message unacceptable.
                raise RemoteProtocolError(
                    ErrorCode.MUST_UNDERSTAND, f"{cls.TAG} at version {version} does not know {key!r}", key[:64]
                )
            # Unknown optional fields are ignored (tolerance of newer senders).
    message = cls(**args)
    message.check(limits)
    return message
