"""Writes on links past their deadline (spec section 5.3, "Write"; section 12): queued ones
fail, sent ones become uncertain and are probed until the source confirms them over.

``WriteDeadlines`` is the part of ``Links`` (``kvcr_node.links``) that, each check, fails a
write still queued for a session at its deadline (``PEER_UNREACHABLE``), marks a sent one
unanswered at its deadline ``UNCERTAIN`` (its transfer may still write the destination; the
owner is told), asks the source about it with a ``probe`` every ``PROBE_INTERVAL_S`` (the
latest probe only), and ends it once the source answers that no transfer of it runs (or it
restarted), or the link has been down for ``peer_dead_ms``.
"""

from __future__ import annotations

import itertools

from kvcr_node.config import NodeConfig
from kvcr_node.counters import Count, Counters
from kvcr_node.peers import LinkOwner, LinkState, PeerLink, RemoteWrite, WriteStage
from kvcr_protocol import ErrorCode, KeyResult, Message, Probe, ProbeReply, WriteState

PROBE_INTERVAL_S = 0.25
"""How often an uncertain write's source is asked whether the write is over."""


class WriteDeadlines:
    """Deadlines of the writes on links, and the probes of uncertain ones (mixed into ``Links``)."""

    config: NodeConfig
    counters: Counters
    _ids: itertools.count[int]

    @property
    def reports(self) -> LinkOwner:
        raise NotImplementedError

    def _send(self, link: PeerLink, msg: Message) -> bool:
        raise NotImplementedError

    def end_write(self, write: RemoteWrite, code: ErrorCode | None, reason: str, results: tuple[KeyResult, ...] = ()
                  ) -> None:
        raise NotImplementedError

    def _check_writes(self, link: PeerLink, now: float) -> None:
        for write in list(link.queued):
            if write.deadline <= now:
                link.queued.remove(write)
                self.end_write(write, ErrorCode.PEER_UNREACHABLE, f"no session with the source {link.endpoint} before the deadline")
        for write in list(link.writes.values()):
            if write.state is WriteStage.SENT and write.deadline <= now:
                write.state = WriteStage.UNCERTAIN
                self.counters.inc(Count.UNCERTAIN_WRITES)
                self.reports.write_uncertain(write)
            if write.state is not WriteStage.UNCERTAIN:
                continue
            dead_for = now - link.down_since if link.down_since is not None else 0.0
            if link.state is LinkState.DOWN and dead_for * 1000 >= self.config.peer_dead_ms:
                # Gone for longer than peer_dead_ms: nothing of it writes any more.
                self.end_write(write, None, "")
            elif link.state is LinkState.READY and write.next_probe <= now:
                # Only the latest probe of a write is kept: an answer to an older one is
                # not needed (the newer asks the same, later).
                link.probes.pop(write.probe_id, None)
                write.probe_id = next(self._ids)
                link.probes[write.probe_id] = write
                write.next_probe = now + PROBE_INTERVAL_S
                self.counters.inc(Count.PROBES_SENT)
                self._send(link, Probe(write.probe_id, write.id))

    def _on_probe_reply(self, link: PeerLink, msg: ProbeReply) -> None:
        write = link.probes.pop(msg.id, None)
        if write is None or write.state is not WriteStage.UNCERTAIN:
            return
        if msg.incarnation != link.incarnation or msg.state in (WriteState.DONE, WriteState.UNKNOWN):
            # The source confirms no transfer of that write can still run.
            self.end_write(write, None, "")
