"""``KvcrConnector`` built for each of vLLM's roles, and the worker's block observer.

Run in the vLLM environment as ``python vllm_roles_driver.py ENDPOINT``; prints one JSON line
for ``test_vllm_roles.py``. The configuration is ``vllm_scheduler_driver.py``'s. For each
role the facade holds that side only and refuses the other side's calls by name. Each bad
``block_observer`` (not ``module:Class``, a module that is not there, a callable that is not a
``BlockObserver``, a class that cannot be made) is a ``ValueError`` naming the key, raised
before the worker opens a session. Then a worker whose observer raises on every block loads
and saves blocks: the bytes land exactly and nothing is reported failed. Last, a worker
whose read lease ends while its READs run (released right after the first group's post):
every block of that load is reported failed, for vLLM to recompute, none shown as loaded.
"""

from __future__ import annotations

import copy
import json
import sys
import threading
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm_observers import Exploding
from vllm_scheduler_driver import BLOCK, LAYERS, NUM_BLOCKS, prompt_keys, scheduler
from vllm_sources_driver import deposit, pattern

from kvcr_client.integrations.vllm import (
    BlockLoad,
    KvcrConnector,
    KvcrConnectorMetadata,
    KvcrScheduler,
    KvcrWorker,
)

BAD_OBSERVERS: dict[str, object] = {
    "not_a_string": 7,
    "no_class": "vllm_observers",
    "no_module": "kvcr_no_such_module:Observer",
    "no_attribute": "vllm_observers:NoSuchObserver",
    "a_callable": "os:getcwd",
    "needs_arguments": "vllm_observers:NeedsArguments",
}


def refused(call: Any) -> str | None:
    """The error a misrouted call raises (None if it raised nothing)."""
    try:
        call()
    except RuntimeError as exc:
        return str(exc)
    return None


def with_extra(config: Any, **extra: object) -> Any:
    changed = copy.deepcopy(config)
    changed.kv_transfer_config.kv_connector_extra_config = {**changed.kv_transfer_config.kv_connector_extra_config,
                                                            **extra}
    return changed


def lease_lost(sched: Any, keys: list[bytes], layers: list[str]) -> dict[str, Any]:
    """A load under a read grant whose lease the worker's client releases mid-read."""
    worker = KvcrConnector(sched.vllm_config, KVConnectorRole.WORKER, sched.kv_cache_config)
    side = worker.connector_worker
    assert side is not None
    caches = {name: torch.zeros(NUM_BLOCKS, 2, BLOCK, 2, 32, dtype=torch.float32) for name in layers}
    worker.register_kv_caches(caches)
    client = side.client

    def release_all(stage: str) -> None:
        if stage == "posted 0":
            for lease in list(client._scope().leases.values()):
                lease.release()

    client._grants.gate = release_all
    worker.bind_connector_metadata(KvcrConnectorMetadata(loads=[BlockLoad("r-lost", keys, [20, 21, 22])]))
    worker.start_load_kv(None)
    for name in layers:
        worker.wait_for_layer_load(name)
    failed = sorted(worker.get_block_ids_with_load_errors())
    worker.clear_connector_metadata()
    client._grants.gate = None
    stats = worker.get_kv_connector_stats()
    worker.shutdown()
    return {"failed": failed, "refused": client.counters()["grant_refused"], "stats": stats.data if stats is not None else {}}


def main() -> int:
    endpoint = sys.argv[1]
    sched = scheduler(endpoint)
    front = sched.connector
    assert isinstance(front, KvcrConnector)
    worker = KvcrConnector(sched.vllm_config, KVConnectorRole.WORKER, sched.kv_cache_config)
    report: dict[str, Any] = {
        "scheduler_sides": [type(front.connector_scheduler).__name__, type(front.connector_worker).__name__],
        "worker_sides": [type(worker.connector_scheduler).__name__, type(worker.connector_worker).__name__],
        "is_scheduler": isinstance(front.connector_scheduler, KvcrScheduler),
        "is_worker": isinstance(worker.connector_worker, KvcrWorker),
        "worker_refuses": refused(lambda: worker.get_num_new_matched_tokens(object(), 0)),
        "scheduler_refuses": refused(lambda: front.register_kv_caches({})),
    }
    worker.shutdown()
    threads = threading.active_count()
    bad: dict[str, str | None] = {}
    for label, name in BAD_OBSERVERS.items():
        try:
            KvcrConnector(with_extra(sched.vllm_config, block_observer=name), KVConnectorRole.WORKER,
                          sched.kv_cache_config).shutdown()
        except ValueError as exc:
            bad[label] = str(exc)
        else:
            bad[label] = None
    report["bad_observers"] = bad
    report["threads_after_bad"] = threading.active_count() - threads

    exploding = KvcrConnector(with_extra(sched.vllm_config, block_observer="vllm_observers:Exploding"),
                              KVConnectorRole.WORKER, sched.kv_cache_config)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    caches = {name: torch.zeros(NUM_BLOCKS, 2, BLOCK, 2, 32, dtype=torch.float32) for name in layers}
    exploding.register_kv_caches(caches)
    side = front.connector_scheduler
    assert side is not None
    fp = side.settings.fingerprint
    keys = prompt_keys(fp, [(5 * j + 1) % 500 + 10 for j in range(3 * BLOCK)])
    deposit(endpoint, fp.all_slices(keys))  # one rank: a block's one slice
    exploding.bind_connector_metadata(KvcrConnectorMetadata(loads=[BlockLoad("r-load", keys, [20, 21, 22])]))
    exploding.start_load_kv(None)
    for name in layers:
        exploding.wait_for_layer_load(name)
    report["failed"] = sorted(exploding.get_block_ids_with_load_errors())
    exploding.wait_for_save()
    exploding.clear_connector_metadata()
    report["byte_exact"] = all(
        np.array_equal(caches[name][block_id].view(torch.uint8).reshape(-1).numpy(), pattern(b, layer))
        for b, block_id in enumerate([20, 21, 22]) for layer, name in enumerate(layers))
    # Saving blocks 30, 31 under new keys (their bytes are zeros): the observer raises again.
    fresh = [bytes([k[0] ^ 0xFF]) + k[1:] for k in keys[:2]]
    exploding.bind_connector_metadata(KvcrConnectorMetadata(saves=[BlockLoad("r-save", fresh, [30, 31])]))
    exploding.start_load_kv(None)
    exploding.wait_for_save()
    exploding.clear_connector_metadata()
    assert exploding.connector_worker is not None and exploding.connector_worker.settle_saves(30.0)
    stats = exploding.get_kv_connector_stats()
    report["stats"] = stats.data if stats is not None else {}
    report["observer_calls"] = Exploding.calls
    exploding.shutdown()
    report["lease_lost"] = lease_lost(sched, keys, layers)
    sched.shutdown()
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
