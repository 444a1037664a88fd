"""The metrics port of a real node under slow, silent and hostile peers (architecture §4).

A thousand sockets that send a byte a second, or nothing, against ``--metrics-port`` on a
node limited to 1,024 descriptors: the node's threads do not grow, its descriptors stay
within the connection cap, a new engine client is served byte-exact meanwhile, every slow
socket is refused or dropped, a real scrape then succeeds and counts them, and once all is
closed the descriptors are back where they started. Past the connection cap a scraper gets
503 at once; hostile request heads get 414, 431, 405 or 400 and the node serves on.
"""

from __future__ import annotations

import errno
import resource
import socket
import urllib.error
from collections.abc import Callable, Iterator

import pytest

from kvcr_client import Client, KeyStatus
from kvcr_testing.health import assert_clean, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Registrar, StoredObject, plain_layout
from kvcr_testing.measure import FD_SLACK, fd_count, thread_count
from kvcr_testing.nodes import NodeProcess
from kvcr_testing.patterns import KiB, assert_bytes_equal
from kvcr_testing.scrape import PUBLISHED_S, get, metrics_port, raw_request, sample, scrape, settled

SLOT = 4 * KiB
POOL = ("--pool", f"kv:{SLOT}:64")
LAYOUT = plain_layout(4, size=SLOT)
SLOW_SOCKETS = 1000
NODE_FD_LIMIT = 1024
"""The node's descriptor limit in the flood test (the one a thousand threads exhausted)."""
MAX_CONNECTIONS = 16
"""The node's default ``metrics_max_connections``."""
CONNECTION_TIMEOUT_S = 5.0
"""The exporter's ``CONNECTION_TIMEOUT_S``: how long a slow socket may hold a slot."""
DRIBBLE_S = 1.0
"""One byte per slow socket per this long."""
FLOOD_END_S = 60.0
"""A bound on the time until the node has refused or dropped every slow socket (about 10 s:
it accepts 100 a second, and drops the ones in its slots after ``CONNECTION_TIMEOUT_S``;
longer where the kernel's ``somaxconn`` is below the listen backlog and connects wait in
SYN retries)."""
CLIENT_FDS = 16
"""Descriptors a connected engine client may cost the node (its socket, NIXL's connection)."""
SLOW_HEAD = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: " + b"s" * 200 + b"\r\n\r\n"
"""What a slow socket sends, a byte at a time: it never gets to its end within the timeout."""


class SlowPeers:
    """Non-blocking sockets to the metrics port: the ``dribbling`` ones send a byte of
    ``SLOW_HEAD`` per ``step``, the others nothing. Each ends when the node answers 503,
    closes it or resets it; it is then closed here too."""

    def __init__(self, port: int, count: int) -> None:
        self.live: dict[socket.socket, int] = {}
        """Socket -> bytes of ``SLOW_HEAD`` sent (-1: silent)."""
        self.refused = self.closed = 0
        for i in range(count):
            sock = socket.socket()
            sock.setblocking(False)
            err = sock.connect_ex(("127.0.0.1", port))
            assert err in (0, errno.EINPROGRESS), errno.errorcode.get(err, err)
            self.live[sock] = 0 if i % 2 else -1

    def step(self) -> int:
        """Send a byte on each dribbling socket and read what came back; the sockets left open."""
        for sock, sent in list(self.live.items()):
            if 0 <= sent < len(SLOW_HEAD):
                try:
                    self.live[sock] += sock.send(SLOW_HEAD[sent:sent + 1])
                except (BlockingIOError, InterruptedError):
                    pass  # not connected yet (still in the kernel's SYN retries)
                except OSError as exc:
                    if exc.errno != errno.ENOTCONN:
                        self._end(sock, refused=False)
                        continue
            try:
                data = sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                if exc.errno == errno.ENOTCONN:
                    continue
                data = b""
            self._end(sock, refused=data.startswith(b"HTTP/1.1 503 "))
        return len(self.live)

    def _end(self, sock: socket.socket, *, refused: bool) -> None:
        del self.live[sock]
        sock.close()
        self.refused += refused
        self.closed += not refused

    def close(self) -> None:
        for sock in self.live:
            sock.close()
        self.live.clear()


@pytest.fixture
def fd_headroom() -> Iterator[int]:
    """Descriptors this process may open for slow sockets (its soft limit raised towards the
    hard one when it is too low for ``SLOW_SOCKETS``; restored afterwards)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = fd_count() + SLOW_SOCKETS + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        yield (SLOW_SOCKETS + 256 if now == resource.RLIM_INFINITY else now - fd_count() - 256)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def limited(node: NodeProcess, fds: int) -> NodeProcess:
    """Lower a running node's descriptor limit (as an operator's ``ulimit -n`` would)."""
    resource.prlimit(node.proc.pid, resource.RLIMIT_NOFILE, (fds, fds))
    return node


def test_a_thousand_slow_sockets_cost_no_thread_and_bounded_descriptors(
        node_factory: Callable[..., NodeProcess], fd_headroom: int) -> None:
    count = min(SLOW_SOCKETS, fd_headroom)
    assert count >= 200, f"this machine leaves {fd_headroom} descriptors for slow sockets"
    node = limited(node_factory(*POOL, "--metrics-port", "0"), NODE_FD_LIMIT)
    pid, port = node.proc.pid, metrics_port(node)
    base_threads, base_fds = thread_count(pid), fd_count(pid)  # before any scrape, whose close may lag its reply
    assert "kvcr_node_info" in get(port)
    peak = {"threads": 0, "fds": 0}

    def step() -> bool:
        left = peers.step()
        peak["threads"] = max(peak["threads"], thread_count(pid))
        peak["fds"] = max(peak["fds"], fd_count(pid))
        return left == 0

    peers = SlowPeers(port, count)
    try:
        # The slots fill with slow sockets; the rest are refused as the node accepts them.
        assert wait_until(lambda: step() or fd_count(pid) >= base_fds + MAX_CONNECTIONS, CONNECTION_TIMEOUT_S, DRIBBLE_S)
        # A new engine client is served meanwhile, byte-exact.
        with Client(node.endpoint, name="itest-innocent") as client:
            reg = Registrar(client)
            o = StoredObject(client, reg, b"innocent", LAYOUT, seed=7)
            assert client.deliver({o.key: o.spans}).result(RESULT_TIMEOUT_S)[o.key].status is KeyStatus.OK
            assert_bytes_equal(o.dst, o.src, "delivered during the flood")
            reg.close()
            assert_clean(client)
        assert peak["threads"] <= base_threads, ("node threads", base_threads, peak["threads"])
        # Every slow socket ends: refused at the cap, or dropped at its deadline.
        assert wait_until(step, FLOOD_END_S, DRIBBLE_S), f"{len(peers.live)} slow sockets still open"
    finally:
        peers.close()
    assert peak["threads"] <= base_threads, ("node threads", base_threads, peak["threads"])
    assert peak["fds"] <= base_fds + MAX_CONNECTIONS + CLIENT_FDS, ("node descriptors", base_fds, peak["fds"])
    # A real scrape succeeds, and counts what was refused and dropped.
    after = settled(port, lambda s: sample(s, "kvcr_metrics_connections") == 1)
    limit = sample(after, "kvcr_metrics_connections_dropped_total", ("reason", "limit"))
    timeout = sample(after, "kvcr_metrics_connections_dropped_total", ("reason", "timeout"))
    assert limit >= peers.refused > 0 and timeout >= MAX_CONNECTIONS, (limit, peers.refused, timeout)
    assert limit + timeout <= count, (limit, timeout, count)
    assert sample(after, "kvcr_metrics_connections_dropped_total", ("reason", "trickle")) == 0
    assert sample(after, "kvcr_clients") == 0
    # Everything closed: descriptors and threads where they started.
    assert wait_until(lambda: fd_count(pid) <= base_fds + FD_SLACK, PUBLISHED_S), (base_fds, fd_count(pid))
    assert thread_count(pid) <= base_threads
    assert node.stop() == 0, node.output


def test_past_the_cap_a_scraper_gets_503_until_a_slot_frees(node_factory: Callable[..., NodeProcess]) -> None:
    cap = 4
    node = node_factory(*POOL, "--metrics-port", "0", "--metrics-max-connections", str(cap))
    pid, port = node.proc.pid, metrics_port(node)
    base_fds = fd_count(pid)
    silent = [socket.create_connection(("127.0.0.1", port), timeout=PUBLISHED_S) for _ in range(cap)]
    try:
        assert wait_until(lambda: fd_count(pid) == base_fds + cap, PUBLISHED_S), (base_fds, fd_count(pid))
        status, headers, body = raw_request(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (status, headers.get("retry-after")) == (503, "1"), (status, headers, body)
        with pytest.raises(urllib.error.HTTPError) as err:
            get(port)
        assert err.value.code == 503
    finally:
        for sock in silent:
            sock.close()
    # The silent peers left: their slots free at once, without waiting for their deadline.
    # The node frees a slot when it reads the peer's end, so the test waits for that (its
    # descriptors back) before scraping: a scrape sent sooner may still find the cap full.
    assert wait_until(lambda: fd_count(pid) == base_fds, PUBLISHED_S), (base_fds, fd_count(pid))
    after = settled(port, lambda s: sample(s, "kvcr_metrics_connections") == 1)
    assert sample(after, "kvcr_metrics_connections_dropped_total", ("reason", "limit")) == 2
    assert sample(after, "kvcr_metrics_connections_dropped_total", ("reason", "timeout")) == 0
    assert wait_until(lambda: fd_count(pid) == base_fds, PUBLISHED_S), (base_fds, fd_count(pid))


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),
    (b"GET /metrics HTTP/1.1\r\n" + b"X-Pad: " + b"p" * 20_000 + b"\r\n\r\n", 431),
    (b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 405),
    (b"DELETE /metrics HTTP/1.0\r\n\r\n", 405),
    (b"\x00\xff garbage\r\n\r\n", 400),
    (b"GET /metrics SPDY/3\r\n\r\n", 400),
    (b"GET /metrics\r\n\r\n", 400),
    (b"GET /metrics?name[]=kvcr_objects HTTP/1.1\n\n", 200),
    (b"GET /metrics/ HTTP/1.1\r\n\r\n", 404),
    (b"GET http://127.0.0.1/metrics HTTP/1.1\r\n\r\n", 404),
])
def test_hostile_request_heads_get_their_status_and_the_node_serves_on(
        node_factory: Callable[..., NodeProcess], request_bytes: bytes, status: int) -> None:
    node = node_factory(*POOL, "--metrics-port", "0")
    port = metrics_port(node)
    got, headers, body = raw_request(port, request_bytes)
    assert got == status, (got, headers, body[:200])
    assert headers["connection"] == "close" and int(headers["content-length"]) == len(body)
    assert (b"kvcr_node_info" in body) == (status == 200)
    assert "kvcr_node_info" in get(port)
    with Client(node.endpoint, name="itest-after-hostile-head") as client:
        assert_clean(client)


def test_head_gets_the_headers_of_a_scrape_without_its_body(node_factory: Callable[..., NodeProcess]) -> None:
    port = metrics_port(node_factory(*POOL, "--metrics-port", "0"))
    status, headers, body = raw_request(port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, body) == (200, b"")
    assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert int(headers["content-length"]) > 1000
    assert sample(scrape(port), "kvcr_metrics_connections") == 1
