"""Imports run one way: protocol <- io <- node, client; node and client never import each other;
and inside the node, no module imports one that imports it back (architecture §1)."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "kvcr_protocol": ROOT / "protocol" / "kvcr_protocol",
    "kvcr_io": ROOT / "kvcr_io",
    "kvcr_node": ROOT / "kvcr_node",
    "kvcr_client": ROOT / "kvcr_client",
}
MAY_IMPORT = {
    "kvcr_protocol": set(),
    "kvcr_io": {"kvcr_protocol"},
    "kvcr_node": {"kvcr_protocol", "kvcr_io"},
    "kvcr_client": {"kvcr_protocol", "kvcr_io"},
}


def imported_packages(path: Path) -> set[str]:
    """The top-level names of every module ``path`` imports (at any depth of the file)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_imports_run_one_way(package: str) -> None:
    forbidden = set(PACKAGES) - MAY_IMPORT[package] - {package}
    breaches = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & forbidden)
        for path in sorted(PACKAGES[package].rglob("*.py"))
    }
    assert {k: v for k, v in breaches.items() if v} == {}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_node_parts_import_one_way() -> None:
    """The node's parts report upward through callbacks, never by importing the part above."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGES["kvcr_node"].rglob("*.py")):
        deps = graph.setdefault(module_name(path), set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvcr_node"):
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names if alias.name.startswith("kvcr_node"))
    try:
        order = list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"an import cycle inside kvcr_node: {exc.args[1]}")
    assert order.index("kvcr_node.records") < order.index("kvcr_node.operations") < order.index("kvcr_node.node")


def test_the_client_parts_import_one_way() -> None:
    """checks <- regions <- spans <- operations <- client, and the core's parts below the core
    (transport <- driver <- waiters <- loops, session <- actions <- core: a part is handed
    what it uses), with no cycle (architecture §1)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGES["kvcr_client"].glob("*.py")):
        deps = graph.setdefault(module_name(path), set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "kvcr_client":
                deps.update(f"kvcr_client.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvcr_client."):
                deps.add(node.module)
    graph["kvcr_client"].discard("kvcr_client")
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"an import cycle inside kvcr_client: {exc.args[1]}")
    for chain in (("checks", "regions", "spans", "operations", "client"),
                  ("transport", "driver", "waiters", "loops", "core"), ("session", "waiters", "actions", "core")):
        parts = [f"kvcr_client.{part}" for part in chain]
        upward = {part: sorted(graph[part] & set(parts[i + 1:])) for i, part in enumerate(parts)}
        assert {part: above for part, above in upward.items() if above} == {}, chain


def test_no_part_holds_a_proxy_to_the_whole() -> None:
    """A part of the client is handed what it uses (the core's parts: the driver and a
    ``Schedule`` of narrow callables), never a ``weakref.proxy`` to its owner, and no protocol
    a part names its owner by lists a private member (architecture §1)."""
    breaches: list[str] = []
    for path in sorted(PACKAGES["kvcr_client"].rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Attribute) and node.attr == "proxy" and isinstance(node.value, ast.Name) \
                    and node.value.id == "weakref":
                breaches.append(f"{rel}:{node.lineno}: weakref.proxy")
            if isinstance(node, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id == "Protocol" for b in node.bases):
                for member in node.body:
                    name = (member.name if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)) else
                            member.target.id if isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name)
                            else "")
                    if name.startswith("_") and not name.startswith("__"):
                        breaches.append(f"{rel}:{member.lineno}: {node.name}.{name}")
    assert breaches == []


ENGINE_PACKAGES = {"torch", "transformers", "vllm", "sglang", "cupy", "dynamo"}
"""Engines, their tensors and routers: only an integration imports them (cupy only the GPU paths)."""
GPU_MODULES = {"kvcr_node/gpu.py", "kvcr_client/buffers.py", "kvcr_node/memory.py"}


def test_the_core_never_imports_an_engine() -> None:
    """kvcr_client.integrations imports its engine; nothing else does, and nothing outside
    it imports an integration (the core never imports torch)."""
    breaches: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted(PACKAGES[package].rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if "/integrations/" in rel:
                continue
            names = imported_packages(path)
            allowed = {"cupy"} if rel in GPU_MODULES else set()
            bad = sorted((names & ENGINE_PACKAGES) - allowed)
            text = path.read_text()
            if "kvcr_client.integrations" in text and "import" in text:
                bad.append("kvcr_client.integrations")
            if bad:
                breaches[rel] = bad
    assert breaches == {}
