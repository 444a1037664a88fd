"""vLLM's engine (in this process) with ``KvcrConnector`` across a frozen node and a restarted one.

Run in the vLLM environment as ``python vllm_reconnect_driver.py IPC_DIR``; prints one JSON
line for ``test_vllm_reconnect.py``. It starts its own node (heartbeats every 500 ms, so a
client finds a silent node lost within 2.5 s), and with the tiny Llama of
``examples/vllm_prefix.py`` (connector ``vllm_faults.TimedLookups``, which times every
``get_num_new_matched_tokens``):

1. saves a prompt's blocks and loads them in a second generation (the reference);
2. freezes the node (SIGSTOP) for ``FREEZE_S``: a one-block prompt (nothing looked up: its
   save gives up at ``save_timeout_s``), a generation while the session still stands (its
   lookup answered "not yet", then a miss once the heartbeat sent with the lease is unanswered
   for half of ``lookup_timeout_s``, so the step's save is skipped, not waited on too) and one once both sides
   found the node lost (a miss at once, the save skipped), all served by recompute;
3. SIGCONT: generates the first prompt until its blocks load again (the same incarnation);
4. kill -9 and a new node on the same endpoint (a new incarnation, empty): generates until
   the blocks are saved anew and load again.

Every generation's tokens are the reference's; every loaded block's bytes (by digest) are
the ones saved. The connector logs through vLLM's logger (its lines are the test's to read).
The restarted node is at rest at the end (no lease, claim or transfer left).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1] / "examples"), str(HERE.parent)]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import vllm_faults  # noqa: E402
import vllm_prefix  # noqa: E402
from vllm_digests import BlockDigests  # noqa: E402

from kvcr_client import Client  # noqa: E402
from kvcr_testing.health import assert_clean  # noqa: E402
from kvcr_testing.nodes import frozen, start_node  # noqa: E402

FREEZE_S = 5.0
"""How long the node stays frozen (the stall of issue 26)."""
BOUND_S = 30.0
"""The most a wait for the connector to see the node come and go takes."""
TRIES = 16
"""Generations of the first prompt allowed, after the node is back, until its blocks load."""
EXTRA = {"lookup_timeout_s": 0.5, "save_timeout_s": 0.5}
NODE_ARGS = ("--pool", "kv:16KiB:1024", "--heartbeat-ms", "500")


def until(ready: Any, what: str) -> None:
    deadline, pause = time.monotonic() + BOUND_S, threading.Event()
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {BOUND_S} s: {what}")
        pause.wait(0.05)


def main() -> int:
    ipc_dir = Path(sys.argv[1])
    endpoint = f"ipc://{ipc_dir}/reconnect.sock"
    node = start_node(endpoint, *NODE_ARGS)
    try:
        llm = vllm_prefix.engine(endpoint, None, 4, 512, "vllm_faults.TimedLookups", EXTRA)
        conn = vllm_faults.TimedLookups.scheduler
        assert conn is not None and conn.connector_scheduler is not None
        link = conn.connector_scheduler.link
        first, second, third = (
            vllm_prefix.prompt(100),
            [(5 * i + 1) % 500 + 10 for i in range(100)],
            [(3 * i + 2) % 500 + 10 for i in range(100)],
        )
        unseen = [(7 * i + 3) % 500 + 10 for i in range(32)]
        report: dict[str, Any] = {"generations": []}

        def generate(tokens: list[int], phase: str) -> dict[str, Any]:
            before, calls = vllm_prefix.counts(llm), len(vllm_faults.TimedLookups.calls)
            saves = len(vllm_faults.TimedLookups.saves)
            began = time.perf_counter()
            out = vllm_prefix.generate(llm, tokens)
            after = vllm_prefix.counts(llm)
            step = {
                "phase": phase,
                "tokens": out["tokens"],
                "s": time.perf_counter() - began,
                "counts": {k: v - before[k] for k, v in after.items() if v != before[k]},
                "lookups": vllm_faults.TimedLookups.calls[calls:],
                "saves": vllm_faults.TimedLookups.saves[saves:],
            }
            report["generations"].append(step)
            return step

        reference = generate(first, "saved")
        generate(first, "loaded")
        refs = {"unseen": None, "second": None, "third": None}
        began = time.monotonic()
        with frozen(node):
            # One block exactly: nothing to look up (a prompt's last token is always computed),
            # so only the worker's save meets the frozen node, and gives up at save_timeout_s.
            refs["unseen"] = generate(unseen, "frozen-unseen")["tokens"]
            refs["second"] = generate(second, "frozen")["tokens"]
            until(lambda: not link.ready(), "the scheduler side found the frozen node lost")
            refs["third"] = generate(third, "away")["tokens"]
            threading.Event().wait(max(0.0, FREEZE_S - (time.monotonic() - began)))
        report["frozen_s"] = time.monotonic() - began
        for _ in range(TRIES):
            if generate(first, "thawed")["counts"].get("blocks_loaded"):
                break
            threading.Event().wait(0.5)
        node.kill()
        until(lambda: not link.ready(), "the scheduler side found the killed node lost")
        node = start_node(endpoint, *NODE_ARGS)
        for _ in range(TRIES):
            if generate(first, "restarted")["counts"].get("blocks_loaded"):
                break
            threading.Event().wait(0.5)
        # Recomputed without kvcr, the other prompts give what they give with it.
        report["others_same"] = (
            generate(unseen, "after")["tokens"] == refs["unseen"]
            and generate(second, "after")["tokens"] == refs["second"]
            and generate(third, "after")["tokens"] == refs["third"]
        )
        report["same_tokens"] = all(
            g["tokens"] == reference["tokens"]
            for g in report["generations"]
            if g["phase"] in ("saved", "loaded", "thawed", "restarted")
        )
        saved = BlockDigests.saved_digests
        report["blocks_verified"] = bool(BlockDigests.loaded_digests) and all(
            saved.get(k) == v for k, v in BlockDigests.loaded_digests.items()
        )
        report["totals"] = vllm_prefix.counts(llm)
        with Client(endpoint, name="vllm-check") as c:
            st = assert_clean(c)
        report["leases_held"] = st.get("leases", {}).get("held", 0)
        print(json.dumps(report), flush=True)
    finally:
        node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
