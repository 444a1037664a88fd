"""Many nodes placed by NVIDIA Dynamo's router index: 2, 4, 8 and 16 hosts on one switch.

Each size is a fabric of network namespaces (``tests/kvcr_testing/fabric.py``): on every host
a ``kvcr-node`` on TCP and an engine beside it (``tests/cluster/engine.py``, a client of that
node), and the router in the switch's namespace, so every request and event crosses veth
pairs; an engine's transfers go to its own host's node. ``tests/cluster/router_driver.py``
runs the same workload at every size, in the environment ``scripts/dynamo_env.sh`` makes:
requests over 300 shared sequences of 8 blocks (4 KiB each), drawn Zipf-like, each placed by
``DynamoIndex`` on the node holding its longest prefix, leased and delivered from there by
that host's engine (every byte checked), its missing blocks prefilled there with their parents; pools of 32
blocks a node (so every size evicts); one node killed -9 and started again halfway; at
every 100th request and after the restart, the tree's answers against every node's own
``query`` once the events settle.

Load: one request at a time from one router process, the same at every size (this machine
has two cores and every size runs on them): the figures are a light-load view of how the
node count changes what one request pays, not throughput.

Figures (``--json``: one object):
- ``router_agreement``: the tree's choice equals the oracle's (the nodes' own queries) at
  every check, the worst size (goal 1.0);
- ``hit_rate_vs_oracle``: blocks served from the chosen node over blocks the best node held
  at request time, the worst size (goal >= 0.99);
- ``deliver_p99_growth``: p99 of a request's lease and deliver (the router's call to the
  engine, the engine's lease and deliver, its reply) at 16 hosts over the same at
  2 hosts (goal <= 1.5), the anchor being the 2-host run of the same workload;
- ``event_lag_p99_ms``: a deposit's acknowledgement to its blocks matched in the tree, the
  worst size;
- ``node_fds_max``, ``node_rss_mib_max``, ``links_max``: per node at the largest size (links:
  the node's sessions: the router's client and its host's engine);
- per size: serve and lag percentiles; the router's CPU to apply an event batch and a block
  to the tree (``apply_us_per_batch``, ``apply_us_per_block``: stored and removed blocks) and
  to look at one node's stream when it polls (``poll_us_per_stream``); blocks stored; each
  node's RSS and descriptors.

    python3 bench/cluster.py [--sizes 2,4,8,16] [--requests 1000] [--prefixes 300] [--json]

Needs root (namespaces) and ``.venv-dynamo``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from kvcr_testing.engines import DYNAMO_PY, checkout_env  # noqa: E402
from kvcr_testing.fabric import fabric, fabric_problem  # noqa: E402

DRIVER = ROOT / "tests" / "cluster" / "router_driver.py"
SIZE_TIMEOUT_S = 900.0
CHECK_EVERY = 100
"""Requests between two checks of the tree against every node's answers."""
SUBNET = "10.214.0"


def one_size(hosts: int, requests: int, prefixes: int, seed: int) -> dict[str, Any]:
    """The workload at ``hosts`` hosts; the driver's report, with the wall time it took."""
    started = time.monotonic()
    with fabric("b", hosts, SUBNET) as made, tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "fabric.json"
        spec.write_text(json.dumps(made.as_json()))
        proc = subprocess.run(
            [*made.switch.prefix, str(DYNAMO_PY), str(DRIVER), "--fabric", str(spec), "--slots", "32",
             "--requests", str(requests), "--prefixes", str(prefixes), "--check-every", str(CHECK_EVERY),
             "--restart", str(hosts - 1), "--seed", str(seed)],
            capture_output=True, text=True, timeout=SIZE_TIMEOUT_S,
            env=checkout_env({"UCX_TLS": "tcp", "UCX_NET_DEVICES": made.switch.dev}))
    if proc.returncode != 0:
        raise RuntimeError(f"{hosts} hosts: the driver failed\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    report["wall_s"] = time.monotonic() - started
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="2,4,8,16", help="host counts, comma separated (the first is the anchor)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--prefixes", type=int, default=300, help="shared sequences the requests are drawn from")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="also print one JSON object of the figures")
    args = parser.parse_args()
    problem = fabric_problem()
    if problem is not None or not DYNAMO_PY.exists():
        print(f"cluster: cannot run here: {problem or f'no {DYNAMO_PY} (scripts/dynamo_env.sh makes it)'}",
              file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    runs = {n: one_size(n, args.requests, args.prefixes, args.seed) for n in sizes}
    print(f"{'hosts':>5} {'agree':>6} {'hits':>6} {'serve p50':>10} {'p99 ms':>7} {'lag p50':>8} {'p99 ms':>7} "
          f"{'fds':>4} {'rss MiB':>8} {'links':>5} {'evicted':>7} {'wall s':>7}")
    for n, r in runs.items():
        print(f"{n:>5} {r['router_agreement']:>6.3f} {r['hit_rate_vs_oracle']:>6.3f} {r['serve_p50_ms']:>10.2f} "
              f"{r['serve_p99_ms']:>7.2f} {r['event_lag_p50_ms']:>8.2f} {r['event_lag_p99_ms']:>7.2f} "
              f"{r['node_fds_max']:>4} {r['node_rss_mib_max']:>8.1f} {r['sessions_max']:>5} {r['evicted']:>7} "
              f"{r['wall_s']:>7.1f}")
    for n, r in runs.items():
        print(f"{n:>5} hosts: the router applied {r['index']['batches']} batches ({r['index']['stored']} blocks stored, "
              f"{r['index']['removed']} removals) at {r['apply_us_per_batch']:.0f} us a batch, "
              f"{r['apply_us_per_block']:.0f} us a block; a look at one stream {r['poll_us_per_stream']:.0f} us")
    first, last = runs[sizes[0]], runs[sizes[-1]]
    figures = {
        "router_agreement": min(r["router_agreement"] for r in runs.values()),
        "hit_rate_vs_oracle": min(r["hit_rate_vs_oracle"] for r in runs.values()),
        "deliver_p99_growth": last["serve_p99_ms"] / first["serve_p99_ms"],
        "event_lag_p99_ms": max(r["event_lag_p99_ms"] for r in runs.values()),
        "node_fds_max": last["node_fds_max"],
        "node_rss_mib_max": last["node_rss_mib_max"],
        "links_max": last["sessions_max"],
        "sizes": sizes,
        "serve_p99_ms": {n: r["serve_p99_ms"] for n, r in runs.items()},
        "serve_p50_ms": {n: r["serve_p50_ms"] for n, r in runs.items()},
        "event_lag_p50_ms": {n: r["event_lag_p50_ms"] for n, r in runs.items()},
        "index_batches": {n: r["index"]["batches"] for n, r in runs.items()},
        "apply_us_per_batch": {n: r["apply_us_per_batch"] for n, r in runs.items()},
        "apply_us_per_block": {n: r["apply_us_per_block"] for n, r in runs.items()},
        "poll_us_per_stream": {n: r["poll_us_per_stream"] for n, r in runs.items()},
        "blocks_stored": {n: r["index"]["stored"] for n, r in runs.items()},
        "node_rss_mib": {n: r["node_rss_mib_max"] for n, r in runs.items()},
        "node_fds": {n: r["node_fds_max"] for n, r in runs.items()},
        "requests": args.requests,
        "prefixes": args.prefixes,
    }
    print(f"router_agreement {figures['router_agreement']:.3f} (goal 1.0), hit_rate_vs_oracle "
          f"{figures['hit_rate_vs_oracle']:.3f} (goal >= 0.99), deliver_p99_growth {figures['deliver_p99_growth']:.2f} "
          f"({sizes[-1]} hosts over {sizes[0]}; goal <= 1.5), event_lag_p99_ms {figures['event_lag_p99_ms']:.2f}")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
