"""The inventory event stream's vectors (spec/vectors/events.json) and section 15 against the code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import kvcr_protocol as kp
from kvcr_node import event_publisher, inventory, replays
from kvcr_protocol import events as ev

ROOT = Path(__file__).resolve().parents[2]
VECTORS: dict[str, Any] = json.loads((ROOT / "spec" / "vectors" / "events.json").read_text(encoding="utf-8"))
SPEC = (ROOT / "spec" / "kvcr-protocol.md").read_text(encoding="utf-8")
SECTION = " ".join(SPEC.split("## 15. Inventory events\n", 1)[1].split())
"""Section 15 with its line breaks as spaces."""


def event_from_json(obj: dict[str, Any]) -> ev.Event:
    if obj["t"] == "cleared":
        assert set(obj) == {"t"}
        return ev.Cleared()
    keys = tuple(bytes.fromhex(k) for k in obj["keys"])
    if obj["t"] == "stored":
        assert set(obj) - {"parents"} == {"t", "keys", "pools", "tier"}
        parents = tuple(bytes.fromhex(p) for p in obj.get("parents", ()))
        return ev.Stored(keys, tuple(obj["pools"]), obj["tier"], parents)
    assert obj["t"] == "removed" and set(obj) == {"t", "keys", "pools", "tier", "why"}
    return ev.Removed(keys, tuple(obj["pools"]), obj["tier"], ev.RemovedReason(obj["why"]))


def test_vectors_are_of_this_format_version() -> None:
    assert VECTORS["events_version"] == ev.EVENTS_VERSION
    kinds = {type(e) for vec in VECTORS["batches"] for e in (event_from_json(x) for x in vec["fields"]["events"])}
    assert kinds == {ev.Stored, ev.Removed, ev.Cleared}
    reasons = {x.get("why") for vec in VECTORS["batches"] for x in vec["fields"]["events"]}
    assert {r.value for r in ev.RemovedReason} <= reasons
    assert any("parents" in x for vec in VECTORS["batches"] for x in vec["fields"]["events"])


@pytest.mark.parametrize("vec", VECTORS["batches"], ids=[v["name"] for v in VECTORS["batches"]])
def test_valid_batch(vec: dict[str, Any]) -> None:
    f = vec["fields"]
    batch = ev.EventBatch(f["node"], f["incarnation"], f["ts"], tuple(event_from_json(e) for e in f["events"]))
    payload = bytes.fromhex(vec["hex"])
    assert ev.encode_batch(batch) == payload
    assert ev.decode_batch(payload) == batch


@pytest.mark.parametrize("vec", VECTORS["replay_ends"], ids=[v["name"] for v in VECTORS["replay_ends"]])
def test_valid_replay_end(vec: dict[str, Any]) -> None:
    end = ev.ReplayEnd(**vec["fields"])
    payload = bytes.fromhex(vec["hex"])
    assert ev.encode_replay_end(end) == payload
    assert ev.decode_replay_end(payload) == end


@pytest.mark.parametrize("vec", VECTORS["invalid"], ids=[v["name"] for v in VECTORS["invalid"]])
def test_invalid_payload(vec: dict[str, Any]) -> None:
    decode = ev.decode_replay_end if vec["kind"] == "replay_end" else ev.decode_batch
    with pytest.raises(kp.RemoteProtocolError) as info:
        decode(bytes.fromhex(vec["hex"]))
    assert (info.value.code.name, info.value.path) == (vec["error"], vec["path"])


@pytest.mark.parametrize("vec", VECTORS["replay_requests"], ids=[v["name"] for v in VECTORS["replay_requests"]])
def test_invalid_replay_request(vec: dict[str, Any]) -> None:
    with pytest.raises(kp.RemoteProtocolError) as info:
        ev.decode_replay_request([bytes.fromhex(f) for f in vec["frames"]])
    assert (info.value.code.name, info.value.path) == (vec["error"], vec["path"])


def test_section_15_states_the_codes_bounds() -> None:
    """The numbers section 15 promises are the ones the code uses."""
    assert f"`{ev.EVENTS_TOPIC.decode()}`" in SECTION
    assert f"`{ev.REPLAY_SUFFIX}`" in SECTION
    assert f"at most {inventory.REPLAY_MAX_BATCHES} of them and {inventory.REPLAY_MAX_BYTES >> 20} MiB" in SECTION
    assert f"at most {inventory.RING_BATCHES} batches and {inventory.RING_BYTES >> 20} MiB" in SECTION
    assert f"holds {event_publisher.PUB_HWM} batches" in SECTION
    assert f"takes at most {event_publisher.REPLAY_REQUESTS_PER_TURN} replay requests per loop turn" in SECTION
    assert f"a frame of more than {event_publisher.REPLAY_MAX_FRAME} bytes closes" in SECTION
    # The replay budgets (15.4).
    assert f"each at most a batch ({inventory.BATCH_MAX_BYTES >> 10} KiB, 15.2)" in SECTION
    assert f"to at most {inventory.BATCH_MAX_BYTES >> 10} KiB" in SECTION
    assert f"at most {replays.REPLAY_HWM} messages per requester" in SECTION
    assert f"its last {replays.REPLAY_HWM + 1} messages" in SECTION
    assert f"about {replays.REQUESTER_BYTES / (1 << 20):.1f} MiB" in SECTION
    assert f"send buffer is {event_publisher.REPLAY_SNDBUF >> 10} KiB" in SECTION
    assert f"(default {replays.REPLAY_BYTES >> 20} MiB)" in SECTION
    assert f"`events_replay_requesters` (default {replays.REPLAY_REQUESTERS})" in SECTION
    assert f"cannot go on for {replays.REPLAY_STALL_S:g} s" in SECTION
    assert (f"at most {replays.REPLAY_SENDS_PER_TURN} replay messages and "
            f"{replays.REPLAY_SEND_BYTES_PER_TURN >> 10} KiB") in SECTION
    assert f"`max_keys` ({ev.MAX_BATCH_KEYS})" in SECTION
    for kind in ev.EventKind:
        assert f'`"{kind.value}"`' in SECTION
    for reason in ev.RemovedReason:
        assert f'`"{reason.value}"`' in SECTION
