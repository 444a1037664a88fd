"""The NIXL notification payload (version 3, spec section 6.10)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcr_protocol as kp
from kvcr_protocol import ErrorCode, Notification
from kvcr_protocol.columns import U32, pack

NOTES = st.builds(
    Notification,
    token=st.integers(1, (1 << 32) - 1),
    request=st.integers(0, (1 << 64) - 1),
    key=st.integers(0, (1 << 32) - 1),
    group=st.integers(0, 0xFFFF),
    count=st.integers(1, 0xFFFF),
)


@settings(max_examples=200, deadline=None)
@given(NOTES)
def test_round_trip(note: Notification) -> None:
    payload = kp.encode_notification(note)
    assert len(payload) == kp.NOTIFICATION_SIZE and kp.is_notification(payload)
    assert kp.decode_notification(payload) == note
    assert list(note.keys) == list(range(note.key, note.key + note.count))


def test_layout_is_little_endian_and_fixed() -> None:
    payload = kp.encode_notification(Notification(token=0x01020304, request=0x1122334455667788, key=5, group=3, count=2))
    assert payload == bytes.fromhex("4b56" "03" "01" "04030201" "8877665544332211" "05000000" "0200" "0300")


@pytest.mark.parametrize(
    ("field", "value"),
    [("token", 0), ("token", 1 << 32), ("request", -1), ("key", 1 << 32), ("group", 1 << 16), ("count", 0), ("count", 1 << 16)],
)
def test_fields_that_do_not_fit_are_local_errors(field: str, value: int) -> None:
    fields = {"token": 1, "request": 1, "key": 0, "group": 0, "count": 1, field: value}
    with pytest.raises(kp.LocalProtocolError) as info:
        kp.encode_notification(Notification(**fields))
    assert (info.value.code, info.value.path) == (ErrorCode.OUT_OF_RANGE, f"notification.{field}")


def test_other_payloads_are_not_notifications() -> None:
    assert not kp.is_notification(b"")
    assert not kp.is_notification(b"NIXL" + bytes(20))
    assert not kp.is_notification(kp.encode_notification(Notification(1, 2, 3, 4)) + b"\x00")


def test_write_notify_names_the_deliver_item_of_each_write_item() -> None:
    block = kp.deliver_columns([kp.DeliverItem(bytes([i + 1]), (kp.DstSpan("L0", 1, 4096 * i, 4096),)) for i in range(3)])
    write = kp.WriteRequest(9, "client", (), columns=(block,), notify=kp.WriteNotify(7, 41, pack([4, 0, 2], U32)))
    decoded = kp.decode(kp.encode(write, 3), 3)
    assert decoded == write
    assert isinstance(decoded, kp.WriteRequest) and decoded.notify is not None
    assert decoded.notify.item_indices().tolist() == [4, 0, 2]
    with pytest.raises(kp.LocalProtocolError) as info:
        kp.encode(kp.WriteRequest(9, "client", (), columns=(block,), notify=kp.WriteNotify(7, 41, pack([4], U32))), 3)
    assert info.value.path == "notify.items"
