"""Every public argument is checked before anything is sent (issue #10, defect 13).

docs/client.md promises that bad arguments raise ``ArgumentError`` naming the field before
anything is sent. Each row of the table below is one bad value of one argument; the test
asserts the error, its field path, and that nothing reached the node: no request id was
used (the next request gets the very next id), and the node's error and outcome counters
did not move.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvcr_client import ArgumentError, AsyncClient, Client, KeyStatus, Presence, RegionHandle, Span
from kvcr_testing.health import assert_clean
from kvcr_testing.layouts import Layout, Registrar
from kvcr_testing.patterns import KiB, pattern

POOL = ("--pool", "kv:4KiB:64")
SLOT = 4 * KiB
LAYOUT = Layout([(f"L{i}", "kv", SLOT) for i in range(2)])
KEY = b"args/obj"
U32 = (1 << 32) - 1
U64 = (1 << 64) - 1
LONG_TEXT = "r" * 4097
"""One byte over the protocol's ``max_text`` (spec section 11)."""
LONG_NAME = "n" * 129
"""One byte over the protocol's ``max_name`` (spec section 11)."""


class Env:
    """A client with one stored object, a source and a destination region."""

    def __init__(self, client: Client, reg: Registrar) -> None:
        self.client = client
        self.src = reg(pattern(LAYOUT.nbytes, 1))
        self.dst = reg(pattern(LAYOUT.nbytes, 2))
        self.deposit_spans = LAYOUT.source_spans(self.src)
        self.deliver_spans = [Span(n, self.dst, o, s) for (n, _, s), o in zip(LAYOUT.spans, LAYOUT.offsets, strict=True)]


Call = Callable[[Env], Any]

BAD_DEADLINES: list[tuple[str, Any]] = [
    ("negative", -1), ("over uint32", U32 + 1), ("2**40", 2**40), ("str", "5"), ("float", 1.5), ("bool", True),
    ("None", None),
]
BAD_FLAGS: list[tuple[str, Any]] = [("int", 1), ("str", "yes"), ("None", None)]
BAD_REQUEST_IDS: list[tuple[str, Any]] = [("int", 7), ("bytes", b"r"), ("empty", ""), ("too long", LONG_TEXT), ("surrogate", "\udc80")]
BAD_HANDLES: list[tuple[str, Any]] = [("2**70", 2**70), ("over uint64", U64 + 1), ("zero", 0), ("negative", -3),
                                      ("str", "1"), ("bool", True), ("float", 1.0)]


def _cases() -> Iterator[Any]:
    """(id, call, expected field path) for every bad value of every public argument."""

    def case(name: str, call: Call, path: str) -> Any:
        return pytest.param(call, path, id=name)

    for what, bad in BAD_DEADLINES:
        yield case(f"deposit-deadline-{what}", lambda e, b=bad: e.client.deposit({KEY: e.deposit_spans}, deadline_ms=b), "deadline_ms")
        yield case(f"deliver-deadline-{what}", lambda e, b=bad: e.client.deliver({KEY: e.deliver_spans}, deadline_ms=b), "deadline_ms")
        yield case(f"fetch-deadline-{what}", lambda e, b=bad: e.client.fetch({KEY: [("L0", "kv")]}, "r", deadline_ms=b), "deadline_ms")
    for what, bad in BAD_FLAGS:
        yield case(f"deposit-no_evict-{what}", lambda e, b=bad: e.client.deposit({KEY: e.deposit_spans}, no_evict=b), "no_evict")
        yield case(f"deposit-optional-{what}", lambda e, b=bad: e.client.deposit({KEY: e.deposit_spans}, optional=b), "optional")
        yield case(f"deliver-partial-{what}", lambda e, b=bad: e.client.deliver({KEY: e.deliver_spans}, partial=b), "partial")
    for what, bad in BAD_REQUEST_IDS:
        yield case(f"deliver-request_id-{what}", lambda e, b=bad: e.client.deliver({KEY: e.deliver_spans}, request_id=b), "request_id")
        yield case(f"fetch-request_id-{what}", lambda e, b=bad: e.client.fetch({KEY: [("L0", "kv")]}, request_id=b), "request_id")
        yield case(f"query-request_id-{what}", lambda e, b=bad: e.client.query([KEY], request_id=b), "request_id")
        yield case(f"query_prefix-request_id-{what}", lambda e, b=bad: e.client.query_prefix([KEY], request_id=b), "request_id")
        yield case(f"submit_hint-request_id-{what}", lambda e, b=bad: e.client.submit_hint(b, "tcp://127.0.0.1:1", [KEY]), "request_id")
        yield case(f"discard_hint-request_id-{what}", lambda e, b=bad: e.client.discard_hint(b), "request_id")
    for what, bad in [("None", None)]:
        yield case(f"submit_hint-request_id-{what}", lambda e, b=bad: e.client.submit_hint(b, "tcp://127.0.0.1:1", [KEY]), "request_id")
        yield case(f"discard_hint-request_id-{what}", lambda e, b=bad: e.client.discard_hint(b), "request_id")
    for what, bad in [("None", None), ("int", 5), ("no scheme", "127.0.0.1:1"), ("too long", "tcp://" + LONG_TEXT)]:
        yield case(f"submit_hint-endpoint-{what}", lambda e, b=bad: e.client.submit_hint("r", b, [KEY]), "source_endpoint")
    for what, bad in BAD_HANDLES:
        yield case(f"release-handle-{what}", lambda e, b=bad: e.client.release([1, b]), "handles[1]")
    for what, bad in [("None", None), ("int", 5), ("empty", []), ("bytes", b"\x01")]:
        yield case(f"release-handles-{what}", lambda e, b=bad: e.client.release(b), "handles")
    # Batches of keys: not an iterable of bytes keys.
    for what, bad in [("None", None), ("int", 5), ("bytes", b"abc"), ("str", "abc"), ("empty", [])]:
        yield case(f"query-keys-{what}", lambda e, b=bad: e.client.query(b), "keys")
        yield case(f"query_prefix-keys-{what}", lambda e, b=bad: e.client.query_prefix(b), "keys")
        yield case(f"submit_hint-keys-{what}", lambda e, b=bad: e.client.submit_hint("r", "tcp://127.0.0.1:1", b), "keys")
    yield case("query-key-str", lambda e: e.client.query(["k"]), "keys[0]")
    yield case("query-key-empty", lambda e: e.client.query([b""]), "keys[0]")
    yield case("query-key-long", lambda e: e.client.query([b"k" * 257]), "keys[0]")
    yield case("query-key-bytearray", lambda e: e.client.query([KEY, bytearray(b"k")]), "keys[1]")
    yield case("query-keys-too-many", lambda e: e.client.query([KEY] * 4097), "keys")
    yield case("query_prefix-key-long", lambda e: e.client.query_prefix([KEY, b"k" * 257]), "keys[1]")
    yield case("query_prefix-key-str", lambda e: e.client.query_prefix([KEY, KEY, "k"]), "keys[2]")
    yield case("query_prefix-keys-too-many", lambda e: e.client.query_prefix([KEY] * 4097), "keys")
    # What a prefix counts: HIT, FETCHING or FETCHABLE, never MISS.
    for what, bad, path in [("None", None, "presences"), ("empty", [], "presences"), ("str", "HIT", "presences"),
                            ("one presence", Presence.HIT, "presences"), ("miss", [Presence.HIT, Presence.MISS], "presences[1]"),
                            ("str item", ["HIT"], "presences[0]"), ("int item", [1], "presences[0]")]:
        yield case(f"query_prefix-presences-{what}", lambda e, b=bad: e.client.query_prefix([KEY], presences=b), path)
    yield case("submit_hint-key-int", lambda e: e.client.submit_hint("r", "tcp://127.0.0.1:1", [KEY, 5]), "keys[1]")
    # Objects: a mapping of key -> spans.
    for what, bad in [("None", None), ("list", [(KEY, [])]), ("empty", {})]:
        yield case(f"deposit-objects-{what}", lambda e, b=bad: e.client.deposit(b), "objects")
        yield case(f"deliver-objects-{what}", lambda e, b=bad: e.client.deliver(b), "objects")
        yield case(f"fetch-layouts-{what}", lambda e, b=bad: e.client.fetch(b, "r"), "expected_layouts")
    yield case("deliver-key-str", lambda e: e.client.deliver({"k": e.deliver_spans}), "objects['k']")
    yield case("deliver-spans-none", lambda e: e.client.deliver({KEY: None}), f"objects[{KEY!r}].spans")
    yield case("fetch-layout-int-name", lambda e: e.client.fetch({KEY: [(1, "kv")]}, "r"), f"expected_layouts[{KEY!r}][0]")
    yield case("fetch-layout-long-name", lambda e: e.client.fetch({KEY: [(LONG_NAME, "kv")]}, "r"), f"expected_layouts[{KEY!r}][0]")
    yield case("fetch-layout-none-pool", lambda e: e.client.fetch({KEY: [("L0", None)]}, "r"), f"expected_layouts[{KEY!r}][0]")
    yield case("fetch-layout-none", lambda e: e.client.fetch({KEY: None}, "r"), f"expected_layouts[{KEY!r}]")
    # Spans, destinations, regions, handles.
    yield case("deposit-span-name-int", lambda e: e.client.deposit({KEY: [Span(1, e.src, 0, SLOT, "kv")]}), f"objects[{KEY!r}].spans[0].name")  # type: ignore[arg-type]
    yield case("deliver-span-offset-str", lambda e: e.client.deliver({KEY: [Span("L0", e.dst, "0", SLOT)]}), f"objects[{KEY!r}].spans[0].offset")  # type: ignore[arg-type]
    yield case("destination-none", lambda e: e.client.destination(None), "spans")  # type: ignore[arg-type]
    yield case("destination-int", lambda e: e.client.destination(5), "spans")  # type: ignore[arg-type]
    yield case("register-str", lambda e: e.client.register("buffer"), "buffer")
    yield case("register-none", lambda e: e.client.register(None), "buffer")
    yield case("unregister-int", lambda e: e.client.unregister(5), "region")  # type: ignore[arg-type]
    yield case("unregister-stranger", lambda e: e.client.unregister(
        RegionHandle(e.dst.region, e.dst.kind, e.dst.address, e.dst.length, e.dst.device, None)), "region")
    yield case("abort-int", lambda e: e.client.abort(5), "handle")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def node_args() -> tuple[str, ...]:
    return POOL


@pytest.fixture(scope="module")
def env(node: Any) -> Iterator[Env]:
    with Client(node.endpoint, name="args") as client:
        reg = Registrar(client)
        e = Env(client, reg)
        assert client.deposit({KEY: e.deposit_spans}).result(10)[KEY].status is KeyStatus.STORED
        yield e
        assert_clean(client)
        reg.close()


def _node_view(client: Client) -> tuple[int, dict[str, Any]]:
    """The id the client gives its next request, and what the node counted so far."""
    handle = client.stats()
    st = handle.result(5)
    seen = {k: st[k] for k in ("protocol_errors", "outcomes", "counters", "operations_pending", "claims")}
    return handle.op_id, seen


@pytest.mark.parametrize(("call", "path"), list(_cases()))
def test_bad_argument_raises_before_sending(env: Env, call: Call, path: str) -> None:
    first_id, before = _node_view(env.client)
    with pytest.raises(ArgumentError) as err:
        call(env)
    assert err.value.field == path, err.value
    next_id, after = _node_view(env.client)
    assert next_id == first_id + 1, "a request was sent"
    assert after == before, "the node saw something"


def test_bad_constructor_arguments_raise_before_connecting(node: Any, env: Env) -> None:
    _, before = _node_view(env.client)
    for kwargs, path in [
        ({"name": LONG_NAME}, "name"), ({"name": 5}, "name"), ({"timeout": 0}, "timeout"), ({"timeout": "5"}, "timeout"),
        ({"timeout": -1.0}, "timeout"), ({"max_version": 99}, "max_version"),
    ]:
        with pytest.raises(ArgumentError) as err:
            Client(node.endpoint, **kwargs)
        assert err.value.field == path, (kwargs, err.value)
    with pytest.raises(ArgumentError) as err:
        Client(None)  # type: ignore[arg-type]
    assert err.value.field == "endpoint"
    with pytest.raises(ArgumentError) as err:
        env.client.reconnect(timeout=None)  # type: ignore[arg-type]
    assert err.value.field == "timeout"
    _, after = _node_view(env.client)
    assert after == before, "the node saw something"
    # The longest name the protocol carries is accepted (the agent's name is cut to fit).
    with Client(node.endpoint, name="n" * 128) as longest:
        assert longest.query([KEY]).result(5)[KEY].presence.value == "HIT"


async def test_async_client_checks_the_same(node: Any) -> None:
    async with await AsyncClient.connect(node.endpoint, name="args-async") as c:
        region = await c.register(np.zeros(SLOT, dtype=np.uint8))
        spans = [Span("L0", region, 0, SLOT)]
        before = await c.stats()
        for call, path in [
            (lambda: c.deliver({KEY: spans}, deadline_ms=-1), "deadline_ms"),
            (lambda: c.deliver({KEY: spans}, deadline_ms="5"), "deadline_ms"),
            (lambda: c.query([KEY], request_id=7), "request_id"),
            (lambda: c.query_prefix([KEY], presences=[Presence.MISS]), "presences[0]"),
            (lambda: c.query_prefix([b""]), "keys[0]"),
            (lambda: c.discard_hint(None), "request_id"),  # type: ignore[arg-type]
            (lambda: c.release([2**70]), "handles[0]"),
        ]:
            with pytest.raises(ArgumentError) as err:
                call()
            assert err.value.field == path
        with pytest.raises(ArgumentError) as err:
            await c.unregister(5)  # type: ignore[arg-type]
        assert err.value.field == "region"
        after = await asyncio.wait_for(asyncio.wrap_future(c.stats().future), 5)
        assert after["protocol_errors"] == before["protocol_errors"]
        await c.unregister(region)
