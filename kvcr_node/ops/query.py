"""``query``: where each key is, without claiming anything (spec section 5.2)."""

from __future__ import annotations

from kvcr_node.memory import PoolMemory
from kvcr_node.outbox import Outbox
from kvcr_node.records import ClientSession
from kvcr_node.store import ObjectEntry, ObjectState, Store
from kvcr_protocol import Presence, Query, QueryReply, QueryResult

REMOTE_TIER = "remote"
"""The tier a key only a hinted source holds is reported in."""


class Queries:
    """The ``query`` handler."""

    def __init__(self, store: Store, memories: dict[str, PoolMemory], outbox: Outbox) -> None:
        self.store = store
        self.memories = memories
        self.outbox = outbox

    def tier(self, entry: ObjectEntry) -> str:
        """The memory kind of the pool holding the object's first span."""
        return self.memories[entry.layout[0][1]].spec.memory

    def on_query(self, session: ClientSession, msg: Query) -> None:
        hint = session.hints.get(msg.request_id) if msg.request_id is not None else None
        results = []
        for key in msg.keys:
            entry = self.store.lookup(key)
            if entry is not None and entry.state is ObjectState.READY:
                results.append(QueryResult(Presence.HIT, self.tier(entry)))
            elif entry is not None:
                results.append(QueryResult(Presence.FETCHING, self.tier(entry)))
            elif hint is not None and key in hint[1]:
                results.append(QueryResult(Presence.FETCHABLE, REMOTE_TIER))
            else:
                results.append(QueryResult(Presence.MISS))
        self.outbox.reply(session, QueryReply(msg.id, tuple(results)))
