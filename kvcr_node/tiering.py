"""The disk tier at work in the node (architecture §9): ``DiskTier`` decides, this part posts
the moves through the node's ``Transfers`` (its agent with itself on the other side: NIXL's
POSIX backend) and reports each end back.

- Each turn, ``step`` posts the copies ``DiskTier.next_demotions`` places.
- ``promote`` answers ``Operations.sort_items`` for a key missing from the memory pools:
  True when the object is on disk and being read back (the operation waits on the key as on
  any fill), False when it is not there to read. Read backs go in pieces, a bounded number
  of bytes at a time (``kvcr_node.read_backs``); each piece's spans are checked against the
  digests their object had when first stored as it lands, and an object is committed once
  all of it is in and matched: a file changed by hand or torn by a crash is dropped,
  counted, and never served.
- ``take_back`` adopts the copies a node that ran before on the same disk pools left (their
  journal, ``kvcr_node.recovery``); from then on the journal records each copy the tier
  commits or lets go, written each turn (``step``), a removal at once.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from kvcr_io.agent import TransferError
from kvcr_node.digests import Digests
from kvcr_node.disk_tier import Demotion, DiskTier, Promotion
from kvcr_node.journal import Dropped, Journal, close_stopping, failure_log
from kvcr_node.logs import left_out_note
from kvcr_node.metrics import Histogram
from kvcr_node.objects import InventoryListener
from kvcr_node.read_backs import Piece, ReadBacks
from kvcr_node.recovery import take_back_copies
from kvcr_node.state_dir import StateDir
from kvcr_node.store import DepositOutcome
from kvcr_node.transfers import Move, Transfers

log = logging.getLogger("kvcr.node")


class Tiering:
    """Posts the disk tier's copies and read backs, and reports their ends to it."""

    def __init__(
        self, tier: DiskTier, transfers: Transfers, agent: str, digests: Digests,
        wake: Callable[[list[bytes]], None], io: str = "aio",
    ) -> None:
        self.tier = tier
        self.transfers = transfers
        self.agent = agent
        """This node's own agent: the other side of every move of the tier."""
        self.io = io
        """How NIXL's POSIX backend moves the bytes (``kvcr_io.agent.create_posix_backend``)."""
        self.digests = digests
        self.read_backs = ReadBacks(tier.span_bytes)
        """The read backs being read, by piece."""
        self._posting = False
        """Within ``_post_pieces`` (a nested call posts nothing: the loop there goes on)."""
        self._refused: list[Piece] = []
        """Pieces NIXL refused to post: they end in the next ``step``, never inside ``promote``
        (the operation that asked has not begun to wait on the key yet)."""
        self.copied_at = 0.0
        """When a transfer of copies last ended (``time.monotonic``)."""
        self.wake = wake
        """Resumes the operations waiting on keys, each one's together (``Operations.wake_all``)."""
        self.latency = {"write": Histogram(), "read": Histogram()}
        """Seconds a transfer of copies (``write``) or of read backs (``read``) takes, post to end."""
        self.journal: Journal | None = None
        self.recovery: dict[str, Any] = {}
        """What the start took back (``stats`` ``disk_tier`` ``recovery``)."""

    def take_back(
        self, state: StateDir, incarnation: int, compact_bytes: int, inventory: InventoryListener | None,
    ) -> None:
        """Adopt the copies the disk pools' journal records, then journal the tier's copies."""
        taken = take_back_copies(state, self.tier, incarnation, compact_bytes, self._journal_failed, inventory)
        self.journal, self.recovery = taken.journal, taken.figures

    @staticmethod
    def _journal_failed(exc: BaseException) -> None:
        if (left_out := failure_log.admit("disk tier")) is not None:
            log.error("disk tier: a journal write failed (%s): it starts again from the copies held; "
                      "until then a restart would find none%s", exc, left_out_note(left_out))

    def close(self) -> None:
        """Write the journal's last records (the node is stopping: no copy changes any more)."""
        if self.journal is not None:
            close_stopping(self.journal, "disk tier")
            self.journal = None

    def step(self) -> None:
        """Post the rest of the turn's read backs (the last piece, partly filled), then the
        copies to write now as one transfer (the turn's last step: the requests it read asked
        for the read backs). The copies committed or let go since the last turn are journaled
        first, and pieces refused since then end here."""
        if self.journal is not None and self.journal.pending:
            self.journal.flush()
        self.read_backs.seal()
        self._post_pieces()
        if self._refused:
            refused, self._refused = self._refused, []
            for piece in refused:
                self._piece_ended(piece, False)
        demotions = self.tier.next_demotions()
        if not demotions:
            return
        for demotion in demotions:
            if not demotion.entry.digests:  # stored with integrity off: a copy is checked all the same
                demotion.digests = self.digests.of(demotion.entry)
        if not self._post("WRITE", [move for job in demotions for move in job.moves], len(demotions),
                          functools.partial(self._demoted, demotions)):
            self._demoted(demotions, False)

    def _post(self, op: str, moves: list[Move], objects: int, done: Callable[[bool], None]) -> bool:
        """One transfer of ``moves`` (of ``objects`` objects) with the node's own agent,
        ``done(ok)`` at its end; False when NIXL refuses it (``done`` is not called)."""
        histogram, posted = self.latency["write" if op == "WRITE" else "read"], time.monotonic()

        def ended(ok: bool) -> None:
            histogram.observe(time.monotonic() - posted)
            done(ok)

        try:
            self.transfers.start(op, self.agent, moves, ended)
        except TransferError as exc:
            log.warning("disk tier: a %s of %d objects could not be posted: %s", op, objects, exc)
            return False
        return True

    def _demoted(self, demotions: list[Demotion], ok: bool) -> None:
        if not ok:
            log.warning("disk tier: %d copies failed; their objects stay in memory only", len(demotions))
        for demotion in demotions:
            self.tier.demoted(demotion, ok)
        self.copied_at = time.monotonic()

    def stats(self) -> dict[str, Any]:
        """``stats`` ``disk_tier``: the tier's counts, its pools, its I/O, and when copies last ended
        (``time.monotonic`` of this host: a benchmark times the copies from outside by it)."""
        tier = self.tier
        return {**tier.stats(), "copied_at": self.copied_at, "io": self.io,
                "pools": {name: {**pool, "memory": "disk"} for name, pool in tier.disk.pool_stats().items()},
                "moved_bytes": dict(tier.moved_bytes), "recovery": self.recovery,
                **({"journal": self.journal.stats()} if self.journal is not None else {})}

    def recovery_figures(self) -> tuple[tuple[str, int], ...]:
        """What the start took back, and dropped by every reason (0 for most), for metrics."""
        dropped = self.recovery.get("dropped", {})
        return (("recovered", self.recovery.get("recovered", 0)),
                *((f"dropped_{reason.value}", dropped.get(reason.value, 0)) for reason in Dropped))

    def on_disk(self, key: bytes) -> bool:
        """Whether ``key`` is held in the tier only (not in memory, not being read back)."""
        return self.tier.on_disk_only(key) is not None

    def promote(self, key: bytes) -> bool:
        """Read ``key``'s object back from disk, or go on reading it; whether it is coming."""
        tier = self.tier
        if key in tier.promoting:
            return True
        if tier.on_disk_only(key) is None:
            return False
        promotion = tier.promote(key)
        if isinstance(promotion, DepositOutcome):
            return False  # no room in memory now: a miss, as if it were not there
        self.read_backs.add([promotion])
        self._post_pieces()  # a piece it filled goes now: the disk reads while the rest are placed
        return True

    def _post_pieces(self) -> None:
        """Post the full pieces the bound allows. A piece NIXL refuses leaves the bound at
        once (the loop posts the next) and ends in the next ``step``."""
        if self._posting:
            return
        self._posting = True
        tier, read_backs = self.tier, self.read_backs
        try:
            while pieces := read_backs.next():
                for piece in pieces:
                    moves = [move for promotion, first, end in piece.segments
                             for move in tier.moves_of(promotion, first, end)]
                    if not self._post("READ", moves, len(piece.segments), functools.partial(self._piece_read, piece)):
                        read_backs.landed(piece)
                        self._refused.append(piece)
        finally:
            self._posting = False

    def _piece_read(self, piece: Piece, ok: bool) -> None:
        """A piece is in: the next ones are posted first, so the disk reads on while this
        one's spans are checked and the objects it finished are committed and handed on."""
        self.read_backs.landed(piece)
        self._post_pieces()
        self._piece_ended(piece, ok)

    def _piece_ended(self, piece: Piece, ok: bool) -> None:
        read_backs = self.read_backs
        if not ok:
            log.warning("disk tier: reading %d objects back failed; their copies are dropped", len(piece.segments))
        finished = read_backs.ended(piece, ok, self._intact)
        for end in finished:
            promotion = end.promotion
            if end.read and not end.intact:
                self.tier.counts["mismatched"] += 1
                log.warning("disk tier: %s read back does not match its digests; its copy is dropped",
                            promotion.entry.key.hex())
            self.tier.promoted(promotion, end.intact)
        if finished:
            self.wake([end.promotion.entry.key for end in finished])

    def _intact(self, promotion: Promotion, first: int, end: int) -> bool:
        """Whether spans ``first`` to ``end - 1`` read back match the digests their object had
        when stored (or its copy was written: with ``integrity`` off, the node takes them for
        the copy)."""
        return self.digests.matches(promotion.copy.digests, promotion.entry, first, end)
