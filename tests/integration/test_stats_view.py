"""``kvcr stats`` against real nodes: the person's view of a node with several pools and a link
to a peer, ``--json`` for scripts, ``--watch --count`` and an unreachable node."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvcr_client.statsview import to_text
from kvcr_testing.layouts import plain_layout
from kvcr_testing.remote import Sites, warm_link

TOOL_TIMEOUT_S = 60


def kvcr(*argv: str, columns: int | None = None) -> subprocess.CompletedProcess[str]:
    """Run the ``kvcr`` tool to completion (bounded), output captured (so no terminal: plain text)."""
    code = "import sys; from kvcr_client.tool import main; sys.exit(main())"
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=TOOL_TIMEOUT_S, check=False, env=env)


def test_stats_view_of_a_node_with_pools_and_a_peer(sites: Sites) -> None:
    a, b = sites.start("a", "b")
    layout = plain_layout(4)
    src = b.deposit(b"remote", layout, seed=1)
    a.deposit(b"local", plain_layout(40), seed=2)
    warm_link(a, b, b"remote", layout, src, "r-view")  # A now has a ready link to B
    # 1 of 4 keys looked up is held here: a hit rate of 25 % from the node's own lookup counts.
    a.client.query([b"local", b"absent-1", b"absent-2", b"absent-3"]).result(5)

    # Wide enough for the test's long ipc paths in one line (a narrower view folds them).
    proc = kvcr("stats", "--endpoint", a.endpoint, "--timeout", "5", "--audit", columns=160)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    st = a.stats()
    lines = text.splitlines()
    assert lines[0].startswith(f"node {st['node']}  kvcr {st['version']}  protocol v{st['protocol_version']}")
    assert f"incarnation {st['incarnation']:016x}" in lines[0]
    # One row per pool with its memory, slot size, slots in use and bar; the 40-span object fills kv to 40/64.
    rows = {line.split()[0]: line for line in lines if line.startswith(" ") and line.split()[0] in st["pools"]}
    assert set(rows) == {"kv", "full", "swa", "state"}
    assert rows["kv"].split()[1:5] == ["dram", "64", "KiB", "40/64"] and "62.5%" in rows["kv"]
    assert rows["state"].split()[1:4] == ["dram", "1.5", "MiB"] and "0/4" in rows["state"]
    assert "█" in rows["kv"] and "░" in rows["kv"]
    # The link to B, by endpoint, node and state; nothing uncertain; a clean node.
    assert "peers: 1 links (1 ready)" in text
    link = next(line for line in lines if b.endpoint in line)
    assert link.split()[:2] == [b.stats()["node"], "ready"]
    assert "uncertain writes 0 now" in text
    assert "deliver" in text and "deposit" in text
    assert st["lookups"] == {"keys": 4, "hits": 1}
    assert "hit rate 25.0% (1 of 4 keys looked up)" in text
    assert lines[-1].rstrip() == "invariants ok"
    # The tool prints what the pure view makes of the same reply (apart from figures that moved).
    assert len(text.splitlines()) == len(to_text(st, width=160).splitlines())

    as_json = kvcr("stats", "--endpoint", a.endpoint, "--json")
    assert as_json.returncode == 0, as_json.stderr
    parsed = json.loads(as_json.stdout)
    assert as_json.stdout == json.dumps(parsed, indent=2, sort_keys=True) + "\n"
    assert parsed["pools"]["kv"]["allocated"] == 40 and parsed["pools"]["kv"]["memory"] == "dram"
    assert list(parsed["peers"]) == [b.endpoint]


def test_watch_refreshes_count_times(sites: Sites) -> None:
    (a,) = sites.start("w")
    proc = kvcr("stats", "--endpoint", a.endpoint, "--watch", "0.05", "--count", "3", "--audit")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("invariants ok") == 3
    # Without --audit the node runs no accounting check, and the view says so.
    proc = kvcr("stats", "--endpoint", a.endpoint, "--watch", "0.05", "--count", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("invariants not checked (kvcr stats --audit)") == 2
    frames = kvcr("stats", "--endpoint", a.endpoint, "--json", "--watch", "0.05", "--count", "2")
    assert frames.returncode == 0, frames.stderr
    decoder = json.JSONDecoder()
    first, end = decoder.raw_decode(frames.stdout)
    second, _ = decoder.raw_decode(frames.stdout[end:].lstrip())
    assert first["node"] == second["node"]


def test_unreachable_node_exits_1_with_one_line(ipc_dir: object) -> None:
    proc = kvcr("stats", "--endpoint", f"ipc://{ipc_dir}/nobody.sock", "--timeout", "0.5")
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvcr: error: "), proc.stderr
    assert "nobody.sock" in lines[0]
    assert proc.stdout == ""


def test_bad_watch_arguments_are_refused() -> None:
    for argv in (("--watch", "0"), ("--watch", "1", "--count", "0")):
        proc = kvcr("stats", "--endpoint", "ipc:///nonexistent/x.sock", *argv)
        assert proc.returncode == 2 and "must be positive" in proc.stderr
