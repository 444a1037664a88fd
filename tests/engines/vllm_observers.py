"""Block observers for ``vllm_roles_driver.py``, named in the connector's extra config
(``"block_observer": "vllm_observers:Exploding"``): a module of their own, so that the
worker imports the very classes the driver reads."""

from __future__ import annotations

from kvcr_client.integrations.vllm import BlockObserver


class NeedsArguments(BlockObserver):
    """Cannot be made without arguments: refused."""

    def __init__(self, table: dict[str, str]) -> None:
        self.table = table


class Exploding(BlockObserver):
    """Raises on every block shown to it: it must change no outcome."""

    calls = 0

    def saved(self, key: bytes, parts: list[memoryview]) -> None:
        type(self).calls += 1
        raise RuntimeError("observer failure")

    def loaded(self, key: bytes, parts: list[memoryview]) -> None:
        type(self).calls += 1
        raise RuntimeError("observer failure")
