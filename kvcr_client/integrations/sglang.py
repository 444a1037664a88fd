"""SGLang: a HiCache storage backend that keeps pages in kvcr nodes.

SGLang's hierarchical cache writes pages of KV from its host memory pool to a storage
backend and reads them back by page hash. ``KvcrHiCacheStorage`` is one, loadable without
patching SGLang::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{"backend_name": "kvcr",
      "module_path": "kvcr_client.integrations.sglang", "class_name": "KvcrHiCacheStorage",
      "endpoint": "ipc:///run/kvcr/node.sock", "pool": "kv"}'

Each page is one kvcr object with one span, ``page``, in the node pool ``pool``, whose
slot size must be the page's size in bytes. Keys are the page hashes with the rank suffix
SGLang's own file backend uses (MLA pages are shared by every tensor-parallel rank).
Pages move through a staging buffer registered with NIXL once (``staging_pages`` pages),
so a call costs one copy per page on this side and no registration; ``batch_exists``
is one prefix query, which stops at the first page the node does not hold.

Zero copy (``"interface_v1": 1`` in the extra config: SGLang then calls ``batch_set_v1`` and
``batch_get_v1`` with host indices): the host pool's KV buffers are registered once, when
SGLang hands the backend its pool (``register_mem_pool_host``), and each page is put (written
by the client under a write grant where the node grants them, spec section 6.13, else deposited)
from, or delivered into, the host pool itself, one span per pointer the pool gives for a
page (``get_page_buffer_meta``: ``k`` and ``v`` in the page-first layouts, ``L{i}.k`` and
``L{i}.v`` per layer in the layer-first one). The pool's slot size must then be one such
span: layers x page tokens x KV heads x head dim x element size in the page-first layout.

Read grants (spec section 6.12): SGLang looks pages up with ``batch_exists``, which holds
nothing, so each get first takes a read lease of its pages in the backend's own session
(``ReadLeases``) and releases it once they landed. Where the node grants them, the pages
are READ from the node's pools by this backend's agent (counted in ``get_granted``); the
pages it does not grant (not held) and every page of a node that grants none
(``client_transfers = false``, below version 5) the node delivers, as before. A page whose
read its lease may not have covered fails (``LEASE_EXPIRED``, ``LEASE_LOST``) and reads as
missing: SGLang computes it again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvcr_client.client import Client, RegionHandle, Span
from kvcr_client.errors import KvcrError
from kvcr_client.integrations.readleases import ReadLeases

log = logging.getLogger("kvcr.sglang")

DEFAULT_STAGING_PAGES = 64
CALL_TIMEOUT_S = 30.0
SPAN = "page"
V1_BATCH_PAGES = 64
"""Pages per deposit or deliver in the zero-copy calls (a message's key count stays small)."""


class KvcrHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """HiCache pages in a kvcr node: ``set``/``get``/``exists`` and their batches."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = storage_config.extra_config or {}
        if "endpoint" not in extra:
            raise ValueError("the kvcr backend needs extra_config['endpoint'], the node's endpoint")
        self.pool = str(extra.get("pool", "kv"))
        self.staging_pages = int(extra.get("staging_pages", DEFAULT_STAGING_PAGES))
        model = "-".join((storage_config.model_name or "").split("/"))
        rank = "" if storage_config.is_mla_model else f"_{storage_config.tp_rank}_{storage_config.tp_size}"
        self.suffix = f"_{model}{rank}".encode()
        self.client = Client(str(extra["endpoint"]), name=f"sglang-hicache-{storage_config.tp_rank}")
        self._lock = threading.Lock()
        """SGLang calls from its prefetch and backup threads: one call at a time uses the staging buffer."""
        self._staging: np.ndarray | None = None
        self._region: RegionHandle | None = None
        self._page_bytes = 0
        self._host: Any = None
        self._host_regions: list[tuple[int, int, RegionHandle]] = []
        """(start address, end address, region) of each host pool buffer, for zero copy."""
        self.reads = ReadLeases(self.client)
        self.counters = {"set": 0, "set_failed": 0, "get": 0, "get_missed": 0, "get_granted": 0}
        """``get_granted``: pages of ``get`` READ under read grants (the rest the node delivered)."""

    # ------------------------------------------------------------------ staging

    def _key(self, key: str) -> bytes:
        return key.encode() + self.suffix

    def _stage(self, page_bytes: int) -> tuple[np.ndarray, RegionHandle]:
        """The staging buffer for pages of ``page_bytes`` (made, and registered, once)."""
        if self._staging is None or self._region is None or self._page_bytes != page_bytes:
            if self._region is not None:
                self.client.unregister(self._region)
            self._staging = np.zeros(self.staging_pages * page_bytes, dtype=np.uint8)
            self._region = self.client.register(self._staging)
            self._page_bytes = page_bytes
        return self._staging, self._region

    @staticmethod
    def _bytes(tensor: torch.Tensor) -> np.ndarray:
        data: np.ndarray = tensor.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy()
        return data

    # ------------------------------------------------------------------ the interface

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: Sequence[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store every page; True when the node holds all of them afterwards (stored now or before)."""
        if not keys:
            return True
        pages = [self._bytes(v) for v in values]
        size = pages[0].nbytes
        if any(p.nbytes != size for p in pages):
            log.warning("kvcr: pages of different sizes in one batch; nothing stored")
            return False
        ok = True
        with self._lock:
            staging, region = self._stage(size)
            for start in range(0, len(keys), self.staging_pages):
                chunk = range(start, min(start + self.staging_pages, len(keys)))
                for slot, i in enumerate(chunk):
                    staging[slot * size : (slot + 1) * size] = pages[i]
                objects = {self._key(keys[i]): [Span(SPAN, region, slot * size, size, self.pool)]
                           for slot, i in enumerate(chunk)}
                try:
                    # A batch is one chain of pages: each stored with the page before it as its parent.
                    results = self.client.put(objects, parents=self._parents(keys, chunk, None)).result(CALL_TIMEOUT_S)
                except KvcrError as exc:
                    log.warning("kvcr: deposit of %d pages failed: %s", len(chunk), exc)
                    ok = False
                    continue
                stored = sum(1 for r in results.values() if r.ok)
                self.counters["set"] += stored
                self.counters["set_failed"] += len(chunk) - stored
                ok = ok and stored == len(chunk)
        return ok

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: Sequence[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Fill each target with its page; None for a page the node does not hold."""
        if not keys:
            return []
        targets = list(target_locations)
        out: list[torch.Tensor | None] = [None] * len(keys)
        size = targets[0].numel() * targets[0].element_size()
        with self._lock:
            staging, region = self._stage(size)
            for start in range(0, len(keys), self.staging_pages):
                chunk = list(range(start, min(start + self.staging_pages, len(keys))))
                objects = {self._key(keys[i]): [Span(SPAN, region, slot * size, size)] for slot, i in enumerate(chunk)}
                try:
                    results = self._deliver(objects)
                except KvcrError as exc:
                    log.warning("kvcr: deliver of %d pages failed: %s", len(chunk), exc)
                    continue
                for slot, i in enumerate(chunk):
                    if results[self._key(keys[i])]:
                        view = targets[i].view(torch.uint8).reshape(-1)
                        view.copy_(torch.from_numpy(staging[slot * size : (slot + 1) * size]))
                        out[i] = targets[i]
                        self.counters["get"] += 1
                    else:
                        self.counters["get_missed"] += 1
        return out

    def _deliver(self, objects: dict[bytes, list[Span]]) -> dict[bytes, bool]:
        """Deliver pages, whether each landed: those a read lease of this session grants by
        READs under it, the rest by the node; the lease ends once every page is over."""
        lease = self.reads.lease(list(objects))
        try:
            granted = {k: v for k, v in objects.items() if lease is not None and k in lease.granted}
            rest = {k: v for k, v in objects.items() if k not in granted}
            ops = []
            if granted:
                op, read = self.reads.deliver(lambda: self.client.deliver(granted))
                ops.append((op, read))
            if rest:
                ops.append(self.reads.deliver(lambda: self.client.deliver(rest)))
            out: dict[bytes, bool] = {}
            for op, read in ops:
                results = op.result(CALL_TIMEOUT_S)
                for key in results:
                    out[key] = results[key].ok
                    self.counters["get_granted"] += int(read and out[key])
            return out
        finally:
            self.reads.release(lease)

    # ------------------------------------------------------------------ zero copy

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Register the host pool's KV buffers with NIXL once: pages then move in place."""
        super().register_mem_pool_host(mem_pool_host)
        self._unregister_host()
        buffers = (mem_pool_host.get_hybrid_pool_buffer() if hasattr(mem_pool_host, "get_hybrid_pool_buffer")
                   else [mem_pool_host.kv_buffer])
        for tensor in buffers:
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise ValueError("kvcr: the host pool's KV buffers must be contiguous host memory")
            data = tensor.view(torch.uint8).reshape(-1).numpy()
            start = tensor.data_ptr()
            self._host_regions.append((start, start + data.nbytes, self.client.register(data)))
        self._host = mem_pool_host

    def _unregister_host(self) -> None:
        for _, _, region in self._host_regions:
            self.client.unregister(region)
        self._host_regions = []
        self._host = None

    def _page_spans(self, host_indices: torch.Tensor, pages: int, pool: str) -> list[list[Span]]:
        """Each page's spans in the registered host pool (its pointers, in the pool's order)."""
        if self._host is None:
            raise RuntimeError("kvcr: zero-copy calls need register_mem_pool_host first")
        ptrs, sizes = self._host.get_page_buffer_meta(host_indices)
        per_page = len(ptrs) // pages if pages else 0
        if per_page == 0 or per_page * pages != len(ptrs):
            raise ValueError(f"kvcr: {len(ptrs)} pointers for {pages} pages")
        names = ["k", "v"] if per_page == 2 else [f"L{i // 2}.{'kv'[i % 2]}" for i in range(per_page)]
        spans: list[list[Span]] = []
        for p in range(pages):
            page = []
            for j in range(per_page):
                ptr, size = int(ptrs[p * per_page + j]), int(sizes[p * per_page + j])
                start, _, region = next((r for r in self._host_regions if r[0] <= ptr and ptr + size <= r[1]),
                                        (0, 0, None))
                if region is None:
                    raise ValueError(f"kvcr: page {p} span {names[j]} lies outside the registered host pool")
                page.append(Span(names[j], region, ptr - start, size, pool))
            spans.append(page)
        return spans

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store each page straight from the host pool; True for a page the node now holds.
        ``extra_info.prefix_keys`` and ``keys`` are one chain of pages: each page is stored
        with the one before as its parent (spec section 6.4, "Parents")."""
        prefix = extra_info.prefix_keys if extra_info is not None else None
        return self._move_pages(keys, host_indices, deliver=False, before=prefix[-1] if prefix else None)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Deliver each page straight into the host pool; False for a page the node does not hold."""
        return self._move_pages(keys, host_indices, deliver=True)

    def _move_pages(self, keys: list[str], host_indices: torch.Tensor, deliver: bool,
                    before: str | None = None) -> list[bool]:
        """Deposit (or deliver) pages in place, ``V1_BATCH_PAGES`` a message; one outcome a
        page. A deposit names each page's parent: the page before it, ``before`` for the first."""
        out = [False] * len(keys)
        spans = self._page_spans(host_indices, len(keys), "" if deliver else self.pool)
        done, missed = ("get", "get_missed") if deliver else ("set", "set_failed")
        for start in range(0, len(keys), V1_BATCH_PAGES):
            chunk = range(start, min(start + V1_BATCH_PAGES, len(keys)))
            objects = {self._key(keys[i]): spans[i] for i in chunk}
            try:
                parents = {} if deliver else self._parents(keys, chunk, before)
                results = (self._deliver(objects) if deliver else
                           {k: r.ok for k, r in self.client.put(objects, parents=parents).result(CALL_TIMEOUT_S).items()})
            except KvcrError as exc:
                log.warning("kvcr: %s of %d pages failed: %s", "deliver" if deliver else "deposit", len(chunk), exc)
                self.counters[missed] += len(chunk)
                continue
            for i in chunk:
                out[i] = results[self._key(keys[i])]
                self.counters[done if out[i] else missed] += 1
        return out

    # ------------------------------------------------------------------ presence

    def _parents(self, keys: Sequence[str], chunk: range, before: str | None) -> dict[bytes, bytes]:
        """The parents of the pages ``chunk`` of one chain ``keys``: each the page before it,
        and ``before`` (a page stored earlier, or none) for the chain's first."""
        parents = {}
        for i in chunk:
            parent = keys[i - 1] if i else before
            if parent is not None and parent != keys[i]:
                parents[self._key(keys[i])] = self._key(parent)
        return parents

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many pages in a row, from the first, the node holds (one prefix query)."""
        if not keys:
            return 0
        count: int = self.client.query_prefix([self._key(k) for k in keys]).result(CALL_TIMEOUT_S)
        return count

    def clear(self) -> None:
        """Nothing to clear here: the node's pool is shared and evicts by its own policy."""

    def get_stats(self) -> dict[str, int]:
        return dict(self.counters)

    def close(self) -> None:
        self.reads.close()
        self._unregister_host()
        if self._region is not None:
            self.client.unregister(self._region)
            self._region = None
        self.client.close()
