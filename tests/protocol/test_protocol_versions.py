"""Version negotiation and the must-understand rule."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

import kvcr_protocol as kp
from kvcr_protocol import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError
from kvcr_protocol.messages import Deliver, DeliverItem, DstSpan, Hello, PeerHello, Query, WriteRequest

ITEM = DeliverItem(b"\x01" * 16, (DstSpan("L0", 2, 0, 65536),))
PARTIAL = WriteRequest(7, "client-agent", (ITEM,), 500, partial=True)
WHOLE = WriteRequest(8, "client-agent", (ITEM,), 500)
DELIVER_PARTIAL = Deliver(9, (ITEM,), "req", 250, partial=True)
DELIVER = Deliver(9, (ITEM,), "req", 250)


def pack(obj: Any) -> bytes:
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


def unpack(frame: bytes) -> dict[str, Any]:
    obj: dict[str, Any] = msgpack.unpackb(frame, raw=False)
    return obj


def refused(frame: bytes, max_version: int) -> RemoteProtocolError:
    """The error that decoding ``frame`` at ``max_version`` raises."""
    with pytest.raises(RemoteProtocolError) as info:
        kp.decode(frame, max_version)
    return info.value


# ---------------------------------------------------------------- negotiation


@pytest.mark.parametrize(
    ("ours", "theirs", "agreed"),
    [(1, 1, 1), (1, 2, 1), (2, 1, 1), (2, 2, 2), (1, 3, 1), (3, 1, 1), (2, 3, 2), (3, 2, 2), (3, 3, 3),
     (4, 1, 1), (1, 4, 1), (4, 2, 2), (2, 4, 2), (4, 3, 3), (3, 4, 3), (4, 4, 4),
     (5, 1, 1), (1, 5, 1), (5, 2, 2), (2, 5, 2), (5, 3, 3), (3, 5, 3), (5, 4, 4), (4, 5, 4), (5, 5, 5)],
)
def test_negotiation_matrix(ours: int, theirs: int, agreed: int) -> None:
    assert kp.negotiate(kp.supported_up_to(ours), kp.supported_up_to(theirs)) == agreed


def test_negotiation_is_symmetric() -> None:
    for a in kp.PROTOCOL_VERSIONS:
        for b in kp.PROTOCOL_VERSIONS:
            ours, theirs = kp.supported_up_to(a), kp.supported_up_to(b)
            assert kp.negotiate(ours, theirs) == kp.negotiate(theirs, ours) == min(a, b)


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [((1,), (2,)), ((2,), (1,)), ((1, 2), (3, 4)), ((1,), ()), ((3,), (1, 2)), ((1, 2), (3,)), ((4,), (1, 2, 3)), ((1, 2, 3), (4,)),
     ((5,), (1, 2, 3, 4)), ((1, 2, 3, 4), (5,))],
)
def test_no_common_version(ours: tuple[int, ...], theirs: tuple[int, ...]) -> None:
    with pytest.raises(ProtocolError) as info:
        kp.negotiate(ours, theirs)
    assert info.value.code is ErrorCode.UNSUPPORTED_VERSION


def test_negotiation_ignores_unknown_newer_versions() -> None:
    assert kp.negotiate((1, 2), (1, 2, 3, 17)) == 2
    assert kp.negotiate(kp.PROTOCOL_VERSIONS, (1, 2, 3, 17)) == 3
    assert kp.negotiate(kp.PROTOCOL_VERSIONS, (1, 2, 3, 4, 17)) == 4
    assert kp.negotiate(kp.PROTOCOL_VERSIONS, (1, 2, 3, 4, 5, 17)) == 5


def test_supported_up_to() -> None:
    assert kp.supported_up_to(1) == (1,)
    assert kp.supported_up_to(2) == (1, 2)
    assert kp.supported_up_to(3) == (1, 2, 3)
    assert kp.supported_up_to(4) == (1, 2, 3, 4)
    assert kp.supported_up_to(5) == (1, 2, 3, 4, 5)
    assert kp.supported_up_to(kp.CURRENT_VERSION) == kp.PROTOCOL_VERSIONS


@pytest.mark.parametrize("cap", [0, 6, -1, 99])
def test_supported_up_to_refuses_unknown_caps(cap: int) -> None:
    with pytest.raises(ValueError, match="max_version"):
        kp.supported_up_to(cap)


def test_version_constants() -> None:
    assert kp.BASE_VERSION == 1
    assert kp.COLUMNS_VERSION == 3
    assert kp.LEASES_VERSION == 4
    assert kp.PROTOCOL_VERSIONS == (1, 2, 3, 4, 5) and kp.CURRENT_VERSION == kp.CLIENT_GONE_VERSION == 5
    # One tuple names the versions, one constant the newest: the reference node and client
    # offer every version the package speaks.
    assert kp.CURRENT_VERSION == max(kp.PROTOCOL_VERSIONS) == 5
    assert kp.PARTIAL_LAYOUT_VERSION in kp.PROTOCOL_VERSIONS
    for stale in ("SUPPORTED_VERSIONS", "LATEST_VERSION"):
        assert not hasattr(kp, stale) and not hasattr(kp.versions, stale)


# ----------------------------------------------------------- must-understand


def test_partial_write_encodes_at_version_2_with_the_bang_key() -> None:
    frame = kp.encode(PARTIAL, 2)
    obj = unpack(frame)
    assert obj["v"] == 2 and obj["!partial"] is True and "partial" not in obj
    assert kp.decode(frame, 2) == PARTIAL


def test_whole_write_omits_the_must_understand_field() -> None:
    for version in (1, 2):
        obj = unpack(kp.encode(WHOLE, version))
        assert "!partial" not in obj
        assert kp.decode(kp.encode(WHOLE, version), version) == WHOLE


@pytest.mark.parametrize("msg", [PARTIAL, DELIVER_PARTIAL], ids=["write", "deliver"])
def test_partial_cannot_be_encoded_at_version_1(msg: WriteRequest | Deliver) -> None:
    with pytest.raises(LocalProtocolError) as info:
        kp.encode(msg, 1)
    assert (info.value.code, info.value.path) == (ErrorCode.UNSUPPORTED_VERSION, "partial")


def test_version_2_partial_write_reaching_a_version_1_endpoint() -> None:
    assert refused(kp.encode(PARTIAL, 2), 1).code is ErrorCode.UNSUPPORTED_VERSION


@pytest.mark.parametrize("max_version", [1, 2])
def test_version_1_frame_carrying_partial_is_refused(max_version: int) -> None:
    obj = unpack(kp.encode(WHOLE, 1))
    obj["!partial"] = True
    error = refused(pack(obj), max_version)
    assert (error.code, error.path) == (ErrorCode.MUST_UNDERSTAND, "!partial")


def test_unbanged_partial_is_an_ignored_optional_field() -> None:
    # Without "!", "partial" is just an unknown optional key: it never makes a subset.
    obj = unpack(kp.encode(WHOLE, 2))
    obj["partial"] = True
    assert kp.decode(pack(obj), 2) == WHOLE


# ------------------------------------------------------- deliver's partial flag


def test_partial_deliver_encodes_at_version_2_without_a_bang() -> None:
    # On deliver, partial is an ordinary optional field (not must-understand).
    obj = unpack(kp.encode(DELIVER_PARTIAL, 2))
    assert obj["v"] == 2 and obj["partial"] is True and "!partial" not in obj
    assert kp.decode(kp.encode(DELIVER_PARTIAL, 2), 2) == DELIVER_PARTIAL


def test_plain_deliver_carries_partial_false_at_version_2_only() -> None:
    assert unpack(kp.encode(DELIVER, 2))["partial"] is False
    assert "partial" not in unpack(kp.encode(DELIVER, 1))
    for version in (1, 2):
        assert kp.decode(kp.encode(DELIVER, version), version) == DELIVER


@pytest.mark.parametrize("max_version", [1, 2])
@pytest.mark.parametrize("value", [True, 1, "yes", None])
def test_version_1_deliver_ignores_a_partial_key(max_version: int, value: object) -> None:
    # Version 1 has no such field: the key is an unknown optional one, whatever it holds.
    obj = unpack(kp.encode(DELIVER, 1))
    obj["partial"] = value
    assert kp.decode(pack(obj), max_version) == DELIVER


def test_partial_deliver_reaching_a_version_1_node() -> None:
    assert refused(kp.encode(DELIVER_PARTIAL, 2), 1).code is ErrorCode.UNSUPPORTED_VERSION


@pytest.mark.parametrize("value", [1, 0, "true", None, [True]])
def test_partial_deliver_flag_must_be_a_bool(value: object) -> None:
    obj = unpack(kp.encode(DELIVER_PARTIAL, 2))
    obj["partial"] = value
    error = refused(pack(obj), 2)
    assert (error.code, error.path) == (ErrorCode.WRONG_TYPE, "partial")


def test_partial_deliver_flag_absent_means_false() -> None:
    obj = unpack(kp.encode(DELIVER, 2))
    del obj["partial"]
    assert kp.decode(pack(obj), 2) == DELIVER


def test_bang_partial_on_deliver_is_refused() -> None:
    obj = unpack(kp.encode(DELIVER, 2))
    obj["!partial"] = True
    error = refused(pack(obj), 2)
    assert (error.code, error.path) == (ErrorCode.MUST_UNDERSTAND, "!partial")


def test_unknown_optional_fields_are_ignored() -> None:
    for version in kp.PROTOCOL_VERSIONS:
        obj = unpack(kp.encode(Query(3, (b"k",), "r"), version))
        obj["x_new"] = [1, 2, {"a": b"b"}]
        obj["priority"] = 9
        assert kp.decode(pack(obj), version) == Query(3, (b"k",), "r")


@pytest.mark.parametrize("key", ["!x", "!", "!partial2", "!request_id"])
def test_unknown_must_understand_field_is_refused(key: str) -> None:
    obj = unpack(kp.encode(Query(3, (b"k",)), 2))
    obj[key] = False
    assert refused(pack(obj), 2).code is ErrorCode.MUST_UNDERSTAND


def test_every_must_understand_field_is_banged_and_versioned() -> None:
    for cls in kp.ALL_MESSAGES:
        for f in cls.FIELDS:
            assert f.key.startswith("!") == f.must_understand
            if f.must_understand:
                assert not f.required and f.since > kp.BASE_VERSION


# ------------------------------------------------------------ version rules


@pytest.mark.parametrize("cls", [Hello, PeerHello])
@pytest.mark.parametrize("version", [1, 2])
def test_hellos_always_travel_at_version_1(cls: type[Hello] | type[PeerHello], version: int) -> None:
    if cls is Hello:
        msg: Hello | PeerHello = Hello(1, (1, 2), "c", "a", b"md")
    else:
        msg = PeerHello(1, (1, 2), "n", 5, "a", b"md")
    frame = kp.encode(msg, version)
    assert unpack(frame)["v"] == 1
    assert kp.decode(frame, 1) == msg


@pytest.mark.parametrize("v", [0, 2, 3, 4, 5, 6, 99, (1 << 64) - 1])
def test_hello_is_readable_at_any_version(v: int) -> None:
    hello = Hello(1, (1, 2, 3, 4), "c", "a", b"")
    obj = unpack(kp.encode(hello))
    obj["v"] = v
    assert kp.decode(pack(obj), 1) == hello


def test_version_1_frames_are_readable_by_version_2() -> None:
    assert kp.decode(kp.encode(WHOLE, 1), 2) == WHOLE


@pytest.mark.parametrize("version", [0, kp.CURRENT_VERSION + 1])
def test_cannot_encode_at_an_unknown_version(version: int) -> None:
    with pytest.raises(LocalProtocolError) as info:
        kp.encode(WHOLE, version)
    assert info.value.code is ErrorCode.UNSUPPORTED_VERSION


def test_what_each_version_adds() -> None:
    added = {(f.since, cls.TAG, f.key) for cls in kp.ALL_MESSAGES for f in cls.FIELDS if f.since > 1}
    assert added == {
        (2, "write", "!partial"), (2, "deliver", "partial"),
        (3, "deposit", "!columns"), (3, "deliver", "!columns"), (3, "deliver", "!notify"), (3, "write", "!columns"),
        (3, "write", "!notify"), (3, "query", "!prefix"), (3, "query_reply", "!columns"),
        (3, "complete", "done"), (3, "write_done", "done"),
        (5, "lease", "!read"), (5, "lease", "!node_md"), (5, "lease_reply", "!held"), (5, "lease_reply", "!grant"),
        # Optional, sent only when set (spec section 7, "Further version-5 additions"): a
        # receiver without them ignores them and keeps the older behaviour.
        (5, "welcome", "resume"), (5, "peer_welcome", "twins"), (5, "welcome", "kept"), (5, "stats", "audit"),
    }
    assert {(cls.SINCE, cls.TAG) for cls in kp.ALL_MESSAGES if cls.SINCE > 1} == {
        (3, "progress"), (4, "lease"), (4, "lease_reply"), (4, "renew"), (4, "unlease"), (4, "lease_end"),
        (5, "peer_forget"), (5, "put"), (5, "put_reply"), (5, "commit"), (5, "unput"), (5, "suspect"),
    }
    # Version 4 adds messages only, nothing must-understand; version 5's fields (read grants,
    # on version-4 messages) are all must-understand, so a frame that does not use them is
    # the version-4 frame with v = 5.
    for cls in kp.ALL_MESSAGES:
        if cls.SINCE in (kp.LEASES_VERSION, kp.CLIENT_GONE_VERSION):
            assert all(f.must_understand == (f.since == kp.GRANTS_VERSION) for f in cls.FIELDS), cls.TAG
    # Everything version 3 adds that changes what a message means is must-understand.
    for cls in kp.ALL_MESSAGES:
        for f in cls.FIELDS:
            if f.since == 3:
                assert f.must_understand == (f.name != "done"), (cls.TAG, f.key)


# ------------------------------------------------------------------ version 3

BLOCK = kp.deliver_columns([ITEM, DeliverItem(b"\x02" * 16, (DstSpan("L0", 2, 65536, 65536),))], groups=[0])
V3_ONLY: list[kp.Message] = [
    Deliver(9, (), columns=(BLOCK,)),
    Deliver(9, (ITEM,), notify=7),
    WriteRequest(8, "a", (), columns=(BLOCK,)),
    WriteRequest(8, "a", (ITEM,), notify=kp.WriteNotify(7, 9, b"\x00\x00\x00\x00")),
    kp.Deposit(3, (), columns=(kp.deposit_columns([kp.DepositItem(b"k", (kp.SrcSpan("L0", "full", 1, 0, 8),))]),)),
    Query(3, (b"k",), prefix=kp.PREFIX_ALL),
    kp.QueryReply(3, (), kp.QueryColumns(b"\x01", b"\x00", ("dram",))),
    kp.Completion(9, (kp.KeyResult(kp.KeyStatus.OK),), b"\x01\x00\x00\x00"),
    kp.WriteDone(8, (kp.KeyResult(kp.KeyStatus.OK),), b"\x01\x00\x00\x00"),
    kp.Progress(9, b"\x00\x00\x00\x00", b"\x01\x00\x00\x00"),
]


@pytest.mark.parametrize("msg", V3_ONLY, ids=lambda m: type(m).TAG)
@pytest.mark.parametrize("version", [1, 2])
def test_version_3_content_cannot_be_encoded_for_an_older_peer(msg: kp.Message, version: int) -> None:
    # Never a silent drop: the sender learns it must use the older form.
    with pytest.raises(LocalProtocolError) as info:
        kp.encode(msg, version)
    assert info.value.code is ErrorCode.UNSUPPORTED_VERSION


@pytest.mark.parametrize("msg", V3_ONLY, ids=lambda m: type(m).TAG)
def test_version_3_content_round_trips_and_is_refused_below_3(msg: kp.Message) -> None:
    frame = kp.encode(msg, 3)
    assert kp.decode(frame, 3) == msg
    assert refused(frame, 2).code in (ErrorCode.UNSUPPORTED_VERSION, ErrorCode.UNKNOWN_TYPE)
    obj = unpack(frame)
    obj["v"] = 2
    # The same keys in a v=2 frame: unknown must-understand keys, or a message version 2 lacks.
    if type(msg) is not kp.Progress and not any(k.startswith("!") for k in obj):
        return  # only the optional done column: ignored at version 2
    assert refused(pack(obj), 3).code in (ErrorCode.MUST_UNDERSTAND, ErrorCode.UNKNOWN_TYPE)


def test_optional_done_is_ignored_in_a_version_2_frame() -> None:
    obj = unpack(kp.encode(kp.Completion(9, (kp.KeyResult(kp.KeyStatus.OK),)), 2))
    obj["done"] = b"\x01\x00\x00\x00"
    assert kp.decode(pack(obj), 3) == kp.Completion(9, (kp.KeyResult(kp.KeyStatus.OK),))


@pytest.mark.parametrize("max_version", [1, 2, 3])
def test_progress_is_unknown_below_version_3(max_version: int) -> None:
    frame = kp.encode(kp.Progress(9, b"", b""), 3)
    obj = unpack(frame)
    obj["v"] = min(max_version, 2)
    assert (refused(pack(obj), max_version).code, refused(pack(obj), max_version).path) == (ErrorCode.UNKNOWN_TYPE, "t")


@pytest.mark.parametrize("version", [1, 2])
def test_older_messages_read_the_same_at_version_3(version: int) -> None:
    # A v3 endpoint reads every v1/v2 frame by its own version's rules.
    for msg in (WHOLE, DELIVER, Query(3, (b"k",), "r"), kp.Completion(3, (kp.KeyResult(kp.KeyStatus.OK),))):
        assert kp.decode(kp.encode(msg, version), 3) == msg


def test_version_3_frames_of_old_messages_differ_only_in_v_and_new_optional_fields() -> None:
    for msg in (WHOLE, DELIVER, Query(3, (b"k",), "r"), kp.Completion(3, (kp.KeyResult(kp.KeyStatus.OK),))):
        v2, v3 = unpack(kp.encode(msg, 2)), unpack(kp.encode(msg, 3))
        assert v3.pop("v") == 3 and v2.pop("v") == 2
        assert {k: v for k, v in v3.items() if k != "done"} == v2


# ------------------------------------------------------------------ version 4

V4_ONLY: list[kp.Message] = [
    kp.Lease(60, (b"k1", b"k2"), "req", 5000),
    kp.Lease(61, ()),
    kp.LeaseReply(60, 42, 5000, kp.LeaseColumns(b"\x01\x02", b"\x00\x01", ("dram", "remote"))),
    kp.LeaseReply(61, 0, 30000, kp.LeaseColumns(b"", b"", ())),
    kp.LeaseReply(62, 42, 60000),
    kp.RenewLease(62, 42, 60000),
    kp.RenewLease(63, 42),
    kp.ReleaseLease(64, 42),
    kp.LeaseEnded(1, 42, ErrorCode.LEASE_EXPIRED),
    kp.LeaseEnded(2, 42, ErrorCode.PEER_RESTARTED, "source restarted", (b"k2",)),
]


@pytest.mark.parametrize("msg", V4_ONLY, ids=lambda m: type(m).TAG)
@pytest.mark.parametrize("version", [1, 2, 3])
def test_lease_messages_cannot_be_encoded_for_an_older_peer(msg: kp.Message, version: int) -> None:
    with pytest.raises(LocalProtocolError) as info:
        kp.encode(msg, version)
    assert (info.value.code, info.value.path) == (ErrorCode.UNSUPPORTED_VERSION, "t")


@pytest.mark.parametrize("msg", V4_ONLY, ids=lambda m: type(m).TAG)
def test_lease_messages_round_trip_at_4_and_are_unknown_below(msg: kp.Message) -> None:
    frame = kp.encode(msg, 4)
    assert unpack(frame)["v"] == 4
    assert kp.decode(frame, 4) == msg
    for max_version in (1, 2, 3):
        # An endpoint that speaks up to 3 knows no such tag: the tag is checked first.
        error = refused(frame, max_version)
        assert (error.code, error.path) == (ErrorCode.UNKNOWN_TYPE, "t")
    for v in (1, 2, 3):
        obj = unpack(frame)
        obj["v"] = v
        error = refused(pack(obj), 4)
        assert (error.code, error.path) == (ErrorCode.UNKNOWN_TYPE, "t")


@pytest.mark.parametrize("version", [1, 2, 3])
def test_older_messages_read_the_same_at_version_4(version: int) -> None:
    for msg in (WHOLE, DELIVER, Query(3, (b"k",), "r"), kp.Completion(3, (kp.KeyResult(kp.KeyStatus.OK),))):
        assert kp.decode(kp.encode(msg, version), 4) == msg


def test_version_4_frames_of_old_messages_differ_only_in_v() -> None:
    for msg in (*V3_ONLY, WHOLE, DELIVER, PARTIAL, Query(3, (b"k",), "r"), kp.Heartbeat(5)):
        v3, v4 = unpack(kp.encode(msg, 3)), unpack(kp.encode(msg, 4))
        assert v4.pop("v") == 4 and v3.pop("v") == 3
        assert v3 == v4
        assert kp.decode(kp.encode(msg, 4), 4) == msg


def test_lease_columns_agree_with_their_statuses() -> None:
    columns = kp.LeaseColumns(bytes([0, 1, 2, 3, 4, 5, 6]), bytes([0, 1, 2, 1, 1, 2, 2]), ("", "dram", "remote"))
    assert list(columns) == list(kp.LeaseStatus)
    assert columns.held_count() == 2 and kp.HELD == {kp.LeaseStatus.LEASED, kp.LeaseStatus.LEASED_REMOTE}
    assert columns.status_of(2) is kp.LeaseStatus.LEASED_REMOTE and columns.tier_of(2) == "remote"
    assert [int(s) for s in kp.LeaseStatus] == list(range(7))


@pytest.mark.parametrize(
    ("columns", "path"),
    [
        ([b"\x01\x01", b"\x00", ["dram"]], "columns.tier"),
        ([b"\x01\x07", b"\x00\x00", ["dram"]], "columns.status[1]"),
        ([b"\x01", b"\x01", ["dram"]], "columns.tier[0]"),
        ([b"\x01", b"\x00", []], "columns.tier[0]"),
    ],
)
def test_lease_columns_that_disagree_are_refused(columns: list[object], path: str) -> None:
    obj = unpack(kp.encode(kp.LeaseReply(60, 42, 5000, kp.LeaseColumns(b"", b"", ())), 4))
    obj["columns"] = columns
    error = refused(pack(obj), 4)
    assert (error.code, error.path) == (ErrorCode.OUT_OF_RANGE, path)


# ------------------------------------------------------------------ version 5

FORGET = kp.PeerForget(310, "client-agent")


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_peer_forget_cannot_be_encoded_for_an_older_peer(version: int) -> None:
    # Never a silent drop: a target whose session agreed below 5 sends none (spec section 7).
    with pytest.raises(LocalProtocolError) as info:
        kp.encode(FORGET, version)
    assert (info.value.code, info.value.path) == (ErrorCode.UNSUPPORTED_VERSION, "t")


def test_peer_forget_round_trips_at_5_and_is_unknown_below() -> None:
    frame = kp.encode(FORGET, 5)
    assert unpack(frame) == {"v": 5, "t": "peer_forget", "id": 310, "agent": "client-agent"}
    assert kp.decode(frame, 5) == FORGET
    for max_version in (1, 2, 3, 4):
        error = refused(frame, max_version)
        assert (error.code, error.path) == (ErrorCode.UNKNOWN_TYPE, "t")
    for v in (1, 2, 3, 4):
        obj = unpack(frame)
        obj["v"] = v
        error = refused(pack(obj), 5)
        assert (error.code, error.path) == (ErrorCode.UNKNOWN_TYPE, "t")


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_older_messages_read_the_same_at_version_5(version: int) -> None:
    for msg in (WHOLE, DELIVER, Query(3, (b"k",), "r"), kp.Completion(3, (kp.KeyResult(kp.KeyStatus.OK),))):
        assert kp.decode(kp.encode(msg, version), 5) == msg


def test_version_5_frames_of_old_messages_differ_only_in_v() -> None:
    for msg in (*V3_ONLY, *V4_ONLY, WHOLE, DELIVER, PARTIAL, kp.Heartbeat(5)):
        v4, v5 = unpack(kp.encode(msg, 4)), unpack(kp.encode(msg, 5))
        assert v5.pop("v") == 5 and v4.pop("v") == 4
        assert v4 == v5
        assert kp.decode(kp.encode(msg, 5), 5) == msg
