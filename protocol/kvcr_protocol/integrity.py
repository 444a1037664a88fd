"""Integrity reports (version 5, spec section 6.12, "Integrity"): a reader tells the node of
bytes that did not match their digests.

A reader under a grant that finds a span whose digest differs fails the key
``DIGEST_MISMATCH`` and sends ``suspect`` with the key; the node reads the object itself and
condemns it when its bytes no longer match (the reader's word alone drops nothing), and
answers ``complete``, a ``KeyResult`` per key: ``OK`` (it matches, kept),
``DIGEST_MISMATCH`` (it did not, dropped), ``NOT_FOUND`` (not stored here), ``BUSY`` (the
session's checking budget is spent; nothing was read). A message of its own, so sessions
below version 5 never see it.
"""

from __future__ import annotations

from kvcr_protocol.declare import Message, _fields, message
from kvcr_protocol.records import KEY
from kvcr_protocol.wire import Field, Seq


@message("suspect", since=5)
class Suspect(Message):
    """Client -> node: these keys' bytes, read under a grant, did not match their digests."""

    id: int
    keys: tuple[bytes, ...]
    FIELDS = _fields(Field("keys", Seq(KEY, "max_keys", minimum=1)))


INTEGRITY_MESSAGES: tuple[type[Message], ...] = (Suspect,)
