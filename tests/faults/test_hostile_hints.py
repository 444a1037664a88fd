"""Hostile but well-formed hints: bad source endpoints, other clients' request ids, floods.

A hint names a source node for a request's keys (spec section 5.2). A node must refuse a
hint whose endpoint it cannot dial (``BAD_ENDPOINT`` at ``endpoint``) instead of
crashing on it later; keep each session's hints to itself, so that no client can see or
steer another client's request; bound them per session (``HINT_LIMIT``); and forget them
at ``bye`` or when the session expires. After each test the node is alive and clean: no
breach, claim, slot or hint left.

Hints the public client would refuse are sent through the client's core, as a hostile
client would send them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from hostile_helpers import (
    RESULT_TIMEOUT_S,
    KiB,
    Layout,
    Registrar,
    assert_bytes_equal,
    assert_clean,
    pattern,
    slot_accounting,
    stats,
)

from kvcr_client import ArgumentError, Client, ErrorCode, KeyStatus, NodeError, Presence, Span
from kvcr_protocol import IPC_PATH_MAX, Ack, Message, SubmitHint

SLOT = 4 * KiB
POOL = ("--pool", "kv:4KiB:64")
LAYOUT = Layout([(f"L{i}", "kv", SLOT) for i in range(4)])
FETCH_LAYOUT = [(name, "kv") for name in LAYOUT.names]

BAD_ENDPOINTS = [
    "bogus://x",
    "tcp://no such host:1",
    "tcp://127.0.0.1:99999",
    "tcp://127.0.0.1:0",
    "tcp://999.1.1.1:5",
    "tcp://*:5555",
    "tcp://[::1:5555",
    "tcp://127.0.0.1:5\x00",
    "ipc://",
    "ipc:///tmp/" + "x" * IPC_PATH_MAX,
    "ipc:///tmp/with space",
    "inproc://kvcr-zap",
    "udp://127.0.0.1:5555",
    "no-scheme-at-all",
]


def _ack(msg: Message) -> None:
    assert isinstance(msg, Ack), msg


def raw_hint(client: Client, request_id: str, endpoint: str, keys: Sequence[bytes]) -> None:
    """A hint sent as is, past the client's own checks; raises the node's refusal."""
    _, fut = client.core.request(lambda i: SubmitHint(i, request_id, endpoint, tuple(keys)), _ack, RESULT_TIMEOUT_S)
    client.core.wait(fut, RESULT_TIMEOUT_S)


def dst_spans(region: Any) -> list[Span]:
    return [Span(name, region, off, size) for (name, _, size), off in zip(LAYOUT.spans, LAYOUT.offsets, strict=True)]


def deposit(client: Client, reg: Registrar, key: bytes, seed: int) -> np.ndarray:
    src = pattern(LAYOUT.nbytes, seed)
    out = client.deposit({key: LAYOUT.source_spans(reg(src))}).result(RESULT_TIMEOUT_S)[key]
    assert out.status is KeyStatus.STORED, out
    return src


def deliver_into_fresh(client: Client, reg: Registrar, key: bytes, seed: int, request_id: str | None = None) -> Any:
    """Deliver ``key`` into a new sentinel buffer; returns (outcome, buffer, its pattern)."""
    dst = pattern(LAYOUT.nbytes, seed)
    before = dst.copy()
    out = client.deliver({key: dst_spans(reg(dst))}, request_id=request_id).result(RESULT_TIMEOUT_S)[key]
    return out, dst, before


def test_hint_with_a_bad_endpoint_is_refused_and_the_node_goes_on(node_factory: Callable[..., Any]) -> None:
    node = node_factory(*POOL)
    with Client(node.endpoint, name="hinter") as client:
        reg = Registrar(client)
        src = deposit(client, reg, b"here", seed=1)
        slots = slot_accounting(stats(client))
        for n, endpoint in enumerate(BAD_ENDPOINTS):
            rid = f"r{n}"
            with pytest.raises(ArgumentError) as arg:
                client.submit_hint(rid, endpoint, [b"k"])
            assert arg.value.field == "source_endpoint", arg.value
            with pytest.raises(NodeError) as refused:
                raw_hint(client, rid, endpoint, [b"k"])
            assert refused.value.code == ErrorCode.BAD_ENDPOINT, (endpoint, refused.value)
            assert refused.value.path == "endpoint", (endpoint, refused.value)
            # Nothing of the hint was kept: the key is a plain miss, for query, deliver and fetch.
            assert client.query([b"k"], request_id=rid).result(RESULT_TIMEOUT_S)[b"k"].presence is Presence.MISS
            out, dst, before = deliver_into_fresh(client, reg, b"k", seed=10 + n, request_id=rid)
            assert out.status is KeyStatus.FAILED and out.code == ErrorCode.NOT_FOUND, (endpoint, out)
            assert_bytes_equal(dst, before, f"destination after a refused hint to {endpoint!r}")
            fetched = client.fetch({b"k": FETCH_LAYOUT}, request_id=rid).result(RESULT_TIMEOUT_S)[b"k"]
            assert fetched.code == ErrorCode.NOT_FOUND, (endpoint, fetched)
            assert node.proc.poll() is None, "".join(node.output)
        # The node still serves: a local key comes back byte-exact.
        out, dst, _ = deliver_into_fresh(client, reg, b"here", seed=99)
        assert out.status is KeyStatus.OK, out
        assert_bytes_equal(dst, src, "local deliver after the refused hints")
        st = assert_clean(client, slots_before=slots)
        assert st["peers"] == {}, st["peers"]
        reg.close()
    assert node.proc.poll() is None
