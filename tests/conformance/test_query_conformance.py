"""Query conformance: clients and nodes of every protocol version, 1 to 5 (spec sections 5.2, 6.9, 7).

Each (client version, node version) pair agrees on the lower of the two. Whatever it
agrees on, a query gives the same answers (records below version 3, columns from 3 on), and
``query_prefix`` the same count: the node's prefix query from version 3 on, the client's own
count from a whole query below it. One node per node version holds the same keys; every
client version asks it the same questions.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvcr_client import ArgumentError, AsyncClient, Client, KeyPresence, Presence, Presences, Span
from kvcr_testing.health import assert_clean
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Registrar
from kvcr_testing.nodes import running_node, short_ipc_dir
from kvcr_testing.patterns import KiB

VERSIONS = (1, 2, 3, 4, 5)
SLOT = 4 * KiB
HELD = [f"conf-q/held/{i}".encode() for i in range(40)]
HINTED = [f"conf-q/hinted/{i}".encode() for i in range(10)]
ABSENT = [f"conf-q/absent/{i}".encode() for i in range(10)]
REQUEST = "conf-q-request"
SOURCE = "tcp://127.0.0.1:1"
"""The hint's source: never dialled, since a query asks no peer."""
ANSWERS = {
    **{k: KeyPresence(Presence.HIT, "dram") for k in HELD},
    **{k: KeyPresence(Presence.FETCHABLE, "remote") for k in HINTED},
    **{k: KeyPresence(Presence.MISS, "") for k in ABSENT},
}


@pytest.fixture(scope="module", params=VERSIONS, ids=[f"node{v}" for v in VERSIONS])
def versioned_node(request: pytest.FixtureRequest) -> Iterator[tuple[Any, int]]:
    """A node speaking versions up to the parameter, holding ``HELD``."""
    version: int = request.param
    with short_ipc_dir("confq") as d, running_node(d, "n", "--pool", "kv:4KiB:64",
                                                   "--protocol-version", str(version)) as node:
        with Client(node.endpoint, name="conf-q-seed") as seed:
            assert seed.node is not None and seed.node.version == version
            reg = Registrar(seed)
            region = reg(np.arange(len(HELD) * SLOT, dtype=np.uint64).astype(np.uint8))
            spans = {k: [Span("kv", region, i * SLOT, SLOT, "kv")] for i, k in enumerate(HELD)}
            assert seed.deposit(spans).result(RESULT_TIMEOUT_S).all_ok
            reg.close()
            yield node, version
            assert_clean(seed)
    assert node.proc.returncode == 0, node.output


@pytest.mark.parametrize("client_version", VERSIONS, ids=[f"client{v}" for v in VERSIONS])
def test_answers_agree_at_every_pair(versioned_node: tuple[Any, int], client_version: int) -> None:
    node, node_version = versioned_node
    with Client(node.endpoint, name="conf-q", max_version=client_version) as c:
        assert c.node is not None and c.node.version == min(client_version, node_version)
        assert c.submit_hint(REQUEST, SOURCE, HINTED).result(RESULT_TIMEOUT_S) is None
        rng = random.Random(client_version * 10 + node_version)
        keys = [*HELD, *HINTED, *ABSENT]
        rng.shuffle(keys)
        answers = c.query(keys, request_id=REQUEST).result(RESULT_TIMEOUT_S)
        assert isinstance(answers, Presences) and len(answers) == len(keys) and list(answers) == keys
        assert dict(answers.items()) == {k: ANSWERS[k] for k in keys}
        assert [answers[k] for k in keys] == [ANSWERS[k] for k in keys] and keys[0] in answers
        without_hint = c.query(HINTED[:3]).result(RESULT_TIMEOUT_S)
        assert [a.presence for a in without_hint.values()] == [Presence.MISS] * 3
        assert c.discard_hint(REQUEST).result(RESULT_TIMEOUT_S) is None
        assert_clean(c)


# Prefix boundaries: (keys, the HIT prefix, the HIT-or-FETCHABLE prefix).
BOUNDARIES = {
    "first-missing": ([ABSENT[0], *HELD], 0, 0),
    "all-present": (HELD, len(HELD), len(HELD)),
    "last-missing": ([*HELD, ABSENT[0]], len(HELD), len(HELD)),
    "one-present": (HELD[:1], 1, 1),
    "one-missing": (ABSENT[:1], 0, 0),
    "hinted-in-the-middle": ([*HELD[:20], HINTED[0], *HELD[20:], ABSENT[1]], 20, len(HELD) + 1),
    "hinted-first": ([*HINTED, *HELD], 0, len(HINTED) + len(HELD)),
}


@pytest.mark.parametrize("client_version", VERSIONS, ids=[f"client{v}" for v in VERSIONS])
def test_prefix_counts_agree_at_every_pair(versioned_node: tuple[Any, int], client_version: int) -> None:
    node, _ = versioned_node
    with Client(node.endpoint, name="conf-q-prefix", max_version=client_version) as c:
        c.submit_hint(REQUEST, SOURCE, HINTED).result(RESULT_TIMEOUT_S)
        for name, (keys, hits, reachable) in BOUNDARIES.items():
            got = (
                c.query_prefix(keys, REQUEST).result(RESULT_TIMEOUT_S),
                c.query_prefix(keys, REQUEST, [Presence.HIT, Presence.FETCHABLE]).result(RESULT_TIMEOUT_S),
                c.query_prefix(keys, None, [Presence.HIT, Presence.FETCHABLE]).result(RESULT_TIMEOUT_S),
            )
            unhinted = next((i for i, k in enumerate(keys) if k not in HELD), len(keys))
            assert got == (hits, reachable, unhinted), name
        # An empty list is no question: refused before anything is sent, as for every batch.
        with pytest.raises(ArgumentError) as err:
            c.query_prefix([])
        assert err.value.field == "keys"
        c.discard_hint(REQUEST).result(RESULT_TIMEOUT_S)
        assert_clean(c)


def test_async_client_asks_the_same(versioned_node: tuple[Any, int]) -> None:
    node, _ = versioned_node

    async def ask() -> tuple[int, Presences]:
        async with await AsyncClient.connect(node.endpoint, name="conf-q-async") as c:
            count = await c.query_prefix([*HELD, ABSENT[0]])
            return count, await c.query([HELD[0], ABSENT[0]])

    count, answers = asyncio.run(ask())
    assert count == len(HELD)
    assert dict(answers.items()) == {HELD[0]: ANSWERS[HELD[0]], ABSENT[0]: ANSWERS[ABSENT[0]]}
