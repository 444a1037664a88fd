"""``/metrics`` over HTTP for Prometheus: one thread serving the latest snapshot's text.

The thread never touches node state: it reads the ``MetricsSnapshot`` the progress thread
last published (one reference, read once per scrape) and renders it to the text format at
most once per snapshot, so a scrape costs a few system calls and sending cached bytes; the
interpreter is held for microseconds, never for a render per scrape (architecture §4).

One thread serves every connection from a selector, non-blocking: at most
``metrics_max_connections`` are open; one more is answered 503 and closed at once. Each
connection has ``CONNECTION_TIMEOUT_S`` from its accept to send its request head and take
its reply, so slow or silent peers cost one descriptor each, for a bounded time, and never
a thread. The text comes from ``kvcr_node.metrics_text``, so the node needs no metrics
package at all.
"""

from __future__ import annotations

import enum
import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvcr_node.buckets import TokenBucket
from kvcr_node.config import ConfigError
from kvcr_node.logs import Limiter
from kvcr_node.metrics import MetricsSnapshot
from kvcr_node.metrics_text import Dropped, render, render_exporter

log = logging.getLogger("kvcr.node")

METRICS_PATH = "/metrics"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Prometheus text format, version 0.0.4."""
CONNECTION_TIMEOUT_S = 5.0
"""From its accept, how long a connection has to send its request head and take the whole
reply; past it, it is closed and counted (a slowloris peer sending a byte a second, a silent
one, or one that never reads its reply)."""
LINGER_S = 1.0
"""After a reply sent before the whole request was read (414, 431), how long what the peer
still sends is read and discarded, so that it reads the reply rather than a reset."""
MAX_REQUEST_LINE = 8192
"""Bytes of a request line; a longer one is answered 414."""
MAX_HEAD = 16384
"""Bytes of a whole request head (request line and headers); a longer one is answered 431."""
LISTEN_BACKLOG = 1024
"""Connections the kernel queues before the thread accepts them (the kernel's ``somaxconn``
may lower it): a burst of connects waits there, costing the node no descriptor, rather than
in SYN retries of a second and more."""
ACCEPTS_PER_TURN = 64
"""Connections accepted (or refused) per readiness of the listening socket, so that a flood of
connects cannot keep the thread from the connections it serves."""
ACCEPT_BACKOFF_S = 0.1
"""When accepting fails for want of descriptors, how long the listening socket is left alone."""
ACCEPTS_PER_S = 100.0
"""Connections accepted per second at most (served or refused), in bursts of up to
``ACCEPT_BURST``: what the thread does per connection is bounded, so this bounds how often it
takes the interpreter from the progress loop however busy its scrapers are (a snapshot
changes twice a second; Prometheus scrapes every few seconds). Connections beyond wait in
the kernel's queue (``LISTEN_BACKLOG``), holding no descriptor of the node."""
ACCEPT_BURST = 16
READS_PER_CONNECTION = 64
"""Reads a connection may take (its request head, then what it sends after a reply); one
more closes it, counted: a head sent a byte at a time as fast as the peer can costs a
bounded number of turns, not one per byte."""
STOP_TIMEOUT_S = 5.0
"""How long shutdown waits for the server thread to end."""
FAILURE_PAUSE_S = 0.1
"""After an unexpected failure of a whole turn, how long the thread waits before the next."""
LOG_EVERY_S = 60.0
"""At most one line per kind of trouble (connection limit, descriptors, failure) this often;
the next says how many were left out. The counters count every one."""
_RECV_BYTES = 4096

Read = Callable[[], MetricsSnapshot | None]


# --------------------------------------------------------------------------- HTTP


def _reply(status: str, body: bytes, content_type: str = "text/plain; charset=utf-8", *, head_only: bool = False,
           extra: str = "") -> bytes:
    head = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n{extra}"
            "Connection: close\r\n\r\n").encode()
    return head if head_only else head + body


REFUSED = _reply("503 Service Unavailable", b"kvcr-node: too many metrics connections; try again\n",
                 extra="Retry-After: 1\r\n")
"""What a connection past ``metrics_max_connections`` is sent before it is closed."""
NOT_FOUND = _reply("404 Not Found", f"kvcr-node serves {METRICS_PATH} only\n".encode())
BAD_REQUEST = _reply("400 Bad Request", b"kvcr-node: not an HTTP request\n")
NOT_ALLOWED = _reply("405 Method Not Allowed", b"kvcr-node: GET or HEAD only\n", extra="Allow: GET, HEAD\r\n")
URI_TOO_LONG = _reply("414 URI Too Long", f"kvcr-node: a request line has at most {MAX_REQUEST_LINE} bytes\n".encode())
HEAD_TOO_LARGE = _reply("431 Request Header Fields Too Large",
                        f"kvcr-node: a request head has at most {MAX_HEAD} bytes\n".encode())


class Stage(enum.Enum):
    READING = "reading"
    """Reading the request head."""
    WRITING = "writing"
    """Sending the reply."""
    DRAINING = "draining"
    """Reply sent and the write side shut: reading and discarding until the peer closes."""


class _Conn:
    __slots__ = ("deadline", "head", "out", "reads", "sock", "stage", "unread", "watched")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.stage = Stage.READING
        self.head = bytearray()
        self.out = memoryview(b"")
        self.deadline = deadline
        self.reads = 0
        self.watched = False
        """Registered with the selector (a connection served at its accept never is)."""
        self.unread = False
        """The peer sent (or may still send) bytes past the head: linger before closing."""


def request_line(head: bytes) -> tuple[str, str, str] | None:
    """The request line of a whole head as (method, path, version); None when it is not HTTP/1."""
    line = head.split(b"\n", 1)[0].rstrip(b"\r")
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return None
    try:
        method, target, version = (p.decode("ascii") for p in parts)
    except UnicodeDecodeError:
        return None
    return method, target.split("?", 1)[0], version


class MetricsExporter:
    """The server thread: ``/metrics`` from the latest snapshot, 404 for any other path."""

    def __init__(self, address: str, port: int, read: Read, max_connections: int = 16) -> None:
        self.read = read
        self.max_connections = max_connections
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((address, port))
            listener.listen(LISTEN_BACKLOG)
            listener.setblocking(False)
        except OSError as exc:
            listener.close()
            raise ConfigError("metrics_port", f"cannot serve on {address} port {port}: {exc.strerror or exc}") from exc
        self.listener = listener
        self.port: int = listener.getsockname()[1]
        """The port bound (the one asked for, or a free one for 0)."""
        opened: list[socket.socket | selectors.BaseSelector] = [listener]
        try:  # descriptors may run out here too: then nothing is left open
            self._wake_r, self._wake_w = socket.socketpair()
            opened += (self._wake_r, self._wake_w)
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self.selector = selectors.DefaultSelector()
            opened.append(self.selector)
            self.selector.register(listener, selectors.EVENT_READ, None)
            self.selector.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
        except BaseException:
            for thing in opened:
                thing.close()
            raise
        self.conns: dict[int, _Conn] = {}
        """Open connections by descriptor (exporter thread only)."""
        self.dropped = dict.fromkeys(Dropped, 0)
        self._limiter = Limiter(burst=1, window=LOG_EVERY_S)
        self._accepts = TokenBucket(ACCEPTS_PER_S, ACCEPT_BURST)
        self._accepting_at: float | None = None
        """While accepting is paused (the accept rate spent, or no descriptor left): when to resume."""
        self._snapshot: MetricsSnapshot | None = None
        self._text = b""
        """``render`` of ``_snapshot``: rendered once per snapshot, at its first scrape."""
        self._tail: tuple[int, ...] = ()
        self._body = b""
        """``_text`` and the exporter's families for ``_tail`` (open connections, drops)."""
        self._reply_of = b""
        self._reply = b""
        """The 200 reply (head and body) whose body is ``_reply_of``."""
        self._stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="kvcr-metrics", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ the thread

    def _serve(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    self._turn()
                except Exception:  # one bad turn must not end the exporter; the node serves on
                    self._warn("internal", "metrics exporter: unexpected failure (serving on)", exc_info=True)
                    self._stopping.wait(FAILURE_PAUSE_S)  # a failure that repeats must not spin
        finally:
            for conn in list(self.conns.values()):
                self._close(conn)
            self.selector.close()
            self.listener.close()
            self._wake_r.close()

    def _turn(self) -> None:
        now = time.monotonic()
        waits = [c.deadline for c in self.conns.values()]
        if self._accepting_at is not None:
            waits.append(self._accepting_at)
        timeout = max(0.0, min(waits) - now) if waits else None
        for key, mask in self.selector.select(timeout):
            if key.data is None:
                self._accept()
            elif key.data is self._wake_r:
                self._drain_wake()
            else:
                conn: _Conn = key.data
                try:
                    self._step(conn, mask)
                except OSError:
                    self._close(conn)  # reset, or gone: nothing to answer
                except Exception:
                    self._close(conn)
                    self._warn("internal", "metrics exporter: unexpected failure serving a connection", exc_info=True)
        now = time.monotonic()
        for conn in [c for c in self.conns.values() if c.deadline <= now]:
            if conn.stage is not Stage.DRAINING:
                self.dropped[Dropped.TIMEOUT] += 1
            self._close(conn)
        if self._accepting_at is not None and now >= self._accepting_at:
            self._accepting_at = None
            self.selector.register(self.listener, selectors.EVENT_READ, None)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(64):
                pass
        except BlockingIOError:
            pass

    def _pause_accepting(self, until: float) -> None:
        """Leave the listening socket alone until ``until``: its queue waits in the kernel."""
        if self._accepting_at is None:
            self.selector.unregister(self.listener)
        self._accepting_at = until

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            if not self._accepts.take():
                self._pause_accepting(self._accepts.next_at())
                return
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                self._accepts.give_back()
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # The connection stays queued; retrying at once would spin on a readable listener.
                    self._pause_accepting(time.monotonic() + ACCEPT_BACKOFF_S)
                    self._warn("descriptors", "metrics port: cannot accept (%s); pausing %.1f s",
                               exc.strerror, ACCEPT_BACKOFF_S)
                return  # ECONNABORTED and the like: that peer is gone already
            sock.setblocking(False)
            if len(self.conns) >= self.max_connections:
                self._refuse(sock)
                continue
            conn = _Conn(sock, time.monotonic() + CONNECTION_TIMEOUT_S)
            self.conns[sock.fileno()] = conn
            try:
                # A scraper's request is usually there by now: served without a selector round trip.
                self._step(conn, selectors.EVENT_READ)
            except BlockingIOError:
                pass
            except OSError:
                self._close(conn)
                continue
            except Exception:
                self._close(conn)
                self._warn("internal", "metrics exporter: unexpected failure serving a connection", exc_info=True)
                continue
            if conn.sock.fileno() in self.conns and not conn.watched:
                self._watch(conn, selectors.EVENT_READ)

    def _refuse(self, sock: socket.socket) -> None:
        """503 at once, without holding a descriptor beyond this call."""
        self.dropped[Dropped.LIMIT] += 1
        self._warn("limit", "metrics port: %d connections open (metrics_max_connections); answered 503",
                   len(self.conns))
        try:
            try:
                while sock.recv(_RECV_BYTES):  # read what came, so that closing sends no reset over the reply
                    pass
            except BlockingIOError:
                pass
            sock.send(REFUSED)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        sock.close()

    def _step(self, conn: _Conn, mask: int) -> None:
        if conn.stage is Stage.WRITING:
            if mask & selectors.EVENT_WRITE:
                self._send(conn)
            return
        data = conn.sock.recv(_RECV_BYTES)
        if not data:
            self._close(conn)  # the peer closed (or, draining, read our reply and left)
            return
        conn.reads += 1
        if conn.reads > READS_PER_CONNECTION:
            if conn.stage is Stage.READING:
                self.dropped[Dropped.TRICKLE] += 1
            self._close(conn)
            return
        if conn.stage is Stage.DRAINING:
            return
        conn.head += data
        end = conn.head.find(b"\r\n\r\n")
        size = end + 4 if end >= 0 else -1
        if end < 0 and (lf := conn.head.find(b"\n\n")) >= 0:
            size = lf + 2
        if size < 0:
            if b"\n" not in conn.head and len(conn.head) > MAX_REQUEST_LINE:
                self._start_reply(conn, URI_TOO_LONG, unread=True)
            elif len(conn.head) > MAX_HEAD:
                self._start_reply(conn, HEAD_TOO_LARGE, unread=True)
            return
        line_end = conn.head.find(b"\n")
        if line_end > MAX_REQUEST_LINE:
            self._start_reply(conn, URI_TOO_LONG, unread=len(conn.head) > size)
            return
        if size > MAX_HEAD:
            self._start_reply(conn, HEAD_TOO_LARGE, unread=len(conn.head) > size)
            return
        self._start_reply(conn, self._respond(bytes(conn.head[:size])), unread=len(conn.head) > size)

    def _respond(self, head: bytes) -> bytes:
        request = request_line(head)
        if request is None:
            return BAD_REQUEST
        method, path, _ = request
        if method not in ("GET", "HEAD"):
            return NOT_ALLOWED
        if path != METRICS_PATH:
            return NOT_FOUND
        body = self.body()
        if body is not self._reply_of:
            self._reply_of = body
            self._reply = _reply("200 OK", body, CONTENT_TYPE)
        return self._reply[:len(self._reply) - len(body)] if method == "HEAD" else self._reply

    def body(self) -> bytes:
        """The latest snapshot's text (rendered once per snapshot) and the exporter's own families
        (the same bytes object while neither changed)."""
        snapshot = self.read()
        tail = (len(self.conns), *self.dropped.values())
        if snapshot is not self._snapshot:
            self._snapshot = snapshot
            self._text = b"" if snapshot is None else render(snapshot)
        elif tail == self._tail:
            return self._body
        self._tail = tail
        self._body = self._text + render_exporter(len(self.conns), self.dropped)
        return self._body

    def _start_reply(self, conn: _Conn, reply: bytes, *, unread: bool) -> None:
        conn.stage = Stage.WRITING
        conn.head = bytearray()
        conn.out = memoryview(reply)
        conn.unread = unread
        self._send(conn)
        if conn.stage is Stage.WRITING and conn.sock.fileno() in self.conns:
            self._watch(conn, selectors.EVENT_WRITE)

    def _send(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.out)
        except BlockingIOError:
            return
        conn.out = conn.out[sent:]
        if conn.out:
            return
        if not conn.unread:
            self._close(conn)  # all was read: closing sends the rest of the reply, then FIN
            return
        conn.sock.shutdown(socket.SHUT_WR)
        conn.stage = Stage.DRAINING
        conn.deadline = min(conn.deadline, time.monotonic() + LINGER_S)
        self._watch(conn, selectors.EVENT_READ)

    def _watch(self, conn: _Conn, events: int) -> None:
        if conn.watched:
            self.selector.modify(conn.sock, events, conn)
        else:
            self.selector.register(conn.sock, events, conn)
            conn.watched = True

    def _close(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if self.conns.pop(fd, None) is not None and conn.watched:
            self.selector.unregister(conn.sock)
        conn.sock.close()

    def _warn(self, code: str, message: str, *args: Any, exc_info: bool = False) -> None:
        left_out = self._limiter.admit(code)
        if left_out is not None:
            suffix = f" ({left_out} more like it left out before this line)" if left_out else ""
            log.warning(message + suffix, *args, exc_info=exc_info)

    # ------------------------------------------------------------------ other threads

    def close(self) -> None:
        """Stop serving, close every connection and the listening socket, and join the thread (bounded)."""
        self._stopping.set()
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        self.thread.join(STOP_TIMEOUT_S)
        self._wake_w.close()
        if self.thread.is_alive():
            log.warning("the metrics server thread did not stop within %.0f s", STOP_TIMEOUT_S)
            self.listener.close()
