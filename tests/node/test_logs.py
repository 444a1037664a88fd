"""The node's logs (``kvcr_node.logs``): the JSON formatter in process, the one line each
refusal and each failed operation gets, and a real node run with ``--log-format json``
whose every log line parses, including the refusals a hostile client provoked."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvcr_client import Client, ErrorCode, KeyStatus, NodeError
from kvcr_node import logs
from kvcr_node.config import ConfigError, NodeConfig, load_toml
from kvcr_protocol import CURRENT_VERSION, KeyResult, ProtocolError, StatsRequest, encode
from kvcr_testing.health import assert_clean, wait_until
from kvcr_testing.nodes import FakeClock

WAIT_S = 10.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch, clock: FakeClock) -> Iterator[io.StringIO]:
    """The node's logger, at INFO, into a string in JSON, with a fresh limiter on ``clock``; restored afterwards."""
    monkeypatch.setattr(logs, "limiter", logs.Limiter(clock=clock))
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter())
    logger = logging.getLogger("kvcr.node")
    old_level, old_propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield out
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        logger.propagate = old_propagate


def lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_json_formatter_fields_extras_and_exceptions(captured: io.StringIO) -> None:
    log = logging.getLogger("kvcr.node")
    log.info("plain %s", "message", extra={"code": "BUSY", "session": "eng-1", "identity": b"\x01\xff",
                                           "keys": 3, "odd": object})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("it failed")
    first, second = lines(captured)
    assert first["message"] == "plain message" and first["level"] == "INFO" and first["logger"] == "kvcr.node"
    assert first["ts"].endswith("+00:00") and "T" in first["ts"]
    assert (first["code"], first["session"], first["identity"], first["keys"]) == ("BUSY", "eng-1", "01ff", 3)
    assert first["odd"] == str(object)  # not JSON: its str
    assert "exc" not in first
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exc"] and "Traceback" in second["exc"]
    assert not {"args", "msg", "levelno", "pathname"} & set(first), "LogRecord internals are not fields"


def test_a_refusal_is_one_line_with_its_code_and_session(captured: io.StringIO) -> None:
    logs.refusal("deliver", 7, ProtocolError(ErrorCode.BUSY, "64 operations in progress"), "eng-1", b"id", False)
    logs.refusal(None, 0, ProtocolError(ErrorCode.BAD_STATE, "say hello first"), None, b"\x00\x01", False)
    logs.refusal("stats", 3, ProtocolError(ErrorCode.INTERNAL, "the node failed"), "node-b", b"p", True)
    busy, anon, internal = lines(captured)
    assert (busy["level"], busy["code"], busy["session"], busy["role"], busy["request"], busy["request_id"]) == (
        "INFO", "BUSY", "eng-1", "client", "deliver", 7)
    assert "BUSY" in busy["message"] and "eng-1" in busy["message"]
    assert (anon["session"], anon["role"], anon["request"]) == ("identity:0001", "unknown", "frame")
    assert (internal["level"], internal["role"]) == ("WARNING", "peer")


def test_a_thousand_key_failure_is_one_line_with_counts(captured: io.StringIO) -> None:
    ok = KeyResult(KeyStatus.OK)
    results = [ok] * 990 + [KeyResult(KeyStatus.FAILED, ErrorCode.NOT_FOUND, f"key {i} missing") for i in range(8)] + [
        KeyResult(KeyStatus.FAILED, ErrorCode.TRANSFER_FAILED, "writing failed")] * 2
    logs.results("deliver", 12, results, "eng-1", b"id", False)
    logs.results("deliver", 13, [ok] * 5, "eng-1", b"id", False)  # nothing failed: no line
    (line,) = lines(captured)
    assert line["level"] == "WARNING", "a node-side code among them raises the level"
    assert (line["keys"], line["failed"], line["codes"]) == (1000, 10, {"NOT_FOUND": 8, "TRANSFER_FAILED": 2})
    assert (line["code"], line["op"], line["request_id"], line["session"]) == ("NOT_FOUND", "deliver", 12, "eng-1")
    assert "key 0 missing" in line["message"] and "key 1 missing" not in line["message"]


def test_a_flood_of_refusals_is_bounded_and_counted(captured: io.StringIO, clock: FakeClock) -> None:
    busy = ProtocolError(ErrorCode.BUSY, "busy")
    for i in range(logs.LOG_BURST * 4):
        logs.refusal("deliver", i, busy, "flooder", b"id", False)
    logs.refusal("query", 1, ProtocolError(ErrorCode.BAD_STATE, "other code"), "flooder", b"id", False)
    first = lines(captured)
    assert len(first) == logs.LOG_BURST + 1, "one code's flood leaves the others alone"
    assert all(line["suppressed"] == 0 for line in first)
    clock.advance(logs.LOG_WINDOW_S)
    logs.refusal("deliver", 999, busy, "flooder", b"id", False)
    last = lines(captured)[-1]
    assert (last["request_id"], last["suppressed"]) == (999, logs.LOG_BURST * 3)
    assert f"{logs.LOG_BURST * 3} more like it left out" in last["message"]


def test_nothing_is_built_below_the_level(captured: io.StringIO) -> None:
    logging.getLogger("kvcr.node").setLevel(logging.WARNING)
    logs.refusal("deliver", 7, ProtocolError(ErrorCode.BUSY, "busy"), "eng-1", b"id", False)
    logs.results("release", 1, [KeyResult(KeyStatus.FAILED, ErrorCode.UNKNOWN_HANDLE, "no")], "eng-1", b"id", False)
    assert captured.getvalue() == ""
    # A node-side failure still gets its line at WARNING.
    logs.results("deliver", 2, [KeyResult(KeyStatus.FAILED, ErrorCode.TRANSFER_FAILED, "nixl")], "eng-1", b"id", False)
    (line,) = lines(captured)
    assert (line["level"], line["code"]) == ("WARNING", "TRANSFER_FAILED")


def test_log_format_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="log_format"):
        NodeConfig(log_format="xml").validated()
    path = tmp_path / "node.toml"
    path.write_text('log_format = "json"\n[[pools]]\nname = "kv"\nslot_size = "4KiB"\nslot_count = 4\n')
    assert load_toml(path).validated().log_format == "json"
    path.write_text('log_format = 1\n[[pools]]\nname = "kv"\nslot_size = "4KiB"\nslot_count = 4\n')
    with pytest.raises(ConfigError, match="log_format"):
        load_toml(path)


def test_json_logs_of_a_node_refusing_a_hostile_client(node_factory: Callable[..., Any]) -> None:
    node = node_factory("--pool", "kv:4KiB:8", "--max-hints-per-session", "1", "--log-level", "INFO",
                        "--log-format", "json")
    with Client(node.endpoint, name="hostile-1") as client:
        client.submit_hint("r1", node.endpoint, [b"k"]).result(5)
        with pytest.raises(NodeError) as refused:
            client.submit_hint("r2", node.endpoint, [b"k"]).result(5)  # past max_hints_per_session
        assert refused.value.code is ErrorCode.HINT_LIMIT
        released = client.release([424242]).result(5)  # a handle never held: a per-key failure
        assert all(r.code == ErrorCode.UNKNOWN_HANDLE for r in released.values())
        # A frame before hello, from a socket of its own.
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            raw = ctx.socket(zmq.DEALER)
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(node.endpoint)
            raw.send(encode(StatsRequest(5), CURRENT_VERSION))
            assert raw.poll(int(WAIT_S * 1000)), "the node answers a frame before hello"
            raw.recv()
            raw.close(0)
        finally:
            ctx.term()
        client.discard_hint("r1").result(5)
        assert_clean(client)

        def logged() -> list[dict[str, Any]]:
            # The only line that is not a log record is the banner kvcr-node prints on stdout.
            return [json.loads(line) for line in list(node.output)
                    if line.strip() and not line.startswith("kvcr-node ")]

        assert wait_until(lambda: sum(1 for r in logged() if r.get("event") in ("refused", "failed")) >= 3, WAIT_S)
    assert node.stop() == 0
    records = logged()
    assert {r["level"] for r in records} <= {"DEBUG", "INFO", "WARNING", "ERROR"}
    assert all({"ts", "level", "logger", "message"} <= set(r) for r in records)
    (hint,) = [r for r in records if r.get("code") == "HINT_LIMIT"]
    assert (hint["level"], hint["session"], hint["role"], hint["request"], hint["event"]) == (
        "INFO", "hostile-1", "client", "hint", "refused")
    assert hint["path"] == "request_id" and isinstance(hint["request_id"], int)
    (release,) = [r for r in records if r.get("code") == "UNKNOWN_HANDLE"]
    assert (release["event"], release["op"], release["keys"], release["failed"], release["session"]) == (
        "failed", "release", 1, 1, "hostile-1")
    (anon,) = [r for r in records if r.get("code") == "BAD_STATE"]
    assert anon["role"] == "unknown" and anon["session"].startswith("identity:") and anon["request_id"] == 5
    assert any(r["message"] == "stopped" for r in records)
