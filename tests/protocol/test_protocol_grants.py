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
        ({"source": b"\0\0"}, ErrorCode.OUT_OF_RANGE),  # a source column shorter than the keys
        ({"source": b"\1\0\0"}, ErrorCode.OUT_OF_RANGE),  # a source past the (empty) table
        ({"digest": b"\0" * 8}, ErrorCode.OUT_OF_RANGE),  # fewer digests than granted spans
        ({"digest": b"\0" * 7}, ErrorCode.OUT_OF_RANGE),  # not whole u64s
    ],
)
def test_a_grant_whose_columns_disagree_is_refused(change: dict[str, bytes], code: ErrorCode) -> None:
    g = grant()
    wire = msgpack.unpackb(kp.encode(LeaseReply(7, 42, 5000, ANSWERS, True, g), 5))
    fields = dict(zip(("layout", "layouts", "pool", "slot", "node", "source", "sources", "digest"), wire["!grant"],
                      strict=True))
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


def test_a_grant_passed_on_from_a_source_round_trips() -> None:
    """A target's grant names per key the node whose pools its row indexes (spec section
    6.12, "Across nodes"); the source's agent travels with its slot sizes."""
    node = kp.GrantNode("kvcr-node-b", b"md-b", (kp.Region(0, kp.MemoryKind.DRAM, 0, 1 << 20, 1 << 16),), 10_000,
                        kp.columns.pack([4096], "I"))
    g = kp.grant_columns([(("k", "v"), [(0, 1), (0, 2)]), None, (("k",), [(0, 9)])], None, [0, 0, 1],
                         (kp.GrantSource("tcp://127.0.0.1:5555", 3, node),))
    back = kp.decode(kp.encode(LeaseReply(7, 42, 5000, ANSWERS, True, g), 5))
    assert isinstance(back, LeaseReply) and back.grant == g
    assert back.grant.source_of(0) is None and back.grant.source_of(2) == g.sources[0]
    assert node.slot_sizes() == [4096]
    local = kp.grant_columns([(("k",), [(0, 1)]), None, None])
    assert local.source == b"" and local.sources == () and local.source_of(0) is None


def test_a_source_agent_whose_slot_sizes_disagree_is_refused() -> None:
    node = kp.GrantNode("kvcr-node-b", b"md-b", (kp.Region(0, kp.MemoryKind.DRAM, 0, 1 << 20, 1 << 16),), 0,
                        kp.columns.pack([4096, 4096], "I"))
    g = kp.grant_columns([(("k",), [(0, 1)]), None, None], None, [1, 0, 0], (kp.GrantSource("tcp://127.0.0.1:5555", 3, node),))
    with pytest.raises(RemoteProtocolError) as info:
        kp.decode(kp.encode(LeaseReply(7, 42, 5000, ANSWERS, True, g), 5))
    assert info.value.code is ErrorCode.OUT_OF_RANGE and info.value.path.endswith("slot_size")
