"""The vLLM connector's two sides share nothing but what vLLM passes between them.

vLLM builds the connector in its scheduler process and in each worker process
(``kvcr_client.integrations.vllm``, a facade): the scheduler side (``vllm_scheduler``) and
the worker side (``vllm_worker``) may import ``vllm_common`` (the metadata, the stats type,
the settings) but never each other, nor the facade. Read from the source, so that it runs
without vLLM installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

INTEGRATIONS = Path(__file__).resolve().parents[2] / "kvcr_client" / "integrations"
SIDES = {"vllm_scheduler": {"vllm_worker", "vllm"}, "vllm_worker": {"vllm_scheduler", "vllm"}}
"""Side -> the modules of the connector it must not import."""


def imported(module: str) -> set[str]:
    """The ``kvcr_client.integrations`` modules ``module`` imports (last name of each)."""
    tree = ast.parse((INTEGRATIONS / f"{module}.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "kvcr_client.integrations":
                names.update(alias.name for alias in node.names)
            elif node.module.startswith("kvcr_client.integrations."):
                names.add(node.module.rsplit(".", 1)[1])
        elif isinstance(node, ast.Import):
            names.update(a.name.rsplit(".", 1)[1] for a in node.names if a.name.startswith("kvcr_client.integrations."))
    return names


@pytest.mark.parametrize("side", sorted(SIDES))
def test_a_side_imports_only_the_common_part(side: str) -> None:
    names = imported(side)
    assert "vllm_common" in names, names
    assert not names & SIDES[side], (side, names & SIDES[side])


def test_the_facade_builds_both_sides() -> None:
    names = imported("vllm")
    assert {"vllm_common", "vllm_scheduler", "vllm_worker"} <= names, names
