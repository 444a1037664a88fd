"""One message must never stop a node's progress loop (issue #10, defect 1).

A peer endpoint the node cannot connect to fails the keys that need it (``BAD_ENDPOINT``),
and any exception raised while the node handles one message, or in one step of its loop,
fails that message with ``INTERNAL``, is logged and counted (``internal_errors``), and the
loop goes on. The hostile content is injected two ways: through the public client against
a node process (a hint naming a malformed endpoint), and into a node running in this
process (``Node`` built from a ``NodeConfig``), whose methods the test replaces with ones
that raise, so that the guard is tested whatever later code validates earlier.

Every test ends with the node alive, ``invariants`` empty, and no claim, slot, link or
operation left behind.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcr_client import Client, ErrorCode, KeyStatus, NodeError, Span
from kvcr_node.config import NodeConfig
from kvcr_node.node import Node
from kvcr_node.poolspec import PoolSpec
from kvcr_protocol import Query, Role
from kvcr_testing.health import assert_clean, slot_accounting, stats, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Registrar
from kvcr_testing.nodes import inprocess_node
from kvcr_testing.patterns import KiB, assert_bytes_equal, pattern

SLOT = 64 * KiB
SPANS = 4
BAD_ENDPOINTS = ("bogus://x", "tcp://no such host:1", "tcp://127.0.0.1:notaport", "ipc://")


@contextmanager
def node_in_thread(ipc_dir: Path, name: str = "inproc") -> Iterator[tuple[Node, threading.Thread]]:
    """A node whose progress loop runs in a thread of this process; stopped (bounded) on exit."""
    config = NodeConfig(endpoint=f"ipc://{ipc_dir}/{name}.sock", name=name, pools=(PoolSpec("kv", SLOT, 32, "dram"),),
                        log_level="WARNING")
    with inprocess_node(config) as running:
        yield running


def spans(region: Any, pool: str = "") -> list[Span]:
    return [Span(f"L{i}", region, i * SLOT, SLOT, pool) for i in range(SPANS)]


def layout() -> list[tuple[str, str]]:
    return [(f"L{i}", "kv") for i in range(SPANS)]


def tables(client: Client) -> dict[str, int]:
    st = stats(client)
    return dict(st.get("tables", {}))


def assert_node_clean(client: Client, slots: dict[str, tuple[int, int]]) -> dict[str, Any]:
    st = assert_clean(client, slots_before=slots)
    assert st["peers"] == {}, st["peers"]
    assert st["tables"]["links"] == 0 and st["tables"]["link_sockets"] == 0, st["tables"]
    return st


def hinted_source(endpoint: str) -> Callable[..., str]:
    """A stand-in for the node's hint lookup: every remote key comes from ``endpoint``."""
    return lambda *args, **kwargs: endpoint


# --------------------------------------------------------------------------- endpoints


def test_bad_endpoint_hint_does_not_stop_the_node(node_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the public client, its own endpoint check switched off (a hostile client has
    none): a hint naming a malformed endpoint, then a deliver and a fetch that would use it.
    Either the hint is refused when it arrives, or the keys fail BAD_ENDPOINT; the node
    survives both and keeps nothing."""
    monkeypatch.setattr("kvcr_client.operations.endpoint_problem", lambda endpoint: None)
    node = node_factory("--pool", "kv:64KiB:32")
    with Client(node.endpoint, name="hostile") as client:
        reg = Registrar(client)
        dst = np.zeros(SPANS * SLOT, np.uint8)
        region = reg(dst)
        slots = slot_accounting(stats(client))
        for n, endpoint in enumerate(BAD_ENDPOINTS):
            rid = f"r{n}"
            try:
                client.submit_hint(rid, endpoint, [b"k"]).result(RESULT_TIMEOUT_S)
            except NodeError as exc:  # refused when it arrived: nothing can use it
                assert exc.code is ErrorCode.BAD_ENDPOINT, exc
                continue
            out = client.deliver({b"k": spans(region)}, request_id=rid, deadline_ms=2000).result(RESULT_TIMEOUT_S)[b"k"]
            assert out.status is KeyStatus.FAILED and out.code is ErrorCode.BAD_ENDPOINT, (endpoint, out)
            assert endpoint in out.reason, out
            got = client.fetch({b"k": layout()}, request_id=rid, deadline_ms=2000).result(RESULT_TIMEOUT_S)[b"k"]
            assert got.status is KeyStatus.FAILED and got.code is ErrorCode.BAD_ENDPOINT, (endpoint, got)
            client.discard_hint(rid).result(RESULT_TIMEOUT_S)
        assert node.proc.poll() is None, "".join(node.output)
        assert (dst == 0).all()
        assert_node_clean(client, slots)
        reg.close()


def test_link_failure_fails_only_its_keys(ipc_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In process, with the hint lookup bypassed: malformed endpoints reach the link code
    directly. The keys fail BAD_ENDPOINT with a reason naming the endpoint, a fetch's
    slots set aside are freed, no link or socket stays behind, and local keys of the same
    batch are served."""
    with node_in_thread(ipc_dir) as (node, thread), Client(node.endpoint, name="c") as client:
        reg = Registrar(client)
        src = pattern(SPANS * SLOT, 1)
        res = client.deposit({b"local": spans(reg(src), "kv")}).result(RESULT_TIMEOUT_S)
        assert res[b"local"].status is KeyStatus.STORED
        slots = slot_accounting(stats(client))
        for endpoint in BAD_ENDPOINTS:
            monkeypatch.setattr(node.operations, "hinted_source", hinted_source(endpoint))
            dst_local = np.zeros(SPANS * SLOT, np.uint8)
            dst_remote = np.zeros(SPANS * SLOT, np.uint8)
            out = client.deliver({b"local": spans(reg(dst_local)), b"far": spans(reg(dst_remote))},
                                 request_id="r", deadline_ms=2000).result(RESULT_TIMEOUT_S)
            assert out[b"local"].status is KeyStatus.OK, out[b"local"]
            assert_bytes_equal(dst_local, src, "the local key of the batch")
            assert out[b"far"].status is KeyStatus.FAILED and out[b"far"].code is ErrorCode.BAD_ENDPOINT, out[b"far"]
            assert endpoint in out[b"far"].reason, out[b"far"]
            assert (dst_remote == 0).all()
            got = client.fetch({b"far": layout()}, request_id="r", deadline_ms=2000).result(RESULT_TIMEOUT_S)[b"far"]
            assert got.status is KeyStatus.FAILED and got.code is ErrorCode.BAD_ENDPOINT, got
            assert thread.is_alive()
            monkeypatch.undo()
            assert_node_clean(client, slots)
        assert stats(client)["counters"].get("internal_errors", 0) == 0
        reg.close()


# --------------------------------------------------------------------------- the guard


def test_handler_exception_fails_the_message_with_internal(
    ipc_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler that raises: the request gets INTERNAL (an error reply with its id, or
    INTERNAL per key once the operation exists), the failure is logged with its
    traceback and counted, what the operation had set aside is released, and the node
    goes on serving."""

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected failure")

    with node_in_thread(ipc_dir) as (node, thread), Client(node.endpoint, name="c") as client:
        reg = Registrar(client)
        src = pattern(SPANS * SLOT, 2)
        assert client.deposit({b"local": spans(reg(src), "kv")}).result(RESULT_TIMEOUT_S)[b"local"].status is KeyStatus.STORED
        slots = slot_accounting(stats(client))
        caplog.set_level(logging.ERROR, logger="kvcr.node")

        # A whole request fails: the error reply echoes its id.
        monkeypatch.setitem(node.router.handlers[Role.CLIENT], Query, boom)
        with pytest.raises(NodeError) as err:
            client.query([b"local"]).result(RESULT_TIMEOUT_S)
        assert err.value.code is ErrorCode.INTERNAL, err.value
        monkeypatch.undo()

        # Failures after the operation exists: remote keys of a deliver and a fetch (whose
        # slots are already set aside) fail INTERNAL, the batch's local key is still served.
        monkeypatch.setattr(node.operations, "hinted_source", hinted_source("ipc:///nonexistent/x.sock"))
        monkeypatch.setattr(node.links, "open", boom)
        dst = np.zeros(SPANS * SLOT, np.uint8)
        out = client.deliver({b"local": spans(reg(dst)), b"far": spans(reg(np.zeros(SPANS * SLOT, np.uint8)))},
                             request_id="r").result(RESULT_TIMEOUT_S)
        assert out[b"far"].status is KeyStatus.FAILED and out[b"far"].code is ErrorCode.INTERNAL, out[b"far"]
        assert out[b"local"].status is KeyStatus.OK, out[b"local"]
        assert_bytes_equal(dst, src, "the local key of the batch")
        got = client.fetch({b"far": layout()}, request_id="r").result(RESULT_TIMEOUT_S)[b"far"]
        assert got.status is KeyStatus.FAILED and got.code is ErrorCode.INTERNAL, got
        monkeypatch.undo()

        assert thread.is_alive()
        st = assert_node_clean(client, slots)
        assert st["counters"]["internal_errors"] == 3, st["counters"]
        failures = [r for r in caplog.records if r.exc_info and "injected failure" in str(r.exc_info[1])]
        assert len(failures) == 3, [r.getMessage() for r in caplog.records]
        # Still serving, byte-exact.
        again = np.zeros(SPANS * SLOT, np.uint8)
        assert client.deliver({b"local": spans(reg(again))}).result(RESULT_TIMEOUT_S)[b"local"].status is KeyStatus.OK
        assert_bytes_equal(again, src, "a deliver after the failures")
        reg.close()


def test_loop_step_and_completion_failures_do_not_stop_the_loop(ipc_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing loop step (here the capacity-event flush) and a completion callback that
    raises after doing its work: both are counted, the loop goes on, and it still stops
    on request."""
    calls = {"flush": 0, "done": 0}
    with node_in_thread(ipc_dir) as (node, thread), Client(node.endpoint, name="c") as client:
        reg = Registrar(client)
        src = pattern(SPANS * SLOT, 3)
        assert client.deposit({b"k": spans(reg(src), "kv")}).result(RESULT_TIMEOUT_S)[b"k"].status is KeyStatus.STORED
        slots = slot_accounting(stats(client))
        flush, group_done = node.sessions.flush_capacity_events, node.deliveries.group_done

        def failing_flush() -> None:
            calls["flush"] += 1
            if calls["flush"] <= 3:
                raise RuntimeError("injected loop-step failure")
            flush()

        def failing_done(*args: Any) -> None:
            group_done(*args)
            calls["done"] += 1
            raise RuntimeError("injected completion failure")

        monkeypatch.setattr(node.sessions, "flush_capacity_events", failing_flush)
        monkeypatch.setattr(node.deliveries, "group_done", failing_done)
        for seed in range(3):
            dst = np.zeros(SPANS * SLOT, np.uint8)
            assert client.deliver({b"k": spans(reg(dst))}).result(RESULT_TIMEOUT_S)[b"k"].status is KeyStatus.OK
            assert_bytes_equal(dst, src, f"deliver {seed}")
        assert wait_until(lambda: calls["flush"] > 3, RESULT_TIMEOUT_S)
        monkeypatch.undo()
        assert thread.is_alive()
        st = assert_node_clean(client, slots)
        assert st["counters"]["internal_errors"] == 3 + calls["done"], (st["counters"], calls)
        reg.close()
