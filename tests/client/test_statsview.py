"""``kvcr stats`` as a person reads it (``kvcr_client.statsview``): the layout of a fixed stats
reply, compared with a text snapshot, and what each section does with missing or alarming fields.

The snapshot is rewritten, instead of compared, with ``KVCR_UPDATE_SNAPSHOTS=1``; read the
diff before committing it.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from kvcr_client.statsview import bar, invariants, render, size, to_text

SNAPSHOT = Path(__file__).parent / "snapshots" / "stats_view.txt"

STATS: dict[str, Any] = {
    "node": "edge-7",
    "version": "0.1.0",
    "incarnation": 0x633237E94D0BA963,
    "protocol_version": 4,
    "pools": {
        "kv": {"allocated": 48, "evictable": 40, "free": 16, "objects": 3, "slot_size": 65536, "total": 64,
               "memory": "dram"},
        "full": {"allocated": 31, "evictable": 2, "free": 1, "objects": 1, "slot_size": 65536, "total": 32,
                 "memory": "hbm:0"},
        "swa": {"allocated": 0, "evictable": 0, "free": 32, "objects": 0, "slot_size": 16384, "total": 32,
                "memory": "dram"},
        "state": {"allocated": 1, "evictable": 0, "free": 3, "objects": 1, "slot_size": 1572864, "total": 4,
                  "memory": "dram"},
    },
    "objects": 5,
    "ready": 4,
    "writing": 1,
    "evictions": {"full": 12, "kv": 3, "state": 0, "swa": 0},
    "claims": {"total": 3, "handles": 1, "operations": 1, "leases": 1},
    "leases": {"held": 1, "objects": 1, "pinned_slots": {"full": 0, "kv": 8, "state": 0, "swa": 0}, "at_sources": 0,
               "granted": 4, "released": 3},
    "clients": 3,
    "operations_pending": 2,
    "transfers": {"bytes": 3 << 30, "failed": 1, "in_flight": 2, "notified": 7, "notify_failed": 0, "posted": 40},
    "peers": {
        "tcp://10.0.0.8:5555": {"node": "edge-8", "state": "ready", "version": 4, "incarnation": 77,
                                "writes_outstanding": 2, "queued": 1, "uncertain": 1, "leases": 0},
        "tcp://10.0.0.9:5555": {"node": "edge-9", "state": "connecting", "version": 0, "incarnation": 0,
                                "writes_outstanding": 0, "queued": 3, "uncertain": 0, "leases": 0},
    },
    "peer_sessions": 1,
    "outcomes": {"deliver.OK": 120, "deliver.FAILED.NOT_FOUND": 4, "deliver.ABORTED": 1, "deposit.STORED": 30,
                 "deposit.DUPLICATE": 2, "deposit.FAILED.NO_SPACE": 1, "fetch.OK": 5},
    "protocol_errors": {"BAD_REQUEST": 2, "UNKNOWN_REGION": 1},
    "lookups": {"keys": 200, "hits": 150},
    "counters": {"hellos": 4, "internal_errors": 1, "uncertain_writes": 2,
                 "uncertain_resolved": 1, "remote_writes": 9},
    "projection_cache": {"size": 3, "hits": 90, "misses": 3},
    "policy": {"name": "lru", "failures": 0},
    "tables": {"sessions": 4, "retired_sessions": 0, "handles": 1, "waiters": 0, "links": 2, "hints": 1},
    "invariants": ["pool kv: 47 slots allocated, objects hold 48"],
}


def test_layout_matches_the_snapshot() -> None:
    text = to_text(STATS)
    if os.environ.get("KVCR_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.write_text(text)
    assert text == SNAPSHOT.read_text(), f"stats view changed; run with KVCR_UPDATE_SNAPSHOTS=1 and read the diff:\n{text}"


def test_every_section_appears_with_its_figures() -> None:
    text = to_text(STATS)
    for expected in (
        "node edge-7", "kvcr 0.1.0", "protocol v4", "incarnation 633237e94d0ba963",
        "hbm:0", "1.5 MiB", "48/64", "3 MiB / 4 MiB", "75.0%", "96.9%",
        "objects 5 (ready 4, writing 1)", "evictions 15", "hit rate 75.0% (150 of 200 keys looked up)",
        "NOT_FOUND 4", "NO_SPACE 1", "claims", "total 3", "bytes 3 GiB",
        "peers: 2 links (1 connecting, 1 ready)", "tcp://10.0.0.8:5555", "edge-9",
        "uncertain writes 1 now, 2 ever, 1 resolved", "internal errors 1", "BAD_REQUEST 2, UNKNOWN_REGION 1",
        "remote_writes", "retired_sessions", "invariants 1 BREACHED", "pool kv: 47 slots allocated",
    ):
        assert expected in text, expected
    # The counters shown in sections of their own are not listed again.
    assert "internal_errors" not in text and "uncertain_resolved" not in text


def test_a_node_that_counts_no_lookups_gets_no_hit_rate() -> None:
    st = copy.deepcopy(STATS)
    del st["lookups"]
    text = to_text(st)
    assert "hit rate" not in text
    assert "projection cache 3 entries, 90 hits, 3 misses" in text


def test_missing_fields_are_left_out_not_made_up() -> None:
    text = to_text({"node": "old", "pools": {}})
    assert "node old" in text
    assert "incarnation" not in text and "hit rate" not in text
    assert "invariants not checked (kvcr stats --audit)" in text
    assert "peers: 0 links" in text


def test_invariants_green_when_empty_red_otherwise() -> None:
    ok = invariants({"invariants": []})
    assert ok.plain == "invariants ok"
    assert any("green" in str(span.style) for span in ok.spans)
    bad = invariants({"invariants": ["a", "b"]})
    assert bad.plain.splitlines() == ["invariants 2 BREACHED", "  - a", "  - b"]
    assert all("green" not in str(span.style) for span in bad.spans)
    assert any("red" in str(span.style) for span in bad.spans)


def test_bar_and_sizes() -> None:
    assert bar(0, 64, 8).plain == "░░░░░░░░   0.0%"
    assert bar(1, 1000, 8).plain.startswith("█░░░░░░░"), "one slot in use never shows as empty"
    assert bar(64, 64, 8).plain == "████████ 100.0%"
    assert bar(0, 0, 4).plain == "░░░░   0.0%"
    assert [size(n) for n in (0, 512, 65536, 1572864, 3 << 30)] == ["0 B", "512 B", "64 KiB", "1.5 MiB", "3 GiB"]


def test_render_is_a_renderable_for_a_live_view() -> None:
    from rich.console import Console

    console = Console(width=200, record=True, color_system="truecolor", force_terminal=True)
    console.print(render(STATS))
    assert "\x1b[" in console.export_text(styles=True)


def test_a_narrow_terminal_keeps_the_pools_readable() -> None:
    text = to_text(STATS, width=80)
    rows = [line for line in text.splitlines() if line.split()[:1] in (["full"], ["kv"], ["state"], ["swa"])]
    assert len(rows) == 4 and all(len(line) <= 80 for line in text.splitlines())
    assert rows[0].split()[:5] == ["full", "hbm:0", "64", "KiB", "31/32"] and "96.9%" in rows[0]
    assert "…" not in "".join(rows), "nothing in a pool row is cut short"


def test_a_restarted_node_says_what_it_took_back() -> None:
    st = {**copy.deepcopy(STATS), "recovery": {"kept": 0x1234, "recovered": 100_000, "seconds": 0.8,
                                               "dropped": {"torn": 1, "digest_mismatch": 2}},
          "journal": {"generation": 3, "held": 99_990, "bytes": 10, "compactions": 2, "write_failures": 1}}
    text = to_text(st)
    assert "kept the cache of incarnation 0000000000001234: 100,000 objects recovered" in text
    assert "records dropped: digest_mismatch 2, torn 1" in text
    assert "journal: 99,990 objects, generation 3, 1 write failures" in text
    empty = to_text({**copy.deepcopy(STATS), "recovery": {"kept": 0, "recovered": 0, "dropped": {}}})
    assert "started empty on its state directory: 0 objects recovered" in empty
    assert "kept the cache" not in to_text(STATS)
