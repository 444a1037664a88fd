"""The endpoint a node binds by default, which the ``kvcr`` tool dials by default too."""

from __future__ import annotations

import os
from pathlib import Path


def default_endpoint() -> str:
    """An ipc endpoint under the runtime dir ($XDG_RUNTIME_DIR, else /tmp/kvcr-$UID)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "kvcr" if runtime else Path(f"/tmp/kvcr-{os.getuid()}")
    return f"ipc://{base / 'node.sock'}"
