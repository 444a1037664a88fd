"""The inventory event codec (spec section 15): round trips, and hostile payloads refused with the field named."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcr_protocol import ErrorCode, LocalProtocolError, RemoteProtocolError
from kvcr_protocol.events import (
    END_SEQ,
    END_SEQ_FRAME,
    MAX_BATCH_KEYS,
    MAX_SEQ,
    Cleared,
    EventBatch,
    Removed,
    RemovedReason,
    ReplayEnd,
    Stored,
    decode_batch,
    decode_replay_end,
    decode_replay_request,
    decode_seq,
    encode_batch,
    encode_replay_end,
    encode_replay_request,
    encode_seq,
    replay_endpoint,
)

GOOD: dict[str, Any] = {"v": 1, "node": "n1", "inc": 7, "ts": 12.5}
STORED: dict[str, Any] = {"t": "stored", "keys": [b"k"], "pools": ["kv"], "tier": "dram"}


def refused(payload: bytes) -> tuple[str, str]:
    with pytest.raises(RemoteProtocolError) as info:
        decode_batch(payload)
    return info.value.code.name, info.value.path


def batch(*events: Any, **changes: Any) -> bytes:
    return msgpack.packb({**GOOD, "events": list(events), **changes}, use_bin_type=True)


keys = st.lists(st.binary(min_size=1, max_size=256), min_size=1, max_size=20).map(tuple)
names = st.text(min_size=1, max_size=32).filter(lambda s: len(s.encode("utf-8", "surrogatepass")) <= 128)
pools = st.lists(names, min_size=1, max_size=4).map(tuple)
events = st.one_of(
    st.builds(Stored, keys, pools, names),
    st.builds(Removed, keys, pools, names, st.sampled_from(RemovedReason)),
    st.just(Cleared()),
)


@settings(max_examples=200, deadline=None)
@given(names, st.integers(1, (1 << 64) - 1), st.floats(0, 4e9, allow_nan=False), st.lists(events, max_size=8))
def test_every_batch_round_trips(node: str, inc: int, ts: float, evs: list[Any]) -> None:
    original = EventBatch(node, inc, ts, tuple(evs))
    payload = encode_batch(original)
    assert decode_batch(payload) == original
    assert encode_batch(decode_batch(payload)) == payload  # canonical


@pytest.mark.parametrize(
    ("payload", "code", "path"),
    [
        (batch(STORED, node=""), "OUT_OF_RANGE", "node"),
        (batch(inc=-5), "OUT_OF_RANGE", "inc"),
        (batch(inc=2.0), "WRONG_TYPE", "inc"),
        (batch(ts=float("inf")), "OUT_OF_RANGE", "ts"),
        (batch(ts=None), "MISSING_FIELD", "ts"),
        (batch({**STORED, "keys": b"k"}), "WRONG_TYPE", "events[0].keys"),
        (batch({**STORED, "keys": [7]}), "WRONG_TYPE", "events[0].keys[0]"),
        (batch({**STORED, "pools": "kv"}), "WRONG_TYPE", "events[0].pools"),
        (batch({**STORED, "pools": [1]}), "WRONG_TYPE", "events[0].pools[0]"),
        (batch({**STORED, "pools": ["p"] * 257}), "TOO_MANY", "events[0].pools"),
        (batch({**STORED, "tier": ""}), "OUT_OF_RANGE", "events[0].tier"),
        (batch({**STORED, "t": "removed", "why": 1}), "WRONG_TYPE", "events[0].why"),
        (batch({"t": "Stored"}), "UNKNOWN_TYPE", "events[0].t"),
        (batch({"t": "BlockStored", "block_hashes": [1]}), "UNKNOWN_TYPE", "events[0].t"),
        (batch(*([{"t": "cleared"}] * (MAX_BATCH_KEYS + 1))), "TOO_MANY", "events"),
        (msgpack.packb({**GOOD, "events": [], 5: 1}), "WRONG_TYPE", ""),
        (msgpack.packb("stored"), "NOT_A_MAP", ""),
        (b"\x81\xa1v\x01\xa1v\x01", "MALFORMED", ""),  # a repeated key
        (b"\xd4\x01\x00", "MALFORMED", ""),  # an extension type
        (b"\x85\xa1v\x01", "MALFORMED", ""),  # a map of 5 entries cut after one
    ],
    ids=["node-empty", "inc-negative", "inc-float", "ts-inf", "ts-nil", "keys-bin", "key-int", "pools-str", "pool-int",
         "pools-257", "tier-empty", "why-int", "type-case", "vllm-event", "events-4097", "key-int-map", "str",
         "repeated-key", "extension", "truncated"],
)
def test_hostile_batches_are_refused_naming_the_field(payload: bytes, code: str, path: str) -> None:
    assert refused(payload) == (code, path)


def test_unknown_fields_are_ignored_unless_must_understand() -> None:
    assert decode_batch(batch({**STORED, "lora": 3}, extra="x")).events == (Stored((b"k",), ("kv",), "dram"),)
    assert refused(batch({**STORED, "!lora": 3})) == ("MUST_UNDERSTAND", "events[0].!lora")


def test_a_huge_payload_is_refused_before_it_is_parsed() -> None:
    assert refused(b"\x00" * ((8 << 20) + 1)) == ("TOO_LARGE", "")


def test_encoding_refuses_what_cannot_travel() -> None:
    with pytest.raises(LocalProtocolError) as info:
        encode_batch(EventBatch("n", 0, 1.0, ()))
    assert info.value.path == "inc"
    with pytest.raises(LocalProtocolError) as info:
        encode_batch(EventBatch("n", 1, 1.0, (Stored(tuple(b"%d" % i for i in range(MAX_BATCH_KEYS + 1)), ("kv",), "dram"),)))
    assert (info.value.code, info.value.path) == (ErrorCode.TOO_MANY, "events")


def test_sequence_numbers() -> None:
    assert encode_seq(0) == bytes(8) and encode_seq(MAX_SEQ) == b"\x7f" + b"\xff" * 7
    assert encode_seq(END_SEQ) == END_SEQ_FRAME == b"\xff" * 8
    assert decode_seq(encode_seq(258)) == 258
    assert decode_seq(END_SEQ_FRAME, end=True) == END_SEQ
    for bad in (-2, MAX_SEQ + 1, 1 << 64, True, 1.0):
        with pytest.raises(LocalProtocolError):
            encode_seq(bad)  # type: ignore[arg-type]
    with pytest.raises(RemoteProtocolError) as info:
        decode_seq(END_SEQ_FRAME)  # only a replay's end may be negative
    assert (info.value.code, info.value.path) == (ErrorCode.OUT_OF_RANGE, "seq")
    with pytest.raises(RemoteProtocolError) as info:
        decode_seq(b"\x80" + bytes(7), end=True)  # negative, and not the end marker
    assert info.value.code is ErrorCode.OUT_OF_RANGE
    with pytest.raises(RemoteProtocolError) as info:
        decode_seq(bytes(4))
    assert (info.value.code, info.value.path) == (ErrorCode.MALFORMED, "seq")


def test_replay_request_and_end() -> None:
    assert decode_replay_request(encode_replay_request(41)) == 41
    for bad in (-1, MAX_SEQ + 1):
        with pytest.raises(LocalProtocolError):
            encode_replay_request(bad)
    with pytest.raises(RemoteProtocolError) as info:
        decode_replay_request([])
    assert info.value.path == "replay"
    end = ReplayEnd(3, 9, 5, int(ErrorCode.OUT_OF_RANGE), "start 12 is past the next seq 9", "replay.start")
    assert decode_replay_end(encode_replay_end(end)) == end and not end.ok
    assert decode_replay_end(encode_replay_end(ReplayEnd(9, 9, 5))).ok
    with pytest.raises(RemoteProtocolError) as info:
        decode_replay_end(msgpack.packb({"v": 1, "oldest": 0, "next": 1 << 63, "inc": 5}))
    assert (info.value.code, info.value.path) == (ErrorCode.OUT_OF_RANGE, "next")


@pytest.mark.parametrize(
    ("endpoint", "replay"),
    [("ipc:///run/kvcr/n.ev", "ipc:///run/kvcr/n.ev.replay"), ("tcp://127.0.0.1:5600", "tcp://127.0.0.1:5601"),
     ("tcp://[::1]:7000", "tcp://[::1]:7001")],
)
def test_replay_endpoint_follows_from_the_events_endpoint(endpoint: str, replay: str) -> None:
    assert replay_endpoint(endpoint) == replay


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:0", "tcp://127.0.0.1:65535", "tcp://*:x", "inproc://ev"])
def test_no_replay_endpoint_follows_from_these(endpoint: str) -> None:
    with pytest.raises(ValueError, match="give one"):
        replay_endpoint(endpoint)
