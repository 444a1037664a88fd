"""NVIDIA Dynamo's KV router index fed by kvcr nodes' events (``kvcr_client.integrations.dynamo``).

Dynamo's own ``RadixTree`` (the package ``ai-dynamo-runtime``, in the environment
``scripts/dynamo_env.sh`` makes; the project's never imports it) is the consumer, not one
written here. Three scripts run in that environment and report JSON:

- ``index_model.py``: thousands of event batches of several workers, made to be hard
  (children before parents, parents evicted under their children, keys in two tiers,
  restarts), against a model of what each holds: after every batch the tree's longest
  prefix of every sequence, per worker, is the model's; and a node whose stream sends what
  does not decode, dropped from the tree.
- ``router_driver.py``: real nodes (2 and 4) whose pools are too small for the workload, a
  request stream over shared prefixes placed by the tree, each served by a lease and a
  deliver from the chosen node (every byte checked) and prefilled there with parents; a
  node killed -9 and started again halfway. At every check, after the events settle, the
  tree's choice and its per-node matches equal the nodes' own query answers, and the
  nodes end clean; and the same over TCP, 8 hosts as network namespaces on one switch,
  each with its node and an engine beside it, the router in the switch's namespace.
- ``route_keys.py``: the prefix a real model (SmolLM2-135M, in the engine environment)
  deposited through the transformers integration on a host of a fabric, found whole at its
  node by the tree.

Outside CI, without the environment, the module is skipped and says why; in CI it must run.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvcr_testing.engines import DYNAMO_PY, ENGINE_PY, EXAMPLES, checkout_env, require_engines, run_script
from kvcr_testing.fabric import fabric, fabric_problem
from kvcr_testing.nodes import start_node

HERE = Path(__file__).resolve().parent
DRIVER_TIMEOUT_S = 300.0

require_engines(DYNAMO_PY, "scripts/dynamo_env.sh")


def run(script: str, *args: str) -> dict[str, Any]:
    return run_script(HERE / script, *args, timeout_s=DRIVER_TIMEOUT_S, python=DYNAMO_PY)


def test_the_index_matches_a_model_of_what_nodes_hold() -> None:
    report = run("index_model.py", "--batches", "3000")
    assert report["disagreed"] == 0, report["first"]
    assert report["checks"] == 3000 * 12
    counts = report["index"]
    # Every hard case happened: blocks waited for their parent and went back in with it,
    # removals took descendants, and workers restarted.
    assert counts["waiting"] > 100 and counts["rejoined"] > 100, counts
    assert counts["removed"] > 100 and counts["restarts"] > 10, counts
    # A node whose stream sends what does not decode is no longer followed, and its blocks
    # leave the tree; the other node's stay.
    refused = report["hostile"]
    assert refused["before"] == {"1": 1, "2": 1} and refused["after"] == {"1": 1}, refused
    assert refused["failed_streams"] == 1 and "does not decode" in refused["failures"]["2"], refused


@pytest.mark.timeout(2 * DRIVER_TIMEOUT_S)
@pytest.mark.parametrize("nodes", [2, 4])
def test_requests_placed_by_dynamos_tree_agree_with_the_nodes_own_answers(nodes: int) -> None:
    report = run("router_driver.py", "--nodes", str(nodes), "--slots", "32", "--requests", "200",
                 "--check-every", "50", "--restart", "1")
    assert report["mismatches"] == [], report
    assert report["router_agreement"] == 1.0 and report["node_agreement"] == 1.0, report
    assert report["checks"] == 6 * 60, report  # four checks, the restart's and the last, of 60 sequences
    # Placed by the tree, every request found at its node every block any node could serve.
    assert report["misses"] == 0 and report["hit_rate_vs_oracle"] == 1.0, report
    assert report["served_blocks"] > 0 and report["evicted"] > 0, report
    # The killed node came back as a new incarnation; the tree dropped its blocks (a
    # restart per node start, and one for the kill) and learnt what it stored since.
    assert report["incarnations"][1] == 2, report
    assert report["index"]["restarts"] == nodes + 1, report
    assert report["event_lag_p99_ms"] is not None, report


def run_on_fabric(tmp_path: Path, hosts: int, *args: str) -> dict[str, Any]:
    """``router_driver.py`` in the switch's namespace of a fabric of ``hosts`` hosts."""
    problem = fabric_problem()
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs as root with iproute2: {problem}", pytrace=False)
        pytest.skip(problem)
    with fabric("r", hosts, "10.213.0") as made:
        spec = tmp_path / "fabric.json"
        spec.write_text(json.dumps(made.as_json()))
        proc = subprocess.run(
            [*made.switch.prefix, str(DYNAMO_PY), str(HERE / "router_driver.py"), "--fabric", str(spec), *args],
            capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S,
            env=checkout_env({"UCX_TLS": "tcp", "UCX_NET_DEVICES": made.switch.dev}))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.timeout(2 * DRIVER_TIMEOUT_S)
@pytest.mark.parametrize("hosts", [8])  # 16 hosts: bench/cluster.py
def test_hosts_on_a_switch_route_by_the_tree_over_tcp(hosts: int, tmp_path: Path) -> None:
    """Network namespaces on one bridge, a node and its engine on each, over TCP; the
    router in the switch's namespace: every request and event crosses veth pairs."""
    report = run_on_fabric(tmp_path, hosts, "--slots", "32", "--requests", "200", "--check-every", "50",
                           "--restart", "5")
    assert report["nodes"] == hosts and report["mismatches"] == [], report
    assert report["router_agreement"] == 1.0 and report["node_agreement"] == 1.0, report
    assert report["misses"] == 0 and report["hit_rate_vs_oracle"] == 1.0, report
    assert report["incarnations"][5] == 2 and report["index"]["restarts"] == hosts + 1, report
    assert report["sessions_max"] == 2, report  # the router's client and the host's engine: no link left behind


@pytest.mark.timeout(2 * DRIVER_TIMEOUT_S)
def test_a_real_engine_on_a_fabric_host_is_found_in_dynamos_tree_over_tcp(tmp_path: Path) -> None:
    """SmolLM2-135M prefills a prompt in the engine environment on host 1 of a fabric and
    deposits its prefix's blocks into that host's node through the transformers
    integration, which names each block's parent. Dynamo's tree, in the switch's namespace
    following both nodes' events over TCP, finds every block of the prefix at node 1: past
    the first block the tree finds a block only under its parent."""
    require_engines(ENGINE_PY)
    problem = fabric_problem()
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs as root with iproute2: {problem}", pytrace=False)
        pytest.skip(problem)
    with fabric("m", 2, "10.215.0") as made:
        nodes = [start_node(f"tcp://{h.addr}:5555", "--pool", "kv:12KiB:4096", "--events-endpoint",
                            f"tcp://{h.addr}:5600", prefix=h.prefix, env=h.ucx) for h in made.hosts]
        try:
            host = made.hosts[1]
            engine = subprocess.run(
                [*host.prefix, str(ENGINE_PY), str(EXAMPLES / "transformers_prefix.py"), "deposit", "--node",
                 nodes[1].endpoint, "--tokens", "200", "--out", str(tmp_path / "reference.pt")],
                capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S, env=checkout_env(host.ucx))
            assert engine.returncode == 0, engine.stdout[-3000:] + engine.stderr[-3000:]
            keys = json.loads(engine.stdout.strip().splitlines()[-1])["keys"]
            route = subprocess.run(
                [*made.switch.prefix, str(DYNAMO_PY), str(HERE / "route_keys.py"),
                 *(f"--follow={i}=tcp://{h.addr}:5600" for i, h in enumerate(made.hosts)),
                 "--keys", ",".join(keys), "--want", str(len(keys))],
                capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S, env=checkout_env(made.switch.ucx))
            assert route.returncode == 0, route.stdout[-3000:] + route.stderr[-3000:]
            report = json.loads(route.stdout.strip().splitlines()[-1])
        finally:
            for node in nodes:
                node.kill()
    assert len(keys) == 12 and (report["best"], report["held"]) == (1, 12), report
    assert report["scores"] == {"1": 12} and report["parents"] == {"0": 0, "1": 11}, report

