"""vLLM's own ``Scheduler`` drives ``KvcrConnector``'s scheduler side, outside the engine.

``vllm_scheduler_driver.py`` (run in the vLLM environment) builds a real ``Scheduler`` from
``EngineArgs`` and a KV cache config, with the connector loaded by vLLM's factory, and
steps it with made-up model outputs. Checked here against vLLM's own allocation: the
tokens the lease matched become the request's computed tokens; ``update_state_after_alloc``
puts the leased keys in the request's first allocated blocks, in order; the metadata saves
the full blocks each step computes (every chunk of a chunked prefill, in the blocks vLLM
allocated for it); ``request_finished`` names this node in ``kv_transfer_params``; the
scheduler-side stats reach ``SchedulerStats`` and vLLM's connector-stats logger sums them;
the node ends with no lease held.

Keys come from vLLM's block hashes (issue 39): vLLM's own requests that differ only in a
``cache_salt``, a LoRA adapter (its name, or the same name at another path) or an image (its
hash) are saved under keys no other variant has, and never match each other's blocks; a
fresh request identical to a saved one matches and loads its blocks. An image from token 40
leaves the first block's KV what the plain prompt's is: that block alone is shared. A
connector refuses, naming ``PYTHONHASHSEED``, a hash vLLM roots at a random seed per process
(``xxhash`` without it), which no other server could share; quantization and the model's
revision change every key (the fingerprint's salt).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcr_client import Client
from kvcr_testing.engines import VLLM_PY, require_engines, run_script
from kvcr_testing.health import assert_clean
from kvcr_testing.nodes import short_ipc_dir, start_node

TIMEOUT_S = 300.0
DRIVER = Path(__file__).with_name("vllm_scheduler_driver.py")

require_engines(VLLM_PY)

Runs = tuple[dict[str, Any], dict[str, str], dict[str, dict[str, Any]]]
"""Each run's report, the endpoint of its node, and its node's stats after every run."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """The driver's three runs in one process (vLLM imported once), each against a node of its
    own; each node checked clean after them."""
    disk = tmp_path_factory.mktemp("disk-tier")
    pools = {
        "drive": ("--pool", "kv:16KiB:256"),
        "isolation": ("--pool", "kv:16KiB:256"),
        # The disk run's blocks leave this small memory pool for the disk tier.
        "disk": ("--pool", "kv:16KiB:16", "--pool", f"kv-disk:16KiB:256:disk:{disk}", "--disk-demote-mark", "1"),
    }
    with short_ipc_dir("vsch") as folder:
        nodes = {mode: start_node(f"ipc://{folder}/{mode}.sock", *args) for mode, args in pools.items()}
        try:
            r = run_script(DRIVER, *(f"{mode}={node.endpoint}" for mode, node in nodes.items()),
                           timeout_s=TIMEOUT_S, python=VLLM_PY)
            after = {}
            for mode, node in nodes.items():
                with Client(node.endpoint, name="vllm-check") as c:
                    after[mode] = assert_clean(c)
            yield r, {mode: node.endpoint for mode, node in nodes.items()}, after
        finally:
            for node in nodes.values():
                node.stop()


def entry(request: str, keys: list[str], block_ids: list[int], parents: list[str] | None = None) -> dict[str, Any]:
    """A load (no parents) or a save (each block's parent: the key of the block before it)."""
    return {"request": request, "keys": keys, "block_ids": block_ids, "source": None, "parents": parents or []}


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_scheduler_drives_the_connector(runs: Runs) -> None:
    r, endpoint, st = runs[0]["drive"], runs[1]["drive"], runs[2]["drive"]
    steps, loaded, chunked = r["steps"], r["loaded_keys"], r["chunked_keys"]
    assert r["unfinished"] is False and len(steps) == 6, steps

    # 100 tokens, two blocks in the node: 64 tokens matched, 36 computed in one step.
    first = steps[0]
    assert first["new"] == {"loaded": {"num_computed_tokens": 64}}, first
    assert first["scheduled"] == {"loaded": 36}
    blocks = first["block_ids"]["loaded"]
    assert first["loads"] == [entry("loaded", loaded[:2], blocks[:2])]
    # The third block, computed here, saved with the second as its parent.
    assert first["saves"] == [entry("loaded", loaded[2:3], blocks[2:3], loaded[1:2])]
    assert first["kv_connector_stats"] is not None
    assert {k: v for k, v in first["kv_connector_stats"].items() if v} == {"leases": 1, "matched_tokens": 64}
    # A decode step, then the end: the node that served it is named for a decode engine elsewhere.
    assert steps[1]["loads"] == steps[1]["saves"] == []
    assert steps[1]["finished"] == {"loaded": {"kvcr_endpoint": endpoint}}

    # 200 new tokens at 64 a step: each chunk's two full blocks saved where vLLM put them.
    for i, s in enumerate(steps[2:5]):
        assert s["scheduled"] == {"chunked": 64}, s
        ids = s["block_ids"]["chunked"][2 * i : 2 * i + 2]
        parents = ["" if i == 0 else chunked[2 * i - 1], chunked[2 * i]]  # the first block names none
        assert s["loads"] == [] and s["saves"] == [entry("chunked", chunked[2 * i : 2 * i + 2], ids, parents)], s
    last = steps[5]
    assert last["scheduled"] == {"chunked": 8} and last["saves"] == [], last
    assert last["finished"] == {"chunked": {"kvcr_endpoint": endpoint}}
    assert all(s["kv_connector_stats"] is None for s in steps[1:])  # nothing more leased
    # vLLM's own connector-stats logger, fed that step's stats twice, sums them.
    assert len(r["logged"]) == 1 and "leases=2" in r["logged"][0] and "matched_tokens=128" in r["logged"][0], r
    assert st["leases"]["held"] == 0 and st["objects"] == 2


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_keys_isolate_salts_adapters_and_images(runs: Runs) -> None:
    r, st = runs[0]["isolation"], runs[2]["isolation"]
    keys: dict[str, list[str]] = r["keys"]
    assert all(len(k) == 3 for k in keys.values()), keys  # 100 tokens: three full blocks saved
    assert all(r["keys_from_vllm_hashes"].values()), r["keys_from_vllm_hashes"]  # Fingerprint.engine_keys of vLLM's hashes
    late = ("image_1_late", "image_2_late")
    for name in late:
        assert keys[name][0] == keys["plain"][0]  # before the image: the plain prompt's KV, its key
    distinct = [k for name, ks in keys.items() for k in (ks[1:] if name in late else ks)]
    assert len(set(distinct)) == len(distinct), keys  # no other key shared by any two variants

    # The node holds the plain request's blocks only: no other variant matches them.
    plain = r["plain_held"]
    assert plain["plain"] == {"matched": 96, "loads": keys["plain"]}, plain
    for name in late:
        assert plain[name] == {"matched": 32, "loads": keys["plain"][:1]}, plain
    for name, found in plain.items():
        if name != "plain" and name not in late:
            assert found == {"matched": 0, "loads": []}, (name, found)
    # Every variant's blocks held: a fresh request identical to a saved one loads exactly its blocks.
    for name, found in r["all_held"].items():
        assert found == {"matched": 96, "loads": keys[name]}, (name, found)

    schemes = r["settings"]["schemes"]
    for algo in ("sha256", "sha256_cbor"):
        assert schemes[f"{algo}/unset"] == f"{algo}, vLLM's default seed", schemes
    for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        assert schemes[f"{algo}/7"] == f"{algo}, PYTHONHASHSEED", schemes
    for algo in ("xxhash", "xxhash_cbor"):
        refusal = schemes[f"{algo}/unset"]
        assert refusal.startswith("refused: ") and "PYTHONHASHSEED" in refusal and repr(algo) in refusal, refusal
    assert r["settings"]["salt_changes"] == {"quantization": True, "revision": True}, r["settings"]
    assert st["leases"]["held"] == 0 and st["objects"] == len(distinct) == 28


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_blocks_held_on_disk_are_read_back_and_loaded_on_the_first_request(runs: Runs) -> None:
    """A prompt whose blocks the node holds only in its disk tier (as after a restart on its
    disk pools): the lookup's lease answers them PENDING while the node reads them back, the
    scheduler answers vLLM "not yet" and leases again, and the request is scheduled with both
    blocks matched and loaded, not computed."""
    r, st = runs[0]["disk"], runs[2]["disk"]
    assert r["unfinished"] is False, r
    assert r["new"] == {"loaded": {"num_computed_tokens": 64}}, r
    assert r["loads"] and r["loads"][0]["keys"] == r["loaded_keys"][:2], r
    counted = {name: sum(s.get(name, 0) for s in r["stats"]) for name in ("leases", "matched_tokens", "lookups_asked_again")}
    assert counted["leases"] == 1 and counted["matched_tokens"] == 64 and counted["lookups_asked_again"] >= 1, r
    assert r["not_yet_steps"] >= 1, r  # vLLM was told "not yet" while the node read the blocks back
    assert st["leases"]["held"] == 0 and st["disk_tier"]["promoted"] >= 2, st["disk_tier"]
