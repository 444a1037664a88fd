"""Property tests: round trips of random valid messages, and hostile bytes.

Strategies are built generically from the ``FIELDS`` tables, so a new message or field
is covered without editing this file.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcr_protocol as kp
from kvcr_protocol import DEFAULT_LIMITS, RemoteProtocolError
from kvcr_protocol.columns import U16, U32, U64, DeliverColumns, DepositColumns, QueryColumns, SpanColumns, pack
from kvcr_protocol.messages import BASE_ENCODED, Message
from kvcr_protocol.notify import WriteNotify
from kvcr_protocol.wire import (
    NUL,
    AnyMap,
    Bool,
    Bytes,
    EnumStr,
    Field,
    Opt,
    Packed,
    RecordType,
    Seq,
    Str,
    UInt,
    WireType,
)

SMALL = 3  # at most this many items per array: keeps examples small and fast
SETTINGS = settings(deadline=None, max_examples=400, suppress_health_check=[HealthCheck.too_slow])


def _utf8_within(limit: int) -> st.SearchStrategy[str]:
    return st.text(max_size=min(limit, 12)).filter(lambda s: len(s.encode("utf-8")) <= limit)


JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=SMALL) | st.dictionaries(st.text(max_size=6), inner, max_size=SMALL),
    max_leaves=8,
)


_NAMES = st.lists(st.text(max_size=6).filter(lambda s: NUL not in s), min_size=1, max_size=4)


@st.composite
def span_columns(draw: st.DrawFn, cls: type[SpanColumns]) -> SpanColumns:
    """A coherent block of columns: k keys of n spans, every column form drawn."""
    names = draw(_NAMES)
    n, k = len(names), draw(st.integers(1, 3))
    keys = tuple(draw(st.lists(st.binary(min_size=1, max_size=8), min_size=k, max_size=k)))
    u32, u64 = st.integers(0, (1 << 32) - 1), st.integers(0, (1 << 64) - 1)
    regions = draw(u32 | st.lists(u32, min_size=n, max_size=n).map(lambda v: pack(v, U32))
                   | st.lists(u32, min_size=n * k, max_size=n * k).map(lambda v: pack(v, U32)))
    offsets = pack(draw(st.lists(u64, min_size=n * k, max_size=n * k)), U64)
    lengths = draw(u64 | st.lists(u64, min_size=n, max_size=n).map(lambda v: pack(v, U64)))
    if cls is DepositColumns:
        pools = NUL.join(draw(st.lists(st.sampled_from(["full", "swa", "state"]), min_size=n, max_size=n)))
        return DepositColumns(keys, NUL.join(names), regions, offsets, lengths, pools)
    groups = b""
    if draw(st.booleans()):
        drawn = draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=n))
        dense = {g: i for i, g in enumerate(sorted(set(drawn)))}
        groups = pack([dense[g] for g in drawn], U16)
    return DeliverColumns(keys, NUL.join(names), regions, offsets, lengths, groups)


COLUMN_STRATEGIES: dict[type[Any], st.SearchStrategy[Any]] = {
    DeliverColumns: span_columns(DeliverColumns),
    DepositColumns: span_columns(DepositColumns),
    QueryColumns: st.lists(
        st.builds(kp.QueryResult, st.sampled_from(list(kp.Presence)), st.sampled_from(["", "dram", "hbm:0", "remote"])),
        max_size=SMALL,
    ).map(QueryColumns.from_results),
    WriteNotify: st.builds(WriteNotify, st.integers(1, (1 << 32) - 1), st.integers(0, (1 << 64) - 1), st.just(b"")),
    kp.LeaseGrant: st.lists(
        st.none() | st.tuples(_NAMES, st.integers(0, 3), st.integers(0, (1 << 32) - 1)), max_size=SMALL,
    ).map(lambda rows: kp.grant_columns([
        None if row is None else (tuple(row[0]), [(row[1], (row[2] + j) % (1 << 32)) for j in range(len(row[0]))]) for row in rows
    ])),
    kp.LeaseColumns: st.lists(st.tuples(st.sampled_from(list(kp.LeaseStatus)), st.integers(0, 2)), max_size=SMALL).map(
        lambda rows: kp.LeaseColumns(bytes(s for s, _ in rows), bytes(t for _, t in rows), ("", "remote", "dram"))
    ),
}


def coherent(msg: Message) -> Message:
    """The message with the fields that must agree made to agree (what a sender guarantees)."""
    changes: dict[str, Any] = {}
    if getattr(msg, "columns", None) and getattr(msg, "items", None):
        changes["columns"] = ()
    if isinstance(msg, (kp.Completion, kp.WriteDone)) and msg.done:
        changes["done"] = pack(range(len(msg.results)), U32)
    if isinstance(msg, kp.Progress):
        changes["done"] = pack(range(len(msg.items) // 4), U32)
    if isinstance(msg, kp.Query):
        changes["prefix"] = msg.prefix & kp.PREFIX_ALL
    if isinstance(msg, kp.QueryReply) and msg.columns is not None and msg.results:
        changes["results"] = ()
    if isinstance(msg, kp.LeaseReply) and msg.grant is not None:
        # A grant answers the keys of its lease: one row per answer, none without answers.
        n = 0 if msg.columns is None else len(msg.columns)
        changes["grant"] = None if msg.columns is None else kp.grant_columns(
            [(("a", "b"), [(0, i), (1, i)]) if i % 2 else None for i in range(n)], msg.grant.node)
    if isinstance(msg, kp.PutReply) and msg.grant is not None:
        # A put's grant: one row per result.
        changes["grant"] = kp.grant_columns(
            [(("a",), [(0, i)]) if i % 2 else None for i in range(len(msg.results))], msg.grant.node)
    if isinstance(msg, kp.Put) and msg.columns:
        changes["items"] = ()
    msg = dataclasses.replace(msg, **changes) if changes else msg  # type: ignore[type-var]
    if getattr(msg, "parents", None):
        # One parent per key, none its own key's (drawn parents are cycled over the keys).
        keys = kp.message_keys(msg.items, getattr(msg, "columns", ()))  # type: ignore[attr-defined]
        drawn = msg.parents  # type: ignore[attr-defined]
        parents = tuple(p if p != k else b"" for k, p in zip(keys, (drawn * len(keys))[: len(keys)], strict=True))
        msg = dataclasses.replace(msg, parents=parents)  # type: ignore[type-var]
    if isinstance(msg, kp.WriteRequest) and msg.notify is not None:
        items = pack(range(kp.item_count(msg)), U32)
        msg = dataclasses.replace(msg, notify=dataclasses.replace(msg.notify, items=items))
    return msg


def strategy_for(wt: WireType[Any]) -> st.SearchStrategy[Any]:
    """Values that are valid for a wire type under the default limits."""
    if isinstance(wt, RecordType) and wt.cls in COLUMN_STRATEGIES:
        return COLUMN_STRATEGIES[wt.cls]
    if isinstance(wt, Packed):
        return st.lists(st.integers(0, (1 << (8 * wt.width)) - 1), max_size=SMALL).map(
            lambda v: pack(v, {1: "B", 2: U16, 4: U32, 8: U64}[wt.width])
        )
    if isinstance(wt, UInt):
        return st.integers(0, wt.maximum)
    if isinstance(wt, Bool):
        return st.booleans()
    if isinstance(wt, Bytes):
        limit = getattr(DEFAULT_LIMITS, wt.limit)
        return st.binary(min_size=wt.minimum, max_size=min(limit, 24))
    if isinstance(wt, Str):
        if wt.choices is not None:
            return st.sampled_from(sorted(wt.choices))
        return _utf8_within(getattr(DEFAULT_LIMITS, wt.limit))
    if isinstance(wt, EnumStr):
        return st.sampled_from([*wt.enum_type.__members__.values()])
    if isinstance(wt, Opt):
        return st.none() | strategy_for(wt.inner)
    if isinstance(wt, Seq):
        limit = getattr(DEFAULT_LIMITS, wt.limit)
        return st.lists(strategy_for(wt.item), min_size=wt.minimum, max_size=min(limit, SMALL)).map(tuple)
    if isinstance(wt, RecordType):
        return st.builds(wt.cls, *[strategy_for(f.type) for f in wt.fields])
    if isinstance(wt, AnyMap):
        return st.dictionaries(st.text(max_size=8), JSONISH, max_size=4)
    raise TypeError(f"no strategy for {type(wt).__name__}")


def field_strategy(f: Field, version: int) -> st.SearchStrategy[Any]:
    if f.since > version:
        return st.just(f.default)  # not expressible at this version
    return strategy_for(f.type)


def message_strategy(cls: type[Message], version: int) -> st.SearchStrategy[Message]:
    if cls in BASE_ENCODED:
        version = kp.BASE_VERSION
    return st.builds(cls, **{f.name: field_strategy(f, version) for f in cls.FIELDS}).map(coherent)


VERSIONED = st.sampled_from(kp.PROTOCOL_VERSIONS).flatmap(
    lambda v: st.tuples(
        st.just(v),
        st.sampled_from([c for c in kp.ALL_MESSAGES if c.SINCE <= v]).flatmap(lambda c: message_strategy(c, v)),
    )
)


@SETTINGS
@given(VERSIONED)
def test_round_trip_of_every_message(pair: tuple[int, Message]) -> None:
    version, msg = pair
    frame = kp.encode(msg, version)
    assert kp.decode(frame, version) == msg
    assert kp.decode(frame, kp.CURRENT_VERSION) == msg
    assert kp.encode(kp.decode(frame, version), version) == frame  # canonical: re-encoding is stable
    obj = msgpack.unpackb(frame, raw=False)
    assert list(obj)[:2] == ["v", "t"]
    assert obj["v"] == (kp.BASE_VERSION if type(msg) in BASE_ENCODED else version)


def test_every_message_type_has_a_strategy() -> None:
    for version in kp.PROTOCOL_VERSIONS:
        for cls in kp.ALL_MESSAGES:
            assert message_strategy(cls, version) is not None


def _decode_or_refuse(frame: bytes, max_version: int) -> None:
    """Decoding returns a message or raises RemoteProtocolError, never anything else."""
    try:
        msg = kp.decode(frame, max_version)
    except RemoteProtocolError as exc:
        assert isinstance(exc.code, kp.ErrorCode) and exc.code != kp.ErrorCode.OK
    else:
        assert isinstance(msg, Message)


@SETTINGS
@given(st.binary(max_size=64), st.sampled_from(kp.PROTOCOL_VERSIONS))
def test_random_bytes_only_raise_remote_errors(frame: bytes, max_version: int) -> None:
    _decode_or_refuse(frame, max_version)


@st.composite
def mutated_frames(draw: st.DrawFn) -> tuple[bytes, int]:
    version, msg = draw(VERSIONED)
    frame = bytearray(kp.encode(msg, version))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "duplicate"]))
        if not frame:
            break
        i = draw(st.integers(0, len(frame) - 1))
        if op == "flip":
            frame[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            frame[i] = draw(st.integers(0, 255))
        elif op == "insert":
            frame.insert(i, draw(st.integers(0, 255)))
        elif op == "delete":
            del frame[i]
        elif op == "truncate":
            del frame[i:]
        else:
            j = draw(st.integers(i, len(frame)))
            frame[j:j] = frame[i:j]
    return bytes(frame), draw(st.sampled_from(kp.PROTOCOL_VERSIONS))


@SETTINGS
@given(mutated_frames())
def test_mutated_frames_only_raise_remote_errors(case: tuple[bytes, int]) -> None:
    _decode_or_refuse(*case)


# Structured hostility: valid msgpack maps with plausible keys and arbitrary values.
_TAGS = st.sampled_from([c.TAG for c in kp.ALL_MESSAGES] + ["nope", ""])
_KEYS = st.sampled_from(sorted({f.key for c in kp.ALL_MESSAGES for f in c.FIELDS} | {"!x", "x", "v", "t"}))


@st.composite
def hostile_maps(draw: st.DrawFn) -> bytes:
    obj: dict[Any, Any] = {"v": draw(st.integers(-1, 3) | JSONISH), "t": draw(_TAGS | JSONISH)}
    for key in draw(st.lists(_KEYS, max_size=6)):
        obj[key] = draw(JSONISH | st.lists(st.lists(JSONISH, max_size=6), max_size=3))
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


@SETTINGS
@given(hostile_maps(), st.sampled_from(kp.PROTOCOL_VERSIONS))
def test_hostile_maps_only_raise_remote_errors(frame: bytes, max_version: int) -> None:
    _decode_or_refuse(frame, max_version)


# ------------------------------------------ generated record loaders against the field path

FAST_RECORDS = [kp.SrcSpan, kp.DstSpan, kp.LayoutSpan, kp.PoolInfo, kp.KeyResult, kp.QueryResult, kp.Region]
_ITEM = (
    st.integers(-2, 3) | st.integers((1 << 32) - 2, (1 << 32) + 1) | st.integers((1 << 64) - 2, (1 << 64) - 1)
    | st.text(max_size=4) | st.text(min_size=60, max_size=70) | st.text("\u00e9\u4e2d\U0001f600", min_size=15, max_size=40)
    | st.booleans() | st.none() | st.binary(max_size=3) | st.floats(allow_nan=False)
    | st.sampled_from(["OK", "FAILED", "HIT", "MISS", "dram", "vram", "ok", "Hit"])
)


def _field_by_field(rt: RecordType[Any], value: Any) -> Any:
    """The full path alone: what the generated loader must agree with."""
    saved = rt.load_one
    rt.load_one = None
    try:
        return rt.load(value, "r", DEFAULT_LIMITS)
    except RemoteProtocolError as exc:
        return (exc.code, exc.path)
    finally:
        rt.load_one = saved


@SETTINGS
@given(st.sampled_from(FAST_RECORDS), st.data())
def test_generated_record_loaders_agree_with_field_checks(cls: type[Any], data: st.DataObject) -> None:
    rt = RecordType(cls)
    assert rt.load_one is not None and rt.load_many is not None
    n = len(cls.FIELDS)
    valid = st.tuples(*(strategy_for(f.type) for f in cls.FIELDS)).map(list)
    noisy = st.lists(_ITEM, min_size=n - 1, max_size=n + 1)
    values = data.draw(st.lists(valid | noisy, min_size=1, max_size=4))
    expected = [_field_by_field(rt, v) for v in values]
    for value, want in zip(values, expected, strict=True):
        fast = rt.load_one(value, DEFAULT_LIMITS)
        # The generated loader either accepts exactly what the field checks accept (the
        # same record), or declines and leaves the error to the full path.
        assert fast is None or (fast == want and type(fast) is type(want))
        try:
            got: Any = rt.load(value, "r", DEFAULT_LIMITS)
        except RemoteProtocolError as exc:
            got = (exc.code, exc.path)
        assert got == want and type(got) is type(want)
    many = rt.load_many(values, DEFAULT_LIMITS)
    if all(isinstance(w, cls) for w in expected) and all(len(v) == n for v in values):
        assert many == tuple(expected)
    else:
        assert many is None
