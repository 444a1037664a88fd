"""The README's client example runs as written, against a real node, and delivers the bytes it put.

A newcomer copies it first: a change of the API that breaks it fails here, not on them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kvcr_client import KeyStatus
from kvcr_testing.nodes import NodeProcess

README = Path(__file__).parents[2] / "README.md"
EXAMPLE_ENDPOINT = "ipc:///tmp/kvcr-0/node.sock"


@pytest.fixture(scope="module")
def node_args() -> tuple[str, ...]:
    return ("--pool", "kv:64KiB:64")  # the pool the example names, room for its 32 spans


def example() -> str:
    """The Python block of the README's "Use it from an engine" section."""
    section = README.read_text().split("## Use it from an engine", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the section shows one example"
    return str(blocks[0])


def test_the_readme_example_puts_and_delivers_layer_by_layer(node: NodeProcess) -> None:
    code = example()
    assert EXAMPLE_ENDPOINT in code
    scope: dict[str, Any] = {}
    exec(compile(code.replace(EXAMPLE_ENDPOINT, node.endpoint), str(README), "exec"), scope)
    results = scope["handle"].result(0)
    assert results[b"prefix-hash"].status is KeyStatus.OK
    # What it delivered is what it put: the buffer was never written in between, so put
    # the same object again from a pattern and deliver it into the example's own layout.
    cache, layers, kv_class = scope["cache"], scope["layers"], scope["Client"]
    assert len(layers) == 32 and cache.nbytes == 32 * 65536
    with kv_class(node.endpoint) as kv:
        region = kv.register(cache)
        cache[:] = (1 + (scope["np"].arange(cache.nbytes) % 251)).astype(cache.dtype)
        expected = cache.copy()
        spans = [type(s)(s.name, region, s.offset, s.length, s.pool) for s in layers]
        assert kv.put({b"readme-check": spans}).result(10)[b"readme-check"].status is KeyStatus.STORED
        cache[:] = 0
        handle = kv.deliver({b"readme-check": spans}, plan=[[f"L{i}"] for i in range(32)])
        handle.wait(0, timeout=10)
        assert (cache[:65536] == expected[:65536]).all(), "layer 0 landed byte for byte when wait(0) returned"
        assert handle.result(10)[b"readme-check"].ok
        assert (cache == expected).all()
        kv.unregister(region)
