"""Shared fixtures: real kvcr-node processes on private ipc endpoints.

The helpers themselves live in the ``kvcr_testing`` package (``tests/kvcr_testing``, on
``sys.path`` through pytest's ``pythonpath`` setting); pytest rewrites their asserts too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.register_assert_rewrite("kvcr_testing")

from kvcr_testing.nodes import NodeProcess, short_ipc_dir, start_node  # noqa: E402


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    """A short private directory for the test's ipc socket files (ipc paths are limited to ~107 bytes)."""
    with short_ipc_dir("test") as path:
        yield path


@pytest.fixture
def node_factory(ipc_dir: Path) -> Iterator[Callable[..., NodeProcess]]:
    """Start nodes on fresh ipc endpoints; every one is stopped after the test."""
    nodes: list[NodeProcess] = []
    counter = iter(range(1000))

    def make(*extra: str) -> NodeProcess:
        node = start_node(f"ipc://{ipc_dir}/n{next(counter)}.sock", *extra)
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.stop()
