"""The engine of the cluster workload: serves a request's prefix from its node and prefills the rest.

An ``Engine`` holds a client of one node. ``serve`` leases a request's blocks there and
delivers the held prefix into its own memory, checking every byte against what was
deposited (``block_bytes``); ``prefill`` deposits the blocks it lacked, each naming its
parent, as an engine that computed them would. ``router_driver.py`` runs one in its own
process on one host; run as a script (``engine.py --node ENDPOINT --bind ENDPOINT``), one
engine serves the requests a router sends it over ZeroMQ, one at a time, on its host of a
fabric, next to its node.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgpack
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvcr_testing

from kvcr_client import Client, KeyStatus, LeaseStatus, Span
from kvcr_testing.patterns import KiB, pattern

BLOCK = 4 * KiB
"""One block: one span of one slot."""
RESULT_TIMEOUT_S = 30.0


def sequence_keys(prefix: int, blocks: int) -> list[bytes]:
    """Block keys of sequence ``prefix``: each a hash over the one before and its own tokens."""
    keys, previous = [], b""
    for i in range(blocks):
        previous = hashlib.blake2b(previous + b"tokens:%d:%d" % (prefix, i), digest_size=16).digest()
        keys.append(previous)
    return keys


def block_bytes(key: bytes) -> np.ndarray:
    """What block ``key`` holds: a pattern of its own."""
    return pattern(BLOCK, int.from_bytes(key[:4], "little"))


class Engine:
    """Serves and prefills requests' blocks at one node."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.requests = 0

    def serve(self, keys: Sequence[bytes]) -> int:
        """Lease ``keys`` and deliver the held prefix, every byte checked; the blocks served."""
        client = self.client
        self.requests += 1
        lease = client.lease(keys, request_id=f"r{self.requests}").result(RESULT_TIMEOUT_S)
        try:
            n = 0
            for key in keys:
                if lease.status(key) is not LeaseStatus.LEASED:
                    break
                n += 1
            if not n:
                return 0
            dst = np.zeros(BLOCK * n, dtype=np.uint8)
            region = client.register(dst)
            try:
                results = client.deliver({k: [Span("L0", region, i * BLOCK, BLOCK)] for i, k in enumerate(keys[:n])}
                                         ).result(RESULT_TIMEOUT_S)
                for i, key in enumerate(keys[:n]):
                    assert results[key].status is KeyStatus.OK, (key.hex(), results[key])
                    assert np.array_equal(dst[i * BLOCK:(i + 1) * BLOCK], block_bytes(key)), f"{key.hex()}: wrong bytes"
            finally:
                client.unregister(region)
            return n
        finally:
            lease.release().result(RESULT_TIMEOUT_S)

    def prefill(self, keys: Sequence[bytes], parents: Mapping[bytes, bytes]) -> None:
        """Deposit ``keys`` (computed here), each with its parent; every one stored (or held already)."""
        if not keys:
            return
        client = self.client
        src = np.concatenate([block_bytes(k) for k in keys])
        region = client.register(src)
        try:
            results = client.deposit({k: [Span("L0", region, i * BLOCK, BLOCK, "kv")] for i, k in enumerate(keys)},
                                     parents={k: parents[k] for k in keys if k in parents}).result(RESULT_TIMEOUT_S)
        finally:
            client.unregister(region)
        stored = [k for k in keys if results[k].status in (KeyStatus.STORED, KeyStatus.DUPLICATE)]
        assert len(stored) == len(keys), {k.hex(): results[k] for k in keys}


class RemoteEngine:
    """An ``Engine`` in another process (``engine.py`` run as a script), asked over ZeroMQ."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self.sock = context.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, int(2 * RESULT_TIMEOUT_S * 1000))
        self.sock.connect(endpoint)

    def _ask(self, request: dict[str, object]) -> dict[str, object]:
        self.sock.send(msgpack.packb(request))
        reply: dict[str, object] = msgpack.unpackb(self.sock.recv())
        if "error" in reply:
            raise AssertionError(f"the engine failed: {reply['error']}")
        return reply

    def serve(self, keys: Sequence[bytes]) -> int:
        served = self._ask({"t": "serve", "keys": list(keys)})["served"]
        assert isinstance(served, int)
        return served

    def prefill(self, keys: Sequence[bytes], parents: Mapping[bytes, bytes]) -> None:
        self._ask({"t": "prefill", "keys": list(keys), "parents": {k: parents[k] for k in keys if k in parents}})

    def close(self) -> None:
        self._ask({"t": "stop"})
        self.sock.close(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--node", required=True, help="the node's endpoint")
    parser.add_argument("--bind", required=True, help="where the router sends requests (a ZeroMQ REP)")
    args = parser.parse_args(argv)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    rep = context.socket(zmq.REP)
    rep.setsockopt(zmq.LINGER, 0)
    rep.bind(args.bind)
    print(f"engine ready on {args.bind}", flush=True)
    with Client(args.node, name="cluster-engine") as client:
        engine = Engine(client)
        while True:
            request = msgpack.unpackb(rep.recv(), strict_map_key=False)
            try:
                if request["t"] == "serve":
                    started = time.perf_counter()
                    reply: dict[str, object] = {"served": engine.serve(request["keys"]),
                                                "seconds": time.perf_counter() - started}
                elif request["t"] == "prefill":
                    engine.prefill(request["keys"], request["parents"])
                    reply = {}
                else:
                    rep.send(msgpack.packb({}))
                    break
            except Exception as exc:  # the router reports it and fails the run
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            rep.send(msgpack.packb(reply))
    rep.close(0)
    context.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
