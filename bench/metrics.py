"""Scrapes against lookups: what busy ``/metrics`` scrapers cost an innocent client's queries.

One node with a metrics port; one client (this process) times one-key query round trips
(a hit) in phases that take turns: a quiet phase, then a busy one while ``--scrapers``
scrapers (threads of one separate process, so that they share no interpreter with the
client) scrape in a tight loop, each over a fresh connection, reading every reply whole.
The quiet phases are the anchor, measured in the same run on the same machine:

- ``quiet_query_p50_us``, ``quiet_query_p99_us``: query round trips with nobody scraping;
- ``scrape_query_p50_us``, ``scrape_query_p99_us``: the same while the scrapers run;
- ``scrape_query_p50_ratio``, ``scrape_query_p99_ratio``: busy over quiet (goal p50 <= 1.2);
- ``pair_p50_ratio_median``, ``pair_p50_ratio_p10``, ``pair_p50_ratio_p90``: the p50 ratio of each
  busy phase to the quiet phase before it, over the pairs (the spread the machine's noise gives);
- ``scrapes_per_s``: replies the scrapers read whole (200, 503 or other) per second of scraping, and
  ``scrape_refused``, ``scrape_failed``: of those, 503s (the connection cap), and scrapes
  that got no reply at all.

Run: ``python bench/metrics.py [--scrapers 8] [--json]``; ``--json`` prints one JSON object
as the last line. Timings on a shared machine are noisy: compare ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import process_group

import kvcr_protocol as kp
from kvcr_client import Client, Span

SLOT = 4 << 10
KEYS = 64
PHASES = 16
"""Quiet and busy phases each (they alternate, quiet first): short and many, so that a
shared machine's load drifts over both alike."""
PHASE_S = 0.6
"""How long one phase times queries."""
SETTLE_S = 0.2
"""After the scrapers start or stop, how long before the next phase's timing starts."""
SCRAPE_TIMEOUT_S = 10.0
RESULT_TIMEOUT_S = 30.0
REQUEST = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\nConnection: close\r\n\r\n"


# --------------------------------------------------------------------------- the scrapers' process


def scrape_once(port: int) -> int:
    """One scrape on a fresh connection, read to its end: the status code (0: no reply)."""
    with socket.create_connection(("127.0.0.1", port), timeout=SCRAPE_TIMEOUT_S) as sock:
        sock.sendall(REQUEST)
        head = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            if len(head) < 16:
                head += chunk[:16]
    m = re.match(rb"HTTP/1\.[01] (\d{3})", head)
    return int(m.group(1)) if m else 0


def scraper_process(port: int, scrapers: int) -> None:
    """Scrape in ``scrapers`` threads between a ``go`` and a ``stop`` line on stdin; after each
    ``stop``, print ``done OK REFUSED FAILED SECONDS`` (the seconds from ``go`` to the end of
    the last scrape). ``quit`` ends the process."""
    running = threading.Event()
    quit_ = threading.Event()
    lock = threading.Lock()
    counts = {"ok": 0, "refused": 0, "failed": 0}
    last = [0.0]
    started = 0.0

    def loop() -> None:
        while not quit_.is_set():
            if not running.wait(0.1):
                continue
            try:
                status = scrape_once(port)
            except OSError:
                status = 0
            key = "ok" if status == 200 else "refused" if status == 503 else "failed"
            with lock:
                counts[key] += 1
                last[0] = time.perf_counter()

    threads = [threading.Thread(target=loop, name=f"scraper-{i}", daemon=True) for i in range(scrapers)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "go":
            with lock:
                counts.update(ok=0, refused=0, failed=0)
            started = time.perf_counter()
            running.set()
        elif command == "stop":
            running.clear()
            time.sleep(SETTLE_S)  # let the scrapes in flight end, so that the next quiet phase is quiet
            with lock:
                print(f"done {counts['ok']} {counts['refused']} {counts['failed']} {max(0.0, last[0] - started)}", flush=True)
        elif command == "quit":
            break
    quit_.set()
    for t in threads:
        t.join(SCRAPE_TIMEOUT_S)


# --------------------------------------------------------------------------- the client


def start_node(endpoint: str) -> tuple[subprocess.Popen[str], int]:
    """A node with a metrics port on a free port, and that port (from its start line)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvcr_node.cli", "--endpoint", endpoint, "--pool",
                             f"kv:{SLOT}:{2 * KEYS}", "--log-level", "WARNING", "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        m = re.search(r"listening on .* metrics on http://127\.0\.0\.1:(\d+)/metrics", line)
        if m:
            return proc, int(m.group(1))
    proc.kill()
    raise RuntimeError(f"the node did not start: {''.join(seen)}")


def percentile(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q))


def bench(endpoint: str, port: int, scrapers: int) -> dict[str, Any]:
    worker = subprocess.Popen([sys.executable, __file__, "--scrape-worker", str(port), str(scrapers)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert worker.stdin is not None and worker.stdout is not None
    assert worker.stdout.readline().strip() == "ready"
    quiet: list[float] = []
    busy: list[float] = []
    pairs: list[float] = []
    scraped = {"ok": 0, "refused": 0, "failed": 0}
    scraping_s = 0.0
    keys = [b"k%031d" % i for i in range(KEYS)]
    buf = np.arange(KEYS * SLOT, dtype=np.uint64).astype(np.uint8)
    try:
        with Client(endpoint, name="bench-metrics") as client:
            region = client.register(buf)
            stored = client.deposit({k: [Span("kv", region, i * SLOT, SLOT, "kv")] for i, k in enumerate(keys)}).result(
                RESULT_TIMEOUT_S)
            assert stored.all_ok, stored

            def phase(into: list[float]) -> None:
                end = time.perf_counter() + PHASE_S
                i = 0
                while True:
                    one = [keys[i % KEYS]]
                    i += 1
                    t0 = time.perf_counter()
                    answer = client.query(one).result(RESULT_TIMEOUT_S)
                    t1 = time.perf_counter()
                    assert answer[one[0]].presence is kp.Presence.HIT
                    into.append(t1 - t0)
                    if t1 >= end:
                        return

            phase([])  # warm-up
            for _ in range(PHASES):
                q, b = len(quiet), len(busy)
                phase(quiet)
                worker.stdin.write("go\n")
                worker.stdin.flush()
                time.sleep(SETTLE_S)
                phase(busy)
                pairs.append(percentile(busy[b:], 50) / percentile(quiet[q:], 50))
                worker.stdin.write("stop\n")
                worker.stdin.flush()
                _, ok, refused, failed, seconds = worker.stdout.readline().split()
                for name, n in (("ok", ok), ("refused", refused), ("failed", failed)):
                    scraped[name] += int(n)
                scraping_s += float(seconds)
            stats = client.stats(audit=True).result(RESULT_TIMEOUT_S)
            assert stats["invariants"] == [], stats["invariants"]
    finally:
        worker.stdin.write("quit\n")
        worker.stdin.flush()
        worker.wait(SCRAPE_TIMEOUT_S + 5)
    total = sum(scraped.values())
    return {
        "scrapers": scrapers,
        "quiet_n": len(quiet), "busy_n": len(busy),
        "quiet_query_p50_us": percentile(quiet, 50) * 1e6, "quiet_query_p99_us": percentile(quiet, 99) * 1e6,
        "scrape_query_p50_us": percentile(busy, 50) * 1e6, "scrape_query_p99_us": percentile(busy, 99) * 1e6,
        "scrape_query_p50_ratio": percentile(busy, 50) / percentile(quiet, 50),
        "scrape_query_p99_ratio": percentile(busy, 99) / percentile(quiet, 99),
        "pair_p50_ratio_median": percentile(pairs, 50), "pair_p50_ratio_p10": percentile(pairs, 10),
        "pair_p50_ratio_p90": percentile(pairs, 90),
        "scrapes_per_s": total / scraping_s if scraping_s else 0.0,
        "scrape_refused": scraped["refused"], "scrape_failed": scraped["failed"],
    }


def report(k: dict[str, Any]) -> str:
    return "\n".join([
        f"one-key query round trips, {k['scrapers']} busy scrapers against quiet ({PHASES} phases of each, "
        f"{PHASE_S} s)",
        f"  quiet   p50 {k['quiet_query_p50_us']:8.1f} us  p99 {k['quiet_query_p99_us']:8.1f} us  (n={k['quiet_n']})",
        f"  scraped p50 {k['scrape_query_p50_us']:8.1f} us  p99 {k['scrape_query_p99_us']:8.1f} us  (n={k['busy_n']})",
        f"  ratio   p50 {k['scrape_query_p50_ratio']:.2f} (goal <= 1.2)  p99 {k['scrape_query_p99_ratio']:.2f}",
        f"  p50 ratio per pair of phases: median {k['pair_p50_ratio_median']:.2f}, p10 {k['pair_p50_ratio_p10']:.2f}, "
        f"p90 {k['pair_p50_ratio_p90']:.2f}",
        f"  scrapes {k['scrapes_per_s']:,.0f}/s read whole; {k['scrape_refused']} refused (503), "
        f"{k['scrape_failed']} without a reply",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scrape-worker", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--scrapers", type=int, default=8, help="scrapers in the busy phases (default 8)")
    parser.add_argument("--json", action="store_true", help="the report to stderr, one JSON object to stdout")
    args = parser.parse_args()
    if args.scrape_worker:
        scraper_process(*args.scrape_worker)
        return 0
    with process_group("metrics") as (run, procs):
        endpoint = f"ipc://{run}/metrics-node.sock"
        node, port = start_node(endpoint)
        procs.append(node)
        k = bench(endpoint, port, args.scrapers)
    print(report(k), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({name: round(value, 3) if isinstance(value, float) else value for name, value in k.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
