"""Two spellings of one source, one link (spec section 5.3, "Twin links"), with real nodes.

Node B listens on ``tcp://127.0.0.1:P``; A's clients hint its keys under that spelling and
under ``tcp://localhost:P``. B proves to A that both links reach it (``peer_welcome.twins``):
A keeps one link, B one peer session, and keys hinted under either spelling arrive byte for
byte. B restarts on the same port: the alias follows the link to the new incarnation.
"""

from __future__ import annotations

import socket
from typing import Any

from kvcr_client import LeaseStatus
from kvcr_testing.health import wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, plain_layout
from kvcr_testing.nodes import start_node
from kvcr_testing.remote import POOLS, Sites, assert_site_clean, deliver_checked, poll_stats

LAYOUT = plain_layout(4)
SLACK_S = 10.0
IDLE_MS = 8000
"""A's peer_idle_ms: longer than a restart of B takes, so that the link lives through them."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def one_link(a: Any, b: Any, numeric: str, named: str) -> dict[str, Any]:
    """A holds one link to B (its spelling first dialled), the other spelling an alias of it,
    and B one peer session."""
    peers = a.stats()["peers"]
    assert len(peers) == 1, peers
    (endpoint, peer), = peers.items()
    assert {endpoint, *peer["aliases"]} == {numeric, named}, peers
    assert b.stats()["peer_sessions"] == 1
    return dict(peer)


def test_two_spellings_of_one_source_share_one_link_and_follow_its_restarts(sites: Sites) -> None:
    port = free_port()
    numeric, named = f"tcp://127.0.0.1:{port}", f"tcp://localhost:{port}"
    (a,) = sites.start(("a", {"args": ("--peer-idle-ms", str(IDLE_MS))}))
    for restart in range(3):
        b = sites.adopt(start_node(numeric, *POOLS), f"b{restart}")
        first = b.deposit(b"one-%d" % restart, LAYOUT, seed=10 + restart)
        second = b.deposit(b"two-%d" % restart, LAYOUT, seed=20 + restart)
        a.client.submit_hint("by-number", numeric, [b"one-%d" % restart]).result(RESULT_TIMEOUT_S)
        a.client.submit_hint("by-name", named, [b"two-%d" % restart]).result(RESULT_TIMEOUT_S)
        spans = range(len(LAYOUT.spans))
        for _ in range(2):
            deliver_checked(a, b"one-%d" % restart, LAYOUT, first, spans, seed=30, request_id="by-number")
            deliver_checked(a, b"two-%d" % restart, LAYOUT, second, spans, seed=31, request_id="by-name")
        peer = one_link(a, b, numeric, named)
        assert peer["incarnation"] == b.stats()["incarnation"], "the link follows the source's restarts"
        # Leases through either spelling go through the one session at B.
        lease = a.client.lease([b"two-%d" % restart], request_id="by-name").result(RESULT_TIMEOUT_S)
        assert lease.status(b"two-%d" % restart) is LeaseStatus.LEASED_REMOTE
        assert b.stats()["leases"]["held"] == 1 and b.stats()["peer_sessions"] == 1
        lease.release().result(RESULT_TIMEOUT_S)
        poll_stats(b, lambda st: st["leases"]["held"] == 0, SLACK_S, "B let go of the lease")
        assert_site_clean(b)
        sites.sites.remove(b)
        b.close()
        b.node.stop()
        sites.owned.remove(b.node)
    # One fold: the link and its alias lived through B's restarts (each a new incarnation).
    assert a.stats()["counters"]["links_folded"] == 1, a.stats()["counters"]
    assert a.stats()["counters"]["peer_restarts"] == 2
    # Nothing uses the link: it closes idle, and its alias with it.
    assert wait_until(lambda: not a.stats()["peers"], IDLE_MS / 1000 + SLACK_S)
    tables = a.stats()["tables"]
    assert tables["links"] == tables["link_aliases"] == tables["links_draining"] == 0, tables
    assert_site_clean(a)
