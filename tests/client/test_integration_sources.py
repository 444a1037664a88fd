"""The engine connectors' source policy: a request chooses among the operator's sources only.

``SourcePolicy`` judges what a request's transfer parameters name (vLLM's
``kv_transfer_params`` are request-body fields): the engine's own node, the configured
``source`` and ``allowed_sources`` pass, in any spelling of them, and the operator's
spelling is what comes out; anything else falls back to the configured source, saying why,
and never raises. ``CauseLog`` logs a flood of one cause as one line a window.
"""

from __future__ import annotations

import logging

import pytest

from kvcr_client.integrations.sources import CauseLog, Refusal, SourcePolicy, Verdict
from kvcr_testing.nodes import FakeClock

OWN = "ipc:///tmp/kvcr/a.sock"
DEFAULT = "tcp://prefill-1:7400"
ALLOWED = ["tcp://10.0.0.2:7400", "ipc:///tmp/kvcr/b.sock", "tcp://[2001:db8::7]:7400"]


@pytest.fixture
def policy() -> SourcePolicy:
    return SourcePolicy(OWN, DEFAULT, ALLOWED)


@pytest.mark.parametrize(
    ("named", "source"),
    [
        ("tcp://10.0.0.2:7400", "tcp://10.0.0.2:7400"),
        ("tcp://10.0.0.2:07400", "tcp://10.0.0.2:7400"),
        ("ipc:////tmp/kvcr/./b.sock", "ipc:///tmp/kvcr/b.sock"),
        ("tcp://[2001:DB8:0::7]:7400", "tcp://[2001:db8::7]:7400"),
        ("tcp://PREFILL-1.:7400", DEFAULT),
        ("ipc:///tmp//kvcr/a.sock", None),  # the engine's own node: nothing to hint
    ],
)
def test_allowed_sources_pass_in_any_spelling_as_the_operator_spelled_them(
        policy: SourcePolicy, named: str, source: str | None) -> None:
    assert policy.judge({"kvcr_endpoint": named}) == Verdict(source)


@pytest.mark.parametrize(
    ("params", "why"),
    [
        ({"kvcr_endpoint": "http://127.0.0.1/"}, Refusal.BAD_ENDPOINT),
        ({"kvcr_endpoint": ""}, Refusal.BAD_ENDPOINT),
        ({"kvcr_endpoint": "inproc://x"}, Refusal.BAD_ENDPOINT),
        ({"kvcr_endpoint": "tcp://127.0.0.1:" + "9" * 100_000}, Refusal.ENDPOINT_SIZE),
        ({"kvcr_endpoint": "x" * 10_000_000}, Refusal.ENDPOINT_SIZE),
        ({"kvcr_endpoint": 7400}, Refusal.ENDPOINT_TYPE),
        ({"kvcr_endpoint": b"tcp://10.0.0.2:7400"}, Refusal.ENDPOINT_TYPE),
        ({"kvcr_endpoint": ["tcp://10.0.0.2:7400"]}, Refusal.ENDPOINT_TYPE),
        (["tcp://10.0.0.2:7400"], Refusal.PARAMS_TYPE),
        ("tcp://10.0.0.2:7400", Refusal.PARAMS_TYPE),
        ({"kvcr_endpoint": "tcp://127.0.0.1:7400"}, Refusal.NOT_ALLOWED),
        ({"kvcr_endpoint": "tcp://10.0.0.2:7401"}, Refusal.NOT_ALLOWED),
        ({"kvcr_endpoint": "tcp://localhost:7400"}, Refusal.NOT_ALLOWED),
        ({"kvcr_endpoint": "ipc:///tmp/kvcr/c.sock"}, Refusal.NOT_ALLOWED),
        ({"kvcr_endpoint": "ipc://@kvcr"}, Refusal.NOT_ALLOWED),
    ],
)
def test_anything_else_falls_back_to_the_configured_source_saying_why(
        policy: SourcePolicy, params: object, why: Refusal) -> None:
    assert policy.judge(params) == Verdict(DEFAULT, why)
    assert SourcePolicy(OWN).judge(params) == Verdict(None, why)


@pytest.mark.parametrize("params", [None, {}, {"other": 1}, {"kvcr_endpoint": None}])
def test_naming_nothing_is_no_refusal(policy: SourcePolicy, params: object) -> None:
    assert policy.judge(params) == Verdict(DEFAULT)
    assert SourcePolicy(OWN).judge(params) == Verdict(None)


def test_permits_only_allowed_sources(policy: SourcePolicy) -> None:
    assert all(policy.permits(e) for e in [*ALLOWED, DEFAULT, "tcp://10.0.0.2:07400"])
    assert not any(policy.permits(e) for e in [OWN, "tcp://127.0.0.1:7400", "http://x/", "x" * 100_000])


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("http://node/",), "['endpoint']"),
        ((OWN, "tcp://*:5"), "['source']"),
        ((OWN, None, ["tcp://10.0.0.2:7400", "tcp://10.0.0.2"]), "['allowed_sources'][1]"),
        ((OWN, None, "tcp://10.0.0.2:7400"), "a list of endpoints"),
        ((OWN, None, 5), "a list of endpoints"),
    ],
)
def test_a_bad_configuration_is_refused_naming_the_key(args: tuple[object, ...], words: str) -> None:
    with pytest.raises(ValueError) as info:
        SourcePolicy(*args)  # type: ignore[arg-type]
    assert words in str(info.value), info.value


def test_a_flood_of_one_cause_is_one_line_a_window(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    causes = CauseLog(logging.getLogger("kvcr.test"), window=60.0, clock=clock)
    with caplog.at_level(logging.WARNING, "kvcr.test"):
        logged = [causes.warn("source:BAD_ENDPOINT", "refused %s", "one") for _ in range(10_000)]
        assert causes.warn("source:NOT_ALLOWED", "refused %s", "two")
        clock.advance(59.0)
        assert not causes.warn("source:BAD_ENDPOINT", "refused %s", "one")
        clock.advance(1.0)
        assert causes.warn("source:BAD_ENDPOINT", "refused %s", "one")
    assert logged.count(True) == 1
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused one", "refused two", "refused one (10000 more like it in the last 60 s)"], lines
    assert len(causes._last) == 2 and causes._left_out == {}
