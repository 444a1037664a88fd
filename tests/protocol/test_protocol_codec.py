"""Codec behaviour that the vectors cannot pin: size limits, local errors, peek_id."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

import kvcr_protocol as kp
from kvcr_protocol import DEFAULT_LIMITS, ErrorCode, Limits, LocalProtocolError, RemoteProtocolError
from kvcr_protocol.messages import (
    DeliverItem,
    DepositItem,
    DstSpan,
    Heartbeat,
    Query,
    SrcSpan,
    StatsReply,
)


def pack(obj: Any) -> bytes:
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


def test_frame_over_the_limit_is_refused_before_parsing() -> None:
    frame = b"\xc1" * (DEFAULT_LIMITS.max_frame + 1)  # would be MALFORMED if parsed
    with pytest.raises(RemoteProtocolError) as info:
        kp.decode(frame)
    assert info.value.code is ErrorCode.TOO_LARGE


def test_frame_at_the_limit_is_parsed() -> None:
    frame = kp.encode(Query(1, (b"k" * 10,)))
    assert kp.decode(frame, limits=Limits(max_frame=len(frame))) == Query(1, (b"k" * 10,))
    with pytest.raises(RemoteProtocolError) as info:
        kp.decode(frame, limits=Limits(max_frame=len(frame) - 1))
    assert info.value.code is ErrorCode.TOO_LARGE and info.value.path == ""


def test_total_spans_over_the_limit() -> None:
    limits = Limits(max_spans=5)
    spans = tuple(SrcSpan(f"L{i}", "full", 1, i, 1) for i in range(3))
    ok = kp.encode(kp.Deposit(1, (DepositItem(b"a", spans[:2]), DepositItem(b"b", spans[:3]))))
    assert kp.decode(ok, limits=limits)
    over = kp.encode(kp.Deposit(1, (DepositItem(b"a", spans), DepositItem(b"b", spans))))
    with pytest.raises(RemoteProtocolError) as info:
        kp.decode(over, limits=limits)
    assert info.value.code is ErrorCode.TOO_MANY and info.value.path == "items"


def test_total_spans_count_deliver_items_too() -> None:
    limits = Limits(max_spans=2)
    item = DeliverItem(b"k", (DstSpan("a", 1, 0, 1), DstSpan("b", 1, 1, 1)))
    with pytest.raises(RemoteProtocolError) as info:
        kp.decode(kp.encode(kp.Deliver(1, (item, item))), limits=limits)
    assert info.value.code is ErrorCode.TOO_MANY


def test_custom_limits_apply() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        kp.decode(kp.encode(Query(1, (b"12345",))), limits=Limits(max_key=4))
    assert info.value.code is ErrorCode.TOO_LARGE and info.value.path == "keys[0]"


def test_decode_accepts_bytes_like_frames() -> None:
    frame = kp.encode(Heartbeat(3))
    assert kp.decode(bytearray(frame)) == Heartbeat(3)  # type: ignore[arg-type]
    assert kp.decode(memoryview(frame)) == Heartbeat(3)  # type: ignore[arg-type]


def test_repeated_map_key_is_malformed() -> None:
    frame = b"\x84" + pack("v") + pack(1) + pack("t") + pack("heartbeat") + pack("id") + pack(1) + pack("id") + pack(1)
    with pytest.raises(RemoteProtocolError) as info:
        kp.decode(frame)
    assert info.value.code is ErrorCode.MALFORMED


def test_repeated_key_inside_stats_is_malformed() -> None:
    head = pack({"v": 1, "t": "stats_reply", "id": 1, "stats": {}})[:-1]
    frame = head + b"\x82" + pack("a") + pack(1) + pack("a") + pack(2)
    with pytest.raises(RemoteProtocolError) as info:
        kp.decode(frame)
    assert info.value.code is ErrorCode.MALFORMED


def test_zero_length_extension_inside_stats_is_malformed() -> None:
    head = pack({"v": 1, "t": "stats_reply", "id": 1, "stats": {}})[:-1]
    frame = head + b"\x81" + pack("a") + b"\xc7\x00\x05"
    with pytest.raises(RemoteProtocolError) as info:
        kp.decode(frame)
    assert info.value.code is ErrorCode.MALFORMED


@pytest.mark.parametrize(
    "message",
    [Heartbeat(1 << 64), StatsReply(1, {"x": object()}), StatsReply(1, {"x": 1 << 70})],
)
def test_unencodable_values_raise_local_errors(message: kp.Message) -> None:
    with pytest.raises(LocalProtocolError) as info:
        kp.encode(message)
    assert info.value.code is ErrorCode.WRONG_TYPE


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(LocalProtocolError) as info:
        kp.encode(object())  # type: ignore[arg-type]
    assert info.value.code is ErrorCode.UNKNOWN_TYPE


def test_encoding_is_deterministic_and_in_field_order() -> None:
    msg = kp.Deliver(9, (DeliverItem(b"k", (DstSpan("L0", 1, 0, 4),)),), "r", 10)
    frame = kp.encode(msg)
    assert frame == kp.encode(msg)
    keys = list(msgpack.unpackb(frame, raw=False))
    assert keys == ["v", "t", "id", "items", "request_id", "deadline_ms", "partial"]
    # Version 1 has no partial field, so it is not emitted there.
    keys = list(msgpack.unpackb(kp.encode(msg, 1), raw=False))
    assert keys == ["v", "t", "id", "items", "request_id", "deadline_ms"]


def test_errors_carry_code_reason_and_path() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        kp.decode(pack({"v": 1, "t": "query", "id": 1, "keys": [b"ok", "bad"]}))
    err = info.value
    assert err.code is ErrorCode.WRONG_TYPE and err.path == "keys[1]"
    assert "WRONG_TYPE" in str(err) and "keys[1]" in str(err) and err.reason
    assert isinstance(err, kp.ProtocolError)
    assert not isinstance(err, LocalProtocolError)


@pytest.mark.parametrize(
    ("frame", "expected"),
    [
        (pack({"v": 1, "t": "query", "id": 77, "keys": "bad"}), 77),
        (pack({"v": 9, "t": "nope", "id": 5}), 5),
        (pack({"id": -1}), 0),
        (pack({"id": True}), 0),
        (pack({"id": "5"}), 0),
        (pack([1, 2]), 0),
        (b"\xc1", 0),
        (b"", 0),
        (pack({"v": 1, "id": 3}) + b"\x00", 0),
    ],
)
def test_peek_id(frame: bytes, expected: int) -> None:
    assert kp.peek_id(frame) == expected


def test_error_codes_are_in_their_ranges() -> None:
    values = [c.value for c in ErrorCode]
    assert len(values) == len(set(values))
    for code in ErrorCode:
        assert 0 <= code.value <= 0xFFFF
        assert code.value == 0 or 100 <= code.value < 500
