"""A node's Prometheus metrics, scraped over HTTP (loopback) and parsed with
``prometheus_client``'s text parser."""

from __future__ import annotations

import re
import socket
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from kvcr_testing.health import wait_until
from kvcr_testing.nodes import NodeProcess

SCRAPE_TIMEOUT_S = 5.0
PUBLISHED_S = 5.0
"""A bound on how long a node takes to publish what it counted (it publishes every 0.5 s)."""

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]
"""Every sample of a scrape by (name, sorted labels)."""


def metrics_port(node: NodeProcess) -> int:
    """The port a node started with ``--metrics-port`` printed on its start line."""
    for line in node.output:
        m = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", line)
        if m:
            return int(m.group(1))
    raise AssertionError(f"the node printed no metrics port: {node.output}")


def get(port: int, path: str = "/metrics") -> str:
    """The body of ``path`` on the metrics port (``HTTPError`` for a status other than 200)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=SCRAPE_TIMEOUT_S) as reply:
        body: bytes = reply.read()
    return body.decode()


def raw_request(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` as it is on a fresh connection and read the reply to its end: the
    status (0 when the reply is not HTTP), its headers (lower-case names) and its body."""
    with socket.create_connection(("127.0.0.1", port), timeout=SCRAPE_TIMEOUT_S) as sock:
        sock.sendall(request)
        reply = bytearray()
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = bytes(reply).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    m = re.match(r"HTTP/1\.[01] (\d{3}) ", lines[0])
    headers = dict((k.strip().lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:]))
    return (int(m.group(1)) if m else 0), headers, body


def parse(text: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(port: int) -> Samples:
    return parse(get(port))


def sample(s: Samples, name: str, *labels: tuple[str, str]) -> float:
    """One sample's value (0 when absent)."""
    return s.get((name, tuple(sorted(labels))), 0.0)


def moved(before: Samples, after: Samples) -> Samples:
    """Samples that changed, by how much (counters and histogram counts)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def settled(port: int, check: Callable[[Samples], bool]) -> Samples:
    """The first scrape (bounded wait) for which ``check`` holds: snapshots are published
    every half second, so counts appear within one interval."""
    last: list[Samples] = []

    def ok() -> bool:
        last[:] = [scrape(port)]
        return check(last[0])

    if not wait_until(ok, PUBLISHED_S, 0.05):
        shown = "\n".join(f"{name}{dict(labels)} {value}" for (name, labels), value in sorted(last[0].items())
                           if not name.endswith("_bucket"))
        raise AssertionError(f"the scrapes never showed what was expected; the last:\n{shown}")
    return last[0]
