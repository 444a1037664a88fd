"""CurveZMQ authentication: key files and the ZAP allow-list check.

Keys are z85 text (40 characters) in files. The node's ROUTER runs as a CURVE server;
the ZAP handler (served from the progress loop, on the context's well-known inproc
endpoint) lets in only the public keys on the allow-list, and counts every refusal.
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq
from zmq.utils import z85

ZAP_ENDPOINT = "inproc://zeromq.zap.01"


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


def read_allow_list(path: str | Path) -> frozenset[bytes]:
    """Allowed public keys, one z85 key per line, optionally followed by a name.

    Blank lines and lines starting with ``#`` are skipped (``#`` is a z85 character, so
    comments are whole lines only).
    """
    keys = set()
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        text = stripped.split()[0]
        if len(text) != 40:
            raise AuthKeyError(f"{path}:{n}: expected a 40-character z85 key")
        keys.add(text.encode())
    return frozenset(keys)


def write_keypair(prefix: Path) -> tuple[Path, Path]:
    """Create PREFIX.pub and PREFIX.key (the secret, readable by its owner only)."""
    public, secret = zmq.curve_keypair()
    pub_path, key_path = prefix.with_suffix(".pub"), prefix.with_suffix(".key")
    pub_path.write_text(public.decode() + "\n")
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.decode() + "\n")
    return pub_path, key_path


def zap_reply(frames: list[bytes], allowed: frozenset[bytes]) -> tuple[list[bytes], bytes | None]:
    """Answer one ZAP request (RFC 27): 200 for an allowed CURVE key, 400 otherwise.

    Returns the reply frames and the client's key (z85) when it is allowed, else None.
    """
    # version, request id, domain, address, identity, mechanism, credentials...
    if len(frames) < 6:
        return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""], None
    version, request_id, _domain, _address, _identity, mechanism = frames[:6]
    ok = False
    user = b""
    if mechanism == b"CURVE" and len(frames) >= 7 and len(frames[6]) == 32:
        user = z85.encode(frames[6])
        ok = user in allowed
    status, text = (b"200", b"OK") if ok else (b"400", b"key not allowed")
    return [version, request_id, status, text, user if ok else b"", b""], (user if ok else None)
