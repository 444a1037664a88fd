"""SGLang's HiCache storage interface served by a kvcr node.

SGLang creates the backend itself, through its storage backend factory with the
``dynamic`` backend (what ``--hicache-storage-backend dynamic`` does), from the class
path in the extra config. Pages of patterned KV go in (``batch_set``, ``set``), come back
into other memory (``batch_get``, ``get``) byte for byte, ``batch_exists`` counts the pages
held in a row, and a page never stored reads as missing. Prints one JSON line.

Run against a node whose pool slot is one page (32 KiB here):

    kvcr-node --endpoint ipc:///tmp/n.sock --pool kv:32KiB:256 &
    .venv-engines/bin/python examples/sglang_hicache.py --node ipc:///tmp/n.sock
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

PAGE_SHAPE = (2, 2, 16, 4, 64)
"""K and V, 2 layers, a page of 16 tokens, 4 KV heads, head dim 64, in bfloat16: 32 KiB."""
PAGES = 100


def page(i: int) -> torch.Tensor:
    """A patterned page (never zeros): every page differs from every other."""
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(PAGE_SHAPE, generator=g).to(torch.bfloat16)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--node", required=True, help="the endpoint of the kvcr node")
    args = parser.parse_args()
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="example/model",
        extra_config={"backend_name": "kvcr", "module_path": "kvcr_client.integrations.sglang",
                      "class_name": "KvcrHiCacheStorage", "endpoint": args.node, "pool": "kv", "staging_pages": 32},
    )
    storage = StorageBackendFactory.create_backend("dynamic", config, None)
    assert isinstance(storage, HiCacheStorage)
    keys = [f"page-{i:04d}" for i in range(PAGES)]
    values = [page(i) for i in range(PAGES)]
    report: dict[str, object] = {"backend": type(storage).__name__}
    report["batch_set"] = storage.batch_set(keys[:90], values[:90])
    report["set"] = storage.set(keys[90], values[90])
    report["set_again"] = storage.set(keys[0], values[0])  # already held: still True
    report["batch_exists_all"] = storage.batch_exists(keys[:91])
    report["batch_exists_gap"] = storage.batch_exists([*keys[:10], "never-stored", *keys[10:20]])
    report["exists_missing"] = storage.exists("never-stored")
    targets = [torch.zeros(PAGE_SHAPE, dtype=torch.bfloat16) for _ in range(91)]
    got = storage.batch_get(keys[:91], targets)
    report["batch_get_equal"] = all(g is not None and torch.equal(g, v) for g, v in zip(got, values[:91], strict=True))
    one = storage.get(keys[42], torch.zeros(PAGE_SHAPE, dtype=torch.bfloat16))
    report["get_equal"] = one is not None and torch.equal(one, values[42])
    report["get_missing"] = storage.get("never-stored", torch.zeros(PAGE_SHAPE, dtype=torch.bfloat16)) is None
    mixed = storage.batch_get([keys[1], "never-stored", keys[2]], [torch.zeros(PAGE_SHAPE, dtype=torch.bfloat16)] * 3)
    report["batch_get_mixed"] = [m is not None for m in mixed]
    report["stats"] = storage.get_stats()
    storage.close()
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
