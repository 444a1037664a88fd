"""kvcr_protocol is pure: importing it pulls in no sockets, NIXL, threads or asyncio."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN_PREFIXES = ("zmq", "nixl", "nixl_cu12", "nixl_cu13", "asyncio", "concurrent", "kvcr_node", "kvcr_client")
FORBIDDEN_EXACT = {"threading", "socket", "_socket", "selectors", "select", "multiprocessing", "cupy", "torch", "numpy"}

PROBE = """
import json, sys
before = set(sys.modules)
import kvcr_protocol
import kvcr_protocol.codec, kvcr_protocol.descriptors, kvcr_protocol.projection, kvcr_protocol.versions
import kvcr_protocol.events
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_import_adds_no_io_modules() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True)
    added = json.loads(out.stdout)
    assert "kvcr_protocol" in added
    bad = [
        name
        for name in added
        if name in FORBIDDEN_EXACT or any(name == p or name.startswith(p + ".") for p in FORBIDDEN_PREFIXES)
    ]
    assert bad == [], f"importing kvcr_protocol imported {bad}"
