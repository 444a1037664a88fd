"""Completion by NIXL notification (version 3, spec section 6.10).

A node (or a source, across nodes) that writes a group of a key into client memory
attaches a small fixed payload to that write as its NIXL notification; the client's own
agent receives it when the bytes have landed, so the client learns "group g of key k of
request r landed" without the control messages that follow.

Payload, 24 bytes, little-endian::

    0  magic    2 bytes  b"KV"
    2  version  u8       3
    3  kind     u8       1 = LANDED
    4  token    u32      the request's ``!notify`` token (never 0)
    8  request  u64      the client's request id (the deliver's ``id``)
    16 key      u32      the first item index (in the deliver's item order)
    20 count    u16      how many consecutive items, from ``key`` (at least 1)
    22 group    u16      the group number (0 for a key without a plan)
"""

from __future__ import annotations

import enum
import struct
from array import array
from dataclasses import dataclass
from typing import ClassVar

from kvcr_protocol.columns import U32, unpack
from kvcr_protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from kvcr_protocol.limits import Limits
from kvcr_protocol.records import U32_MAX
from kvcr_protocol.versions import COLUMNS_VERSION
from kvcr_protocol.wire import Field, Packed, Record, UInt

NOTIFY_MAGIC = b"KV"
NOTIFY_VERSION = COLUMNS_VERSION
"""The payload layout's version byte: the protocol version that defined it."""
_LAYOUT = struct.Struct("<2sBBIQIHH")
NOTIFICATION_SIZE = _LAYOUT.size
assert NOTIFICATION_SIZE == 24


class NotifyKind(enum.IntEnum):
    """What a notification says."""

    LANDED = 1
    """Every span of group ``group`` of items ``key`` .. ``key + count - 1`` has landed."""


@dataclass(frozen=True, slots=True)
class Notification:
    """One decoded notification payload."""

    token: int
    request: int
    key: int
    group: int
    count: int = 1
    kind: NotifyKind = NotifyKind.LANDED

    @property
    def keys(self) -> range:
        """The item indices it covers."""
        return range(self.key, self.key + self.count)


def encode_notification(note: Notification) -> bytes:
    """The 24-byte payload of ``note``; ``LocalProtocolError`` if a field does not fit."""
    bounds = (("token", 1, U32_MAX), ("request", 0, (1 << 64) - 1), ("key", 0, U32_MAX), ("count", 1, 0xFFFF), ("group", 0, 0xFFFF))
    for name, low, high in bounds:
        value = getattr(note, name)
        if type(value) is not int or not low <= value <= high:
            raise LocalProtocolError(ErrorCode.OUT_OF_RANGE, f"{value!r} is outside {low}..{high}", f"notification.{name}")
    return _LAYOUT.pack(NOTIFY_MAGIC, NOTIFY_VERSION, note.kind, note.token, note.request, note.key, note.count, note.group)


def is_notification(payload: bytes) -> bool:
    """Whether ``payload`` claims to be a kvcr notification (size and magic); other users of
    the agent's notifications are left alone."""
    return len(payload) == NOTIFICATION_SIZE and payload[:2] == NOTIFY_MAGIC


def decode_notification(payload: bytes) -> Notification:
    """The notification in ``payload``; ``RemoteProtocolError`` naming the bad field."""
    if len(payload) != NOTIFICATION_SIZE:
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"{len(payload)} bytes, a notification has {NOTIFICATION_SIZE}", "notification")
    magic, version, kind, token, request, key, count, group = _LAYOUT.unpack(payload)
    if magic != NOTIFY_MAGIC:
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"magic {magic!r} is not {NOTIFY_MAGIC!r}", "notification.magic")
    if version != NOTIFY_VERSION:
        raise RemoteProtocolError(ErrorCode.UNSUPPORTED_VERSION, f"layout version {version}", "notification.version")
    if kind not in NotifyKind.__members__.values():
        raise RemoteProtocolError(ErrorCode.OUT_OF_RANGE, f"kind {kind} is unknown", "notification.kind")
    if token == 0:
        raise RemoteProtocolError(ErrorCode.OUT_OF_RANGE, "token 0 is never sent", "notification.token")
    if count == 0:
        raise RemoteProtocolError(ErrorCode.OUT_OF_RANGE, "a notification covers at least one item", "notification.count")
    return Notification(token, request, key, group, count, NotifyKind(kind))


@dataclass(frozen=True, slots=True)
class WriteNotify(Record):
    """What a source needs to notify a target's client: the token and request id of the
    client's deliver, and the deliver's item index of each item of the write."""

    token: int
    request: int
    items: bytes
    CHECKED: ClassVar[bool] = True
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("token", UInt(U32_MAX)), Field("request", UInt()), Field("items", Packed(4, "max_keys")),
    )

    def item_indices(self) -> array[int]:
        """The deliver's item index of each item of the write, in write order."""
        return unpack(self.items, U32)

    def check(self, limits: Limits) -> None:
        if self.token == 0:
            raise RemoteProtocolError(ErrorCode.OUT_OF_RANGE, "token 0 means no notification; leave !notify out", ".token")
