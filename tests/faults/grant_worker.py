"""A kvcr client holding read grants, in a process of its own (spec section 6.12).

Run as ``python grant_worker.py ENDPOINT [--slot BYTES]`` with ``tests/`` on
``PYTHONPATH`` (``kvcr_testing.hostile.Worker`` sees to it, with ``mode`` ``grants``).
It reports ``ready``, then answers one command a line on stdin with one JSON line on
stdout, so a test can run it in another network namespace, freeze it (SIGSTOP) while it
holds granted leases, or kill it:

- ``deposit KEY SPANS SEED``: deposit a patterned object of ``SPANS`` slots;
- ``lease TTL_MS KEY...``: lease the keys (one lease), report statuses and the grant;
- ``deliver KEY SPANS SEED PLAN DEADLINE_MS``: deliver the whole object (``PLAN`` 1: one
  group per span) into a sentinel buffer; reports the outcome, whether every byte is the
  pattern's, whether the client READ it itself under its grant, and the seconds it took;
- ``release``: release every lease; ``tables``: the client's table sizes;
- ``quit`` (or EOF): close the client and exit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

from kvcr_client import Client, KvcrError, NodeError, Span
from kvcr_protocol import code_of
from kvcr_testing.patterns import pattern


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}, default=str), flush=True)


class GrantClient:
    def __init__(self, endpoint: str, slot: int, name: str) -> None:
        self.client = Client(endpoint, name=name, timeout=30)
        self.slot = slot
        self.leases: list[Any] = []
        self.regions: dict[int, Any] = {}
        self.buffers: dict[int, np.ndarray] = {}

    def buffer(self, spans: int) -> tuple[np.ndarray, Any]:
        """A registered destination of ``spans`` slots, reused across commands."""
        if spans not in self.buffers:
            self.buffers[spans] = np.zeros(spans * self.slot, np.uint8)
            self.regions[spans] = self.client.register(self.buffers[spans])
        return self.buffers[spans], self.regions[spans]

    def deposit(self, key: str, spans: int, seed: int) -> dict[str, Any]:
        src = pattern(spans * self.slot, seed)
        region = self.client.register(src)
        try:
            res = self.client.deposit({key.encode(): [Span(f"L{i}", region, i * self.slot, self.slot, "kv")
                                                      for i in range(spans)]}).result(60)
        finally:
            self.client.unregister(region)
        o = res[key.encode()]
        return {"status": o.status.value, "code": int(o.code)}

    def lease(self, ttl_ms: int, keys: list[str]) -> dict[str, Any]:
        try:
            lease = self.client.lease([k.encode() for k in keys], ttl_ms=ttl_ms).result(60)
        except NodeError as exc:
            return {"error": getattr(exc.code, "name", str(exc.code))}
        self.leases.append(lease)
        return {"id": lease.id, "statuses": {k: lease.status(k.encode()).name for k in keys},
                "granted_keys": self.client.tables()["granted_keys"]}

    def deliver(self, key: str, spans: int, seed: int, plan: bool, deadline_ms: int) -> dict[str, Any]:
        dst, region = self.buffer(spans)
        dst[:] = 0xEE
        reads = self.client.counters()["grant_reads"]
        t0 = time.monotonic()
        handle = self.client.deliver(
            {key.encode(): [Span(f"L{i}", region, i * self.slot, self.slot) for i in range(spans)]},
            plan=[[f"L{i}"] for i in range(spans)] if plan else None, deadline_ms=deadline_ms,
        )
        try:
            res = handle.result(deadline_ms / 1000 + 30)
        except (KvcrError, TimeoutError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - t0}
        o = res[key.encode()]
        return {"status": o.status.value, "code": getattr(code_of(o.code), "name", int(o.code)),
                "exact": bool(np.array_equal(dst, pattern(spans * self.slot, seed))),
                "granted": self.client.counters()["grant_reads"] > reads, "seconds": time.monotonic() - t0}

    def release(self) -> dict[str, Any]:
        leases, self.leases = self.leases, []
        for lease in leases:
            if lease.ended is None:
                try:
                    lease.release().result(30)
                except KvcrError:
                    pass  # ended meanwhile: nothing left to release
        return {"released": len(leases)}

    def tables(self) -> dict[str, Any]:
        return {"tables": self.client.tables(), "node_loaded": self.client.grants().node_agent is not None}

    def serve(self) -> None:
        emit("ready", agent=self.client.core.agent.name)
        while (line := sys.stdin.readline()) and line.strip() != "quit":
            cmd, *args = line.split()
            if cmd == "deposit":
                emit("deposit", **self.deposit(args[0], int(args[1]), int(args[2])))
            elif cmd == "lease":
                emit("lease", **self.lease(int(args[0]), args[1:]))
            elif cmd == "deliver":
                emit("deliver", **self.deliver(args[0], int(args[1]), int(args[2]), args[3] == "1", int(args[4])))
            elif cmd == "release":
                emit("release", **self.release())
            elif cmd == "tables":
                emit("tables", **self.tables())
            else:
                emit("error", error=f"unknown command {cmd!r}")
        self.client.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("endpoint")
    p.add_argument("--slot", type=int, default=64 << 10)
    p.add_argument("--name", default="")
    args = p.parse_args()
    GrantClient(args.endpoint, args.slot, args.name or f"grants-{os.getpid()}").serve()


if __name__ == "__main__":
    main()
