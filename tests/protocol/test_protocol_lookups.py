"""Query columns and prefix queries (version 3): the same answers as records, read lazily."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcr_protocol as kp
from kvcr_protocol import ErrorCode, Presence, QueryResult

SETTINGS = settings(max_examples=200, deadline=None)
HIT, WRITING, HINTED, ABSENT = (
    QueryResult(Presence.HIT, "dram"),
    QueryResult(Presence.FETCHING, "dram"),
    QueryResult(Presence.FETCHABLE, "remote"),
    QueryResult(Presence.MISS),
)
ANSWERS = st.sampled_from([HIT, QueryResult(Presence.HIT, "hbm:0"), QueryResult(Presence.HIT, "hbm:7"), WRITING, HINTED, ABSENT])
MASKS = st.sets(st.sampled_from([Presence.HIT, Presence.FETCHING, Presence.FETCHABLE]), min_size=1).map(
    lambda s: kp.prefix_mask(*s)
)


def prefix_of(results: list[QueryResult], mask: int) -> int:
    """The prefix length by the record form: the reference the columns must agree with."""
    count = 0
    for result in results:
        if not mask >> kp.PRESENCE_CODE[result.presence] & 1:
            break
        count += 1
    return count


@SETTINGS
@given(st.lists(ANSWERS, max_size=64), MASKS)
def test_columns_equal_the_record_form(results: list[QueryResult], mask: int) -> None:
    columns = kp.QueryColumns.from_results(results)
    assert len(columns) == len(results)
    assert columns.results() == tuple(results) and list(columns) == results
    for i, result in enumerate(results):
        assert columns[i] == result
        assert columns.presence_of(i) is result.presence and columns.tier_of(i) == result.tier
        assert kp.PRESENCE_BY_CODE[columns.state_of(i)] is result.presence
    assert columns.prefix_length(mask) == prefix_of(results, mask)
    reply = kp.QueryReply(5, (), columns)
    assert kp.decode(kp.encode(reply, 3), 3) == reply
    assert reply.view() == columns == kp.QueryReply(5, tuple(results)).view()


@pytest.mark.parametrize(
    ("results", "expected"),
    [
        ([], 0),
        ([ABSENT, HIT, HIT], 0),
        ([HIT, HIT, HIT], 3),
        ([HIT, HIT, ABSENT], 2),
        ([HIT, ABSENT, HIT], 1),
        ([HIT, WRITING, HIT], 1),
        ([HIT, HINTED], 1),
    ],
    ids=["empty", "first-missing", "all-present", "last-missing", "middle-missing", "writing-stops", "hinted-stops"],
)
def test_prefix_on_every_boundary(results: list[QueryResult], expected: int) -> None:
    mask = kp.prefix_mask(Presence.HIT)
    assert kp.QueryColumns.from_results(results).prefix_length(mask) == expected == prefix_of(results, mask)


def test_a_wider_mask_counts_writing_and_hinted_keys() -> None:
    columns = kp.QueryColumns.from_results([HIT, WRITING, HINTED, ABSENT, HIT])
    assert columns.prefix_length(kp.PREFIX_ALL) == 3
    assert columns.prefix_length(kp.prefix_mask(Presence.HIT, Presence.FETCHING)) == 2


@pytest.mark.parametrize("counted", [(), (Presence.MISS,), (Presence.HIT, Presence.MISS)])
def test_a_prefix_never_counts_misses(counted: tuple[Presence, ...]) -> None:
    with pytest.raises(ValueError, match="HIT, FETCHING and FETCHABLE"):
        kp.prefix_mask(*counted)


@pytest.mark.parametrize("mask", [1, 16, 0x11, 255])
def test_a_prefix_mask_outside_the_presences_is_refused(mask: int) -> None:
    frame = kp.encode(kp.Query(1, (b"k",), prefix=2), 3).replace(b"\xa7!prefix\x02", b"\xa7!prefix" + bytes([0xCC, mask]))
    with pytest.raises(kp.RemoteProtocolError) as info:
        kp.decode(frame, 3)
    assert (info.value.code, info.value.path) == (ErrorCode.OUT_OF_RANGE, "prefix")
    with pytest.raises(kp.LocalProtocolError):
        kp.encode(kp.Query(1, (b"k",), prefix=mask), 3)


def test_a_plain_query_has_no_prefix_on_the_wire() -> None:
    assert b"!prefix" not in kp.encode(kp.Query(1, (b"k",)), 3)


def test_too_many_tiers_cannot_be_sent() -> None:
    results = [QueryResult(Presence.HIT, f"hbm:{i}") for i in range(kp.DEFAULT_LIMITS.max_tiers + 1)]
    with pytest.raises(ValueError, match="distinct tiers"):
        kp.QueryColumns.from_results(results)


def test_keys_of_a_large_query_load_in_one_pass() -> None:
    keys = tuple(i.to_bytes(16, "little") for i in range(1, 4097))
    assert kp.decode(kp.encode(kp.Query(1, keys), 3), 3) == kp.Query(1, keys)
    bad = list(keys)
    bad[4000] = b""
    with pytest.raises(kp.RemoteProtocolError) as info:
        kp.decode(kp.encode(kp.Query(1, tuple(bad)), 3), 3)
    assert (info.value.code, info.value.path) == (ErrorCode.OUT_OF_RANGE, "keys[4000]")


@pytest.mark.parametrize(
    ("bad", "code"),
    [("text", ErrorCode.WRONG_TYPE), (7, ErrorCode.WRONG_TYPE), (b"", ErrorCode.OUT_OF_RANGE),
     (b"x" * 257, ErrorCode.TOO_LARGE), (None, ErrorCode.WRONG_TYPE), ([b"k"], ErrorCode.WRONG_TYPE)],
    ids=["str", "int", "empty", "too-long", "nil", "array"],
)
def test_one_bad_key_among_many_is_named(bad: object, code: ErrorCode) -> None:
    """The one-pass check of a key list falls back to naming the first key that fails."""
    frame = msgpack.packb({"v": 3, "t": "query", "id": 1, "keys": [b"a", b"b", bad, b"c"]}, use_bin_type=True)
    with pytest.raises(kp.RemoteProtocolError) as info:
        kp.decode(frame, 3)
    assert (info.value.code, info.value.path) == (code, "keys[2]")


@pytest.mark.parametrize(
    ("bad", "code"),
    [(5, ErrorCode.WRONG_TYPE), (b"dram", ErrorCode.WRONG_TYPE), ("h" * 129, ErrorCode.TOO_LARGE),
     ("\u00e9" * 65, ErrorCode.TOO_LARGE)],
    ids=["int", "bin", "too-long", "too-long-in-utf8"],
)
def test_one_bad_tier_is_named(bad: object, code: ErrorCode) -> None:
    obj = {"v": 3, "t": "query_reply", "id": 1, "results": [], "!columns": [b"\x01\x01", b"\x00\x01", ["dram", bad]]}
    with pytest.raises(kp.RemoteProtocolError) as info:
        kp.decode(msgpack.packb(obj, use_bin_type=True), 3)
    assert (info.value.code, info.value.path) == (code, "columns.tiers[1]")


def test_the_longest_tier_names_pass() -> None:
    tiers = ("h" * 128, "\u00e9" * 64, "")
    reply = kp.QueryReply(1, (), kp.QueryColumns(b"\x01\x01\x00", b"\x00\x01\x02", tiers))
    assert kp.decode(kp.encode(reply, 3), 3) == reply


def test_plain_arrays_encode_as_they_are() -> None:
    """Keys (and other arrays of plain values) dump without a call per item: the same bytes."""
    keys = tuple(i.to_bytes(8, "big") for i in range(300))
    frame = kp.encode(kp.Query(1, keys, "r"), 3)
    assert frame == msgpack.packb({"v": 3, "t": "query", "id": 1, "keys": list(keys), "request_id": "r"}, use_bin_type=True)
    assert kp.decode(frame, 3) == kp.Query(1, keys, "r")
