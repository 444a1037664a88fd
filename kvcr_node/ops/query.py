"""``query``: where each key is, without claiming anything (spec sections 5.2 and 6.9).

The store looks the keys up in one batch (``Store.lookup_codes``: one byte per key), and
two table translations turn those bytes into the reply's presence and tier columns, so a
query of a thousand keys makes no object per key. A version-3 session gets the columns
(``!columns``); older sessions get the same answers as records, byte for byte as before.
A prefix query (``!prefix``) looks the keys up in runs that double in length and stops
after the run that holds the first key its mask does not count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcr_node.metrics import Metrics
from kvcr_node.outbox import Outbox
from kvcr_node.records import Session
from kvcr_node.store import LOOKUP_ABSENT, ObjectState, Store, lookup_code
from kvcr_protocol import COLUMNS_VERSION, PRESENCE_BY_CODE, PRESENCE_CODE, Presence, Query, QueryColumns, QueryReply

REMOTE_TIER = "remote"
"""The tier a key only a hinted source holds is reported in."""
HINTED = 1
"""The lookup code of a key the store lacks and the session's hint names (the store's codes
leave 1 free)."""
DISK_TIER = "disk"
"""The tier a key held only in the disk tier is reported in (architecture §9)."""
ON_DISK = 255
"""The lookup code of a key the memory pools lack and the disk tier holds (the store's codes
stop below it: ``MAX_TIERS``)."""
FIRST_RUN = 16
"""Keys a prefix query looks up first; each further run is twice as long (spec section 6.9)."""
_CODES = 256


class Queries:
    """The ``query`` handler; its tier table is the node's: no tier, remote, then the store's tiers."""

    def __init__(self, store: Store, outbox: Outbox, metrics: Metrics,
                 on_disk: Callable[[bytes], object] | None = None) -> None:
        """``on_disk``: the disk tier's copy of a key held on disk only (None: no disk tier)."""
        self.store = store
        self.outbox = outbox
        self.metrics = metrics
        self.on_disk = on_disk
        self._hit = bytes([PRESENCE_CODE[Presence.HIT]])
        self.tiers: tuple[str, ...] = ("", REMOTE_TIER, *store.tiers, *((DISK_TIER,) if on_disk else ()))
        presence = bytearray(_CODES)
        tier = bytearray(_CODES)
        presence[LOOKUP_ABSENT] = PRESENCE_CODE[Presence.MISS]
        presence[HINTED], tier[HINTED] = PRESENCE_CODE[Presence.FETCHABLE], 1
        for index in range(len(store.tiers)):
            for state, answer in ((ObjectState.WRITING, Presence.FETCHING), (ObjectState.READY, Presence.HIT)):
                code = lookup_code(index, state)
                presence[code], tier[code] = PRESENCE_CODE[answer], 2 + index
        if on_disk is not None:
            presence[ON_DISK], tier[ON_DISK] = PRESENCE_CODE[Presence.HIT], len(self.tiers) - 1
        self._presence = bytes(presence)
        """Lookup code -> presence code."""
        self._tier = bytes(tier)
        """Lookup code -> index into ``tiers``."""

    def on_query(self, session: Session, msg: Query) -> None:
        received = self.metrics.clock()
        hint = session.hints.get(msg.request_id) if msg.request_id is not None else None
        hinted = hint[1] if hint is not None else None
        if msg.prefix:
            codes = self._prefix(msg.keys, hinted, msg.prefix)
        else:
            codes = self._codes(msg.keys, hinted)
        presence = codes.translate(self._presence)
        columns = QueryColumns(presence, codes.translate(self._tier), self.tiers)
        if session.version >= COLUMNS_VERSION:
            self.outbox.reply(session, QueryReply(msg.id, (), columns))
        else:
            self.outbox.reply(session, QueryReply(msg.id, columns.results()))
        # Every key named counts as a lookup; a prefix query's keys after its answer as misses.
        metrics = self.metrics
        metrics.lookups += len(msg.keys)
        metrics.hits += presence.count(self._hit)
        metrics.request_done("query", received)

    def _codes(self, keys: Sequence[bytes], hinted: frozenset[bytes] | None) -> bytes:
        """The lookup code of each key; a key the store lacks and ``hinted`` names is ``HINTED``."""
        codes = self.store.lookup_codes(keys)
        on_disk = self.on_disk
        if on_disk is not None and LOOKUP_ABSENT in codes:
            codes = bytes([
                ON_DISK if code == LOOKUP_ABSENT and on_disk(key) is not None else code
                for code, key in zip(codes, keys, strict=True)
            ])
        if hinted and LOOKUP_ABSENT in codes:
            codes = bytes([
                HINTED if code == LOOKUP_ABSENT and key in hinted else code for code, key in zip(codes, keys, strict=True)
            ])
        return codes

    def _prefix(self, keys: Sequence[bytes], hinted: frozenset[bytes] | None, mask: int) -> bytes:
        """The lookup codes of the keys in a row, from the first, whose presence ``mask`` counts.

        Runs of ``FIRST_RUN``, then twice as many keys each: no key is looked up past the
        run that holds the first uncounted one.
        """
        counted = bytes(code for code in range(len(PRESENCE_BY_CODE)) if mask >> code & 1)
        parts: list[bytes] = []
        start, run = 0, FIRST_RUN
        while start < len(keys):
            codes = self._codes(keys[start:start + run], hinted)
            presence = codes.translate(self._presence)
            count = len(presence) - len(presence.lstrip(counted))
            parts.append(codes[:count])
            if count < len(codes):
                break
            start += count
            run *= 2
        return b"".join(parts)
