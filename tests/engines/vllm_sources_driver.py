"""Hostile ``kv_transfer_params`` against vLLM's own ``Scheduler`` and the connector's worker side.

Run in the vLLM environment as ``python vllm_sources_driver.py A B C``: A is the engine's
node, B a source node the operator allowed (``allowed_sources``), C another node that holds
blocks too but was never allowed. Prints one JSON line for ``test_vllm_sources.py``.

The requests are what an OpenAI API client can send: ``kv_transfer_params`` are request-body
fields. Each hostile request names something a node must not dial (a URL, a huge string,
a wrong type, an ipc path and a loopback port of listeners that never answer, node C) and
has a prompt whose blocks node C holds; an allowed request names B, one with a request id
no protocol field can carry, one names A itself in another spelling, and an innocent one
names nothing and finds its blocks on A. The listeners are real sockets that never accept:
any dial would sit in their backlog, so the driver counts what it can accept at the end.

A second scheduler (the default ``lookup_wait_s``, ``lookup_timeout_s`` 1 s) has one request whose allowed source is
frozen (a listener that never accepts: the dial connects, the greeting is never answered)
beside an innocent one; every ``schedule()`` call is timed. Then the worker side: loads
naming a source that is not allowed, a load whose metadata does not add up, and one from B,
whose bytes are compared with what was deposited there.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request
from vllm_scheduler_driver import BLOCK, LAYERS, NUM_BLOCKS, SLOT, prompt_keys, request, scheduler, step

from kvcr_client import Client, Span
from kvcr_client.integrations.vllm import BlockLoad, KvcrConnector, KvcrConnectorMetadata

PROMPT_TOKENS = 100
"""Three full blocks of 32 beyond the token that is always computed: 96 tokens to match."""
RUN_S = 120.0
"""The longest the driver steps a scheduler before it reports what is unfinished."""
FROZEN_TIMEOUT_S = 1.0
"""The frozen run's ``lookup_timeout_s`` (the default is 0.2 s)."""
MAIN_EXTRA = {"lookup_timeout_s": 30.0, "lookup_wait_s": 0.0}
"""Generous: an allowed source's first dial must not time out on a loaded machine; and no wait,
so that a remote lease is always answered "not yet" first, then with its count."""


def prompt(i: int) -> list[int]:
    return [(7 * j + 3 + 17 * i) % 500 + 10 for j in range(PROMPT_TOKENS)]


def pattern(b: int, layer: int) -> np.ndarray:
    """The bytes of block ``b``'s layer ``layer``, distinct per block and layer."""
    return ((np.arange(SLOT, dtype=np.uint32) * 7 + b * 31 + layer * 101) % 251).astype(np.uint8)


def deposit(endpoint: str, keys: list[bytes]) -> None:
    """Store blocks under ``keys`` in the node at ``endpoint`` (``pattern``'s bytes), as another
    engine's connector would (one span a layer, named as the connector names them)."""
    with Client(endpoint, name="sources-driver") as client:
        buf = np.concatenate([pattern(b, layer) for b in range(len(keys)) for layer in range(LAYERS)])
        region = client.register(buf)
        objects = {key: [Span(f"model.layers.{layer}.self_attn.attn", region, (b * LAYERS + layer) * SLOT, SLOT, "kv")
                         for layer in range(LAYERS)] for b, key in enumerate(keys)}
        results = client.deposit(objects).result(30)
        assert all(r.ok for r in results.values()), results
        client.unregister(region)


def listener(family: int, address: Any) -> socket.socket:
    """A socket that listens and never accepts: a dial lands in its backlog, nothing answers."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind(address)
    sock.listen(64)
    return sock


def connections(sock: socket.socket) -> int:
    """How many connections reached ``sock`` (accepted now, and closed); then closes it."""
    sock.setblocking(False)
    count = 0
    while True:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            break
        conn.close()
        count += 1
    sock.close()
    return count


def add_stats(total: dict[str, int], stats: dict[str, Any] | None) -> None:
    for name, value in (stats or {}).items():
        total[name] = total.get(name, 0) + int(value)


def drive(sched: Scheduler, requests: dict[str, tuple[str, list[int], Any]]) -> dict[str, Any]:
    """Add ``requests`` (label -> request id, prompt, kv_transfer_params) and step until all
    finish: the tokens each was admitted with, its loads, the connector's counts, the time of
    every ``schedule()``."""
    ids = {}
    prompts = {}
    for label, (request_id, tokens, params) in requests.items():
        extra = {"kv_transfer_params": params} if params is not None else None
        sched.add_request(request(request_id, tokens, SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)))
        ids[request_id] = label
        prompts[request_id] = tokens
    connector = sched.connector
    assert isinstance(connector, KvcrConnector)
    not_yet: dict[str, int] = {}
    """Label -> how often the connector answered vLLM "not yet" (None)."""
    answer = connector.get_num_new_matched_tokens

    def counted(request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        matched = answer(request, num_computed_tokens)
        if matched[0] is None:
            label = ids[request.request_id]
            not_yet[label] = not_yet.get(label, 0) + 1
        return matched

    connector.get_num_new_matched_tokens = counted  # type: ignore[method-assign]
    admitted: dict[str, int] = {}
    admitted_at: dict[str, int] = {}
    """Label -> the step (0, 1, ...) whose schedule() admitted it."""
    loads: dict[str, list[dict[str, Any]]] = {}
    stats: dict[str, int] = {}
    times: list[float] = []
    finished: dict[str, Any] = {}
    began = time.monotonic()
    while sched.has_unfinished_requests() and time.monotonic() - began < RUN_S:
        record = step(sched, prompts)
        times.append(record["schedule_s"])
        for request_id, new in record["new"].items():
            admitted.setdefault(ids[request_id], new["num_computed_tokens"])
            admitted_at.setdefault(ids[request_id], len(times) - 1)
        for load in record["loads"]:
            loads.setdefault(ids[load["request"]], []).append({"source": load["source"], "blocks": len(load["keys"])})
        for request_id, params in record["finished"].items():
            finished[ids[request_id]] = params
        add_stats(stats, record["kv_connector_stats"])
    left = connector.get_kv_connector_stats()
    add_stats(stats, left.data if left is not None else None)
    return {"admitted": admitted, "admitted_at": admitted_at, "not_yet": not_yet, "loads": loads, "stats": stats, "steps": len(times), "schedule_s": times,
            "finished": finished, "unfinished": sched.has_unfinished_requests(),
            "wall_s": time.monotonic() - began}


def hostile(silent_ipc: str, silent_port: int, other: str) -> dict[str, Any]:
    """What a request may carry that must name no source: label -> kv_transfer_params."""
    return {
        "url": {"kvcr_endpoint": "http://127.0.0.1/"},
        "huge_port": {"kvcr_endpoint": "tcp://127.0.0.1:" + "9" * 100_000},
        "huge": {"kvcr_endpoint": "x" * 1_000_000},
        "int": {"kvcr_endpoint": 7400},
        "list": {"kvcr_endpoint": ["tcp://127.0.0.1:1"]},
        "dict": {"kvcr_endpoint": {"endpoint": other}},
        "empty": {"kvcr_endpoint": ""},
        "inproc": {"kvcr_endpoint": "inproc://kvcr"},
        "silent_ipc": {"kvcr_endpoint": f"ipc://{silent_ipc}"},
        "silent_tcp": {"kvcr_endpoint": f"tcp://127.0.0.1:{silent_port}"},
        "silent_tcp_name": {"kvcr_endpoint": f"tcp://localhost:{silent_port}"},
        "silent_tcp_v6": {"kvcr_endpoint": f"tcp://[::1]:{silent_port}"},
        "other_node": {"kvcr_endpoint": other},
    }


def main_run(a: str, b: str, c: str, folder: Path) -> tuple[dict[str, Any], Scheduler]:
    silent_ipc = str(folder / "silent.sock")
    ipc = listener(socket.AF_UNIX, silent_ipc)
    tcp = listener(socket.AF_INET, ("127.0.0.1", 0))
    port = tcp.getsockname()[1]
    sched = scheduler(a, {**MAIN_EXTRA, "allowed_sources": [b]})
    connector = sched.connector
    assert isinstance(connector, KvcrConnector)
    fp = connector.connector_scheduler.settings.fingerprint
    bad = hostile(silent_ipc, port, c)
    requests: dict[str, tuple[str, list[int], Any]] = {}
    for i, (label, params) in enumerate(bad.items()):
        requests[label] = (f"hostile-{label}", prompt(i), params)
    n = len(bad)
    # Node C holds every hostile prompt's blocks: a request that reached it would match them.
    deposit(c, [k for i in range(n) for k in fp.all_slices(prompt_keys(fp, prompt(i)[:-1]))])
    deposit(b, [k for i in (n, n + 1) for k in fp.all_slices(prompt_keys(fp, prompt(i)[:-1]))])
    deposit(a, [k for i in (n + 2, n + 3) for k in fp.all_slices(prompt_keys(fp, prompt(i)[:-1]))])
    requests["allowed"] = ("allowed", prompt(n), {"kvcr_endpoint": b})
    requests["allowed_long_id"] = ("r" * 100_000, prompt(n + 1), {"kvcr_endpoint": b})
    requests["own_spelling"] = ("own", prompt(n + 2), {"kvcr_endpoint": a.replace("ipc://", "ipc:///", 1)})
    requests["innocent"] = ("innocent", prompt(n + 3), None)
    report = drive(sched, requests)
    report["hostile"] = sorted(bad)
    report["silent_ipc_connections"] = connections(ipc)
    report["silent_tcp_connections"] = connections(tcp)
    return report, sched


def frozen_run(a: str, folder: Path) -> dict[str, Any]:
    frozen = listener(socket.AF_INET, ("127.0.0.1", 0))
    endpoint = f"tcp://127.0.0.1:{frozen.getsockname()[1]}"
    # The default lookup_wait_s; a lookup_timeout_s that a local lease meets on a loaded machine.
    sched = scheduler(a, {"allowed_sources": [endpoint], "lookup_timeout_s": FROZEN_TIMEOUT_S})
    connector = sched.connector
    assert isinstance(connector, KvcrConnector)
    fp = connector.connector_scheduler.settings.fingerprint
    deposit(a, fp.all_slices(prompt_keys(fp, prompt(90)[:-1])))
    report = drive(sched, {"frozen": ("frozen", prompt(91), {"kvcr_endpoint": endpoint}),
                           "innocent": ("innocent", prompt(90), None)})
    report["endpoint"] = endpoint
    report["lookup_timeout_s"] = connector.connector_scheduler.settings.lookup_timeout_s
    report["lookup_wait_s"] = connector.connector_scheduler.settings.lookup_wait_s
    sched.shutdown()
    report["frozen_connections"] = connections(frozen)
    return report


def worker_run(sched: Scheduler, b: str, c: str, folder: Path) -> dict[str, Any]:
    """The worker side, given metadata as a scheduler could hand it."""
    connector = sched.connector
    assert isinstance(connector, KvcrConnector)
    worker = KvcrConnector(sched.vllm_config, KVConnectorRole.WORKER, sched.kv_cache_config)
    silent = listener(socket.AF_INET, ("127.0.0.1", 0))
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    # [blocks, ...]: a block's K and V together, one span of one slot per layer.
    caches = {name: torch.zeros(NUM_BLOCKS, 2, BLOCK, 2, 32, dtype=torch.float32) for name in layers}
    worker.register_kv_caches(caches)
    fp = connector.connector_scheduler.settings.fingerprint
    keys = prompt_keys(fp, prompt(50)[:-1])
    deposit(b, fp.all_slices(keys))  # one rank: the slice is the block
    loads = [
        BlockLoad("w-url", keys, [1, 2, 3], "http://127.0.0.1/"),
        BlockLoad("w-silent", keys, [4, 5, 6], f"tcp://127.0.0.1:{silent.getsockname()[1]}"),
        BlockLoad("w-other", keys, [7, 8, 9], c),
        BlockLoad("w-mismatch", keys, [10], None),
        BlockLoad("w-ok", keys, [20, 21, 22], b, "w-ok"),
    ]
    worker.bind_connector_metadata(KvcrConnectorMetadata(loads=loads))
    worker.start_load_kv(None)
    for name in layers:
        worker.wait_for_layer_load(name)
    failed = sorted(worker.get_block_ids_with_load_errors())
    worker.wait_for_save()
    worker.clear_connector_metadata()
    exact = all(np.array_equal(caches[name][block_id].view(torch.uint8).reshape(-1).numpy(), pattern(b_, layer))
                for b_, block_id in enumerate([20, 21, 22]) for layer, name in enumerate(layers))
    stats = worker.get_kv_connector_stats()
    worker.shutdown()
    return {"failed": failed, "byte_exact": exact, "stats": stats.data if stats is not None else {},
            "silent_connections": connections(silent)}


def main() -> int:
    a, b, c = sys.argv[1:4]
    folder = Path(tempfile.mkdtemp(prefix="kvcr-src-", dir="/tmp"))
    atexit.register(shutil.rmtree, folder, True)  # the process's own files go with it
    report, sched = main_run(a, b, c, folder)
    report["worker"] = worker_run(sched, b, c, folder)
    sched.shutdown()
    report["frozen"] = frozen_run(a, folder)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
