"""vLLM with ``KvcrConnector`` (``kvcr_client.integrations.vllm``), vLLM's own engine on the CPU.

vLLM's scheduler drives the connector's scheduler side (matched tokens through a lease,
state after allocation, metadata, ``request_finished``) and its worker the worker side
(``register_kv_caches``, ``start_load_kv``, ``wait_for_layer_load`` per layer,
``wait_for_save``). A tiny Llama with seeded random weights generates twice: the second
generation loads the prompt's full blocks from kvcr layer by layer, and its tokens and
logprobs are the first's, with the blocks' bytes in vLLM's cache proven equal by digest; the
same load with two blocks' bytes swapped gives other logprobs (the comparison can fail). Then across two
nodes: one engine process saves through node B, another loads through node A, which
leases and gets the blocks from B, named by the engine's configuration or per request in
``kv_transfer_params``. A prompt longer than vLLM's token budget is prefilled in chunks and
every full block of every chunk is saved. An engine whose KV layout differs from the saver's
under the same model id finds none of its blocks (the compatibility fingerprint in every
key): a miss, never a load. Where keys are made to collide across layouts
(``vllm_faults.LayoutBlind``), the load of a leased block fails at the node: vLLM is told
which, recomputes them, and generates what it generates without a cache; when only a later
block fails, the blocks before it are kept and only the rest is recomputed. Every count is the one vLLM itself
aggregated from the connectors (its Prometheus counters) and is checked against the
node's own record of what it stored and delivered. A load from the engine's own node
READs the node's pools under the worker's read grant (the node delivers nothing), and with
``--no-client-transfers`` the node delivers it, to the same tokens and logprobs; blocks a
source holds the nodes deliver. Runs ``examples/vllm_prefix.py`` in the vLLM environment
(``scripts/engines_env.sh``; skipped outside CI without it).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcr_client import Client
from kvcr_testing.engines import VLLM_PY, require_engines, run_example
from kvcr_testing.health import assert_clean, outcome_count, stats
from kvcr_testing.nodes import NodeProcess

POOL = "kv:16KiB:1024"
"""One slot per layer block: 32 tokens x 2 KV heads x 32 x K and V x 4 bytes."""
TIMEOUT_S = 300.0
HERE = Path(__file__).parent
LOAD_TIMEOUT_S = 5.0
"""The load's deadline where the source is killed: the node gives up on it then."""
LOADED = {"layer_waits": 4, "loads": 1, "grant_loads": 1, "blocks_loaded": 3, "saves": 0, "blocks_saved": 0, "save_errors": 0, "saves_timed_out": 0,
          "saves_paused": 0, "load_errors": 0, "blocks_failed": 0,
          "leases": 1, "matched_tokens": 96, "sources_refused": 0, "lookups_timed_out": 0, "lookups_asked_again": 0,
          "lookup_errors": 0,
          "node_outages": 0, "reconnects": 0, "node_away_ms": 0, "node_away": 0, "node_stalled": 0}
"""Four layers, three full blocks of 32 of a 100-token prompt: one lease, one load (READ under
the worker's read grant), a wait per layer."""
REMOTE_LOADED = {**LOADED, "grant_loads": 0}
"""The same load, of blocks a source holds: the nodes deliver them (grants cover local keys)."""
PATIENT = {"lookup_timeout_s": 30.0}
"""A lookup (a first dial to a source included) answered in time on a loaded machine; meanwhile
vLLM's scheduler is told "not yet" and steps again."""
SAVED = {**dict.fromkeys(LOADED, 0), "saves": 1, "blocks_saved": 3}

require_engines(VLLM_PY)


def vllm(*args: str, extra: dict[str, object] | None = None) -> dict[str, object]:
    return run_example("vllm_prefix.py", *args, "--extra", json.dumps({**PATIENT, **(extra or {})}),
                       timeout_s=TIMEOUT_S, python=VLLM_PY)


def faulty(connector: str, *args: str) -> dict[str, object]:
    """``vllm`` with a connector of ``vllm_faults``."""
    return run_example("vllm_prefix.py", *args, "--connector", f"vllm_faults.{connector}", "--extra",
                       json.dumps(PATIENT), timeout_s=TIMEOUT_S, python=VLLM_PY,
                       env={"PYTHONPATH": os.pathsep.join(filter(None, (str(HERE), os.environ.get("PYTHONPATH"))))})


def blind(*args: str) -> dict[str, object]:
    """``vllm`` with ``vllm_faults.LayoutBlind``: keys that do not name the KV layout."""
    return faulty("LayoutBlind", *args)


def node_record(node: NodeProcess) -> tuple[int, int]:
    """What the node itself did: blocks stored (by puts the worker wrote, or deposits), blocks delivered."""
    with Client(node.endpoint, name="vllm-check") as c:
        st = stats(c)
    return outcome_count(st, "put.STORED") + outcome_count(st, "deposit.STORED"), outcome_count(st, "deliver.OK")


def load_failing(r: dict[str, object], blocks_loaded: int, blocks_failed: int, blocks_saved: int,
                 expected: dict[str, int] = LOADED) -> None:
    """A generation whose blocks failed to load: vLLM was told exactly which, recomputed them
    (and the connector saved them then: ``blocks_saved`` of them stored, where the node did
    not hold their keys already) and generated the reference's tokens; the blocks kept are
    the bytes the reference computed."""
    loaded = r["loaded"]
    assert isinstance(loaded, dict)
    assert loaded["load_errors"] >= 1, loaded
    assert loaded == {**expected, "blocks_loaded": blocks_loaded, "blocks_failed": blocks_failed, "saves": 1,
                      "blocks_saved": blocks_saved, "load_errors": loaded["load_errors"]}, loaded
    assert r["blocks_matching"] == blocks_loaded, r
    assert r["same_tokens"] is True and r["same_logprobs"] is True, r


def assert_nodes_clean(*nodes: NodeProcess) -> None:
    for node in nodes:
        with Client(node.endpoint, name="vllm-check") as c:
            st = assert_clean(c)
            assert st["leases"]["held"] == 0


@pytest.mark.timeout(2 * TIMEOUT_S)
@pytest.mark.parametrize("grants", [True, False], ids=["grants", "no-client-transfers"])
def test_second_generation_loads_the_prefix_layer_by_layer(node_factory: Callable[..., NodeProcess],
                                                            grants: bool) -> None:
    node = node_factory("--pool", POOL, *(() if grants else ("--no-client-transfers",)))
    r = vllm("both", "--node", node.endpoint)
    assert r["saved"] == SAVED, r["saved"]
    assert r["loaded"] == (LOADED if grants else REMOTE_LOADED), r["loaded"]
    assert r["same_tokens"] is True and r["same_logprobs"] is True and r["blocks_verified"] is True, r
    # The node's own record: under the grant the worker READ the blocks, the node delivered none.
    assert node_record(node) == (SAVED["blocks_saved"], 0 if grants else LOADED["blocks_loaded"])
    assert_nodes_clean(node)


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_wrong_bytes_loaded_change_what_the_model_generates(node_factory: Callable[..., NodeProcess]) -> None:
    """The comparison above can fail: the tiny Llama's weights are real (seeded), so a load
    whose blocks come back swapped (``vllm_faults.SwappedLoads``: another block's bytes, the
    failure of ranks sharing keys) makes the model generate other logprobs, and the digests
    see the swap."""
    node = node_factory("--pool", POOL)
    r = faulty("SwappedLoads", "both", "--node", node.endpoint)
    assert r["loaded"]["blocks_loaded"] == 3, r["loaded"]  # type: ignore[index]
    assert r["same_logprobs"] is False and r["blocks_verified"] is False, r
    assert_nodes_clean(node)


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_chunked_prefill_saves_every_chunk(node_factory: Callable[..., NodeProcess]) -> None:
    """300 tokens with a budget of 128 a step: chunks of 128, 128 and 44 tokens; the nine full
    blocks (4 + 4 + 1) are saved as their chunks complete them, then all nine are loaded."""
    node = node_factory("--pool", POOL)
    r = vllm("both", "--node", node.endpoint, "--prompt-tokens", "300", "--max-batched-tokens", "128")
    assert r["saved"] == {**SAVED, "saves": 3, "blocks_saved": 9}, r["saved"]
    assert r["loaded"] == {**LOADED, "blocks_loaded": 9, "matched_tokens": 288}, r["loaded"]
    assert r["same_tokens"] is True and r["same_logprobs"] is True and r["blocks_verified"] is True, r
    assert node_record(node) == (9, 0)  # READ under the worker's grant
    assert_nodes_clean(node)


@pytest.mark.timeout(6 * TIMEOUT_S)
def test_other_layout_misses_and_a_failed_load_is_recomputed(node_factory: Callable[..., NodeProcess],
                                                             tmp_path: Path) -> None:
    """A two-layer model saves the prompt's blocks under the model id a four-layer engine uses
    too. The four-layer engine finds none (its fingerprint names its own layout): it computes
    the prompt, saves its own three blocks, and generates the uncached tokens. With keys blind
    to the layout the four-layer engine leases the two-layer blocks, its deliver fails (the
    stored layout is not its own), the connector reports the three blocks, and vLLM recomputes
    them: the tokens and logprobs are those of the four-layer model without any cache (run
    against another node)."""
    shared, clean = node_factory("--pool", POOL), node_factory("--pool", POOL)
    saved = vllm("save", "--node", shared.endpoint, "--layers", "2", "--out", str(tmp_path / "two.json"))
    assert saved["saved"] == SAVED, saved["saved"]
    reference = tmp_path / "reference.json"
    vllm("save", "--node", clean.endpoint, "--out", str(reference))
    missed = vllm("load", "--node", shared.endpoint, "--reference", str(reference))
    assert missed["loaded"] == SAVED, missed["loaded"]  # no lease matched, no load: the prompt computed and saved
    assert missed["same_tokens"] is True and missed["same_logprobs"] is True, missed
    assert node_record(shared) == (6, 0)
    saved = blind("save", "--node", shared.endpoint, "--layers", "2", "--out", str(tmp_path / "two-blind.json"))
    assert saved["saved"] == SAVED, saved["saved"]
    load_failing(blind("load", "--node", shared.endpoint, "--reference", str(reference)), 0, 3, 0)
    assert node_record(shared) == (9, 0)
    assert_nodes_clean(shared, clean)


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_across_two_nodes(node_factory: Callable[..., NodeProcess], tmp_path: Path) -> None:
    node_a, node_b = node_factory("--pool", POOL), node_factory("--pool", POOL)
    reference = tmp_path / "reference.json"
    saved = vllm("save", "--node", node_b.endpoint, "--out", str(reference))
    assert saved["saved"]["blocks_saved"] == 3, saved  # type: ignore[index]
    r = vllm("load", "--node", node_a.endpoint, "--source", node_b.endpoint, "--reference", str(reference))
    assert r["loaded"] == REMOTE_LOADED, r["loaded"]
    assert r["same_tokens"] is True and r["same_logprobs"] is True and r["blocks_verified"] is True, r
    # The source named per request instead, in kv_transfer_params (what the saving engine's
    # request_finished returns), as a decode engine on another host would get it: used where
    # the operator allowed it, refused where not: nothing dialled, a miss, the prompt computed
    # (and its blocks saved in A, which is why this run comes last).
    r = vllm("load", "--node", node_a.endpoint, "--params-source", node_b.endpoint, "--reference", str(reference),
             extra={"allowed_sources": [node_b.endpoint]})
    assert r["loaded"] == REMOTE_LOADED, r["loaded"]
    assert r["same_tokens"] is True and r["same_logprobs"] is True and r["blocks_verified"] is True, r
    r = vllm("load", "--node", node_a.endpoint, "--params-source", node_b.endpoint, "--reference", str(reference))
    assert r["loaded"] == {**SAVED, "sources_refused": 1}, r["loaded"]
    assert r["same_tokens"] is True and r["same_logprobs"] is True, r
    assert_nodes_clean(node_a, node_b)


@pytest.mark.timeout(5 * TIMEOUT_S)
def test_block_failing_mid_prompt_is_recomputed_alone(node_factory: Callable[..., NodeProcess],
                                                      tmp_path: Path) -> None:
    """The prompt's first two blocks are stored by the four-layer model (a 70-token prompt that
    begins the same way), its third by the two-layer model under the same model id. The
    four-layer engine leases all three and loads them in one deliver: the first two land, the
    third fails. Only the third is reported: vLLM keeps the two, recomputes from the third,
    and generates the uncached tokens. Keys blind to the layout (``vllm_faults.LayoutBlind``)
    make the two models' blocks collide, as the fingerprint keeps real engines from doing."""
    shared, clean = node_factory("--pool", POOL), node_factory("--pool", POOL)
    first = blind("save", "--node", shared.endpoint, "--prompt-tokens", "70", "--out", str(tmp_path / "a.json"))
    assert first["saved"] == {**SAVED, "blocks_saved": 2}, first["saved"]
    second = blind("save", "--node", shared.endpoint, "--layers", "2", "--out", str(tmp_path / "b.json"))
    assert second["saved"]["blocks_saved"] == 1, second["saved"]  # type: ignore[index]
    reference = tmp_path / "reference.json"
    blind("save", "--node", clean.endpoint, "--out", str(reference))  # digests under the same keys
    load_failing(blind("load", "--node", shared.endpoint, "--reference", str(reference)), 2, 1, 0)
    assert_nodes_clean(shared, clean)


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_source_killed_after_the_lease(node_factory: Callable[..., NodeProcess], tmp_path: Path) -> None:
    """Node B holds the blocks; the engine's node A leases them at B, then B is killed (by the
    scheduler side, right after the lease: ``vllm_faults.py``) before the worker's deliver.
    A cannot reach B before the load's deadline (``load_timeout_s``), the deliver fails,
    every block is reported, vLLM recomputes the prompt: the tokens are the uncached ones, the
    recomputed blocks are saved in A, and A ends clean."""
    node_a, node_b = node_factory("--pool", POOL), node_factory("--pool", POOL)
    reference = tmp_path / "reference.json"
    vllm("save", "--node", node_b.endpoint, "--out", str(reference))
    r = run_example("vllm_prefix.py", "load", "--node", node_a.endpoint, "--source", node_b.endpoint,
                    "--reference", str(reference), "--connector", "vllm_faults.SourceKilledAfterLease",
                    "--extra", json.dumps({**PATIENT, "kill_pid": node_b.proc.pid, "load_timeout_s": LOAD_TIMEOUT_S}),
                    timeout_s=TIMEOUT_S, python=VLLM_PY,
                    env={"PYTHONPATH": os.pathsep.join(filter(None, (str(HERE), os.environ.get("PYTHONPATH"))))})
    assert node_b.proc.wait(10) == -signal.SIGKILL
    load_failing(r, 0, 3, 3, REMOTE_LOADED)  # recomputed, the three blocks are saved in A: the next request finds them there
    assert node_record(node_a) == (3, 0)
    assert_nodes_clean(node_a)
