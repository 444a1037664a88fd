"""Errors reach callers translated once, at the core's boundary: every one a ``KvcrError``, so
an integration's ``except KvcrError`` sees them all (a protocol error is not one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvcr_client import ArgumentError, Client, ClientStateError, KvcrError, NodeError
from kvcr_client.errors import translated
from kvcr_protocol import ErrorCode, LocalProtocolError, Query, RemoteProtocolError


def test_each_protocol_error_becomes_the_client_error_that_says_whose_fault_it_is() -> None:
    argument = translated(LocalProtocolError(ErrorCode.OUT_OF_RANGE, "prefix mask 0x12c", "prefix"))
    assert isinstance(argument, ArgumentError) and argument.field == "prefix"
    state = translated(LocalProtocolError(ErrorCode.BAD_STATE, "request id 3 is in flight", "id"))
    assert isinstance(state, ClientStateError) and state.code is ErrorCode.BAD_STATE and state.path == "id"
    remote = translated(RemoteProtocolError(ErrorCode.WRONG_TYPE, "not a uint", "results[0].code"))
    assert isinstance(remote, NodeError) and remote.code is ErrorCode.WRONG_TYPE and remote.path == "results[0].code"
    assert all(isinstance(e, KvcrError) for e in (argument, state, remote))


def test_a_request_that_does_not_encode_fails_as_an_argument_error_naming_the_field(
        node_factory: Callable[..., Any]) -> None:
    node = node_factory("--pool", "kv:4KiB:16")
    with Client(node.endpoint, name="errors") as client:
        _, future = client.core.request(lambda i: Query(i, (b"a",), None, 300), lambda m: m, 5.0)  # prefix: u8 mask
        with pytest.raises(ArgumentError) as raised:
            client.core.wait(future, 5.0)
        assert raised.value.field == "prefix"
        _, zero = client.core.request(lambda i: Query(i, (b"b",)), lambda m: m, 5.0, op_id=0)  # ids are never 0
        with pytest.raises(ClientStateError) as refused:
            client.core.wait(zero, 5.0)
        assert refused.value.path == "id"
        assert client.query([b"a"]).result(5)[b"a"].presence.name == "MISS"
