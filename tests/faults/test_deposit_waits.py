"""A deposit of a key that is still WRITING waits for the writer's outcome (spec section 9).

``DUPLICATE`` reports success: the key is stored. So a deposit must not say it while
the key's first writer may still fail. Here the writer is a fetch that node A runs from
a source B frozen with SIGSTOP, which keeps the key WRITING in A for as long as the test
needs: a second client's deposit of the key then waits. When the fetch fails (B is
killed and known gone), the deposit stores the key from its own bytes; when the fetch
succeeds (B thaws), the deposit answers DUPLICATE; a deposit whose deadline passes while
it waits fails TIMEOUT. Every delivered byte is checked; both nodes end clean.
"""

from __future__ import annotations

import signal
from typing import Any

import numpy as np

from kvcr_client import Client, ErrorCode, KeyStatus
from kvcr_testing.health import wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Registrar, plain_layout
from kvcr_testing.patterns import pattern
from kvcr_testing.remote import FAILED, OK, deliver_checked, expect, warm_link

LAYOUT = plain_layout(4)
FETCH_LAYOUT = {b"k": [(name, "kv") for name in LAYOUT.names]}
PEER_DEAD_MS = 500
FETCH_DEADLINE_MS = 1500
WAIT_S = 1.0
"""How long the test watches a deposit that must still be waiting."""
SLACK_S = 5.0


def depositor(a: Any, seed: int) -> tuple[Client, Any, np.ndarray]:
    """A second client of A with its own patterned bytes for ``k``."""
    client = Client(a.endpoint, name=f"depositor{seed}")
    reg = Registrar(client)
    src = pattern(LAYOUT.nbytes, seed)
    return client, reg, LAYOUT.source_spans(reg(src)), src


def test_deposit_stores_the_key_when_the_writer_fails(sites: Any) -> None:
    a, b = sites.start(("a", {"args": ("--peer-dead-ms", str(PEER_DEAD_MS))}), "b")
    b_src = b.deposit(b"k", LAYOUT, seed=1)
    warm_link(a, b, b"k", LAYOUT, b_src, "r")
    client, reg, spans, mine = depositor(a, seed=2)
    try:
        b.node.proc.send_signal(signal.SIGSTOP)  # killed below; thawed in ``finally`` if a check fails first
        fetch = a.client.fetch(FETCH_LAYOUT, request_id="r", deadline_ms=FETCH_DEADLINE_MS)
        assert wait_until(lambda: a.stats()["writing"] == 1, SLACK_S)
        deposit = client.deposit({b"k": spans}, deadline_ms=30_000)
        assert not wait_until(deposit.done, WAIT_S), deposit.result(0)
        # The fetch gives up; its slots stay reserved (B may still write them), and so the
        # deposit goes on waiting.
        expect(fetch.result(FETCH_DEADLINE_MS / 1000 + SLACK_S)[b"k"], FAILED, ErrorCode.DESTINATION_UNCERTAIN)
        assert not deposit.done()
        b.node.proc.send_signal(signal.SIGKILL)
        b.node.proc.wait(SLACK_S)
        # B is known gone after peer_dead_ms: the fill is abandoned, the deposit stores its own bytes.
        out = deposit.result(PEER_DEAD_MS / 1000 + SLACK_S)[b"k"]
        assert out.status is KeyStatus.STORED, out
        a.resident[b"k"] = tuple(pool for _, pool, _ in LAYOUT.spans)
        deliver_checked(a, b"k", LAYOUT, mine, range(4), seed=3)
        st = a.stats()
        assert st["outcomes"].get("deposit.STORED") == 1, st["outcomes"]
    finally:
        if b.node.proc.poll() is None:
            b.node.proc.send_signal(signal.SIGCONT)
        reg.close()
        client.close()


def test_deposit_answers_duplicate_once_the_writer_commits(sites: Any) -> None:
    a, b = sites.start("a", "b")
    b_src = b.deposit(b"k", LAYOUT, seed=4)
    warm_link(a, b, b"k", LAYOUT, b_src, "r")
    client, reg, spans, _ = depositor(a, seed=5)
    try:
        b.node.proc.send_signal(signal.SIGSTOP)
        try:
            fetch = a.client.fetch(FETCH_LAYOUT, request_id="r", deadline_ms=30_000)
            assert wait_until(lambda: a.stats()["writing"] == 1, SLACK_S)
            # A deposit whose deadline passes while it waits fails TIMEOUT; nothing of it stays.
            short = client.deposit({b"k": spans}, deadline_ms=300).result(SLACK_S)[b"k"]
            expect(short, FAILED, ErrorCode.TIMEOUT)
            deposit = client.deposit({b"k": spans}, deadline_ms=30_000)
            assert not wait_until(deposit.done, WAIT_S), deposit.result(0)
        finally:
            b.node.proc.send_signal(signal.SIGCONT)
        # B serves the write: the fetch commits the key, and only then is the deposit a duplicate.
        fetched = fetch.result(SLACK_S)[b"k"]
        expect(fetched, OK)
        out = deposit.result(SLACK_S)[b"k"]
        assert out.status is KeyStatus.DUPLICATE, out
        a.resident[b"k"] = tuple(pool for _, pool, _ in LAYOUT.spans)
        a.client.release([fetched.handle]).result(RESULT_TIMEOUT_S)
        deliver_checked(a, b"k", LAYOUT, b_src, range(4), seed=6)  # B's bytes, not the depositor's
        st = a.stats()
        assert st["outcomes"].get("deposit.FAILED.TIMEOUT") == 1, st["outcomes"]
        assert st["outcomes"].get("deposit.DUPLICATE") == 1, st["outcomes"]
    finally:
        reg.close()
        client.close()
