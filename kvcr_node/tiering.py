"""The disk tier at work in the node (architecture §9): ``DiskTier`` decides, this part posts
the moves through the node's ``Transfers`` (its agent with itself on the other side: NIXL's
POSIX backend) and reports each end back.

- Each turn, ``step`` posts the copies ``DiskTier.next_demotions`` places.
- ``promote`` answers ``Operations.sort_items`` for a key missing from the memory pools:
  True when the object is on disk and being read back (the operation waits on the key as on
  any fill), False when it is not there to read. A read back is checked against the
  digests its object had when first stored before it is committed: a file changed by
  hand or torn by a crash is dropped, counted, and never served.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from kvcr_io.agent import TransferError
from kvcr_io.digests import UNCHECKED, unpack_digests
from kvcr_node.digests import Digests
from kvcr_node.disk_pools import DiskPool
from kvcr_node.disk_tier import Demotion, DiskTier, Promotion
from kvcr_node.store import DepositOutcome
from kvcr_node.transfers import Transfers

log = logging.getLogger("kvcr.node")


class Tiering:
    """Posts the disk tier's copies and read backs, and reports their ends to it."""

    def __init__(
        self, tier: DiskTier, files: list[DiskPool], transfers: Transfers, agent: str, digests: Digests,
        wake: Callable[[bytes], None],
    ) -> None:
        self.tier = tier
        self.files = files
        self.transfers = transfers
        self.agent = agent
        """This node's own agent: the other side of every move of the tier."""
        self.digests = digests
        self.wake = wake
        """Resumes the operations waiting on a key (``Operations.wake``)."""

    def step(self) -> None:
        """Post the copies to write now (the turn's last step)."""
        for demotion in self.tier.next_demotions():
            try:
                self.transfers.start("WRITE", self.agent, demotion.moves, functools.partial(self._demoted, demotion))
            except TransferError as exc:
                log.warning("disk tier: a copy of %s could not be posted: %s", demotion.entry.key.hex(), exc)
                self.tier.demoted(demotion, False)

    def _demoted(self, demotion: Demotion, ok: bool) -> None:
        if not ok:
            log.warning("disk tier: the copy of %s failed; it stays in memory only", demotion.entry.key.hex())
        self.tier.demoted(demotion, ok)

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
        try:
            self.transfers.start("READ", self.agent, promotion.moves, functools.partial(self._promoted, promotion))
        except TransferError as exc:
            log.warning("disk tier: reading %s back could not be posted: %s", key.hex(), exc)
            tier.promoted(promotion, False)
            return False
        return True

    def _promoted(self, promotion: Promotion, ok: bool) -> None:
        key = promotion.entry.key
        if not ok:
            log.warning("disk tier: reading %s back failed; its copy is dropped", key.hex())
        elif not self._intact(promotion):
            ok = False
            self.tier.counts["mismatched"] += 1
            log.warning("disk tier: %s read back does not match its digests; its copy is dropped", key.hex())
        self.tier.promoted(promotion, ok)
        self.wake(key)

    def _intact(self, promotion: Promotion) -> bool:
        """Whether the bytes read back match the digests their object had when stored."""
        if not promotion.copy.digests:
            return True  # stored without digests (integrity off): nothing to check against
        taken = unpack_digests(promotion.copy.digests)
        now = unpack_digests(self.digests.of(promotion.entry))
        return all(was == UNCHECKED or was == is_ for was, is_ in zip(taken, now, strict=True))
