"""Sources' grants passed on to clients (``kvcr_node.source_grants``, spec section 6.12,
"Across nodes"), in process: a source's rows reach the client only with an agent of the
incarnation that granted them; its agent goes once per client session and incarnation
(again when the client asks for the node's); local rows stay as they are; the span limit
counts both."""

from __future__ import annotations

import dataclasses

import kvcr_protocol as kp
from kvcr_node.records import Session
from kvcr_node.source_grants import SourceGrants
from kvcr_protocol import GrantNode, MemoryKind, Region
from kvcr_protocol.columns import U32, pack

B = "ipc:///tmp/kvcr-b.sock"
NODE_B = GrantNode("kvcr-node-b", b"md-b", (Region(0, MemoryKind.DRAM, 0, 1 << 30, 1 << 20),), 7_000,
                   kp.columns.pack([4096], "I"))


def source_grant(node: GrantNode | None = NODE_B) -> kp.LeaseGrant:
    return kp.grant_columns([(("k", "v"), [(0, 3), (0, 4)]), None], node)


def test_rows_need_the_agent_of_the_incarnation_that_granted_them() -> None:
    grants = SourceGrants()
    assert grants.wants_node(B, 7)
    assert grants.rows(B, 7, source_grant(None), 2) == {}  # no agent cached: nothing to read with
    assert grants.rows(B, 7, source_grant(), 2) == {0: ((("k", "v"), bytes([0, 0]), pack([3, 4], U32)), b"")}
    assert not grants.wants_node(B, 7) and grants.wants_node(B, 8)
    assert grants.rows(B, 7, source_grant(None), 2) == {0: ((("k", "v"), bytes([0, 0]), pack([3, 4], U32)), b"")}
    # The source's digests of the row's spans come with it, to be passed on (spec section 6.12).
    digested = dataclasses.replace(source_grant(None), digest=kp.columns.pack([11, 12], "Q"))
    assert grants.rows(B, 7, digested, 2)[0][1] == kp.columns.pack([11, 12], "Q")
    assert grants.rows(B, 8, source_grant(None), 2) == {}  # restarted: the cached agent is not its
    bad = GrantNode("kvcr-node-b", b"md-b", NODE_B.pools, 0)  # no slot sizes: a client could not read
    assert SourceGrants().rows(B, 7, source_grant(bad), 2) == {}
    passed_on = kp.grant_columns([(("k",), [(0, 1)])], None, [1], (kp.GrantSource(B, 7, NODE_B),))
    assert grants.rows(B, 7, passed_on, 1) == {}  # a source names no other sources


def test_the_agent_goes_once_per_client_session() -> None:
    grants = SourceGrants()
    grants.rows(B, 7, source_grant(), 2)
    session = Session(b"client", "engine", "client-agent", 5)
    local = [None, (("x",), bytes([1]), pack([9], U32)), None]
    remote = {0: (B, 7, (("k", "v"), bytes([0, 0]), pack([3, 4], U32)))}
    first = grants.columns(session, local, remote, None)
    assert first.source == bytes([1, 0, 0]) and first.sources == (kp.GrantSource(B, 7, NODE_B),)
    assert [(i, names) for i, names, _, _ in first.keys(kp.DEFAULT_LIMITS)] == [(0, ("k", "v")), (1, ("x",))]
    again = grants.columns(session, local, remote, None)
    assert again.sources == (kp.GrantSource(B, 7, None),)
    asked = grants.columns(session, local, remote, NODE_B)  # the client asked for the node's agent: it has none cached
    assert asked.sources == (kp.GrantSource(B, 7, NODE_B),)
    other = Session(b"other", "engine", "other-agent", 5)
    assert grants.columns(other, local, remote, None).sources[0].node == NODE_B


def test_the_span_limit_counts_local_and_source_rows() -> None:
    grants = SourceGrants()
    grants.rows(B, 7, source_grant(), 2)
    session = Session(b"client", "engine", "client-agent", 5)
    remote = {0: (B, 7, (("k", "v"), bytes([0, 0]), pack([3, 4], U32)))}
    out = grants.columns(session, [None, (("x",), bytes([1]), pack([9], U32))], remote, None, max_spans=2)
    assert out.source == b"" and out.sources == ()  # K's two spans would pass the limit: by deliver
    assert [i for i, _, _, _ in out.keys(kp.DEFAULT_LIMITS)] == [1]
