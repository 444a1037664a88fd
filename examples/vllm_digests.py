"""A ``BlockObserver`` that keeps the SHA-256 of each block's bytes in vLLM's cache.

``examples/vllm_prefix.py`` names it in the connector's extra config
(``"block_observer": "vllm_digests:BlockDigests"``; this folder is on ``sys.path`` when the
example runs). vLLM's engine runs in the example's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so its worker's observer and the example see the
same tables: block key (hex) -> digest as saved, and as loaded once every layer landed, so
that a run proves the bytes the model read are the bytes another engine computed.
"""

from __future__ import annotations

import hashlib
from typing import ClassVar

from kvcr_client.integrations.vllm import BlockObserver

KEPT = 4096
"""Blocks each table keeps (the latest)."""


class BlockDigests(BlockObserver):
    """Digests of the blocks saved and loaded in this process, over every layer in span order."""

    saved_digests: ClassVar[dict[str, str]] = {}
    loaded_digests: ClassVar[dict[str, str]] = {}

    def saved(self, key: bytes, parts: list[memoryview]) -> None:
        self._keep(self.saved_digests, key, parts)

    def loaded(self, key: bytes, parts: list[memoryview]) -> None:
        self._keep(self.loaded_digests, key, parts)

    @staticmethod
    def _keep(table: dict[str, str], key: bytes, parts: list[memoryview]) -> None:
        h = hashlib.sha256()
        for part in parts:
            h.update(part)
        table[key.hex()] = h.hexdigest()
        while len(table) > KEPT:
            del table[next(iter(table))]
