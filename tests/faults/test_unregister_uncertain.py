"""Unregistering memory that a source may still write (spec sections 5.2 and 12).

A deliver from a source B that stops answering (SIGSTOP) fails DESTINATION_UNCERTAIN at
its deadline, and node A keeps the destination reserved until B is known to be done or
gone. While it is, A must not acknowledge an ``unregions`` of that region, and the
client must not deregister the memory: ``unregister`` waits (as long as its ``timeout``
allows; past it, it raises and the region stays registered and announced) and returns
once the reservation ends. Afterwards nothing is left: no write, no held withdrawal.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvcr_client import ArgumentError, ErrorCode, OperationTimeout, Span
from kvcr_testing.health import wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, plain_layout
from kvcr_testing.patterns import KiB
from kvcr_testing.remote import FAILED, Dest, deliver_checked, expect

LAYOUT = plain_layout(4)
DEADLINE_MS = 1000
PEER_DEAD_MS = 500
SHORT_TIMEOUT_S = 0.5
WAIT_S = 1.0
"""How long the test watches an unregister that must still be waiting."""
SLACK_S = 5.0


def held(site: Any) -> int:
    return int(site.stats()["tables"]["withdrawals"])


def test_unregister_waits_while_a_source_may_still_write(sites: Any) -> None:
    a, b = sites.start(("a", {"args": ("--peer-dead-ms", str(PEER_DEAD_MS))}), "b")
    src = b.deposit(b"k", LAYOUT, seed=1)
    a.client.submit_hint("r", b.endpoint, [b"k"]).result(RESULT_TIMEOUT_S)
    deliver_checked(a, b"k", LAYOUT, src, range(4), seed=2, request_id="r")  # the peer session is up
    a.deposit(b"local", plain_layout(1), seed=3)
    dst = Dest(a, LAYOUT, range(4), seed=4)
    a.reg.regions.remove(dst.region)  # this test unregisters it itself
    with pytest.raises(ArgumentError):
        a.client.unregister(dst.region, timeout=-1)

    b.node.proc.send_signal(signal.SIGSTOP)  # killed below; thawed in ``finally`` if a check fails first
    try:
        out = a.client.deliver({b"k": dst.spans}, request_id="r", deadline_ms=DEADLINE_MS).result(DEADLINE_MS / 1000 + SLACK_S)
        expect(out[b"k"], FAILED, ErrorCode.DESTINATION_UNCERTAIN)

        # Past its timeout, unregister gives up: the region stays registered and announced.
        with pytest.raises(OperationTimeout, match="stays registered"):
            a.client.unregister(dst.region, timeout=SHORT_TIMEOUT_S)
        assert held(a) == 0, "the node gave the withdrawal up"
        # The region stays announced; its reserved spans take no new deliver (test_reserved_destinations.py).
        into = [Span("L0", dst.region, dst.spans[0].offset, 64 * KiB)]
        expect(a.client.deliver({b"local": into}).result(RESULT_TIMEOUT_S)[b"local"], FAILED,
               ErrorCode.DESTINATION_UNCERTAIN)

        # Without a timeout it waits as long as the source may still write.
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(a.client.unregister, dst.region)
            assert wait_until(lambda: held(a) == 1, SLACK_S)
            assert not wait_until(waiting.done, WAIT_S), waiting.result(0)
            # Meanwhile the withdrawn region takes no new work.
            refused = a.client.deliver({b"local": into}).result(RESULT_TIMEOUT_S)[b"local"]
            expect(refused, FAILED, ErrorCode.BAD_DESCRIPTOR)
            b.node.proc.send_signal(signal.SIGKILL)
            b.node.proc.wait(SLACK_S)
            # B is known gone after peer_dead_ms: the reservation ends, the ack comes, the memory goes.
            waiting.result(PEER_DEAD_MS / 1000 + SLACK_S)
    finally:
        if b.node.proc.poll() is None:
            b.node.proc.send_signal(signal.SIGCONT)
    assert dst.region.registration is None
    st = a.stats()
    assert st["tables"]["withdrawals"] == 0, st["tables"]
    assert st["counters"].get("unregions_held") == 2, st["counters"]
    assert st["peers"][b.endpoint]["uncertain"] == 0, st["peers"]
