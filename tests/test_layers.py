"""Imports run one way: protocol <- io <- node, client; node and client never import each other."""

from __future__ import annotations

import ast
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
