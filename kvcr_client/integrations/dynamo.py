"""NVIDIA Dynamo's KV router index, fed by kvcr nodes' inventory events (spec section 15).

Dynamo's KV-aware router places a request on the worker that holds the longest prefix of
its blocks, from a radix tree (``dynamo.llm.RadixTree``) that the workers' KV events
build: each ``stored`` block names its parent block, and a block is found only under the
chain of its parents from the root. ``DynamoIndex`` follows one or many kvcr nodes'
event streams (``EventStream``: in order, gaps and restarts filled by replay) and applies
what they say to such a tree, one Dynamo worker id per node; ``best`` answers which node
holds the longest prefix of a request's block keys. It imports ``dynamo`` (the optional
environment ``scripts/dynamo_env.sh`` makes); nothing else in ``kvcr_client`` imports it.

How kvcr's holdings become Dynamo blocks:
- A key is a block; its Dynamo hashes (the block hash and the tokens hash, the one a match
  walks by) are both ``block_hash(key)``, a 64-bit hash of the key. An engine's key for
  block i is already a hash chained over the blocks before it, so the key names the whole
  prefix, and one key has the same hashes on every node, as Dynamo's index needs.
- A node holds a key while any tier holds it (memory, HBM or its disk tier;
  ``InventoryMirror``'s ``held`` and ``gone``).
- Dynamo's tree takes a block only under a parent it holds for that worker, and drops a
  block's descendants with it. kvcr evicts without regard to prefixes, so a node may hold a
  block whose parent it evicted. Such a block waits, out of the tree, until its parent is
  held again; then it and its waiting descendants go in. So the tree holds, per node,
  exactly the keys whose chain of parents the node holds to a root: the prefixes a request
  can be served from.
- A key whose deposit named no parent is a root (the first block of a sequence).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import zmq
from dynamo.llm import RadixTree

from kvcr_client.events import EventStream, EventStreamError, InventoryMirror, MirrorChanges
from kvcr_protocol.events import EventBatch

DP_RANK = 0
"""The data-parallel rank of every kvcr worker in the tree: a node is one worker."""


def block_hash(key: bytes) -> int:
    """The Dynamo block hash (and tokens hash) of a kvcr key: the first 8 bytes of its
    BLAKE2b, little-endian, a u64 as Dynamo's events carry."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


@dataclass(slots=True)
class _Worker:
    """One node's blocks as the tree has them."""

    worker_id: int
    mirror: InventoryMirror = field(default_factory=InventoryMirror)
    in_tree: set[bytes] = field(default_factory=set)
    """Held keys whose chain of parents is held to a root: in the tree."""
    children: dict[bytes, set[bytes]] = field(default_factory=dict)
    """Parent key -> the held keys that name it, in the tree or waiting for it."""
    parent_of: dict[bytes, bytes] = field(default_factory=dict)
    """Held key -> the parent it names (the mirror forgets it as the key goes)."""
    event_id: int = 0


@dataclass(slots=True)
class IndexCounts:
    """What a ``DynamoIndex`` did, for its reports."""

    batches: int = 0
    stored: int = 0
    """Blocks put into the tree."""
    removed: int = 0
    """Removals applied to the tree (each takes the block's descendants too)."""
    waiting: int = 0
    """Blocks that came to be held with their parent not held (kept out of the tree)."""
    rejoined: int = 0
    """Blocks put back into the tree when their parent came to be held again."""
    restarts: int = 0
    """Times a node's blocks were all dropped: a ``cleared`` or a new incarnation."""
    failed_streams: int = 0
    """Nodes no longer followed because their stream failed (``DynamoIndex.failures``)."""
    apply_cpu_s: float = 0.0
    """CPU this thread spent applying batches to the tree (``apply``; receiving them not counted)."""
    polls: int = 0
    """``poll`` calls: each looks at every followed stream once."""


class DynamoIndex:
    """A ``RadixTree`` of the blocks that kvcr nodes hold, one worker id per node."""

    def __init__(self, tree: RadixTree | None = None) -> None:
        self.tree = tree if tree is not None else RadixTree()
        self._workers: dict[int, _Worker] = {}
        self._streams: dict[int, EventStream] = {}
        self._poller = zmq.Poller()
        """Every followed stream's sockets (``EventStream.sockets``), polled at once."""
        self._owner: dict[zmq.Socket[bytes], int] = {}
        """A stream's socket -> its worker id."""
        self.counts = IndexCounts()
        self.failures: dict[int, str] = {}
        """Worker id -> why its stream failed and it is no longer followed."""

    # -- following nodes ---------------------------------------------------------------

    def follow(self, worker_id: int, events_endpoint: str, replay_endpoint: str | None = None) -> EventStream:
        """Follow a node's events as worker ``worker_id`` (a u64 of the caller's choosing)."""
        if worker_id in self._streams:
            raise ValueError(f"worker {worker_id} is followed already")
        stream = EventStream(events_endpoint, replay_endpoint)
        self._streams[worker_id] = stream
        for sock in stream.sockets:
            self._poller.register(sock, zmq.POLLIN)
            self._owner[sock] = worker_id
        self._workers.setdefault(worker_id, _Worker(worker_id))
        self.failures.pop(worker_id, None)
        return stream

    def poll(self, timeout: float = 0.0) -> int:
        """Apply what every followed node published since, waiting up to ``timeout`` for
        any; one poll over every stream's sockets, ``recv`` only on those that have
        something. Returns the batches applied.

        A node whose stream fails (a batch that does not decode, a replay that does not
        answer: ``EventStreamError``) is no longer followed, and its blocks leave the tree:
        the index never routes by a view it cannot keep. ``failures`` says why; ``follow``
        it again to retry."""
        applied = 0
        self.counts.polls += 1
        ready = dict(self._poller.poll(max(0, int(timeout * 1000))))
        for worker_id in sorted({self._owner[sock] for sock in ready}):
            try:
                batches = self._streams[worker_id].recv(0.0)
            except EventStreamError as exc:
                self._drop(worker_id, str(exc))
                continue
            for _, batch in batches:
                self.apply(worker_id, batch)
                applied += 1
        return applied

    def _unfollow(self, worker_id: int) -> None:
        """Stop polling and close worker ``worker_id``'s stream."""
        stream = self._streams.pop(worker_id)
        for sock in stream.sockets:
            self._poller.unregister(sock)
            del self._owner[sock]
        stream.close()

    def _drop(self, worker_id: int, why: str) -> None:
        self._unfollow(worker_id)
        worker = self._workers.pop(worker_id)
        self.tree.remove_worker(worker.worker_id)
        self.failures[worker_id] = why
        self.counts.failed_streams += 1

    def mirror(self, worker_id: int) -> InventoryMirror:
        """The node's holdings as its events said (every tier), for checks and reports."""
        return self._workers[worker_id].mirror

    def close(self) -> None:
        for worker_id in list(self._streams):
            self._unfollow(worker_id)

    def __enter__(self) -> DynamoIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the tree ------------------------------------------------------------------------

    def apply(self, worker_id: int, batch: EventBatch) -> None:
        """Apply one of the node's batches, in sequence order."""
        spent = time.thread_time()
        worker = self._workers.setdefault(worker_id, _Worker(worker_id))
        changes = worker.mirror.apply(batch)
        self.counts.batches += 1
        self._change(worker, changes)
        self.counts.apply_cpu_s += time.thread_time() - spent

    def _change(self, worker: _Worker, changes: MirrorChanges) -> None:
        parents = worker.mirror.parents
        if changes.restarted:
            self.tree.remove_worker(worker.worker_id)
            worker.in_tree.clear()
            worker.children.clear()
            worker.parent_of.clear()
            self.counts.restarts += 1
        for key in changes.gone:
            self._gone(worker, key)
        for key in changes.held:
            parent = parents.get(key, b"")
            if parent:
                worker.parent_of[key] = parent
                worker.children.setdefault(parent, set()).add(key)
            if not parent or parent in worker.in_tree:
                self._insert(worker, key, parent)
            else:
                self.counts.waiting += 1

    def _gone(self, worker: _Worker, key: bytes) -> None:
        parent = worker.parent_of.pop(key, b"")
        if parent:
            siblings = worker.children[parent]
            siblings.discard(key)
            if not siblings:
                del worker.children[parent]
        if key not in worker.in_tree:
            return
        self._send(worker, {"removed": {"block_hashes": [block_hash(key)]}})
        self.counts.removed += 1
        # Dynamo drops the block's descendants with it: they wait for it again.
        stack = [key]
        while stack:
            gone = stack.pop()
            worker.in_tree.discard(gone)
            stack.extend(child for child in worker.children.get(gone, ()) if child in worker.in_tree)

    def _insert(self, worker: _Worker, key: bytes, parent: bytes) -> None:
        """``key`` into the tree under ``parent`` (b"": a root), then every held descendant
        that waited for it, each chain as one stored event."""
        stack = [(key, parent)]
        while stack:
            top, above = stack.pop()
            blocks = [top]
            worker.in_tree.add(top)
            # Follow single children into one event (a chain of blocks, each the parent of the next).
            while True:
                waiting = [c for c in worker.children.get(blocks[-1], ()) if c not in worker.in_tree]
                if not waiting:
                    break
                first, rest = waiting[0], waiting[1:]
                stack.extend((child, blocks[-1]) for child in rest)
                blocks.append(first)
                worker.in_tree.add(first)
            self._send(worker, {"stored": {
                "parent_hash": block_hash(above) if above else None,
                "blocks": [{"block_hash": block_hash(b), "tokens_hash": block_hash(b)} for b in blocks],
            }})
            self.counts.stored += len(blocks)
            self.counts.rejoined += len(blocks) - (top == key)

    def _send(self, worker: _Worker, data: dict[str, object]) -> None:
        worker.event_id += 1
        self.tree.apply_event(worker.worker_id, json.dumps(
            {"event_id": worker.event_id, "data": data, "dp_rank": DP_RANK}).encode())

    # -- routing -------------------------------------------------------------------------

    def scores(self, keys: Iterable[bytes]) -> dict[int, int]:
        """Worker id -> how many of ``keys``, from the first, the tree says it holds (workers
        that hold none are left out)."""
        found = self.tree.find_matches([block_hash(k) for k in keys])
        return {worker_id: count for (worker_id, _), count in found.scores.items() if count}

    def best(self, keys: Sequence[bytes], among: Iterable[int] | None = None) -> tuple[int | None, int]:
        """The worker holding the longest prefix of ``keys`` (the lowest id among equals),
        and that prefix's length; ``(None, 0)`` when none holds the first key. ``among``:
        only these workers may be chosen."""
        scores = self.scores(keys)
        allowed = None if among is None else set(among)
        best: tuple[int | None, int] = (None, 0)
        for worker_id, count in sorted(scores.items()):
            if (allowed is None or worker_id in allowed) and count > best[1]:
                best = (worker_id, count)
        return best
