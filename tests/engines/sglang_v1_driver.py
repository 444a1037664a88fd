"""SGLang's zero-copy HiCache calls (``batch_set_v1``/``batch_get_v1``) against a real host pool.

Run in the engine environment as ``python sglang_v1_driver.py ENDPOINT``; prints one JSON
line for ``test_sglang_v1.py``. SGLang's factory makes the backend (``dynamic``, with
``interface_v1`` as a server would be configured); the host pool is SGLang's own
``MHATokenToKVPoolHost`` in the page-first layout, made from a real ``MHATokenToKVPool``
on the CPU, and handed to the backend as SGLang's cache controller does
(``register_mem_pool_host``). Pages are stored from one part of the pool and delivered into
another; the bytes are compared exactly, and every byte outside the destinations is
checked untouched.

SGLang's memory pools import its model configs, which import torchvision. The only
torchvision for torch 2.13 here is a CUDA build: its C++ ops cannot load against the CPU
torch, and its import then stops registering fake kernels for two of them. With a CPU torch
the driver declares those two operators' schemas first, so torchvision's Python part
imports; nothing here calls a torchvision operator. ``scripts/engines_env.sh`` installs
torchvision and SGLang's other import-time needs into ``<engine venv>/hicache-extras``
(``KVCR_HICACHE_EXTRAS`` names another folder), outside the environment's own packages.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

EXTRAS = os.environ.get("KVCR_HICACHE_EXTRAS") or str(Path(sys.prefix) / "hicache-extras")
sys.path.insert(0, EXTRAS)
if torch.version.cuda is None:
    for op in ("nms", "qnms"):
        torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

PAGE = 16
LAYERS = 4
HEADS = 2
HEAD_DIM = 32
DEVICE_TOKENS = 256
PAGES = 10
SOURCE = 0
"""Host pages stored."""
DESTINATION = 20
"""Host pages delivered into (PAGES + 1: the last for a page never stored)."""
SENTINEL = 0xA5


def host_pool() -> MHATokenToKVPoolHost:
    device = MHATokenToKVPool(size=DEVICE_TOKENS, page_size=PAGE, dtype=torch.float32, head_num=HEADS,
                              head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                              enable_alt_stream=False)
    return MHATokenToKVPoolHost(device._mha_buffer_info(), host_to_device_ratio=2.0, host_size=0, page_size=PAGE,
                                layout="page_first", pin_memory=False, device="cpu",
                                device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=LAYERS)


def indices(first_page: int, pages: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + pages) * PAGE, dtype=torch.int64)


def main() -> int:
    endpoint = sys.argv[1]
    host = host_pool()
    raw = host.kv_buffer.view(torch.uint8)  # [2, tokens, layers, heads, head_dim * 4]: K and V, page-first
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(7)))
    dst = slice(DESTINATION * PAGE, (DESTINATION + PAGES + 1) * PAGE)
    raw[:, dst] = SENTINEL
    before = raw.clone()
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="example/model",
        extra_config={"backend_name": "kvcr", "module_path": "kvcr_client.integrations.sglang",
                      "class_name": "KvcrHiCacheStorage", "endpoint": endpoint, "pool": "kv", "interface_v1": 1},
    )
    storage = StorageBackendFactory.create_backend("dynamic", config, None)
    assert isinstance(storage, HiCacheStorage)
    storage.register_mem_pool_host(host)
    keys = [f"page-{i:04d}" for i in range(PAGES)]
    ptrs, sizes = host.get_page_buffer_meta(indices(SOURCE, 1))
    report: dict[str, object] = {"backend": type(storage).__name__, "span_bytes": sorted(set(sizes)),
                                 "spans_per_page": len(ptrs), "host_pages": host.size // PAGE}
    report["set"] = storage.batch_set_v1(keys, indices(SOURCE, PAGES))
    report["set_again"] = storage.batch_set_v1(keys[:2], indices(SOURCE, 2))
    report["exists"] = storage.batch_exists(keys)
    report["get"] = storage.batch_get_v1([*keys, "never-stored"], indices(DESTINATION, PAGES + 1))
    src = slice(SOURCE * PAGE, (SOURCE + PAGES) * PAGE)
    got = slice(DESTINATION * PAGE, (DESTINATION + PAGES) * PAGE)
    report["pages_equal"] = bool(torch.equal(raw[:, got], before[:, src]))
    missing = slice((DESTINATION + PAGES) * PAGE, (DESTINATION + PAGES + 1) * PAGE)
    report["missing_untouched"] = bool(torch.equal(raw[:, missing], before[:, missing]))
    outside = torch.ones(raw.shape[1], dtype=torch.bool)
    outside[got] = False
    report["rest_untouched"] = bool(torch.equal(raw[:, outside], before[:, outside]))
    # Page 3 of the destination per layer and K/V, as SGLang's own per-layer views read it
    # (as int32: random bytes make NaNs, which no float comparison calls equal).
    report["layer_views_equal"] = all(
        torch.equal(refs[layer][(DESTINATION + 3) * PAGE : (DESTINATION + 4) * PAGE].view(torch.int32),
                    refs[layer][(SOURCE + 3) * PAGE : (SOURCE + 4) * PAGE].view(torch.int32))
        for refs in (host.k_data_refs, host.v_data_refs) for layer in range(LAYERS))
    report["stats"] = storage.get_stats()
    storage.close()
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
