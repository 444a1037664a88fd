"""What inventory events cost the node: store churn with and without a listener, and the batches.

Deposits into a full FIFO pool (each one evicts one object and commits one) are timed on a
store with no listener (no events endpoint: the default) and on one that reports to an
``Inventory``, which then encodes the turn's events into batches as the node's loop
would, one batch per ``--per-turn`` deposits. Also: encoded bytes per event and the time
to answer a replay of ``REPLAY_MAX_BATCHES`` batches from the ring.

Run: ``uv run python bench/events.py [--json]``; the anchor is the same churn with no listener,
interleaved with it.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

from kvcr_node.eviction import Layout, make_policy
from kvcr_node.inventory import REPLAY_MAX_BATCHES, Inventory
from kvcr_node.poolspec import PoolSpec
from kvcr_node.store import DepositOutcome, Store
from kvcr_protocol.events import encode_replay_request

LAYOUT: Layout = (("L0", "kv"),)
SLOTS = 4096


def _key(i: int) -> bytes:
    """A 32-byte key, the size of a typical prefix hash."""
    return i.to_bytes(32, "big")


def churn(with_events: bool, deposits: int, per_turn: int) -> tuple[float, Inventory | None, int]:
    """Seconds per deposit (evicting one, committing one), the inventory, and the bytes published."""
    store = Store([PoolSpec("kv", 64, SLOTS)], make_policy("fifo"))
    inventory = Inventory("bench", 1, {"kv": "dram"}) if with_events else None
    store.listener = inventory
    published = 0
    for i in range(SLOTS):  # full: every timed deposit evicts
        _, entry = store.begin_deposit(_key(i), LAYOUT)
        assert entry is not None
        store.commit(entry)
    if inventory is not None:
        inventory.take()
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        for i in range(SLOTS, SLOTS + deposits):
            outcome, entry = store.begin_deposit(_key(i), LAYOUT)
            if outcome is not DepositOutcome.NEW or entry is None:
                raise RuntimeError(f"deposit failed: {outcome}")
            store.commit(entry)
            if inventory is not None and (i + 1) % per_turn == 0:
                published += sum(len(p) for _, p in inventory.take())
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    return elapsed / deposits, inventory, published


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1e6:6.2f} us (min {min(values) * 1e6:.2f}, max {max(values) * 1e6:.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deposits", type=int, default=100_000)
    p.add_argument("--per-turn", type=int, default=16, help="deposits per loop turn (one batch each)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", action="store_true", help="the report to stderr, one JSON object of the figures to stdout")
    args = p.parse_args()
    out = sys.stderr if args.json else sys.stdout
    plain: list[float] = []
    with_events: list[float] = []
    inventory: Inventory | None = None
    published = 0
    for _ in range(args.repeat):  # interleaved, so a machine that slows down slows both alike
        plain.append(churn(False, args.deposits, args.per_turn)[0])
        t, inventory, published = churn(True, args.deposits, args.per_turn)
        with_events.append(t)
    assert inventory is not None
    ratio = statistics.median(with_events) / statistics.median(plain)
    events = 2 * args.deposits  # one removed and one stored key per deposit
    per_event = published / events
    print(f"deposit+evict, no events endpoint (anchor): {_spread(plain)}", file=out)
    print(f"deposit+evict, events published:            {_spread(with_events)}  ratio {ratio:.2f}", file=out)
    print(f"bytes per key event (32-byte keys, {args.per_turn} deposits a batch): {per_event:.1f}", file=out)
    replay = encode_replay_request(inventory.oldest)
    n = 200
    times = []
    for _ in range(n):
        start = time.perf_counter()
        inventory.replay(replay)
        times.append(time.perf_counter() - start)
    replay_ms = statistics.median(times) * 1e3
    print(f"replay answer of {REPLAY_MAX_BATCHES} batches from the ring: median {replay_ms:.3f} ms "
          f"(p90 {sorted(times)[int(0.9 * n)] * 1e3:.3f} ms)", file=out)
    if args.json:
        print(json.dumps({
            "deposit_us": statistics.median(plain) * 1e6, "deposit_events_us": statistics.median(with_events) * 1e6,
            "events_ratio": ratio, "bytes_per_key_event": per_event, "replay_ms": replay_ms,
        }))


if __name__ == "__main__":
    main()
