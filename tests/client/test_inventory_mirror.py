"""``InventoryMirror``: a node's holdings as its events say, and what each batch changed.

A router that places requests by key wants to know when a key comes to be held by a node
in any tier, and when no tier holds it any more: a key copied to the disk tier and then
evicted from memory is held throughout (spec section 15.3).
"""

from __future__ import annotations

from kvcr_client.events import InventoryMirror
from kvcr_protocol.events import Cleared, EventBatch, Removed, RemovedReason, Stored

KV, DISK = ("kv",), ("kv-disk",)


def batch(*events: Stored | Removed | Cleared, inc: int = 1) -> EventBatch:
    return EventBatch("n", inc, 0.0, events)


def test_keys_come_and_go_across_tiers_with_their_parents() -> None:
    mirror = InventoryMirror()
    changes = mirror.apply(batch(Cleared(), Stored((b"a", b"b"), KV, "dram", (b"", b"a"))))
    assert changes.restarted and changes.held == [b"a", b"b"] and changes.gone == []
    assert mirror.parents == {b"b": b"a"}
    # b copied to disk, then evicted from memory: held all along, so no change.
    changes = mirror.apply(batch(Stored((b"b",), DISK, "disk", (b"a",)), Removed((b"b",), KV, "dram")))
    assert not changes.restarted and changes.held == [] and changes.gone == []
    assert list(mirror.keys[b"b"]) == ["disk"] and mirror.parents[b"b"] == b"a"
    # Its copy goes too: gone, and its parent with it.
    changes = mirror.apply(batch(Removed((b"b",), DISK, "disk", RemovedReason.REMOVED)))
    assert changes.gone == [b"b"] and b"b" not in mirror.keys and mirror.parents == {}


def test_a_key_stored_and_removed_in_one_batch_changes_nothing_it_did_not_hold() -> None:
    mirror = InventoryMirror()
    mirror.apply(batch(Cleared(), Stored((b"a",), KV, "dram")))
    changes = mirror.apply(batch(Stored((b"t",), KV, "dram"), Removed((b"t",), KV, "dram"),
                                 Removed((b"a",), KV, "dram"), Stored((b"a",), KV, "dram", (b"p",))))
    assert changes.held == [] and changes.gone == []
    assert set(mirror.keys) == {b"a"} and mirror.parents == {b"a": b"p"}


def test_a_clear_or_a_new_incarnation_restarts_and_lists_only_what_is_held_since() -> None:
    mirror = InventoryMirror()
    mirror.apply(batch(Cleared(), Stored((b"a", b"b"), KV, "dram")))
    changes = mirror.apply(batch(Stored((b"c",), KV, "dram"), Cleared(), Stored((b"d",), KV, "dram", (b"a",))))
    assert changes.restarted and changes.held == [b"d"] and changes.gone == []
    assert set(mirror.keys) == {b"d"} and mirror.parents == {b"d": b"a"}
    changes = mirror.apply(batch(Stored((b"e",), KV, "dram"), inc=2))
    assert changes.restarted and changes.held == [b"e"] and set(mirror.keys) == {b"e"} and mirror.parents == {}
    assert mirror.incarnation == 2
