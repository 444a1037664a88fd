"""The conformance vectors in spec/vectors/ against the codec."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

import kvcr_protocol as kp
from kvcr_protocol.messages import BASE_ENCODED, Deliver, Message, WriteRequest
from kvcr_protocol.wire import AnyMap, Bool, Bytes, EnumStr, Opt, Record, RecordType, Seq, Str, UInt, WireType

VECTORS = Path(__file__).resolve().parents[2] / "spec" / "vectors"
VALID: list[dict[str, Any]] = json.loads((VECTORS / "valid.json").read_text(encoding="utf-8"))["vectors"]
INVALID: list[dict[str, Any]] = json.loads((VECTORS / "invalid.json").read_text(encoding="utf-8"))["vectors"]


def value_from_json(wt: WireType[Any], value: Any) -> Any:
    """One field value from its JSON form."""
    if isinstance(wt, Bytes):
        assert set(value) == {"hex"}
        return bytes.fromhex(value["hex"])
    if isinstance(wt, EnumStr):
        return wt.enum_type(value)
    if isinstance(wt, Opt):
        return None if value is None else value_from_json(wt.inner, value)
    if isinstance(wt, Seq):
        assert isinstance(value, list)
        return tuple(value_from_json(wt.item, v) for v in value)
    if isinstance(wt, RecordType):
        return object_from_json(wt.cls, value)
    if isinstance(wt, (UInt, Bool, Str, AnyMap)):
        return value
    raise TypeError(type(wt).__name__)


def object_from_json(cls: type[Message] | type[Record], obj: dict[str, Any]) -> Any:
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
        assert vec["version"] in kp.SUPPORTED_VERSIONS
    for vec in INVALID:
        assert {"name", "max_version", "error", "path", "description", "hex"} <= set(vec)
        assert vec["error"] in kp.ErrorCode.__members__


@pytest.mark.parametrize("vec", VALID, ids=[v["name"] for v in VALID])
def test_valid_vector(vec: dict[str, Any]) -> None:
    msg = message_of(vec)
    frame = bytes.fromhex(vec["hex"])
    assert kp.encode(msg, vec["version"]) == frame
    assert kp.decode(frame, vec["version"]) == msg
    # A version-1 frame stays readable by an endpoint that speaks more.
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
    # Every message is expressible at every version; only a partial write or deliver needs version 2.
    have: dict[str, set[int]] = {}
    for vec in VALID:
        have.setdefault(vec["tag"], set()).add(vec["version"])
    for cls in kp.ALL_MESSAGES:
        assert have.get(cls.TAG, set()) >= set(kp.SUPPORTED_VERSIONS), cls.TAG
    assert set(have) == {cls.TAG for cls in kp.ALL_MESSAGES}


def test_partial_write_vectors_are_version_2_only() -> None:
    partial = [v for v in VALID if v["tag"] == WriteRequest.TAG and v["fields"].get("partial")]
    assert partial, "no vector for a partial write"
    assert all(v["version"] == kp.PARTIAL_LAYOUT_VERSION for v in partial)
    whole = [v for v in VALID if v["tag"] == WriteRequest.TAG and not v["fields"].get("partial")]
    assert {v["version"] for v in whole} == set(kp.SUPPORTED_VERSIONS)


def test_partial_deliver_vectors_are_version_2_only() -> None:
    partial = [v for v in VALID if v["tag"] == Deliver.TAG and v["fields"].get("partial")]
    assert partial, "no vector for a partial deliver"
    assert all(v["version"] == kp.PARTIAL_LAYOUT_VERSION for v in partial)
    for vec in partial:
        obj = msgpack.unpackb(bytes.fromhex(vec["hex"]), raw=False)
        assert obj["partial"] is True and "!partial" not in obj
    plain = [v for v in VALID if v["tag"] == Deliver.TAG and not v["fields"].get("partial")]
    assert {v["version"] for v in plain} == set(kp.SUPPORTED_VERSIONS)
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
