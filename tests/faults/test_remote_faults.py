"""Cross-node delivery when a source or a client fails (spec section 12: failures are first-class).

Each fault is made deterministic with SIGSTOP: the source is frozen before it can read the
write request, so the test knows what was and was not written; SIGKILL then removes it
with no cleanup at all. Node A is the target (the client's node), B the source.

- A frozen source: the deliver fails DESTINATION_UNCERTAIN at its deadline; A keeps the
  write as uncertain (a frozen source is not a dead one) until B is known gone, i.e.
  disconnected for ``--peer-dead-ms`` or back with a new incarnation; for a fetch, A's
  WRITING slots stay allocated until then.
- A restarted source: old writes end PEER_RESTARTED (or, already uncertain, resolved);
  new ones work, byte-exact, with the new node's bytes.
- A killed client: the source still ends its transfer and drops its claims.

After each test every surviving node is clean: no claim, no breach, nothing pending, no
write to a peer outstanding, and exactly the slots of the objects the test knows of.
"""

from __future__ import annotations

import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvcr_client import ErrorCode, NodeLostError, OperationTimeout, Presence
from kvcr_testing.health import counter, outcome_count, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, plain_layout
from kvcr_testing.nodes import frozen, start_node
from kvcr_testing.remote import FAILED, OK, POOLS, Dest, deliver_checked, expect, poll_stats, warm_link

DEADLINE_MS = 1500
PEER_DEAD_MS = 500
SLACK_S = 3.0
"""How much later than its deadline a failed operation may complete."""
LAYOUT = plain_layout(4)


def kill(node: Any) -> None:
    node.proc.send_signal(signal.SIGKILL)
    node.proc.wait(10)


def peer(st: dict[str, Any], endpoint: str) -> dict[str, Any]:
    return dict(st["peers"].get(endpoint, {}))


# --------------------------------------------------------------------------- a source that dies


def test_source_frozen_then_killed_deliver(sites: Any) -> None:
    a, b = sites.start(("a", {"args": ("--peer-dead-ms", str(PEER_DEAD_MS))}), "b")
    src = b.deposit(b"k", LAYOUT, seed=1)
    warm_link(a, b, b"k", LAYOUT, src, "r")

    with frozen(b.node):
        dst = Dest(a, LAYOUT, range(4), seed=10)
        started = time.monotonic()
        handle = a.client.deliver({b"k": dst.spans}, request_id="r", deadline_ms=DEADLINE_MS)
        out = handle.result(DEADLINE_MS / 1000 + SLACK_S)[b"k"]
        elapsed = time.monotonic() - started
        expect(out, FAILED, ErrorCode.DESTINATION_UNCERTAIN)
        assert DEADLINE_MS / 1000 - 0.1 <= elapsed <= DEADLINE_MS / 1000 + SLACK_S, elapsed
        dst.assert_untouched()  # B was frozen before it could read the request
        st = a.stats()
        assert peer(st, b.endpoint)["uncertain"] == 1, st["peers"]
        assert counter(st, "uncertain_writes") == 1
        # Frozen is not dead: the link is still up, so the write stays uncertain well past
        # peer_dead_ms (A keeps probing).
        assert not wait_until(lambda: peer(a.stats(), b.endpoint)["uncertain"] == 0, 2 * PEER_DEAD_MS / 1000)
        kill(b.node)
    st = poll_stats(a, lambda st: peer(st, b.endpoint).get("writes_outstanding") == 0, PEER_DEAD_MS / 1000 + SLACK_S,
                    "the uncertain write resolved after the source died")
    assert peer(st, b.endpoint)["state"] == "down", st["peers"]
    assert counter(st, "uncertain_resolved") == 1, st["counters"]
    dst.assert_untouched()
    # New work towards the dead source fails at its deadline, not later; A stays clean.
    deliver_checked(a, b"k", LAYOUT, None, range(4), seed=11, request_id="r", deadline_ms=800,
                    code=ErrorCode.PEER_UNREACHABLE)


def test_source_that_answers_late_resolves_the_uncertain_write(sites: Any) -> None:
    """B thaws after A's deadline: it still serves the write (it cannot know the deadline
    passed while it was frozen), and its answer resolves A's uncertain write."""
    a, b = sites.start(("a", {"args": ("--peer-dead-ms", "60000")}), "b")
    src = b.deposit(b"k", LAYOUT, seed=7)
    warm_link(a, b, b"k", LAYOUT, src, "r")
    with frozen(b.node):
        dst = Dest(a, LAYOUT, range(4), seed=70)
        out = a.client.deliver({b"k": dst.spans}, request_id="r", deadline_ms=DEADLINE_MS)
        expect(out.result(DEADLINE_MS / 1000 + SLACK_S)[b"k"], FAILED, ErrorCode.DESTINATION_UNCERTAIN)
        assert peer(a.stats(), b.endpoint)["uncertain"] == 1
    st = poll_stats(a, lambda st: counter(st, "uncertain_resolved") == 1, SLACK_S, "B's late answer resolved the write")
    assert peer(st, b.endpoint)["writes_outstanding"] == 0, st["peers"]
    # "Uncertain" meant it: the destination holds either its own pattern or the whole object.
    if (dst.buf == dst.before).all():
        dst.assert_untouched()
    else:
        dst.assert_delivered(src)
    deliver_checked(a, b"k", LAYOUT, src, range(4), seed=71, request_id="r")


def test_source_frozen_then_killed_fetch_frees_writing_slots(sites: Any) -> None:
    a, b = sites.start(("a", {"args": ("--peer-dead-ms", str(PEER_DEAD_MS))}), "b")
    src = b.deposit(b"k", LAYOUT, seed=2)
    warm_link(a, b, b"k", LAYOUT, src, "r")
    free_before = a.stats()["pools"]["kv"]["free"]
    expected_layout = {b"k": [(name, "kv") for name in LAYOUT.names]}

    with frozen(b.node):
        fetch = a.client.fetch(expected_layout, request_id="r", deadline_ms=DEADLINE_MS)
        out = fetch.result(DEADLINE_MS / 1000 + SLACK_S)[b"k"]
        expect(out, FAILED, ErrorCode.DESTINATION_UNCERTAIN)
        assert out.handle is None
        # The slots the source may still write stay allocated, the entry WRITING.
        st = a.stats()
        assert st["writing"] == 1 and st["pools"]["kv"]["free"] == free_before - 4, st["pools"]
        assert a.client.query([b"k"]).result(5)[b"k"].presence is Presence.FETCHING
        # A local deliver of the key waits on the WRITING entry.
        dst = Dest(a, LAYOUT, range(4), seed=20)
        waiting = a.client.deliver({b"k": dst.spans}, deadline_ms=20_000)
        assert not wait_until(waiting.done, 2 * PEER_DEAD_MS / 1000)
        assert a.stats()["writing"] == 1
        kill(b.node)
    # Resolved: the fill is abandoned, the waiting deliver learns the key is not here.
    st = poll_stats(a, lambda st: st["writing"] == 0, PEER_DEAD_MS / 1000 + SLACK_S, "the WRITING fill freed")
    assert st["pools"]["kv"]["free"] == free_before, st["pools"]
    assert counter(st, "uncertain_resolved") == 1, st["counters"]
    expect(waiting.result(SLACK_S)[b"k"], FAILED, ErrorCode.NOT_FOUND)
    dst.assert_untouched()
    assert a.client.query([b"k"]).result(5)[b"k"].presence is Presence.MISS


def test_source_that_never_answers_is_unreachable(sites: Any, tmp_path: Path) -> None:
    (a,) = sites.start("a")
    nowhere = f"ipc://{Path(a.endpoint.removeprefix('ipc://')).parent}/nobody.sock"
    a.client.submit_hint("r", nowhere, [b"k"]).result(RESULT_TIMEOUT_S)
    started = time.monotonic()
    deliver_checked(a, b"k", LAYOUT, None, range(4), seed=30, request_id="r", deadline_ms=800,
                    code=ErrorCode.PEER_UNREACHABLE)
    out = a.client.fetch({b"k": [(n, "kv") for n in LAYOUT.names]}, request_id="r", deadline_ms=800).result(SLACK_S + 1)
    expect(out[b"k"], FAILED, ErrorCode.PEER_UNREACHABLE)
    assert time.monotonic() - started < 2 * (0.8 + SLACK_S)
    assert peer(a.stats(), nowhere)["state"] == "connecting"


# --------------------------------------------------------------------------- a source that restarts


def test_source_restart(sites: Any) -> None:
    # peer_dead_ms far beyond the test: only the new incarnation can end B1's writes.
    (a,) = sites.start(("a", {"args": ("--peer-dead-ms", "60000")}))
    b1 = sites("b1")
    endpoint = b1.endpoint
    src1 = b1.deposit(b"k", LAYOUT, seed=3)
    warm_link(a, b1, b"k", LAYOUT, src1, "r")
    inc1 = a.stats()["peers"][endpoint]["incarnation"]

    with frozen(b1.node):
        sent_dst = Dest(a, LAYOUT, range(4), seed=40)
        sent = a.client.deliver({b"k": sent_dst.spans}, request_id="r", deadline_ms=30_000)
        gone_dst = Dest(a, LAYOUT, range(4), seed=41)
        gone = a.client.deliver({b"k": gone_dst.spans}, request_id="r", deadline_ms=DEADLINE_MS)
        expect(gone.result(DEADLINE_MS / 1000 + SLACK_S)[b"k"], FAILED, ErrorCode.DESTINATION_UNCERTAIN)
        st = a.stats()
        assert peer(st, endpoint)["writes_outstanding"] == 2 and peer(st, endpoint)["uncertain"] == 1, st["peers"]
        kill(b1.node)
    poll_stats(a, lambda st: peer(st, endpoint)["state"] == "down", SLACK_S, "A saw the source go")
    assert not sent.done()

    b2 = sites.adopt(start_node(endpoint, *POOLS), "b2")
    src2 = b2.deposit(b"k", LAYOUT, seed=4)  # the same key, other bytes
    inc2 = b2.stats()["incarnation"]
    assert inc2 != inc1
    st = poll_stats(a, lambda st: peer(st, endpoint)["incarnation"] == inc2 and peer(st, endpoint)["state"] == "ready",
                    SLACK_S + 2, "A reconnected to the new incarnation")
    assert counter(st, "peer_restarts") == 1, st["counters"]
    assert counter(st, "uncertain_resolved") == 1, st["counters"]
    assert peer(st, endpoint)["writes_outstanding"] == 0, st["peers"]
    expect(sent.result(SLACK_S)[b"k"], FAILED, ErrorCode.PEER_RESTARTED)
    sent_dst.assert_untouched()
    gone_dst.assert_untouched()

    # New operations reach the new node and carry its bytes.
    deliver_checked(a, b"k", LAYOUT, src2, range(4), seed=42, request_id="r")
    deliver_checked(a, b"k", LAYOUT, src2, [0], seed=43, request_id="r", partial=True)
    deliver_checked(a, b"k", LAYOUT, src2, [1, 2, 3], seed=44, request_id="r", partial=True)
    out = a.client.fetch({b"k": [(n, "kv") for n in LAYOUT.names]}, request_id="r").result(RESULT_TIMEOUT_S)[b"k"]
    expect(out, OK)
    a.resident[b"k"] = ("kv",) * 4
    deliver_checked(a, b"k", LAYOUT, src2, range(4), seed=45)
    assert out.handle is not None
    a.client.release([out.handle]).result(RESULT_TIMEOUT_S)
    assert counter(b2.stats(), "writes_inline") == 4


# --------------------------------------------------------------------------- a client that dies


class DoomedClient:
    """``remote_fault_client.py`` in a process of its own, driven line by line."""

    def __init__(self, a: Any, b: Any, key: bytes, warm: bool) -> None:
        script = Path(__file__).resolve().parent / "remote_fault_client.py"
        self.proc = subprocess.Popen(
            [sys.executable, str(script), a.endpoint, b.endpoint, key.decode(), str(len(LAYOUT.spans)),
             str(64 * 1024), "1" if warm else "0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines: list[str] = []

    def expect_line(self, wanted: str, timeout_s: float = 20.0) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(stdout, selectors.EVENT_READ)
            end = time.monotonic() + timeout_s
            while time.monotonic() < end and sel.select(max(0.0, end - time.monotonic())):
                line = stdout.readline()
                if not line:
                    break
                self.lines.append(line)
                if line.strip() == wanted:
                    return
        raise AssertionError(f"the client process did not say {wanted!r}: {''.join(self.lines)}")

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.mark.parametrize("known", [True, False], ids=["source-knows-client", "source-never-saw-client"])
def test_client_killed_mid_remote_deliver(sites: Any, known: bool) -> None:
    """The client dies while its deliver waits at a frozen B. B then either writes into a
    process that is gone (it knew the client's agent) or refuses the client's metadata;
    either way the write ends, B's claim drops, and A settles the dead client's op."""
    a, b = sites.start("a", "b")
    src = b.deposit(b"k", LAYOUT, seed=5)
    warm_link(a, b, b"k", LAYOUT, src, "r")
    doomed = DoomedClient(a, b, b"k", warm=known)
    try:
        if known:
            doomed.expect_line("warm")
        with frozen(b.node):
            if known:
                doomed.go()
            doomed.expect_line("sent")
            # A forwarded the client's deliver to B (B, frozen, has not read it).
            poll_stats(a, lambda st: peer(st, b.endpoint)["writes_outstanding"] == 1, 10, "the write sent to B")
            doomed.kill()
    finally:
        if doomed.proc.poll() is None:
            doomed.kill()
    poll_stats(b, lambda st: st["operations_pending"] == 0 and st["transfers"]["in_flight"] == 0
               and st["claims"]["total"] == 0, 10, "B ended the write")
    poll_stats(a, lambda st: peer(st, b.endpoint)["writes_outstanding"] == 0 and st["operations_pending"] == 0, 10,
               "A settled the dead client's operation")
    # The link still works for the living.
    deliver_checked(a, b"k", LAYOUT, src, range(4), seed=50, request_id="r")


def test_target_killed_mid_write(sites: Any) -> None:
    """A dies while its write waits at a frozen B: B serves it (the client is alive), ends
    the transfer and drops its claim; the client's operation fails (its node is gone)."""
    a, b = sites.start("a", "b")
    src = b.deposit(b"k", LAYOUT, seed=6)
    warm_link(a, b, b"k", LAYOUT, src, "r")
    with frozen(b.node):
        dst = Dest(a, LAYOUT, range(4), seed=60)
        handle = a.client.deliver({b"k": dst.spans}, request_id="r", deadline_ms=DEADLINE_MS)
        poll_stats(a, lambda st: peer(st, b.endpoint)["writes_outstanding"] == 1, 10, "the write sent to B")
        kill(a.node)
    st = poll_stats(b, lambda st: outcome_count(st, "write.") == 2, 10, "B ended the orphaned write")
    assert st["claims"]["total"] == 0 and st["operations_pending"] == 0, st
    with pytest.raises((NodeLostError, OperationTimeout)):
        handle.result(DEADLINE_MS / 1000 + SLACK_S)
    # B wrote into the (living) client's memory: if it did, the bytes are the right ones.
    if st["outcomes"].get("write.OK") == 2:
        dst.assert_delivered(src)
    else:
        dst.assert_untouched()


# --------------------------------------------------------------------------- a target that stalls


def test_target_stalled_past_the_source_grace_reconnects(sites: Any) -> None:
    """A freezes longer than B's client grace: B drops A's peer session as silent. Once A
    runs again, its session with B must come back (a new hello), not fail every write."""
    a, b = sites.start("a", ("b", {"args": ("--client-grace-ms", "600", "--heartbeat-ms", "150")}))
    src = b.deposit(b"k", LAYOUT, seed=8)
    warm_link(a, b, b"k", LAYOUT, src, "r")
    with frozen(a.node):
        poll_stats(b, lambda st: counter(st, "peers_expired") == 1, 10, "B dropped A's silent peer session")
    poll_stats(a, lambda st: peer(st, b.endpoint).get("state") == "ready", SLACK_S, "A's link usable")
    dst = Dest(a, LAYOUT, range(4), seed=80)
    out = a.client.deliver({b"k": dst.spans}, request_id="r").result(RESULT_TIMEOUT_S)[b"k"]
    if out.status is OK:
        dst.assert_delivered(src)
    else:
        # The first write may meet the dropped session (refused whole); the link must heal.
        assert out.code == ErrorCode.BAD_STATE, out
        dst.assert_untouched()
    deliver_checked(a, b"k", LAYOUT, src, range(4), seed=81, request_id="r")
    assert b.stats()["peer_sessions"] == 1
