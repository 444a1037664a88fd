"""What inventory events cost the node: store churn with and without a listener, and the batches.

Deposits into a full FIFO pool (each one evicts one object and commits one) are timed on a
store with no listener (no events endpoint: the default) and on one that reports to an
``Inventory``, which then encodes the turn's events into batches as the node's loop
would, one batch per ``--per-turn`` deposits. Also: encoded bytes per event and the time
to answer a replay of ``REPLAY_MAX_BATCHES`` batches from the ring.

Run: ``python bench/events.py``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deposits", type=int, default=100_000)
    p.add_argument("--per-turn", type=int, default=16, help="deposits per loop turn (one batch each)")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    plain = statistics.median(churn(False, args.deposits, args.per_turn)[0] for _ in range(args.repeat))
    runs = [churn(True, args.deposits, args.per_turn) for _ in range(args.repeat)]
    with_events = statistics.median(r[0] for r in runs)
    _, inventory, published = runs[-1]
    assert inventory is not None
    events = 2 * args.deposits  # one removed and one stored key per deposit
    print(f"deposit+evict, no events endpoint: {plain * 1e6:7.2f} us")
    print(f"deposit+evict, events published:  {with_events * 1e6:7.2f} us  ({with_events / plain:.2f}x)")
    print(f"bytes per key event (32-byte keys, {args.per_turn} deposits a batch): {published / events:.1f}")
    replay = encode_replay_request(inventory.oldest)
    start = time.perf_counter()
    n = 200
    for _ in range(n):
        inventory.replay(replay)
    print(f"replay answer of {REPLAY_MAX_BATCHES} batches from the ring: {(time.perf_counter() - start) / n * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
