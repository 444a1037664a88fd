"""Memory a source may still write takes no new work until it cannot (spec section 12).

A deliver from a source B that stops answering (SIGSTOP) fails ``DESTINATION_UNCERTAIN``
at its deadline: B may still write the destination, until it confirms or is known gone.
If the engine delivered something else into the same memory meanwhile, that deliver could
end first, be reported ``OK``, and then be overwritten by B's late write; a deposit or put
from that memory could store bytes the late write changed. So node A refuses, key by key
and with nothing moved, a deliver into those spans and a deposit or put from them, naming
the span; a granted lease does not let the client READ into them either (such a deliver
goes by the node). Memory clear of them is used as ever, and once B is known gone it all
is again, every byte checked. Afterwards no reservation, slot or withdrawal is left.
"""

from __future__ import annotations

import signal
from typing import Any

from kvcr_client import ErrorCode, KeyStatus, Presence, Span
from kvcr_testing.layouts import RESULT_TIMEOUT_S, plain_layout
from kvcr_testing.patterns import KiB, assert_bytes_equal
from kvcr_testing.remote import FAILED, OK, Dest, deliver_checked, expect, poll_stats

LAYOUT = plain_layout(4)
SPAN = 64 * KiB
DEADLINE_MS = 1000
PEER_DEAD_MS = 500
SLACK_S = 5.0


def reserved(site: Any) -> int:
    return int(site.stats()["tables"]["reserved_writes"])


def test_memory_a_source_may_still_write_takes_no_deliver_deposit_or_put_until_it_cannot(sites: Any) -> None:
    a, b = sites.start(("a", {"args": ("--peer-dead-ms", str(PEER_DEAD_MS), "--lease-pool-fraction", "1")}), "b")
    src = b.deposit(b"k", LAYOUT, seed=1)
    a.client.submit_hint("r", b.endpoint, [b"k"]).result(RESULT_TIMEOUT_S)
    deliver_checked(a, b"k", LAYOUT, src, range(4), seed=2, request_id="r")  # the peer session is up
    local = a.deposit(b"local", plain_layout(1), seed=3)
    lease = a.client.lease([b"local"]).result(RESULT_TIMEOUT_S)
    assert b"local" in lease.granted, "the node grants reads of what it leases"
    dst = Dest(a, LAYOUT, range(4), seed=4)
    spans = dst.spans
    # Spans 0 and 1 go uncertain; 2 and 3 of the same region stay clear.
    uncertain, clear = spans[:2], spans[2:]

    b.node.proc.send_signal(signal.SIGSTOP)  # killed below; thawed in ``finally`` if a check fails first
    try:
        out = a.client.deliver({b"k": uncertain}, request_id="r", partial=True,
                               deadline_ms=DEADLINE_MS).result(DEADLINE_MS / 1000 + SLACK_S)
        expect(out[b"k"], FAILED, ErrorCode.DESTINATION_UNCERTAIN)
        assert reserved(a) == 1 and a.client.tables()["uncertain_node"] == 1

        # A deliver into them, by the node or under the granted lease: refused, nothing moved.
        into = [Span("L0", dst.region, uncertain[1].offset + SPAN // 2, SPAN)]
        refused = a.client.deliver({b"local": into}).result(RESULT_TIMEOUT_S)[b"local"]
        expect(refused, FAILED, ErrorCode.DESTINATION_UNCERTAIN)
        assert f"region {dst.region.region} bytes {into[0].offset}.." in refused.reason, refused.reason
        dst.assert_untouched()
        # A deposit or put from them: refused, nothing stored.
        source = [Span("L0", dst.region, uncertain[0].offset, SPAN, "kv")]
        for store, key in ((a.client.deposit, b"from-deposit"), (a.client.put, b"from-put")):
            stored = store({key: source}).result(RESULT_TIMEOUT_S)[key]
            expect(stored, FAILED, ErrorCode.DESTINATION_UNCERTAIN)
        answers = a.client.query([b"from-deposit", b"from-put"]).result(RESULT_TIMEOUT_S)
        assert {answers[k].presence for k in answers} == {Presence.MISS}, answers

        # Memory clear of them is used as ever (the granted READ included).
        fine = [Span("L0", dst.region, clear[0].offset, SPAN)]
        assert a.client.deliver({b"local": fine}).result(RESULT_TIMEOUT_S)[b"local"].status is OK
        assert_bytes_equal(dst.buf[clear[0].offset : clear[0].offset + SPAN], local, "deliver clear of the reservation")

        b.node.proc.send_signal(signal.SIGKILL)
        b.node.proc.wait(SLACK_S)
        # B is known gone after peer_dead_ms: the reservation ends.
        poll_stats(a, lambda st: st["tables"]["reserved_writes"] == 0, PEER_DEAD_MS / 1000 + SLACK_S,
                   "the reservation ends once the source is known gone")
    finally:
        if b.node.proc.poll() is None:
            b.node.proc.send_signal(signal.SIGCONT)

    # Now the memory takes new work again: the first deliver goes by the node and frees it here too.
    assert a.client.deliver({b"local": into}).result(RESULT_TIMEOUT_S)[b"local"].status is OK
    assert_bytes_equal(dst.buf[into[0].offset : into[0].offset + SPAN], local, "deliver once the reservation ended")
    assert a.client.tables()["uncertain_node"] == 0
    for store, key in ((a.client.deposit, b"from-deposit"), (a.client.put, b"from-put")):
        assert store({key: source}).result(RESULT_TIMEOUT_S)[key].status is KeyStatus.STORED
        a.resident[key] = ("kv",)
    lease.release().result(RESULT_TIMEOUT_S)
    st = a.stats()
    assert st["tables"]["withdrawals"] == 0 and st["tables"]["reserved_writes"] == 0, st["tables"]
    assert st["counters"].get("uncertain_resolved") == 1, st["counters"]
