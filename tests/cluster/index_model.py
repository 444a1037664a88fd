"""``DynamoIndex`` against a model of what nodes hold, with Dynamo's own tree (run in ``.venv-dynamo``).

Run by ``tests/cluster/test_dynamo_router.py``; prints a JSON report last. No nodes: event
batches as nodes publish them (spec section 15) are made here, in their thousands, for
several workers at once, and applied both to a ``DynamoIndex`` (over a real
``dynamo.llm.RadixTree``) and to a plain model, the keys each worker holds in each tier.
After every batch, for every sequence and worker, the tree's match must equal the model's
longest held prefix (the first keys of the sequence held in some tier, each block's
parent the one before it).

The batches are what makes that hard: blocks stored in any order (a child before its
parent, in one batch or several), parents evicted while their children stay (the tree
drops a block's descendants with it, so they must come back when the parent does), a key
copied to the disk tier and evicted from memory (still held), removed and stored again
within one batch, and ``cleared`` and new incarnations. Last, a node whose stream sends a
batch that does not decode: the index stops following it and drops its blocks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time

import zmq

from kvcr_client.integrations.dynamo import DynamoIndex
from kvcr_protocol.events import EVENTS_TOPIC, Cleared, Event, EventBatch, Removed, Stored, encode_seq

MEMORY, DISK = (("kv",), "dram"), (("kv-disk",), "disk")
GARBAGE = b"\xc1 not msgpack"
"""A payload no batch decodes from (0xc1 is never used by msgpack)."""


class Model:
    """What one worker holds, per tier, as the batches made so far say."""

    def __init__(self) -> None:
        self.tiers: dict[bytes, set[str]] = {}
        self.incarnation = 1

    def held_prefix(self, keys: list[bytes]) -> int:
        n = 0
        for key in keys:
            if not self.tiers.get(key):
                break
            n += 1
        return n


def batch_for(rng: random.Random, model: Model, sequences: list[list[bytes]], parents: dict[bytes, bytes]) -> EventBatch:
    """A random batch of one worker's changes, applied to ``model`` as made."""
    events: list[Event] = []
    new_incarnation = rng.random() < 0.01
    if new_incarnation:
        model.incarnation += 1
        model.tiers.clear()
        events.append(Cleared())
    for _ in range(rng.randint(1, 4)):
        roll = rng.random()
        held = [k for k, tiers in model.tiers.items() if tiers]
        if roll < 0.45:  # blocks of a sequence stored, in a random order
            seq = rng.choice(sequences)
            start = rng.randrange(len(seq))
            blocks = seq[start:rng.randint(start + 1, len(seq))]
            if rng.random() < 0.3:
                rng.shuffle(blocks)
            pools, tier = DISK if rng.random() < 0.2 else MEMORY
            events.append(Stored(tuple(blocks), pools, tier, tuple(parents.get(b, b"") for b in blocks)))
            for b in blocks:
                model.tiers.setdefault(b, set()).add(tier)
        elif roll < 0.85 and held:  # evicted or dropped from one tier
            key = rng.choice(held)
            tier = rng.choice(sorted(model.tiers[key]))
            pools = DISK[0] if tier == "disk" else MEMORY[0]
            events.append(Removed((key,), pools, tier))
            model.tiers[key].discard(tier)
        elif roll < 0.95 and held:  # removed and stored again in one batch
            key = rng.choice(held)
            tier = rng.choice(sorted(model.tiers[key]))
            pools = DISK[0] if tier == "disk" else MEMORY[0]
            events += [Removed((key,), pools, tier), Stored((key,), pools, tier, (parents.get(key, b""),))]
        elif rng.random() < 0.3:
            events.append(Cleared())
            model.tiers.clear()
    return EventBatch("n", model.incarnation, 0.0, tuple(events))


def hostile(ipc: str) -> dict[str, object]:
    """A node whose replay socket answers with a batch that does not decode: the index stops
    following it and drops its blocks; another node's blocks stay."""
    context = zmq.Context()
    pub, replay = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
    pub.bind(f"ipc://{ipc}/bad.ev")
    replay.bind(f"ipc://{ipc}/bad.ev.replay")
    index = DynamoIndex()
    try:
        index.apply(1, EventBatch("good", 1, 0.0, (Cleared(), Stored((b"g0",), *MEMORY))))
        index.apply(2, EventBatch("bad", 1, 0.0, (Cleared(), Stored((b"g0",), *MEMORY))))
        index.follow(2, f"ipc://{ipc}/bad.ev")
        before = index.scores([b"g0"])
        deadline = time.monotonic() + 10.0
        while 2 not in index.failures and time.monotonic() < deadline:
            while replay.poll(0):  # the stream's replay requests: answered with what does not decode
                sender, *_ = replay.recv_multipart()
                replay.send_multipart([sender, b"", encode_seq(0), GARBAGE])
            pub.send_multipart([EVENTS_TOPIC, encode_seq(0), GARBAGE])  # until the subscription has reached the PUB
            index.poll(0.01)
        return {"before": {str(k): v for k, v in before.items()}, "after": {str(k): v for k, v in index.scores([b"g0"]).items()},
                "failures": {str(k): v for k, v in index.failures.items()}, "failed_streams": index.counts.failed_streams}
    finally:
        index.close()
        pub.close(0)
        replay.close(0)
        context.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--sequences", type=int, default=12)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    sequences = [[b"s%d/b%d" % (s, i) for i in range(args.blocks)] for s in range(args.sequences)]
    parents = {seq[i]: seq[i - 1] for seq in sequences for i in range(1, len(seq))}
    models = {w: Model() for w in range(1, args.workers + 1)}
    index = DynamoIndex()
    checks = disagreed = 0
    first: str | None = None
    for n in range(args.batches):
        worker = rng.choice(list(models))
        index.apply(worker, batch_for(rng, models[worker], sequences, parents))
        for seq in sequences:
            tree = index.scores(seq)
            truth = {w: p for w, m in models.items() if (p := m.held_prefix(seq))}
            checks += 1
            if tree != truth:
                disagreed += 1
                first = first or f"batch {n}: {seq[0]!r}.. tree {tree} model {truth}"
    with tempfile.TemporaryDirectory(prefix="kvcr-idx-") as ipc:
        refused = hostile(ipc)
    print(json.dumps({"batches": args.batches, "checks": checks, "disagreed": disagreed, "first": first,
                      "index": dataclasses.asdict(index.counts), "hostile": refused}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
