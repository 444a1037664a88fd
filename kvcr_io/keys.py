"""CurveZMQ key files: one z85 key per file; a key pair is PREFIX.pub and PREFIX.key.

Shared by the node (its own keys) and the ``kvcr`` tool (``kvcr keygen``).
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq
from zmq.utils import z85


class AuthKeyError(ValueError):
    """A key file is missing or does not hold a z85 CurveZMQ key."""


def read_key(path: str | Path) -> bytes:
    """The z85 key in ``path`` (40 characters), as bytes."""
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise AuthKeyError(f"{path}: cannot read: {exc.strerror}") from exc
    key = text.encode()
    if len(key) != 40:
        raise AuthKeyError(f"{path}: expected a 40-character z85 key, got {len(key)} characters")
    try:
        z85.decode(key)
    except ValueError as exc:
        raise AuthKeyError(f"{path}: not z85: {exc}") from exc
    return key


def write_keypair(prefix: Path) -> tuple[Path, Path]:
    """Create PREFIX.pub and PREFIX.key (the secret, readable by its owner only)."""
    public, secret = zmq.curve_keypair()
    pub_path, key_path = prefix.with_suffix(".pub"), prefix.with_suffix(".key")
    pub_path.write_text(public.decode() + "\n")
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.decode() + "\n")
    return pub_path, key_path
