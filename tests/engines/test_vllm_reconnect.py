"""vLLM's engine with ``KvcrConnector`` survives a frozen node and a restarted one (issue 26).

``vllm_reconnect_driver.py`` (run in the vLLM environment, the engine in its process) freezes
its node for 5 s and later kills it and starts a new one on the same endpoint. Checked here:
while frozen, the scheduler side's ``get_num_new_matched_tokens`` never waits on the node
(each call within a generous behaviour bound, ``CALL_BOUND_S``; the longest is printed), a
step's save gives up at ``save_timeout_s`` (``SAVE_BOUND_S``), the requests are served by
recompute; once the node is back (the same incarnation, then a new
one) both sides reconnect without vLLM restarting, the prompt's blocks are saved anew where
the node lost them and load again, with the reference's tokens and the saved bytes (by
digest); the connector counts the outages and reconnects; its INFO lines come through
vLLM's logger in vLLM's format; the restarted node is left at rest.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from kvcr_testing.engines import VLLM_PY, require_engines, run_script_output
from kvcr_testing.nodes import short_ipc_dir

TIMEOUT_S = 300.0
DRIVER = Path(__file__).with_name("vllm_reconnect_driver.py")
CALL_BOUND_S = 0.1
"""A behaviour bound, not a performance figure: a call that waited on the frozen node would
take ``lookup_timeout_s`` (0.5 s here) or the session's silence (2.5 s)."""

SAVE_BOUND_S = 1.5
"""A behaviour bound: a save waits ``save_timeout_s`` (0.5 s here) for a frozen node; one that
waited for the session's silence would take 2.5 s."""

require_engines(VLLM_PY)


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_the_connector_rides_out_a_frozen_node_and_a_restarted_one() -> None:
    here = str(Path(__file__).parent)
    with short_ipc_dir("vllm-rc") as ipc_dir:
        r, output = run_script_output(
            DRIVER,
            str(ipc_dir),
            timeout_s=TIMEOUT_S,
            python=VLLM_PY,
            env={"PYTHONPATH": os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH"))))},
        )
    gens = r["generations"]
    by_phase: dict[str, list[dict]] = {}
    for g in gens:
        by_phase.setdefault(g["phase"], []).append(g)
    assert r["same_tokens"] and r["others_same"] and r["blocks_verified"], r
    assert by_phase["loaded"][0]["counts"].get("blocks_loaded") == 3, by_phase["loaded"]

    # Frozen: nothing loaded, every call quick. The lookup answered "not yet", then a miss once
    # the heartbeat sent with its lease went unanswered past the bound; or, where the machine
    # was slow enough that a heartbeat sent before it had gone unanswered that long already, a
    # miss at once (the scheduler side counts it node_stalled, as the worker counts the step).
    # Both are the frozen node's miss; which one depends only on the machine's speed.
    frozen, away = by_phase["frozen"][0], by_phase["away"][0]
    assert not frozen["counts"].get("blocks_loaded"), frozen
    if frozen["counts"].get("lookups_timed_out"):
        assert frozen["counts"]["lookups_timed_out"] == 1 and frozen["counts"].get("node_stalled") == 1, frozen
        assert any(answer is None for _, answer in frozen["lookups"]), frozen["lookups"]
    else:
        assert frozen["counts"].get("node_stalled") == 2, frozen
        assert all(answer == 0 for _, answer in frozen["lookups"]), frozen["lookups"]
    assert away["counts"].get("node_away", 0) >= 1 and not away["counts"].get("blocks_loaded"), away
    calls = [s for g in (frozen, away) for s, _ in g["lookups"]]
    print(
        f"get_num_new_matched_tokens with the node frozen: {len(calls)} calls, longest {max(calls) * 1000:.1f} ms, "
        f"generations {frozen['s']:.2f} s and {away['s']:.2f} s (frozen {r['frozen_s']:.1f} s)"
    )
    assert max(calls) < CALL_BOUND_S, calls
    # A save that met the frozen node first gave up at save_timeout_s (nothing written, saves
    # paused), not at the session's silence.
    unseen = by_phase["frozen-unseen"][0]
    assert unseen["counts"].get("saves_timed_out") == 1 and not unseen["counts"].get("blocks_saved"), unseen
    assert not unseen["counts"].get("node_stalled"), unseen
    print(f"wait_for_save meeting the frozen node: longest {max(unseen['saves']) * 1000:.0f} ms")
    assert max(unseen["saves"]) < SAVE_BOUND_S, unseen["saves"]
    # Once the scheduler side's lookup found the node stalled (its heartbeat unanswered for
    # half of lookup_timeout_s), the step's metadata said so and the save was skipped, not waited on.
    assert not frozen["counts"].get("saves_timed_out"), frozen
    print(f"wait_for_save with the node known stalled: longest {max(frozen['saves']) * 1000:.1f} ms")
    assert max(frozen["saves"]) < CALL_BOUND_S, frozen["saves"]
    # Once the scheduler side found the node lost, the step's metadata said it was away: the
    # worker saved nothing and waited for nothing, neither a save nor a welcome.
    print(f"wait_for_save with the node known away: longest {max(away['saves'], default=0.0) * 1000:.1f} ms")
    assert max(away["saves"], default=0.0) < CALL_BOUND_S, away["saves"]

    # Back: the blocks load again after SIGCONT, and after a restart once saved anew.
    assert by_phase["thawed"][-1]["counts"].get("blocks_loaded") == 3, by_phase["thawed"]
    restarted = by_phase["restarted"]
    assert restarted[-1]["counts"].get("blocks_loaded") == 3, restarted
    assert any(g["counts"].get("blocks_saved") == 3 for g in restarted), restarted
    totals = r["totals"]
    # Each side (scheduler, one worker) saw two outages and reconnected after each.
    assert totals["node_outages"] == 4 and totals["reconnects"] == 4, totals
    assert totals["node_away_ms"] > 0 and totals["load_errors"] == 0, totals

    # The connector's INFO lines, in vLLM's format (process, level, date, [file:line]).
    info = [line for line in output if re.search(r"\bINFO \d\d-\d\d [\d:]+ \[[a-z_]+\.py:\d+\] kvcr: ", line)]
    assert any("layers registered" in line for line in info), output[-40:]
    assert any("reconnected to" in line for line in info), output[-40:]
    print("\n".join(line for line in output if "] kvcr: " in line))
    assert r["leases_held"] == 0
