"""Every invalid request of the spec's vectors, sent raw to a live node (spec/vectors).

The conformance tests decode each invalid vector in process. Here each one whose message a
client sends goes to a running node as it is, on a session welcomed at the vector's
version, as a hostile client would send it: its bytes are not what the client library would
ever encode (a parent count that does not match the keys, a key named as its own parent,
counts and columns out of range, wrong types). The node must answer each with the
``error`` the vector names, code and path, keep the session and serve the next request,
and end with nothing held: slots, claims, leases, registrations.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq

from kvcr_client import Client
from kvcr_protocol import PROTOCOL_VERSIONS, Error, ErrorCode, Hello, Query, QueryReply, Welcome, decode, encode
from kvcr_testing.health import assert_clean, stats
from kvcr_testing.nodes import ClientAgent, NodeProcess

VECTORS = Path(__file__).resolve().parents[2] / "spec" / "vectors"
FILES = ("invalid.json", "invalid-v3.json", "invalid-v4.json", "invalid-v5.json")
REQUESTS = frozenset({
    "regions", "unregions", "deposit", "query", "deliver", "fetch", "release", "abort", "hint", "unhint",
    "stats", "lease", "renew", "unlease", "suspect", "put", "commit", "unput",
})
"""The messages a client sends once welcomed (``hello``, ``heartbeat`` and ``bye`` aside)."""
RAW_TIMEOUT_MS = 5000


def requests() -> list[dict[str, Any]]:
    """The invalid vectors whose message is a client's request."""
    out = []
    for name in FILES:
        for vec in json.loads((VECTORS / name).read_text(encoding="utf-8"))["vectors"]:
            try:
                fields = msgpack.unpackb(bytes.fromhex(vec["hex"]), raw=False, strict_map_key=False)
            except Exception:  # not a map at all: test_local's malformed frames cover those
                continue
            if isinstance(fields, dict) and fields.get("t") in REQUESTS:
                out.append(vec)
    return out


INVALID = requests()


class RawSession:
    """A DEALER welcomed at one version, sending frames as they are."""

    def __init__(self, endpoint: str, version: int, agent: ClientAgent) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.version = version
        welcome = self.ask(encode(Hello(1, (version,), f"hostile-v{version}", agent.name, agent.metadata), 1))
        assert isinstance(welcome, Welcome) and welcome.version == version, welcome

    def ask(self, frame: bytes) -> Any:
        self.sock.send(frame)
        assert self.sock.poll(RAW_TIMEOUT_MS), "the node did not answer"
        return decode(self.sock.recv(), self.version)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def test_the_spec_has_invalid_requests_of_every_kind_a_client_sends() -> None:
    assert all(int(v["max_version"]) in PROTOCOL_VERSIONS for v in INVALID)
    kinds = {msgpack.unpackb(bytes.fromhex(v["hex"]), raw=False, strict_map_key=False)["t"] for v in INVALID}
    assert {"deposit", "put", "fetch", "deliver", "lease", "query"} <= kinds, kinds
    assert {"parents-count", "parents-self", "parents-str", "parents-257"} <= {v["name"] for v in INVALID}


def test_each_invalid_request_is_refused_by_a_live_node_as_the_spec_says(
    node_factory: Callable[..., NodeProcess],
) -> None:
    node = node_factory("--pool", "kv:4KiB:16")
    agent = ClientAgent("hostile-vectors")
    sessions: dict[int, RawSession] = {}
    try:
        with Client(node.endpoint, name="owner") as owner:
            before = stats(owner)["protocol_errors"]
            refused: dict[str, int] = {}
            for vec in INVALID:
                version = int(vec["max_version"])
                session = sessions.get(version) or sessions.setdefault(version, RawSession(node.endpoint, version, agent))
                reply = session.ask(bytes.fromhex(vec["hex"]))
                assert isinstance(reply, Error), (vec["name"], reply)
                assert (ErrorCode(reply.code).name, reply.path) == (vec["error"], vec["path"]), (vec["name"], reply)
                refused[vec["error"]] = refused.get(vec["error"], 0) + 1
                # The session goes on: the next request is served.
                answer = session.ask(encode(Query(99, (b"k",)), version))
                assert isinstance(answer, QueryReply), (vec["name"], answer)
            assert sum(refused.values()) == len(INVALID), refused
            after = stats(owner)["protocol_errors"]
            for code, count in refused.items():
                assert after.get(code, 0) - before.get(code, 0) == count, (code, before, after)
            for session in sessions.values():
                session.close()
            sessions.clear()
            assert_clean(owner)
    finally:
        for session in sessions.values():
            session.close()
        agent.close()
