"""The benchmarks keep UCX on loopback (``bench/procs.py``): importing ``procs`` sets
``UCX_NET_DEVICES=lo`` unless the environment sets it, and every benchmark that makes a NIXL
agent or starts a node imports ``procs`` (its children inherit the setting)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"

AGENT_MODULES = ("kvcr_client", "kvcr_io", "kvcr_node.cli", "kvcr_node.node")
"""Modules through which a benchmark's process makes a NIXL agent (a client, a node, a raw one)."""


def devices_after_import(env_value: str | None) -> str:
    """``UCX_NET_DEVICES`` in a fresh interpreter after ``import procs``, started with ``env_value``."""
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    if env_value is not None:
        env["UCX_NET_DEVICES"] = env_value
    code = "import os, sys; sys.path.insert(0, sys.argv[1]); import procs; print(os.environ['UCX_NET_DEVICES'])"
    done = subprocess.run([sys.executable, "-c", code, str(BENCH)], capture_output=True, text=True, timeout=60,
                          env=env, check=True)
    return done.stdout.strip()


def test_importing_procs_sets_loopback() -> None:
    assert devices_after_import(None) == "lo"


def test_an_environment_that_names_devices_keeps_them() -> None:
    assert devices_after_import("lo,eth9") == "lo,eth9"


def imported_modules(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
    return names


def makes_agents(tree: ast.Module, modules: set[str]) -> bool:
    """Imports a module that makes agents, or starts ``kvcr_node.cli`` in a child process."""
    if any(m == a or m.startswith(f"{a}.") for m in modules for a in AGENT_MODULES):
        return True
    return any(isinstance(n, ast.Constant) and n.value == "kvcr_node.cli" for n in ast.walk(tree))


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py") if p.name != "procs.py"))
def test_every_benchmark_with_agents_imports_procs(script: str) -> None:
    tree = ast.parse((BENCH / script).read_text())
    modules = imported_modules(tree)
    if makes_agents(tree, modules):
        assert "procs" in modules, f"bench/{script} makes NIXL agents or nodes: it imports procs (UCX on loopback)"
