"""How a message is declared (``Message``, ``message``) and the checks that span a message's items.

The message tables themselves are in ``kvcr_protocol.messages`` (and, for the leases of
version 4 and 5, ``kvcr_protocol.leases``; for version 5's write grants, ``kvcr_protocol.puts``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar, dataclass_transform

from kvcr_protocol.columns import SpanColumns
from kvcr_protocol.errors import ErrorCode, RemoteProtocolError
from kvcr_protocol.limits import Limits
from kvcr_protocol.records import ID as _ID
from kvcr_protocol.records import TEXT as _TEXT
from kvcr_protocol.records import DeliverItem, DepositItem, FetchItem
from kvcr_protocol.wire import Bytes, Field, Opt, Seq, UInt

# Fields that messages of several modules share, declared once.
F_REQUEST_ID = Field("request_id", Opt(_TEXT), None)
F_CODE = Field("code", UInt(0xFFFF))
F_REASON = Field("reason", _TEXT, "")
F_PARENTS = Field("parents", Seq(Bytes("max_key"), "max_keys"), (), sparse=True)
"""Each key's parent key, in the message's key order (spec section 6.4, "Parents"): an
empty bin names none. Only the node's inventory events carry it on (section 15); a node
that does not know the field ignores it."""


class Message:
    """Base of all messages; ``TAG`` is the wire type tag, ``FIELDS`` the wire fields."""

    TAG: ClassVar[str] = ""
    FIELDS: ClassVar[tuple[Field, ...]] = ()
    REPLY: ClassVar[bool] = False
    """True for messages that answer a request (their ``id`` echoes it)."""
    SINCE: ClassVar[int] = 1
    """The version that introduced the message; a frame of an earlier version cannot carry it."""

    def check(self, limits: Limits) -> None:
        """Raise ``RemoteProtocolError`` when fields disagree with each other (spec section
        4.3, step 10); single fields are checked by their wire types."""


M = TypeVar("M", bound=Message)


@dataclass_transform(frozen_default=True)
def message(tag: str, reply: bool = False, since: int = 1) -> Callable[[type[M]], type[M]]:
    """Declare a message: a frozen, slotted dataclass with wire tag ``tag``.

    ``reply`` marks messages that answer a request (their ``id`` echoes it); ``since`` is
    the version that introduced the message.
    """

    def declare(cls: type[M]) -> type[M]:
        out = dataclass(frozen=True, slots=True)(cls)
        out.TAG = tag
        out.REPLY = reply
        out.SINCE = since
        return out

    return declare


def _fields(*fields: Field) -> tuple[Field, ...]:
    return (Field("id", _ID), *fields)


def check_parents(keys: Sequence[bytes], parents: Sequence[bytes]) -> None:
    """A message's ``parents`` name one parent (or none) per key, never the key itself."""
    if not parents:
        return
    if len(parents) != len(keys):
        raise RemoteProtocolError(ErrorCode.OUT_OF_RANGE, f"{len(parents)} parents for {len(keys)} keys", "parents")
    for i, (key, parent) in enumerate(zip(keys, parents, strict=True)):
        if parent == key:
            raise RemoteProtocolError(ErrorCode.OUT_OF_RANGE, "a key is not its own parent", f"parents[{i}]")


def message_keys(items: Sequence[DepositItem | DeliverItem | FetchItem], columns: Sequence[SpanColumns]) -> list[bytes]:
    """A message's keys in its key order: its record items', or its column blocks' one after another."""
    if columns:
        return [key for block in columns for key in block.keys]
    return [item.key for item in items]


def _spans_of(item: DepositItem | DeliverItem | FetchItem) -> int:
    return len(item.layout) if isinstance(item, FetchItem) else len(item.spans)


def _check_items(
    items: Sequence[DepositItem | DeliverItem | FetchItem], columns: Sequence[SpanColumns], limits: Limits
) -> None:
    """Limits that span a message's items (spec section 4.3, step 10): its items travel as
    records or as columns, not both, and their keys and spans fit the limits."""
    if columns and items:
        raise RemoteProtocolError(ErrorCode.OUT_OF_RANGE, "items travel as records or as columns, not both", "columns")
    if columns:
        keys = sum(len(block.keys) for block in columns)
        if keys > limits.max_keys:
            raise RemoteProtocolError(ErrorCode.TOO_MANY, f"{keys} keys in one message, limit {limits.max_keys}", "columns")
        spans = sum(block.entry_count for block in columns)
        path = "columns"
    else:
        spans = sum(map(_spans_of, items))
        path = "items"
    if spans > limits.max_spans:
        raise RemoteProtocolError(ErrorCode.TOO_MANY, f"{spans} spans in one message, limit {limits.max_spans}", path)
