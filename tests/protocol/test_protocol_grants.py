"""Read grants on the wire (version 5, spec section 6.12): columns, checks, versions."""

from __future__ import annotations

import msgpack
import pytest

import kvcr_protocol as kp
from kvcr_protocol import ErrorCode, LeaseColumns, LeaseReply, LeaseStatus, LocalProtocolError, RemoteProtocolError

NODE = kp.GrantNode("kvcr-node-a", b"md", (kp.Region(0, kp.MemoryKind.DRAM, 0, 0x1000, 1 << 20),), 10_000)
ANSWERS = LeaseColumns(bytes([LeaseStatus.LEASED, LeaseStatus.MISS, LeaseStatus.LEASED]), bytes(3), ("dram",))


def grant() -> kp.LeaseGrant:
    return kp.grant_columns([(("a", "b"), [(0, 3), (0, 4)]), None, (("a", "b"), [(0, 9), (0, 1)])], NODE)


def test_a_grant_names_each_granted_key_once_per_layout_and_reads_back_in_order() -> None:
    g = grant()
    assert g.layouts == ("a\0b",) and len(g) == 3
    assert list(g.keys(kp.DEFAULT_LIMITS)) == [(0, ("a", "b"), b"\0\0", [3, 4]), (2, ("a", "b"), b"\0\0", [9, 1])]
    reply = LeaseReply(7, 42, 5000, ANSWERS, True, g)
    assert kp.decode(kp.encode(reply, 5)) == reply


def test_version_5_fields_cannot_travel_at_version_4_and_unused_ones_do_not_travel() -> None:
    with pytest.raises(LocalProtocolError) as info:
        kp.encode(LeaseReply(7, 42, 5000, ANSWERS, True, grant()), 4)
    assert info.value.code is ErrorCode.UNSUPPORTED_VERSION
    with pytest.raises(LocalProtocolError):
        kp.encode(kp.Lease(1, (b"k",), read=True), 4)
    plain = kp.Lease(1, (b"k",))
    v4, v5 = msgpack.unpackb(kp.encode(plain, 4)), msgpack.unpackb(kp.encode(plain, 5))
    assert {**v4, "v": 5} == v5
    assert set(msgpack.unpackb(kp.encode(kp.Lease(1, (b"k",), read=True, node_md=True), 5))) >= {"!read", "!node_md"}


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"pool": b"\0"}, ErrorCode.OUT_OF_RANGE),  # fewer spans than the layouts name
        ({"slot": b"\0" * 12}, ErrorCode.OUT_OF_RANGE),  # slots and pools disagree
        ({"layout": kp.columns.pack([2, 0, 1], "I")}, ErrorCode.OUT_OF_RANGE),  # past the table
    ],
)
def test_a_grant_whose_columns_disagree_is_refused(change: dict[str, bytes], code: ErrorCode) -> None:
    g = grant()
    wire = msgpack.unpackb(kp.encode(LeaseReply(7, 42, 5000, ANSWERS, True, g), 5))
    fields = dict(zip(("layout", "layouts", "pool", "slot", "node"), wire["!grant"], strict=True))
    fields.update(change)
    wire["!grant"] = list(fields.values())
    with pytest.raises(RemoteProtocolError) as info:
        kp.decode(msgpack.packb(wire, use_bin_type=True))
    assert info.value.code is code


def test_a_grant_for_fewer_keys_than_answered_is_refused() -> None:
    short = kp.grant_columns([None, None])
    wire = msgpack.unpackb(kp.encode(LeaseReply(7, 42, 5000, ANSWERS, True, grant()), 5))
    wire["!grant"] = msgpack.unpackb(kp.encode(LeaseReply(7, 42, 5000, LeaseColumns(bytes(2), bytes(2), ("",)), True, short), 5))["!grant"]
    with pytest.raises(RemoteProtocolError) as info:
        kp.decode(msgpack.packb(wire, use_bin_type=True))
    assert info.value.code is ErrorCode.OUT_OF_RANGE and info.value.path == "grant"


def test_huge_grants_meet_the_span_limit() -> None:
    n = kp.DEFAULT_LIMITS.max_spans + 1
    wire = msgpack.unpackb(kp.encode(LeaseReply(7, 42, 5000, ANSWERS, True, grant()), 5))
    wire["!grant"][2], wire["!grant"][3] = bytes(n), bytes(4 * n)
    with pytest.raises(RemoteProtocolError) as info:
        kp.decode(msgpack.packb(wire, use_bin_type=True))
    assert info.value.code is ErrorCode.TOO_MANY
