"""CurveZMQ authentication: the allow-list and the ZAP check (key files: ``kvcr_io.keys``).

Keys are z85 text (40 characters). The node's ROUTER runs as a CURVE server;
the ZAP handler (served from the progress loop, on the context's well-known inproc
endpoint) lets in only the public keys on the allow-list, and counts every refusal.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, cast

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from kvcr_io.keys import AuthKeyError, read_key
from kvcr_io.zmq_flags import EVENTS as _EVENTS
from kvcr_io.zmq_flags import NOBLOCK as _NOBLOCK
from kvcr_io.zmq_flags import POLLIN as _POLLIN
from kvcr_node.config import NodeConfig
from kvcr_node.counters import Count, Counters

log = logging.getLogger("kvcr.node")

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


class CurveServer:
    """The node's ROUTER as a CURVE server, with the ZAP handler it needs.

    ZeroMQ asks the ZAP handler (a REP socket on the context's well-known inproc endpoint)
    about every connection; the progress loop serves it (``serve``), so no thread is
    needed. A client that does not speak CURVE never reaches ZAP: a monitor on the ROUTER
    counts its failed handshake. Its sockets go into the loop's poller (``sockets``).
    """

    def __init__(self, context: zmq.Context[Any], router: zmq.Socket[bytes], config: NodeConfig, counters: Counters) -> None:
        self.counters = counters
        self.secret = read_key(config.curve_secret_key)
        self.public = read_key(config.curve_public_key)
        self.peer = read_key(config.curve_peer_key) if config.curve_peer_key else self.public
        """The key peer nodes serve with (by default our own: one key pair for the cluster)."""
        self.allowed = read_allow_list(config.curve_allow)
        self.router = router
        # The ZAP handler must be bound before the ROUTER accepts anyone.
        self.zap: zmq.Socket[bytes] = context.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind(ZAP_ENDPOINT)
        router.setsockopt(zmq.CURVE_SERVER, 1)
        router.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        router.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        router.setsockopt(zmq.ZAP_DOMAIN, b"kvcr")
        self.monitor = router.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )

    @property
    def sockets(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        return (self.zap, self.monitor)

    @property
    def peer_keys(self) -> tuple[bytes, bytes, bytes]:
        """(the peers' server key, our public key, our secret key), for links to other nodes."""
        return (self.peer, self.public, self.secret)

    def serve(self, ready: Any) -> None:
        """Answer pending ZAP requests and count failed handshakes, for the sockets in ``ready``."""
        if self.zap in ready:
            self._serve_zap()
        if self.monitor in ready:
            self._drain_monitor()

    def _serve_zap(self) -> None:
        while cast(int, self.zap.getsockopt(_EVENTS)) & _POLLIN:
            request = self.zap.recv_multipart(_NOBLOCK)
            reply, user = zap_reply(request, self.allowed)
            if user is not None:
                self.counters.inc(Count.AUTH_ACCEPTED)
            else:
                self.counters.inc(Count.AUTH_REFUSED)
                key = z85.encode(request[6]).decode() if len(request) > 6 and len(request[6]) == 32 else "(none)"
                log.warning("refused a connection: CURVE key %s is not on the allow-list", key)
            self.zap.send_multipart(reply)

    def _drain_monitor(self) -> None:
        while cast(int, self.monitor.getsockopt(_EVENTS)) & _POLLIN:
            event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            if event["event"] in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                self.counters.inc(Count.AUTH_HANDSHAKE_FAILED)
                log.warning("refused a connection that failed the CURVE handshake")

    def close(self) -> None:
        self.router.disable_monitor()
        self.monitor.close(0)
        self.zap.close(0)
