"""Fixtures shared by the test folders: real kvcr-node processes on private ipc endpoints,
with UCX kept on loopback for the whole session (``UCX_NET_DEVICES=lo``, below).

The helpers themselves live in the ``kvcr_testing`` package (``tests/kvcr_testing``, on
``sys.path`` through pytest's ``pythonpath`` setting); pytest rewrites their asserts too.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# --------------------------------------------------------------------------- UCX on loopback
#
# UCX (under NIXL) opens a TCP listener for its wireup on every network device it may use;
# left to choose, that includes the host's external interface, even between processes of
# one host. The suite keeps UCX on loopback: set here, when pytest imports this file, before
# any NIXL agent of this process exists, and inherited by every node, client and engine a
# test starts. A test that runs processes in network namespaces of its own names their veth
# ends instead (``kvcr_testing.netns.Pair.ucx``). An environment that sets UCX_NET_DEVICES
# keeps its own value; tests/integration/test_ucx_loopback.py fails if that is not loopback.
UCX_NET_DEVICES = os.environ.setdefault("UCX_NET_DEVICES", "lo")


def pytest_report_header() -> str:
    return f"UCX_NET_DEVICES={UCX_NET_DEVICES}"


pytest.register_assert_rewrite("kvcr_testing")

from kvcr_client import Client  # noqa: E402
from kvcr_testing.health import assert_clean  # noqa: E402
from kvcr_testing.layouts import Registrar  # noqa: E402
from kvcr_testing.nodes import NodeProcess, running_node, short_ipc_dir, start_node  # noqa: E402
from kvcr_testing.remote import Sites, sites_of  # noqa: E402

# --------------------------------------------------------------------------- nodes of one test


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


@pytest.fixture
def sites(node_factory: Callable[..., NodeProcess]) -> Iterator[Sites]:
    """Nodes with a client each (``kvcr_testing.remote``); on a clean exit every surviving node must be clean."""
    with sites_of(node_factory) as s:
        yield s


# --------------------------------------------------------------------------- one node for a whole module
#
# A module whose tests share a node overrides ``node_args`` (module scope) with the node's
# arguments, and checks the node after every test with
# ``pytestmark = pytest.mark.usefixtures("node_left_clean")``.


@pytest.fixture(scope="module")
def node_args() -> tuple[str, ...]:
    """The arguments of the module's shared ``node``."""
    pytest.fail("a module that uses the shared node overrides the node_args fixture with the node's arguments")


@pytest.fixture(scope="module")
def node(node_args: tuple[str, ...]) -> Iterator[NodeProcess]:
    """One node for the tests of a module; it must exit cleanly (code 0) when stopped."""
    with short_ipc_dir("mod") as d, running_node(d, "n", *node_args) as n:
        yield n
    assert n.proc.returncode == 0, n.output


@pytest.fixture(scope="module")
def client(node: NodeProcess, request: pytest.FixtureRequest) -> Iterator[Client]:
    """A client of the module's node, named after the module (``itest-local`` for test_local.py)."""
    module = request.module.__name__.rpartition(".")[2].removeprefix("test_")
    with Client(node.endpoint, name=f"itest-{module}") as c:
        yield c


@pytest.fixture
def node_left_clean(client: Client) -> Iterator[None]:
    """After the test: the shared node is at rest and consistent."""
    yield
    assert_clean(client)


@pytest.fixture
def register(client: Client) -> Iterator[Registrar]:
    """Registers buffers with the module's client; unregisters them after the test."""
    reg = Registrar(client)
    yield reg
    reg.close()


@pytest.fixture
def key(request: pytest.FixtureRequest) -> Callable[[str], bytes]:
    """Keys unique to the test (the shared node keeps objects between tests)."""
    return lambda label: f"{request.node.name}/{label}".encode()
