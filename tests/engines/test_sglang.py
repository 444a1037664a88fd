"""SGLang's HiCache storage interface against a real kvcr node (``kvcr_client.integrations.sglang``).

SGLang's own storage backend factory creates the backend (the ``dynamic`` backend, as
``--hicache-storage-backend dynamic`` does); pages go in and come back byte for byte,
``batch_exists`` counts the pages held in a row, a page never stored reads as missing, and
the node ends clean. The engine side runs ``examples/sglang_hicache.py`` in the engine
environment (``scripts/engines_env.sh``; skipped outside CI without it).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcr_client import Client
from kvcr_testing.health import assert_clean
from kvcr_testing.nodes import NodeProcess

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PY = ROOT / os.environ.get("KVCR_ENGINES_VENV", ".venv-engines") / "bin" / "python"
EXAMPLE = ROOT / "examples" / "sglang_hicache.py"
TIMEOUT_S = 120.0

if not ENGINE_PY.exists():
    if os.environ.get("CI"):
        pytest.fail(f"CI needs the engine environment {ENGINE_PY}: .ci/run makes it with scripts/engines_env.sh",
                    pytrace=False)
    pytest.skip(f"no engine environment at {ENGINE_PY}: run scripts/engines_env.sh", allow_module_level=True)


def run(*args: str) -> dict[str, Any]:
    proc = subprocess.run([str(ENGINE_PY), str(EXAMPLE), *args], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_hicache_pages_round_trip_byte_exact(node_factory: Callable[..., NodeProcess]) -> None:
    node = node_factory("--pool", "kv:32KiB:256")
    r = run("--node", node.endpoint)
    assert r["backend"] == "KvcrHiCacheStorage"
    assert r["batch_set"] is True and r["set"] is True and r["set_again"] is True, r
    assert r["batch_exists_all"] == 91 and r["batch_exists_gap"] == 10 and r["exists_missing"] is False, r
    assert r["batch_get_equal"] is True and r["get_equal"] is True and r["get_missing"] is True, r
    assert r["batch_get_mixed"] == [True, False, True], r
    assert r["stats"] == {"set": 92, "set_failed": 0, "get": 94, "get_missed": 2}, r
    with Client(node.endpoint, name="sglang-check") as c:
        st = assert_clean(c)
        assert st["objects"] == 91
