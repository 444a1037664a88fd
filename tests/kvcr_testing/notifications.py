"""A client that loses NIXL notifications on purpose (spec section 6.10).

Notifications only tell a client early that a group landed; the control messages alone
must complete every group. ``LossyClient`` runs on ``LossyCore``, which drops every
notification unread while ``losing`` is set, as if none had come, and counts them.
"""

from __future__ import annotations

from kvcr_client import Client
from kvcr_client.core import ClientCore


class LossyCore(ClientCore):
    """A session core that drops the notifications it reads while ``losing``."""

    losing = False

    def _notified(self, payload: bytes) -> None:
        if self.losing:
            self.notifications["dropped"] += 1
            return
        super()._notified(payload)


class LossyClient(Client):
    """A ``Client`` on ``LossyCore``: set ``client.core.losing`` to lose its notifications."""

    core_class = LossyCore
    core: LossyCore
