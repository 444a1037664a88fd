"""Requests placed by NVIDIA Dynamo's radix tree over real kvcr nodes (run in ``.venv-dynamo``).

Made by ``scripts/dynamo_env.sh``; run by ``tests/cluster/test_dynamo_router.py``, which
reads the JSON report this prints last. The script:

1. starts ``--nodes`` kvcr nodes on ipc endpoints, each with one small FIFO pool (the
   workload's blocks do not fit, so nodes evict) and an inventory event stream, and an
   engine for each (``engine.py``); follows every stream with ``DynamoIndex`` (one Dynamo
   worker id per node). On a fabric (``--fabric``), each node and its engine, a process of
   its own, run on their host, over TCP, and this process in the switch's namespace;
2. runs ``--requests`` requests over ``--prefixes`` sequences of ``--blocks`` blocks, the
   sequence drawn Zipf-like. Block i's key is a hash chained over the sequence's blocks
   before it, as an engine's is, and its deposit names block i-1 as its parent. A request
   is the first half or more of a sequence. Each request asks the index for the node
   holding the longest prefix of its keys; that node's engine leases the prefix there and
   delivers it (every byte checked against what was deposited), then deposits the blocks
   it lacked into the same node, as an engine that prefilled them would.
   With no node holding its first block, the request goes to the nodes in turn;
3. at every ``--check-every``-th request, and after a node is killed and started again
   (``--restart``: kill -9, a new incarnation on the same endpoints, empty), waits until
   the events settle (each node's mirror equals the keys a ``query`` finds there), then
   asks the tree and every node's own ``query`` (the oracle) for the longest held prefix
   of every sequence on every node: they must agree.

Reported: the requests, how many agreed with the oracle at each check (per node and for
the choice), blocks served against blocks the oracle could have served at request time,
the index's counts, and the time from a deposit's acknowledgement to its blocks in the
tree. The nodes end clean.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # kvcr_testing

from engine import BLOCK, Engine, RemoteEngine, sequence_keys  # noqa: E402

from kvcr_client import Client, Presence  # noqa: E402
from kvcr_client.integrations.dynamo import DynamoIndex  # noqa: E402
from kvcr_testing.health import assert_clean  # noqa: E402
from kvcr_testing.measure import fd_count, rss_kib  # noqa: E402
from kvcr_testing.nodes import NodeProcess, short_ipc_dir, start_node  # noqa: E402

RESULT_TIMEOUT_S = 30.0
SETTLE_TIMEOUT_S = 20.0
"""How long the events of one check may take to reach the index."""


CONTROL_PORT, EVENTS_PORT, ENGINE_PORT = 5555, 5600, 5700
"""A fabric host's node listens on these (its replay socket on the port after the events'), and
its engine on the last."""
ENGINE_START_S = 60.0


class Site:
    """One node: its process, endpoints and a client of it. On one host (ipc endpoints), or
    on a host of a fabric (``host``: its namespace, address and UCX settings; TCP)."""

    def __init__(self, ipc: Path, index: int, slots: int, policy: str, host: dict[str, Any] | None = None) -> None:
        self.index = index
        self.policy = policy
        self.host = host
        if host is None:
            self.endpoint, self.events = f"ipc://{ipc}/n{index}.sock", f"ipc://{ipc}/n{index}.ev"
        else:
            self.endpoint = f"tcp://{host['addr']}:{CONTROL_PORT}"
            self.events = f"tcp://{host['addr']}:{EVENTS_PORT}"
        self.slots = slots
        self.node: NodeProcess | None = None
        self.client: Client | None = None
        """The router's own client of the node: its ``query`` is the oracle."""
        self.engine: Engine | RemoteEngine | None = None
        self._engine_proc: subprocess.Popen[str] | None = None
        self.incarnations = 0

    def start(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Start the node, then its engine: on a fabric host a process of its own beside the
        node, on one host a client of this process's."""
        args = ("--pool", f"kv:{BLOCK}:{self.slots}", "--policy", self.policy, "--events-endpoint", self.events,
                "--name", f"node-{self.index}")
        if self.host is None:
            self.node = start_node(self.endpoint, *args)
            self.engine = Engine(Client(self.endpoint, name=f"engine-{self.index}"))
        else:
            ucx = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.host["dev"]}
            prefix = ["ip", "netns", "exec", self.host["ns"]]
            self.node = start_node(self.endpoint, *args, prefix=prefix, env=ucx)
            bind = f"tcp://{self.host['addr']}:{ENGINE_PORT}"
            self._engine_proc = subprocess.Popen(
                [*prefix, sys.executable, str(HERE / "engine.py"), "--node", self.endpoint, "--bind", bind],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **ucx})
            assert self._engine_proc.stdout is not None
            line = self._engine_proc.stdout.readline()  # bounded: the process prints it or exits
            if "engine ready" not in line:
                raise RuntimeError(f"the engine of host {self.index} did not start: {line}{self._engine_proc.stdout.read()}")
            self.engine = RemoteEngine(context, bind)
        self.client = Client(self.endpoint, name=f"router-{self.index}")
        self.incarnations += 1

    def stop_engine(self) -> None:
        if isinstance(self.engine, RemoteEngine):
            self.engine.close()
            assert self._engine_proc is not None
            self._engine_proc.wait(ENGINE_START_S)
        elif self.engine is not None:
            self.engine.client.close()
        self.engine = None

    def figures(self) -> dict[str, int]:
        """The node process's descriptors, RSS and sessions now."""
        assert self.node is not None and self.client is not None
        pid = self.node.proc.pid
        st = self.client.stats().result(RESULT_TIMEOUT_S)
        return {"fds": fd_count(pid), "rss_kib": rss_kib(pid), "sessions": int(st["tables"]["sessions"])}

    def kill(self) -> None:
        assert self.node is not None and self.client is not None
        self.stop_engine()
        self.client.close()
        self.node.kill()

    def held_prefix(self, keys: Sequence[bytes]) -> int:
        """The oracle: how many of ``keys``, from the first, the node's own query finds."""
        assert self.client is not None
        found = self.client.query(keys).result(RESULT_TIMEOUT_S)
        n = 0
        for key in keys:
            if found[key].presence is not Presence.HIT:
                break
            n += 1
        return n

    def holds(self, keys: Sequence[bytes]) -> set[bytes]:
        assert self.client is not None
        found = self.client.query(keys).result(RESULT_TIMEOUT_S)
        return {k for k in keys if found[k].presence is Presence.HIT}


class Router:
    """The workload: requests placed by the index, served by lease and deliver, prefilled by deposit."""

    def __init__(self, sites: list[Site], index: DynamoIndex, prefixes: int, blocks: int, seed: int) -> None:
        self.sites = sites
        self.index = index
        self.sequences = [sequence_keys(p, blocks) for p in range(prefixes)]
        self.parents = {seq[i]: seq[i - 1] for seq in self.sequences for i in range(1, blocks)}
        self.rng = random.Random(seed)
        weights = [1 / (rank + 1) ** 1.1 for rank in range(prefixes)]
        self.weights = weights
        self.turn = 0
        self.figures = {"requests": 0, "served_blocks": 0, "oracle_blocks": 0, "prefilled_blocks": 0,
                        "misses": 0, "checks": 0, "agreed": 0, "node_checks": 0, "node_agreed": 0}
        self.lags: list[float] = []
        self.index_cpu_s = 0.0
        """CPU this process spent receiving, decoding and applying the nodes' events."""
        self.serve_s: list[float] = []
        """Lease and deliver of each request the tree placed on a node holding its prefix."""
        self.mismatches: list[str] = []

    def poll(self, timeout: float) -> None:
        """The index applies what the nodes published; its CPU is counted (waiting is not)."""
        spent = time.thread_time()
        self.index.poll(timeout)
        self.index_cpu_s += time.thread_time() - spent

    def request(self) -> None:
        sequence = self.rng.choices(self.sequences, self.weights)[0]
        keys = sequence[:self.rng.randint(max(1, len(sequence) // 2), len(sequence))]  # a prompt of part of it
        self.poll(0.0)
        oracle = max(site.held_prefix(keys) for site in self.sites)
        chosen, held = self.index.best(keys)
        if chosen is None:
            chosen, self.turn = self.turn, (self.turn + 1) % len(self.sites)
        site = self.sites[chosen]
        started = time.perf_counter()
        assert site.engine is not None
        served = site.engine.serve(keys[:held]) if held else 0
        if held:
            self.serve_s.append(time.perf_counter() - started)
        self.figures["requests"] += 1
        self.figures["served_blocks"] += served
        self.figures["oracle_blocks"] += oracle
        if served < held:
            self.figures["misses"] += 1
        self.prefill(site, keys, served)

    def prefill(self, site: Site, keys: list[bytes], have: int) -> None:
        """The engine deposits the blocks from ``have`` on, with their parents; time until the tree has them."""
        rest = keys[have:]
        if not rest:
            return
        assert site.engine is not None
        site.engine.prefill(rest, self.parents)
        acked = time.monotonic()
        self.figures["prefilled_blocks"] += len(rest)
        deadline = acked + SETTLE_TIMEOUT_S
        while self.index.scores(keys).get(site.index, 0) < len(keys) and time.monotonic() < deadline:
            self.poll(0.002)
        if self.index.scores(keys).get(site.index, 0) == len(keys):
            self.lags.append(time.monotonic() - acked)

    def settle(self) -> bool:
        """Wait until every node's mirror is what its query finds (bounded)."""
        every = [k for seq in self.sequences for k in seq]
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            self.poll(0.01)
            if all(set(self.index.mirror(s.index).keys) == s.holds(every) for s in self.sites):
                return True
            if time.monotonic() > deadline:
                return False

    def check(self) -> None:
        """Every sequence: the tree's longest prefix per node against each node's query."""
        settled = self.settle()
        for keys in self.sequences:
            truth = {s.index: n for s in self.sites if (n := s.held_prefix(keys))}
            tree = self.index.scores(keys)
            self.figures["node_checks"] += len(self.sites)
            self.figures["node_agreed"] += sum(tree.get(s.index, 0) == truth.get(s.index, 0) for s in self.sites)
            chosen, held = self.index.best(keys)
            best = max(truth.values(), default=0)
            agreed = held == best and (chosen is None if best == 0 else truth.get(chosen, 0) == best)
            self.figures["checks"] += 1
            self.figures["agreed"] += agreed
            if not agreed and len(self.mismatches) < 5:
                self.mismatches.append(f"settled={settled} tree={tree} oracle={truth}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--slots", type=int, default=96, help="slots per node's pool (one block each)")
    parser.add_argument("--prefixes", type=int, default=60)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--check-every", type=int, default=100)
    parser.add_argument("--restart", type=int, default=-1, help="kill -9 and restart this node halfway (-1: none)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fabric", type=Path, help="a JSON file of fabric hosts (kvcr_testing.fabric): one node a "
                        "host, over TCP; this process runs in the switch's namespace")
    parser.add_argument("--policy", default="fifo", help="the nodes' eviction policy (fifo evicts a sequence's "
                        "first blocks before the later ones a second request added: blocks wait for their parent)")
    args = parser.parse_args(argv)

    with short_ipc_dir("dyn") as ipc:
        hosts: list[dict[str, Any] | None] = [None] * args.nodes
        if args.fabric is not None:
            hosts = json.loads(args.fabric.read_text())["hosts"]
        sites = [Site(ipc, i, args.slots, args.policy, host) for i, host in enumerate(hosts)]
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        with DynamoIndex() as index:
            try:
                for site in sites:
                    site.start(context)
                    index.follow(site.index, site.events)
                router = Router(sites, index, args.prefixes, args.blocks, args.seed)
                for r in range(args.requests):
                    router.request()
                    if (r + 1) % args.check_every == 0:
                        router.check()
                    if r == args.requests // 2 and args.restart >= 0:
                        sites[args.restart].kill()
                        sites[args.restart].start(context)
                        router.check()
                router.check()
                evicted = 0
                per_node = [site.figures() for site in sites]
                for site in sites:
                    assert site.client is not None
                    st = assert_clean(site.client)
                    evicted += sum(st["evictions"].values())
            finally:
                for site in sites:
                    if site.engine is not None:
                        site.stop_engine()
                    if site.client is not None:
                        site.client.close()
                    if site.node is not None:
                        site.node.kill()
                context.term()
    figures = router.figures
    lags, serve = sorted(router.lags), sorted(router.serve_s)
    report = {
        "nodes": len(sites),
        **figures,
        "router_agreement": figures["agreed"] / figures["checks"],
        "node_agreement": figures["node_agreed"] / figures["node_checks"],
        "hit_rate_vs_oracle": figures["served_blocks"] / max(1, figures["oracle_blocks"]),
        "evicted": evicted,
        "event_lag_p50_ms": 1000 * lags[len(lags) // 2] if lags else None,
        "event_lag_p99_ms": 1000 * lags[min(len(lags) - 1, int(len(lags) * 0.99))] if lags else None,
        "serve_p50_ms": 1000 * serve[len(serve) // 2] if serve else None,
        "serve_p99_ms": 1000 * serve[min(len(serve) - 1, int(len(serve) * 0.99))] if serve else None,
        "node_fds_max": max(f["fds"] for f in per_node),
        "node_rss_mib_max": max(f["rss_kib"] for f in per_node) / 1024,
        "sessions_max": max(f["sessions"] for f in per_node),
        "index": dataclasses.asdict(index.counts),
        "index_cpu_s": router.index_cpu_s,
        "apply_us_per_batch": 1e6 * index.counts.apply_cpu_s / max(1, index.counts.batches),
        "apply_us_per_block": 1e6 * index.counts.apply_cpu_s / max(1, index.counts.stored + index.counts.removed),
        "poll_us_per_stream": 1e6 * (router.index_cpu_s - index.counts.apply_cpu_s)
                              / max(1, index.counts.polls * len(sites)),
        "incarnations": [s.incarnations for s in sites],
        "mismatches": router.mismatches,
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
