"""The conformance vectors in spec/vectors/ against the codec."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

import kvcr_protocol as kp
from kvcr_protocol import wire
from kvcr_protocol.messages import BASE_ENCODED, Deliver, Message, WriteRequest
from kvcr_protocol.operations import EVENT_CODES

VECTORS = Path(__file__).resolve().parents[2] / "spec" / "vectors"


def load(name: str) -> list[dict[str, Any]]:
    vectors: list[dict[str, Any]] = json.loads((VECTORS / name).read_text(encoding="utf-8"))["vectors"]
    return vectors


VALID_V12 = load("valid.json")
VALID_V4 = load("valid-v4.json")
VALID_V5 = load("valid-v5.json")
VALID = VALID_V12 + load("valid-v3.json") + VALID_V4 + VALID_V5
INVALID_V4 = load("invalid-v4.json")
INVALID_V5 = load("invalid-v5.json")
INVALID = load("invalid.json") + load("invalid-v3.json") + INVALID_V4 + INVALID_V5
NOTIFY: dict[str, Any] = json.loads((VECTORS / "notify.json").read_text(encoding="utf-8"))


def value_from_json(wt: wire.WireType[Any], value: Any) -> Any:
    """One field value from its JSON form."""
    if isinstance(wt, (wire.Bytes, wire.Packed)) or (isinstance(wt, wire.UIntOrPacked) and isinstance(value, dict)):
        assert set(value) == {"hex"}
        return bytes.fromhex(value["hex"])
    if isinstance(wt, wire.EnumStr):
        return wt.enum_type(value)
    if isinstance(wt, wire.Opt):
        return None if value is None else value_from_json(wt.inner, value)
    if isinstance(wt, wire.Seq):
        assert isinstance(value, list)
        return tuple(value_from_json(wt.item, v) for v in value)
    if isinstance(wt, wire.RecordType):
        return object_from_json(wt.cls, value)
    if isinstance(wt, (wire.UInt, wire.Bool, wire.Str, wire.AnyMap, wire.Joined, wire.UIntOrPacked)):
        return value
    raise TypeError(type(wt).__name__)


def object_from_json(cls: type[Message] | type[wire.Record], obj: dict[str, Any]) -> Any:
    """A message or record from its JSON form; absent fields take their defaults."""
    known = {f.name for f in cls.FIELDS}
    assert set(obj) <= known, f"unknown fields {set(obj) - known} for {cls.__name__}"
    kwargs = {}
    for f in cls.FIELDS:
        if f.name in obj:
            kwargs[f.name] = value_from_json(f.type, obj[f.name])
        else:
            assert not f.required, f"{cls.__name__}.{f.name} is required"
    return cls(**kwargs)


def message_of(vec: dict[str, Any]) -> Message:
    cls = kp.MESSAGE_BY_TAG[vec["tag"]]
    msg: Message = object_from_json(cls, vec["fields"])
    return msg


def test_vector_files_are_well_formed() -> None:
    assert len(INVALID) >= 40
    names = [v["name"] for v in VALID] + [v["name"] for v in INVALID]
    assert len(names) == len(set(names)), "vector names repeat"
    for vec in VALID:
        assert {"name", "version", "wire_version", "tag", "fields", "hex"} <= set(vec)
        assert vec["version"] in kp.PROTOCOL_VERSIONS
    for vec in INVALID:
        assert {"name", "max_version", "error", "path", "description", "hex"} <= set(vec)
        assert vec["error"] in kp.ErrorCode.__members__


@pytest.mark.parametrize("vec", VALID, ids=[v["name"] for v in VALID])
def test_valid_vector(vec: dict[str, Any]) -> None:
    msg = message_of(vec)
    frame = bytes.fromhex(vec["hex"])
    assert kp.encode(msg, vec["version"]) == frame
    assert kp.decode(frame, vec["version"]) == msg
    # A frame stays readable by an endpoint that speaks more.
    assert kp.decode(frame, kp.CURRENT_VERSION) == msg
    assert frame[1:3] == b"\xa1v" and frame[3] == vec["wire_version"]
    for alt in vec.get("accept", []):
        assert kp.decode(bytes.fromhex(alt["hex"]), vec["version"]) == msg, alt["description"]


@pytest.mark.parametrize("vec", INVALID, ids=[v["name"] for v in INVALID])
def test_invalid_vector(vec: dict[str, Any]) -> None:
    with pytest.raises(kp.RemoteProtocolError) as info:
        kp.decode(bytes.fromhex(vec["hex"]), vec["max_version"])
    assert info.value.code is kp.ErrorCode[vec["error"]]
    assert info.value.path == vec["path"]


def test_every_message_has_a_vector_at_every_version() -> None:
    # Every message is expressible at every version from the one that introduced it.
    have: dict[str, set[int]] = {}
    for vec in VALID:
        have.setdefault(vec["tag"], set()).add(vec["version"])
    for cls in kp.ALL_MESSAGES:
        assert have.get(cls.TAG, set()) == {v for v in kp.PROTOCOL_VERSIONS if v >= cls.SINCE}, cls.TAG
    assert set(have) == {cls.TAG for cls in kp.ALL_MESSAGES}


def test_version_1_and_2_files_hold_no_later_vector() -> None:
    assert {v["version"] for v in VALID_V12} == {1, 2}
    assert all(v["version"] == kp.COLUMNS_VERSION for v in load("valid-v3.json"))
    assert all(v["version"] == kp.LEASES_VERSION for v in VALID_V4)
    assert all(v["version"] == kp.CLIENT_GONE_VERSION for v in VALID_V5)
    assert all(v["max_version"] <= kp.PARTIAL_LAYOUT_VERSION for v in load("invalid.json"))
    assert all(v["max_version"] <= kp.COLUMNS_VERSION for v in load("invalid-v3.json"))
    assert all(v["max_version"] <= kp.LEASES_VERSION for v in INVALID_V4)
    assert all(v["max_version"] <= kp.CLIENT_GONE_VERSION for v in INVALID_V5)


def test_each_file_states_its_version() -> None:
    for name, version in (
        ("valid.json", 2), ("invalid.json", 2), ("valid-v3.json", 3), ("invalid-v3.json", 3),
        ("valid-v4.json", 4), ("invalid-v4.json", 4), ("valid-v5.json", 5), ("invalid-v5.json", 5),
    ):
        assert json.loads((VECTORS / name).read_text(encoding="utf-8"))["protocol_version"] == version, name


def test_version_4_file_repeats_every_older_message() -> None:
    # Every message of versions 1 to 3 is there again at version 4, as the same message.
    older = {v["name"].rsplit("-v", 1)[0]: v for v in load("valid-v3.json")}
    again = {v["name"].rsplit("-v", 1)[0]: v for v in VALID_V4 if v["name"].rsplit("-v", 1)[0] in older}
    assert set(older) - set(again) == {"welcome-agreed-3", "peer-welcome-agreed-3"}
    for name, vec in again.items():
        assert message_of(vec) == message_of(older[name]), name
        v3, v4 = msgpack.unpackb(bytes.fromhex(older[name]["hex"]), raw=False), msgpack.unpackb(bytes.fromhex(vec["hex"]), raw=False)
        if vec["wire_version"] == 4:
            assert v4.pop("v") == 4 and v3.pop("v") == 3
        assert v3 == v4, name


def test_version_5_file_repeats_every_older_message() -> None:
    # Every message of versions 1 to 4 is there again at version 5, as the same message.
    older = {v["name"].rsplit("-v", 1)[0]: v for v in VALID_V4}
    again = {v["name"].rsplit("-v", 1)[0]: v for v in VALID_V5 if v["name"].rsplit("-v", 1)[0] in older}
    assert set(older) - set(again) == {"welcome-agreed-4", "peer-welcome-agreed-4"}
    for name, vec in again.items():
        assert message_of(vec) == message_of(older[name]), name
        v4, v5 = msgpack.unpackb(bytes.fromhex(older[name]["hex"]), raw=False), msgpack.unpackb(bytes.fromhex(vec["hex"]), raw=False)
        if vec["wire_version"] == 5:
            assert v5.pop("v") == 5 and v4.pop("v") == 4
        assert v4 == v5, name


def test_version_5_vectors_cover_what_it_adds() -> None:
    # Version 5 opens with one peer message and adds the four write-grant messages
    # (section 6.13) and the integrity report (6.12); nothing of an older message changes.
    added = {cls.TAG for cls in kp.ALL_MESSAGES if cls.SINCE == kp.CLIENT_GONE_VERSION}
    assert added == {kp.PeerForget.TAG, kp.Put.TAG, kp.PutReply.TAG, kp.Commit.TAG, kp.Unput.TAG, kp.Suspect.TAG}
    forgets = [message_of(v) for v in VALID_V5 if v["tag"] == kp.PeerForget.TAG]
    assert forgets and all(isinstance(msg, kp.PeerForget) and msg.agent for msg in forgets)
    announced = {msg.agent for msg in map(message_of, VALID_V5) if isinstance(msg, kp.PeerClient)}
    assert {msg.agent for msg in forgets} <= announced, "a forget names an agent the vectors announce"
    unknown = {msgpack.unpackb(bytes.fromhex(v["hex"]), raw=False)["t"] for v in INVALID_V5 if v["error"] == "UNKNOWN_TYPE"}
    assert unknown == added
    assert any(v["max_version"] == kp.LEASES_VERSION for v in INVALID_V5), "peer_forget at an endpoint of version 4"
    assert {("TOO_LARGE", "agent"), ("MISSING_FIELD", "agent"), ("WRONG_TYPE", "agent")} <= {
        (v["error"], v["path"]) for v in INVALID_V5}


@pytest.mark.parametrize("vec", [v for v in VALID_V5 if v["tag"] == kp.PeerForget.TAG], ids=lambda v: v["name"])
def test_peer_forget_is_refused_below_version_5(vec: dict[str, Any]) -> None:
    msg = message_of(vec)
    frame = bytes.fromhex(vec["hex"])
    for version in (1, 2, 3, 4):
        with pytest.raises(kp.LocalProtocolError) as local:
            kp.encode(msg, version)
        assert local.value.code is kp.ErrorCode.UNSUPPORTED_VERSION
        with pytest.raises(kp.RemoteProtocolError) as remote:
            kp.decode(frame, version)
        assert (remote.value.code, remote.value.path) == (kp.ErrorCode.UNKNOWN_TYPE, "t")


def test_version_3_vectors_cover_what_it_adds() -> None:
    v3 = [message_of(v) for v in load("valid-v3.json")]
    assert any(isinstance(msg, kp.Deposit) and msg.columns for msg in v3)
    blocks = [b for msg in v3 if isinstance(msg, (kp.Deliver, WriteRequest)) for b in msg.columns]
    assert any(b.groups for b in blocks) and any(not b.groups for b in blocks)
    assert {type(b.regions) for b in blocks} == {int, bytes}
    assert {type(b.lengths) for b in blocks} == {int, bytes}
    region_forms = {len(b.regions) // 4 == b.span_count for b in blocks if isinstance(b.regions, bytes)}
    assert region_forms == {True, False}, "per span and per entry regions"
    assert any(isinstance(msg, Deliver) and msg.notify for msg in v3)
    assert any(isinstance(msg, WriteRequest) and msg.notify is not None for msg in v3)
    assert any(isinstance(msg, kp.Completion) and msg.done for msg in v3)
    assert any(isinstance(msg, kp.WriteDone) and msg.done for msg in v3)
    assert any(isinstance(msg, kp.Query) and msg.prefix for msg in v3)
    assert any(isinstance(msg, kp.QueryReply) and msg.columns is not None for msg in v3)


LEASE_TAGS = {kp.Lease.TAG, kp.LeaseReply.TAG, kp.RenewLease.TAG, kp.ReleaseLease.TAG, kp.LeaseEnded.TAG}


def test_version_4_vectors_cover_what_it_adds() -> None:
    v4 = [message_of(v) for v in VALID_V4]
    assert {type(msg).TAG for msg in v4} >= LEASE_TAGS
    assert {cls.TAG for cls in kp.ALL_MESSAGES if cls.SINCE == kp.LEASES_VERSION} == LEASE_TAGS
    replies = [msg for msg in v4 if isinstance(msg, kp.LeaseReply)]
    statuses = {status for msg in replies if msg.columns is not None for status in msg.columns}
    assert statuses == set(kp.LeaseStatus), set(kp.LeaseStatus) - statuses
    assert any(msg.lease == 0 and msg.columns is not None for msg in replies), "a lease that holds nothing"
    assert any(msg.lease and msg.columns is None for msg in replies), "the reply to a renew"
    for msg in replies:
        if msg.columns is not None:
            assert (msg.lease != 0) == (msg.columns.held_count() > 0), msg
    leases = [msg for msg in v4 if isinstance(msg, kp.Lease)]
    assert any(msg.request_id is None and msg.ttl_ms == 0 for msg in leases)
    assert any(len(set(msg.keys)) < len(msg.keys) for msg in leases), "a key repeated in one lease"
    ended = [msg for msg in v4 if isinstance(msg, kp.LeaseEnded)]
    assert any(msg.keys for msg in ended) and any(not msg.keys for msg in ended)
    assert {msg.code for msg in ended} == set(EVENT_CODES[kp.LeaseEnded.TAG])
    errors = {msg.code for msg in v4 if isinstance(msg, kp.Error)}
    assert {kp.ErrorCode.UNKNOWN_LEASE, kp.ErrorCode.LEASE_LIMIT} <= errors


def test_version_4_lease_replies_answer_their_leases() -> None:
    # A lease_reply vector that answers a lease vector (same id) has one status per key,
    # and a repeated key reports the status of its first occurrence.
    leases = {msg.id: msg for msg in map(message_of, VALID_V4) if isinstance(msg, kp.Lease)}
    matched = 0
    for msg in map(message_of, VALID_V4):
        if isinstance(msg, kp.LeaseReply) and msg.columns is not None and msg.id in leases:
            keys = leases[msg.id].keys
            assert len(msg.columns) == len(keys)
            first = {key: keys.index(key) for key in keys}
            for i, key in enumerate(keys):
                assert msg.columns.status_of(i) == msg.columns.status_of(first[key])
                assert msg.columns.tier_of(i) == msg.columns.tier_of(first[key])
            for i, status in enumerate(msg.columns):
                if status is kp.LeaseStatus.LEASED_REMOTE:
                    assert msg.columns.tier_of(i) == "remote"
                if status is kp.LeaseStatus.MISS:
                    assert msg.columns.tier_of(i) == ""
            matched += 1
    assert matched >= 3


def test_version_4_invalid_vectors_cover_what_it_refuses() -> None:
    by_name = {v["name"]: v for v in INVALID_V4}
    tags_below_4 = {msgpack.unpackb(bytes.fromhex(v["hex"]), raw=False)["t"] for v in INVALID_V4 if v["error"] == "UNKNOWN_TYPE"}
    assert tags_below_4 == LEASE_TAGS, "every lease message is unknown below version 4"
    paths = {(v["error"], v["path"]) for v in INVALID_V4}
    for expected in (
        ("OUT_OF_RANGE", "columns.tier"), ("OUT_OF_RANGE", "columns.status[2]"), ("OUT_OF_RANGE", "columns.tier[1]"),
        ("TOO_MANY", "keys"), ("TOO_MANY", "columns.status"), ("TOO_MANY", "columns.tiers"), ("WRONG_TYPE", "columns.status"),
    ):
        assert expected in paths, expected
    assert any(v["max_version"] == kp.COLUMNS_VERSION for v in by_name.values()), "a lease at an endpoint of version 3"


@pytest.mark.parametrize("vec", [v for v in VALID_V4 if v["tag"] in LEASE_TAGS], ids=lambda v: v["name"])
def test_lease_messages_are_refused_below_version_4(vec: dict[str, Any]) -> None:
    msg = message_of(vec)
    frame = bytes.fromhex(vec["hex"])
    for version in (1, 2, 3):
        with pytest.raises(kp.LocalProtocolError) as local:
            kp.encode(msg, version)
        assert local.value.code is kp.ErrorCode.UNSUPPORTED_VERSION
        with pytest.raises(kp.RemoteProtocolError) as remote:
            kp.decode(frame, version)
        assert (remote.value.code, remote.value.path) == (kp.ErrorCode.UNKNOWN_TYPE, "t")
        obj = msgpack.unpackb(frame, raw=False)
        obj["v"] = version
        with pytest.raises(kp.RemoteProtocolError) as lower:
            kp.decode(msgpack.packb(obj, use_bin_type=True), kp.CURRENT_VERSION)
        assert (lower.value.code, lower.value.path) == (kp.ErrorCode.UNKNOWN_TYPE, "t")


def test_version_3_column_blocks_equal_their_record_form() -> None:
    for vec in load("valid-v3.json"):
        msg = message_of(vec)
        if isinstance(msg, (Deliver, WriteRequest, kp.Deposit)) and msg.columns:
            records = kp.record_items(msg)
            assert len(records) == kp.item_count(msg)
            rebuilt = type(msg.columns[0]).to_items(msg.columns[0])
            assert rebuilt == records[: len(rebuilt)]


@pytest.mark.parametrize("vec", NOTIFY["valid"], ids=[v["name"] for v in NOTIFY["valid"]])
def test_valid_notification(vec: dict[str, Any]) -> None:
    note = kp.Notification(**vec["fields"])
    payload = bytes.fromhex(vec["hex"])
    assert kp.encode_notification(note) == payload
    assert kp.decode_notification(payload) == note
    assert kp.is_notification(payload) and len(payload) == kp.NOTIFICATION_SIZE


@pytest.mark.parametrize("vec", NOTIFY["invalid"], ids=[v["name"] for v in NOTIFY["invalid"]])
def test_invalid_notification(vec: dict[str, Any]) -> None:
    with pytest.raises(kp.RemoteProtocolError) as info:
        kp.decode_notification(bytes.fromhex(vec["hex"]))
    assert (info.value.code.name, info.value.path) == (vec["error"], vec["path"])


def test_partial_write_vectors_need_version_2() -> None:
    partial = [v for v in VALID if v["tag"] == WriteRequest.TAG and v["fields"].get("partial")]
    assert partial, "no vector for a partial write"
    assert all(v["version"] >= kp.PARTIAL_LAYOUT_VERSION for v in partial)
    whole = [v for v in VALID if v["tag"] == WriteRequest.TAG and not v["fields"].get("partial")]
    assert {v["version"] for v in whole} == set(kp.PROTOCOL_VERSIONS)


def test_partial_deliver_vectors_need_version_2() -> None:
    partial = [v for v in VALID if v["tag"] == Deliver.TAG and v["fields"].get("partial")]
    assert partial, "no vector for a partial deliver"
    assert all(v["version"] >= kp.PARTIAL_LAYOUT_VERSION for v in partial)
    for vec in partial:
        obj = msgpack.unpackb(bytes.fromhex(vec["hex"]), raw=False)
        assert obj["partial"] is True and "!partial" not in obj
    plain = [v for v in VALID if v["tag"] == Deliver.TAG and not v["fields"].get("partial")]
    assert {v["version"] for v in plain} == set(kp.PROTOCOL_VERSIONS)
    for vec in plain:
        obj = msgpack.unpackb(bytes.fromhex(vec["hex"]), raw=False)
        assert obj.get("partial", False) is False
        assert ("partial" in obj) == (vec["version"] >= kp.PARTIAL_LAYOUT_VERSION)


def test_base_encoded_messages_travel_at_version_1() -> None:
    for vec in VALID:
        if kp.MESSAGE_BY_TAG[vec["tag"]] in BASE_ENCODED:
            assert vec["wire_version"] == kp.BASE_VERSION
        else:
            assert vec["wire_version"] == vec["version"]


def test_vectors_cover_defaults_omitted_and_present() -> None:
    omitted = present = 0
    for vec in VALID:
        cls = kp.MESSAGE_BY_TAG[vec["tag"]]
        optional = [f.name for f in cls.FIELDS if not f.required and not f.must_understand]
        if optional and all(name not in vec["fields"] for name in optional):
            omitted += 1
        if optional and all(name in vec["fields"] for name in optional):
            present += 1
    assert omitted >= 5 and present >= 5
    assert any("defaulted fields omitted" in a["description"] for v in VALID for a in v.get("accept", []))


def test_invalid_vectors_cover_every_frame_level_code() -> None:
    codes = {v["error"] for v in INVALID}
    expected = {
        "MALFORMED",
        "NOT_A_MAP",
        "MISSING_FIELD",
        "WRONG_TYPE",
        "OUT_OF_RANGE",
        "TOO_LARGE",
        "TOO_MANY",
        "UNKNOWN_TYPE",
        "UNSUPPORTED_VERSION",
        "MUST_UNDERSTAND",
    }
    assert expected <= codes
