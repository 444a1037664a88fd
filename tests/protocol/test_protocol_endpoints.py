"""Endpoint checks: exactly the tcp and ipc endpoints a node can dial pass (spec section 12)."""

from __future__ import annotations

import pytest

from kvcr_protocol import IPC_PATH_MAX, canonical_endpoint, endpoint_problem


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://127.0.0.1:7400",
        "tcp://10.0.0.7:1",
        "tcp://10.0.0.7:65535",
        "tcp://[::1]:7400",
        "tcp://[2001:db8::7]:7400",
        "tcp://localhost:7400",
        "tcp://node-3.rack-7.example.com:7400",
        "tcp://node-3.example.com.:7400",
        "tcp://a:5",
        "tcp://" + ".".join(["a" * 63] * 3) + ":5",
        "ipc:///tmp/kvcr/node.sock",
        "ipc://relative/node.sock",
        "ipc://@abstract-name",
        "ipc:///" + "x" * (IPC_PATH_MAX - 1),
    ],
)
def test_dialable_endpoints_pass(endpoint: str) -> None:
    assert endpoint_problem(endpoint) is None


@pytest.mark.parametrize(
    ("endpoint", "words"),
    [
        ("bogus://x", "transport 'bogus'"),
        ("inproc://kvcr-zap", "inproc"),
        ("inproc://", "inproc"),
        ("pgm://eth0;239.192.1.1:5555", "transport 'pgm'"),
        ("udp://127.0.0.1:5555", "transport 'udp'"),
        ("ws://127.0.0.1:5555", "transport 'ws'"),
        ("TCP://127.0.0.1:5555", "transport 'TCP'"),
        ("no-scheme", "expected tcp://host:port"),
        ("", "expected tcp://host:port"),
        ("tcp://no such host:1", "whitespace"),
        ("tcp://127.0.0.1:99999", "port"),
        ("tcp://127.0.0.1:0", "port"),
        ("tcp://127.0.0.1:-1", "port"),
        ("tcp://127.0.0.1:", "port"),
        ("tcp://127.0.0.1:http", "port"),
        ("tcp://127.0.0.1:\uff10\uff11", "port"),  # fullwidth digits are not a port
        ("tcp://127.0.0.1", "port"),
        ("tcp://:5555", "host is empty"),
        ("tcp://*:5555", "wildcard"),
        ("tcp://eth0;10.0.0.1:5555", "source address"),
        ("tcp://999.1.1.1:5", "IPv4"),
        ("tcp://1.2.3:5", "IPv4"),
        ("tcp://::1:5555", "brackets"),
        ("tcp://[::1:5555", "brackets"),
        ("tcp://[not-v6]:5555", "IPv6"),
        ("tcp://[fe80::1%eth0]:5555", "scoped"),
        ("tcp://-leading.example.com:5", "host name"),
        ("tcp://under_score.example.com:5", "host name"),
        ("tcp://exa..mple.com:5", "host name"),
        ("tcp://example.123:5", "numeric"),
        ("tcp://" + "a" * 64 + ".com:5", "host name"),
        ("tcp://" + ".".join(["a" * 63] * 4) + "b:5", "253"),
        ("tcp://café.example.com:5", "host name"),
        ("tcp://127.0.0.1:5\x00", "control"),
        ("ipc:///tmp/a\x00b", "control"),
        ("ipc:///tmp/a b", "whitespace"),
        ("tcp://\u2028host:5", "whitespace"),
        ("ipc://", "empty"),
        ("ipc://*", "wildcard"),
        ("ipc:///" + "x" * IPC_PATH_MAX, "bytes"),
        ("ipc:///" + "é" * (IPC_PATH_MAX // 2 + 1), "bytes"),
    ],
)
def test_undialable_endpoints_are_refused_with_a_reason(endpoint: str, words: str) -> None:
    problem = endpoint_problem(endpoint)
    assert problem is not None, endpoint
    assert words in problem, problem


@pytest.mark.parametrize("value", [None, 5, b"tcp://127.0.0.1:5", ["tcp://127.0.0.1:5"]])
def test_a_non_string_is_refused(value: object) -> None:
    problem = endpoint_problem(value)
    assert problem is not None and "str" in problem


@pytest.mark.parametrize(
    ("spellings", "canonical"),
    [
        (["tcp://127.0.0.1:7400", "tcp://127.0.0.1:07400"], "tcp://127.0.0.1:7400"),
        (["tcp://[::1]:7400", "tcp://[0:0:0:0:0:0:0:1]:7400", "tcp://[::0001]:07400"], "tcp://[::1]:7400"),
        (["tcp://[2001:DB8::7]:5", "tcp://[2001:db8:0::7]:5"], "tcp://[2001:db8::7]:5"),
        (["tcp://Node-3.Example.COM:7400", "tcp://node-3.example.com.:7400"], "tcp://node-3.example.com:7400"),
        (["ipc:///tmp/kvcr/node.sock", "ipc:////tmp//kvcr/./node.sock", "ipc:///tmp/x/../kvcr/node.sock"],
         "ipc:///tmp/kvcr/node.sock"),
        (["ipc://relative/node.sock", "ipc://./relative/node.sock"], "ipc://relative/node.sock"),
        (["ipc://@abstract-name"], "ipc://@abstract-name"),
    ],
)
def test_spellings_of_one_endpoint_have_one_canonical_form(spellings: list[str], canonical: str) -> None:
    assert {canonical_endpoint(e) for e in spellings} == {canonical}
    assert endpoint_problem(canonical) is None and canonical_endpoint(canonical) == canonical


@pytest.mark.parametrize(
    ("a", "b"),
    [("tcp://127.0.0.1:7400", "tcp://127.0.0.2:7400"), ("tcp://127.0.0.1:7400", "tcp://127.0.0.1:7401"),
     ("tcp://localhost:7400", "tcp://127.0.0.1:7400"), ("ipc:///tmp/a.sock", "ipc://tmp/a.sock"),
     ("ipc://@a", "ipc:///a"), ("ipc:///tmp/a.sock", "tcp://127.0.0.1:7400")],
)
def test_different_endpoints_stay_different(a: str, b: str) -> None:
    assert canonical_endpoint(a) != canonical_endpoint(b)


@pytest.mark.parametrize("value", ["http://127.0.0.1/", "tcp://*:5", "inproc://x", "", 5, None, "x" * 100_000])
def test_an_undialable_endpoint_has_no_canonical_form(value: object) -> None:
    with pytest.raises(ValueError) as info:
        canonical_endpoint(value)
    assert str(info.value) == endpoint_problem(value)
