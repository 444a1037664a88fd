"""An engine integration's session with its node, reconnected when the node comes back.

Each side of vLLM's connector (``KvcrScheduler``, ``KvcrWorker``) owns one ``NodeLink``: the ``Client`` and a
``Reconnector`` (``kvcr_client.reconnect``, sans I/O) that says when to send the next hello.
The side asks ``ready(wait_s)`` at the top of each call from vLLM: True while the session is
open; when the client found the node lost (a restart, a stall past the heartbeat silence;
spec section 14) it is False at once, and the call treats the node as absent (a lookup is a
miss, a load is reported failed and recomputed, a save is skipped), counted ``node_away``.
Meanwhile the same calls send hellos with the reconnector's backoff, waiting ``wait_s`` at
most for the welcome (the scheduler's ``lookup_wait_s``, never longer), so vLLM is never
held by an absent node. The hello announces every region the client registered, so a
worker's KV cache is registered with the node again as part of it (a restarted node knows
nothing of the old session). A welcome from another incarnation calls ``on_restart``: the
leases the side held are gone (a node restarted on its state directory still holds what it
held, ``welcome.kept``, and lookups find it again). A node that stalls without dropping the
session (frozen: a heartbeat the side ``probe``d is not answered) is ``stalled`` past the
side's own bound, long before its silence ends the session. ``node_outages``, ``reconnects`` and
``node_away_ms`` count what happened, through the side's ``count``. No engine is imported here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvcr_client.client import Client
from kvcr_client.reconnect import HELLO_TIMEOUT_S, Action, LinkState, Reconnector
from kvcr_protocol import Welcome


class NodeLink:
    """One side's ``Client`` with its node, and when to reconnect it (see the module)."""

    def __init__(
        self,
        endpoint: str,
        name: str,
        count: Callable[[str, int], None],
        log: logging.Logger,
        on_restart: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.endpoint = endpoint
        self.client = Client(endpoint, name=name)
        node = self.client.node
        self.reconnector = Reconnector(node.incarnation if node is not None else None)
        self.count = count
        """Takes a counter's name and an increment: ``node_outages``, ``reconnects``, ``node_away_ms``."""
        self.log = log
        self.on_restart = on_restart
        self.clock = clock
        self._hello: Future[Welcome] | None = None

    @property
    def up(self) -> bool:
        """Whether the session was open when last looked at (``ready`` looks again)."""
        return self.reconnector.up

    def probe(self) -> None:
        """Ask the node for a heartbeat now (one at a time), for ``stalled`` to go by."""
        self.client.core.probe()

    def stalled(self, bound_s: float) -> bool:
        """Whether the node has left a heartbeat (``probe``) unanswered for ``bound_s`` or
        longer without a word (frozen, swapping): the session stands, but a call that cannot
        wait treats the node as away until it speaks again."""
        unanswered = self.client.core.unanswered_s()
        return self.reconnector.up and unanswered > 0.0 and unanswered >= bound_s

    def ready(self, wait_s: float = 0.0) -> bool:
        """Whether the session with the node is open now. When it is not, send the next hello
        once it is due and wait ``wait_s`` at most for its welcome; never raises."""
        r = self.reconnector
        now = self.clock()
        if r.up:
            core = self.client.core
            if core.connected and not core.lost:
                return True
            r.lost(now)
            self.count("node_outages", 1)
            self.log.warning(
                "kvcr: lost the node at %s: lookups are misses, loads recomputed, saves skipped until it "
                "is back (reconnecting with backoff)",
                self.endpoint,
            )
        if r.state is LinkState.CONNECTING:
            self._settle(now, 0.0)
        if r.poll(now) is Action.CONNECT:
            try:
                self._hello = self.client.start_reconnect(HELLO_TIMEOUT_S)
            except Exception as exc:
                self.log.debug("kvcr: a hello to %s could not be sent: %s", self.endpoint, _brief(exc))
                r.failed(now)
                return False
            self._settle(now, wait_s)
        return r.up

    def _settle(self, now: float, wait_s: float) -> None:
        """Take the hello's answer if it is in (waiting ``wait_s`` at most)."""
        hello, r = self._hello, self.reconnector
        if hello is None:
            r.failed(now)
            return
        if wait_s > 0 and not hello.done():
            try:
                self.client.core.wait(hello, wait_s)
            except Exception:
                pass  # read below
        if not hello.done():
            return
        self._hello = None
        try:
            welcome: Any = hello.result(0)
        except Exception as exc:
            self.log.debug("kvcr: a hello to %s failed: %s", self.endpoint, _brief(exc))
            r.failed(self.clock())
            return
        away_s = self.clock() - (r.lost_at if r.lost_at is not None else now)
        previous = r.incarnation
        restarted = r.connected(self.clock(), welcome.incarnation)
        # A node restarted on its state directory names the incarnation whose cache it kept
        # (``welcome.kept``, spec section 6.4): what was saved there is held still.
        kept = restarted and previous is not None and welcome.kept == previous
        self.count("reconnects", 1)
        self.count("node_away_ms", int(away_s * 1000))
        self.log.info(
            "kvcr: reconnected to %s after %.1f s away (%d hellos)%s",
            self.endpoint,
            away_s,
            r.tries,
            (": the node restarted and kept its cache" if kept else ": the node restarted, what it held is gone")
            if restarted else "",
        )
        if restarted and self.on_restart is not None:
            self.on_restart()

    def close(self) -> None:
        self.client.close()


def _brief(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 200 else text[:200] + "..."
