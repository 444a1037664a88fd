"""CurveZMQ authentication: the allow-list and the ZAP check (key files: ``kvcr_io.keys``).

Keys are z85 text (40 characters). The node's ROUTER runs as a CURVE server;
the ZAP handler (served from the progress loop, on the context's well-known inproc
endpoint) lets in only the public keys on the allow-list, and counts every refusal.
"""

from __future__ import annotations

from pathlib import Path

from zmq.utils import z85

from kvcr_io.keys import AuthKeyError

ZAP_ENDPOINT = "inproc://zeromq.zap.01"


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
