"""The inventory event stream (spec section 15): what a node tells routers about the objects it holds.

Pure: no sockets, no clock. A node publishes, on a ZeroMQ PUB socket, multipart messages
``[topic, seq, payload]`` (the framing of vLLM's KV events, so a router that follows
those can follow kvcr nodes): ``seq`` is 8 bytes, big-endian, counting batches from 0 in
each incarnation; ``payload`` is one msgpack map, an ``EventBatch`` of ``Stored``,
``Removed`` and ``Cleared`` events. A ROUTER replay socket answers a request
``[b"", start]`` with every batch it still holds from ``start`` on, ``[b"", seq,
payload]`` each, then ``[b"", END_SEQ_FRAME, ReplayEnd]``.

Every decoding failure is a ``RemoteProtocolError`` naming the field (``events[2].keys[0]``),
as for control frames (spec section 4.3).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from kvcr_protocol.codec import unpack_frame
from kvcr_protocol.errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError
from kvcr_protocol.limits import DEFAULT_LIMITS, Limits
from kvcr_protocol.wire import U64_MAX, Bytes, EnumStr, Seq, Str, UInt

EVENTS_VERSION = 1
"""The ``v`` of every batch and replay end this side writes and reads."""
EVENTS_TOPIC = b"kvcr.inventory"
"""The first frame of every published batch (a subscriber may filter on it)."""
SEQ_SIZE = 8
"""Bytes of a sequence number frame: big-endian, signed (only the end marker is negative)."""
MAX_SEQ = (1 << 63) - 1
"""The largest sequence number (and replay start) a frame can carry."""
END_SEQ = -1
"""The sequence number of the replay answer's last message."""
END_SEQ_FRAME = END_SEQ.to_bytes(SEQ_SIZE, "big", signed=True)
MAX_BATCH_KEYS = DEFAULT_LIMITS.max_keys
"""Keys summed over the events of one batch; a publisher splits a longer turn into several batches."""
REPLAY_SUFFIX = ".replay"
"""An ipc events endpoint's replay socket is the same path with this suffix (``replay_endpoint``)."""


class EventKind(enum.Enum):
    """The ``t`` of an event."""

    STORED = "stored"
    """The keys became READY: a router may send requests for them to this node."""
    REMOVED = "removed"
    """The keys are no longer held (evicted, or removed)."""
    CLEARED = "cleared"
    """Nothing is held: the node started (first batch of an incarnation) or is stopping."""


class RemovedReason(enum.Enum):
    """Why keys were removed (``why``)."""

    EVICTED = "evicted"
    """Evicted to make room for a deposit (the policy chose them)."""
    REMOVED = "removed"
    """Dropped by the node for another reason."""


@dataclass(frozen=True, slots=True)
class Stored:
    """Objects that became READY, all with the same pools and tier."""

    keys: tuple[bytes, ...]
    pools: tuple[str, ...]
    """The distinct pools of the objects' layout, in layout order."""
    tier: str
    """The memory of the first span's pool: ``dram`` or ``hbm:N``."""
    parents: tuple[bytes, ...] = ()
    """Empty, or each key's parent key, in order, as its deposit named it (b"": none named)."""
    KIND: ClassVar[EventKind] = EventKind.STORED

    def parent_of(self, i: int) -> bytes:
        """The parent key of ``keys[i]``; b"" when none was named."""
        return self.parents[i] if self.parents else b""


@dataclass(frozen=True, slots=True)
class Removed:
    """Objects the node no longer holds, all with the same pools and tier."""

    keys: tuple[bytes, ...]
    pools: tuple[str, ...]
    tier: str
    reason: RemovedReason = RemovedReason.EVICTED
    KIND: ClassVar[EventKind] = EventKind.REMOVED


@dataclass(frozen=True, slots=True)
class Cleared:
    """Every object of this node is gone (start or stop of an incarnation)."""

    KIND: ClassVar[EventKind] = EventKind.CLEARED


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published payload: the events of one loop turn (or part of one), in order."""

    node: str
    """The node's name."""
    incarnation: int
    """The node's incarnation: a new one means a restart (its first event is ``Cleared``)."""
    ts: float
    """Wall-clock time of publication, seconds since the epoch."""
    events: tuple[Event, ...]

    @property
    def key_count(self) -> int:
        return sum(len(e.keys) for e in self.events if not isinstance(e, Cleared))


@dataclass(frozen=True, slots=True)
class ReplayEnd:
    """The last message of a replay answer: whether the request was served, and the ring's bounds."""

    oldest: int
    """The seq of the oldest batch the node still holds (``next`` when it holds none)."""
    next: int
    """The seq the node's next batch will carry (the last published is ``next - 1``)."""
    incarnation: int
    """The node's incarnation: another than the subscriber's means the node restarted."""
    code: int = 0
    """0 when the request was served, else the ``ErrorCode`` that refused it."""
    reason: str = ""
    path: str = ""

    @property
    def ok(self) -> bool:
        return self.code == 0


_KEYS = Seq(Bytes("max_key", 1), "max_keys", 1)
_PARENTS = Seq(Bytes("max_key"), "max_keys", 1)
_POOLS = Seq(Str("max_name"), "max_tiers", 1)
_NAME = Str("max_name")
_TEXT = Str("max_text")
_INCARNATION = UInt()
_SEQ = UInt(MAX_SEQ)
_CODE = UInt(0xFFFF)
_REASON = EnumStr(RemovedReason)
_KIND = {kind.value: kind for kind in EventKind}


# --------------------------------------------------------------------------- sequence numbers


def encode_seq(seq: int) -> bytes:
    """The 8-byte frame of ``seq`` (0..MAX_SEQ, or END_SEQ)."""
    if type(seq) is not int or not (0 <= seq <= MAX_SEQ or seq == END_SEQ):
        raise LocalProtocolError(ErrorCode.OUT_OF_RANGE, f"{seq!r} is outside 0..{MAX_SEQ}", "seq")
    return seq.to_bytes(SEQ_SIZE, "big", signed=True)


def decode_seq(frame: bytes, path: str = "seq", end: bool = False) -> int:
    """A sequence number frame: 0..MAX_SEQ, or END_SEQ when ``end`` allows it."""
    if len(frame) != SEQ_SIZE:
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"{len(frame)} bytes, a sequence number has {SEQ_SIZE}", path)
    seq = int.from_bytes(frame, "big", signed=True)
    if seq < 0 and not (end and seq == END_SEQ):
        raise RemoteProtocolError(ErrorCode.OUT_OF_RANGE, f"{seq} is outside 0..{MAX_SEQ}", path)
    return seq


# --------------------------------------------------------------------------- batches


def _event_map(event: Event) -> dict[str, Any]:
    if isinstance(event, Cleared):
        return {"t": EventKind.CLEARED.value}
    out: dict[str, Any] = {"t": event.KIND.value, "keys": list(event.keys), "pools": list(event.pools), "tier": event.tier}
    if isinstance(event, Removed):
        out["why"] = event.reason.value
    elif any(event.parents):  # an event that names no parent is the frame it was before parents existed
        if len(event.parents) != len(event.keys):
            raise LocalProtocolError(
                ErrorCode.OUT_OF_RANGE, f"{len(event.parents)} parents for {len(event.keys)} keys", "parents")
        out["parents"] = list(event.parents)
    return out


def encode_batch(batch: EventBatch) -> bytes:
    """The canonical payload of ``batch``; ``LocalProtocolError`` naming a field that cannot travel."""
    if type(batch.incarnation) is not int or not 1 <= batch.incarnation <= U64_MAX:
        raise LocalProtocolError(ErrorCode.OUT_OF_RANGE, f"{batch.incarnation!r} is outside 1..{U64_MAX}", "inc")
    if batch.key_count > MAX_BATCH_KEYS:
        raise LocalProtocolError(ErrorCode.TOO_MANY, f"{batch.key_count} keys, limit {MAX_BATCH_KEYS}", "events")
    out = {"v": EVENTS_VERSION, "node": batch.node, "inc": batch.incarnation, "ts": float(batch.ts),
           "events": [_event_map(e) for e in batch.events]}
    try:
        payload: bytes = msgpack.packb(out, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as exc:
        raise LocalProtocolError(ErrorCode.WRONG_TYPE, f"cannot encode: {exc}", "") from exc
    return payload


def _map(payload: bytes, limits: Limits) -> dict[Any, Any]:
    obj = unpack_frame(payload if type(payload) is bytes else bytes(payload), limits)
    if type(obj) is not dict:
        raise RemoteProtocolError(ErrorCode.NOT_A_MAP, "the payload is not a map")
    version = obj.get("v")
    if version is None:
        raise RemoteProtocolError(ErrorCode.MISSING_FIELD, "the version is missing", "v")
    if type(version) is not int:
        raise RemoteProtocolError(ErrorCode.WRONG_TYPE, "the version must be an unsigned integer", "v")
    if version != EVENTS_VERSION:
        raise RemoteProtocolError(ErrorCode.UNSUPPORTED_VERSION, f"version {version} (this side reads {EVENTS_VERSION})", "v")
    return obj


def _field(obj: dict[Any, Any], key: str, path: str) -> Any:
    value = obj.get(key)
    if value is None:
        raise RemoteProtocolError(ErrorCode.MISSING_FIELD, f"{key} is required", path + key)
    return value


def _rest(obj: dict[Any, Any], known: frozenset[str], path: str) -> None:
    """Keys past the known ones: a non-str key is WRONG_TYPE, a ``!`` key MUST_UNDERSTAND, others are ignored."""
    if len(obj) <= len(known) and known.issuperset(obj):
        return
    for key in obj:
        if key in known:
            continue
        if type(key) is not str:
            raise RemoteProtocolError(ErrorCode.WRONG_TYPE, "map keys must be str", path.rstrip("."))
        if key.startswith("!"):
            raise RemoteProtocolError(ErrorCode.MUST_UNDERSTAND, f"{key[:64]!r} is not known", path + key[:64])


_BATCH_KEYS = frozenset({"v", "node", "inc", "ts", "events"})
_EVENT_KEYS = {
    EventKind.STORED: frozenset({"t", "keys", "pools", "tier", "parents"}),
    EventKind.REMOVED: frozenset({"t", "keys", "pools", "tier", "why"}),
    EventKind.CLEARED: frozenset({"t"}),
}


def _nonempty(value: str, path: str) -> str:
    if not value:
        raise RemoteProtocolError(ErrorCode.OUT_OF_RANGE, "must not be empty", path)
    return value


def _load_event(obj: Any, path: str, limits: Limits) -> Event:
    if type(obj) is not dict:
        raise RemoteProtocolError(ErrorCode.WRONG_TYPE, "an event is a map", path)
    tag = _field(obj, "t", path + ".")
    if type(tag) is not str:
        raise RemoteProtocolError(ErrorCode.WRONG_TYPE, "the event type must be a str", path + ".t")
    kind = _KIND.get(tag)
    if kind is None:
        raise RemoteProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown event type {tag[:64]!r}", path + ".t")
    if kind is EventKind.CLEARED:
        _rest(obj, _EVENT_KEYS[kind], path + ".")
        return Cleared()
    keys = _KEYS.load(_field(obj, "keys", path + "."), path + ".keys", limits)
    pools = _POOLS.load(_field(obj, "pools", path + "."), path + ".pools", limits)
    for i, pool in enumerate(pools):
        _nonempty(pool, f"{path}.pools[{i}]")
    tier = _nonempty(_NAME.load(_field(obj, "tier", path + "."), path + ".tier", limits), path + ".tier")
    _rest(obj, _EVENT_KEYS[kind], path + ".")
    if kind is EventKind.STORED:
        raw = obj.get("parents")
        if raw is None:
            return Stored(keys, pools, tier)
        parents = _PARENTS.load(raw, path + ".parents", limits)
        if len(parents) != len(keys):
            raise RemoteProtocolError(
                ErrorCode.OUT_OF_RANGE, f"{len(parents)} parents for {len(keys)} keys", path + ".parents")
        return Stored(keys, pools, tier, parents)
    why = obj.get("why")
    reason = RemovedReason.EVICTED if why is None else _REASON.load(why, path + ".why", limits)
    return Removed(keys, pools, tier, reason)


def decode_batch(payload: bytes, limits: Limits = DEFAULT_LIMITS) -> EventBatch:
    """The batch in ``payload``; ``RemoteProtocolError`` naming the first bad field."""
    obj = _map(payload, limits)
    node = _nonempty(_NAME.load(_field(obj, "node", ""), "node", limits), "node")
    incarnation = _INCARNATION.load(_field(obj, "inc", ""), "inc", limits)
    if incarnation == 0:
        raise RemoteProtocolError(ErrorCode.OUT_OF_RANGE, "incarnation 0 is never used", "inc")
    ts = _field(obj, "ts", "")
    if type(ts) is not float:
        raise RemoteProtocolError(ErrorCode.WRONG_TYPE, f"expected a float, got {type(ts).__name__}", "ts")
    if not math.isfinite(ts) or ts < 0:
        raise RemoteProtocolError(ErrorCode.OUT_OF_RANGE, f"{ts!r} is not a time", "ts")
    raw = _field(obj, "events", "")
    if type(raw) is not list:
        raise RemoteProtocolError(ErrorCode.WRONG_TYPE, "expected array", "events")
    if len(raw) > MAX_BATCH_KEYS:
        raise RemoteProtocolError(ErrorCode.TOO_MANY, f"{len(raw)} events, limit {MAX_BATCH_KEYS}", "events")
    events = tuple(_load_event(e, f"events[{i}]", limits) for i, e in enumerate(raw))
    _rest(obj, _BATCH_KEYS, "")
    batch = EventBatch(node, incarnation, ts, events)
    if batch.key_count > MAX_BATCH_KEYS:
        raise RemoteProtocolError(ErrorCode.TOO_MANY, f"{batch.key_count} keys, limit {MAX_BATCH_KEYS}", "events")
    return batch


# --------------------------------------------------------------------------- replay


def encode_replay_request(start: int) -> list[bytes]:
    """What a subscriber's DEALER sends to ask for every held batch from ``start`` on."""
    if type(start) is not int or not 0 <= start <= MAX_SEQ:
        raise LocalProtocolError(ErrorCode.OUT_OF_RANGE, f"{start!r} is outside 0..{MAX_SEQ}", "replay.start")
    return [b"", encode_seq(start)]


def decode_replay_request(frames: list[bytes]) -> int:
    """The start seq of a replay request (the frames after the sender's identity)."""
    if len(frames) != 2 or frames[0] != b"":
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"{len(frames)} frames, a request is [b'', start]", "replay")
    return decode_seq(frames[1], "replay.start")


def encode_replay_end(end: ReplayEnd) -> bytes:
    out = {"v": EVENTS_VERSION, "oldest": end.oldest, "next": end.next, "inc": end.incarnation, "code": end.code,
           "reason": end.reason, "path": end.path}
    payload: bytes = msgpack.packb(out, use_bin_type=True)
    return payload


def replay_refusal(
    exc: ProtocolError, oldest: int, next_seq: int, incarnation: int, limits: Limits = DEFAULT_LIMITS,
) -> ReplayEnd:
    """The end message refusing a replay request for ``exc``."""
    return ReplayEnd(oldest, next_seq, incarnation, int(exc.code), exc.reason[: limits.max_text],
                     exc.path[: limits.max_text])


def decode_replay_end(payload: bytes, limits: Limits = DEFAULT_LIMITS) -> ReplayEnd:
    obj = _map(payload, limits)
    oldest = _SEQ.load(_field(obj, "oldest", ""), "oldest", limits)
    next_seq = _SEQ.load(_field(obj, "next", ""), "next", limits)
    if oldest > next_seq:
        raise RemoteProtocolError(ErrorCode.OUT_OF_RANGE, f"oldest {oldest} is past next {next_seq}", "oldest")
    incarnation = _INCARNATION.load(_field(obj, "inc", ""), "inc", limits)
    if incarnation == 0:
        raise RemoteProtocolError(ErrorCode.OUT_OF_RANGE, "incarnation 0 is never used", "inc")
    code = _CODE.load(obj.get("code", 0), "code", limits)
    reason = _TEXT.load(obj.get("reason", ""), "reason", limits)
    path = _TEXT.load(obj.get("path", ""), "path", limits)
    _rest(obj, frozenset({"v", "oldest", "next", "inc", "code", "reason", "path"}), "")
    return ReplayEnd(oldest, next_seq, incarnation, code, reason, path)


def replay_endpoint(endpoint: str) -> str:
    """The replay endpoint that goes with an events endpoint when none is given:
    ``ipc://PATH`` -> ``ipc://PATH.replay``, ``tcp://HOST:PORT`` -> ``tcp://HOST:PORT+1``."""
    if endpoint.startswith("ipc://"):
        return endpoint + REPLAY_SUFFIX
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint.rpartition(":")
        if sep and port.isdigit() and 0 < int(port) < 65535:
            return f"{host}:{int(port) + 1}"
    raise ValueError(f"no replay endpoint follows from {endpoint!r}; give one (an ipc path, or tcp with a fixed port)")
