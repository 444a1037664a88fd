"""A node's statistics (the ``stats`` reply) laid out for a person: what ``kvcr stats`` prints.

Pure: ``render`` turns the dict ``kvcr_node.stats.Stats.snapshot`` answers into a rich
renderable and ``to_text`` into plain text of a fixed width, so the layout is tested on a
fixed dict. Fields a node does not report are left out, never made up (an older node, or one
that counts no lookups, shows what it has). Colour only marks state: invariants green when
empty, red otherwise; uncertain writes and failures yellow when nonzero.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.table import Table
from rich.text import Text

PIPE_WIDTH = 110
"""Columns of the text written into a pipe or file (a terminal gives its own width); every section fits."""

BAR_WIDTH = 12
"""Cells of a pool's occupancy bar."""
NARROW_BAR_WIDTH = 8
WIDE = 105
"""Columns from which the pools table shows every column (below: no bytes, no leased slots)."""

SHOWN_COUNTERS = frozenset({"internal_errors", "uncertain_writes", "uncertain_resolved"})
"""Counters shown in a section of their own, left out of the general list."""


def size(nbytes: float) -> str:
    """Bytes in binary units: ``64 KiB``, ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" or nbytes == int(nbytes) else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def bar(used: int, total: int, width: int = BAR_WIDTH) -> Text:
    """An occupancy bar with its percentage, readable without colour (filled and empty cells differ)."""
    frac = used / total if total else 0.0
    filled = round(frac * width)
    if used and not filled:
        filled = 1  # one slot in use is never shown as empty
    if used < total:
        filled = min(filled, width - 1)  # nor a pool with a free slot as full
    style = "red" if frac >= 0.9 else "yellow" if frac >= 0.7 else "green"
    text = Text("█" * filled, style=style)
    text.append("░" * (width - filled), style="dim")
    text.append(f" {frac * 100:5.1f}%")
    return text


def _kv(pairs: Mapping[str, Any], title: str, columns: int) -> Group:
    """Names and values, sorted by name, in ``columns`` side-by-side column pairs."""
    table = Table(box=None, show_header=False, pad_edge=False)
    for _ in range(columns):
        table.add_column(style="bold", no_wrap=True)
        table.add_column(justify="right", no_wrap=True)
    names = sorted(pairs)
    rows = -(-len(names) // columns) if names else 0
    for r in range(rows):
        cells: list[str] = []
        for c in range(columns):
            i = c * rows + r
            if i < len(names):
                value = pairs[names[i]]
                cells.extend([names[i], f"{value:,}" if isinstance(value, int) else str(value)])
            else:
                cells.extend(["", ""])
        table.add_row(*cells)
    return Group(Text(title, style="bold"), table if names else Text("  none"))


def _nonzero(value: int, warn: str = "yellow") -> Text:
    return Text(f"{value:,}", style=warn if value else "")


def header(st: Mapping[str, Any]) -> Text:
    text = Text("node ", style="bold")
    text.append(str(st.get("node", "?")), style="bold cyan")
    if "version" in st:
        text.append(f"  kvcr {st['version']}")
    if "protocol_version" in st:
        text.append(f"  protocol v{st['protocol_version']}")
    if "incarnation" in st:
        text.append(f"  incarnation {int(st['incarnation']):016x}")
    text.append("\n")
    parts = [f"{name.replace('_', ' ')} {st[key]:,}" for name, key in (
        ("clients", "clients"), ("peer_sessions", "peer_sessions"), ("operations_pending", "operations_pending"))
        if key in st]
    if "policy" in st:
        policy = st["policy"]
        parts.append(f"eviction policy {policy.get('name', '?')} ({policy.get('failures', 0)} failures)")
    text.append("  ".join(parts))
    recovery = st.get("recovery")
    if isinstance(recovery, Mapping):
        # A node on a state directory: what it took back at its start (architecture §8).
        text.append("\n")
        kept = int(recovery.get("kept", 0))
        text.append(f"kept the cache of incarnation {kept:016x}: " if kept else "started empty on its state directory: ")
        text.append(f"{int(recovery.get('recovered', 0)):,} objects recovered")
        dropped = recovery.get("dropped") or {}
        if dropped:
            text.append("\n  records dropped: " + ", ".join(f"{why} {n:,}" for why, n in sorted(dropped.items())),
                        style="yellow")
        journal = st.get("journal")
        if isinstance(journal, Mapping):
            text.append(f"\n  journal: {int(journal.get('held', 0)):,} objects, generation {journal.get('generation', 0)}")
            failures = int(journal.get("write_failures", 0))
            if failures:
                text.append(f", {failures:,} write failures", style="red")
    return text


def pools(st: Mapping[str, Any], width: int = PIPE_WIDTH) -> Table:
    """One row per pool: memory, slot size, slots and bytes in use, occupancy, evictable slots, objects
    evicted, slots leases pin. Narrower than ``WIDE`` columns: without bytes and leased slots, a shorter bar."""
    wide = width >= WIDE
    table = Table(title="pools", title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, show_edge=False)
    columns = ["pool", "memory", "slot", "slots", "bytes", "occupancy", "evictable", "evicted", "leased"]
    if not wide:
        columns.remove("bytes")
        columns.remove("leased")
    for name in columns:
        table.add_column(name, justify="left" if name in ("pool", "memory", "occupancy") else "right", no_wrap=True)
    evictions = st.get("evictions", {})
    pinned = st.get("leases", {}).get("pinned_slots", {})
    for name in sorted(st.get("pools", {})):
        p = st["pools"][name]
        used, total, slot = p.get("allocated", 0), p.get("total", 0), p.get("slot_size", 0)
        cells: dict[str, str | Text] = {
            "pool": name, "memory": str(p.get("memory", "")), "slot": size(slot), "slots": f"{used:,}/{total:,}",
            "bytes": f"{size(used * slot)} / {size(total * slot)}",
            "occupancy": bar(used, total, BAR_WIDTH if wide else NARROW_BAR_WIDTH),
            "evictable": f"{p.get('evictable', 0):,}", "evicted": f"{evictions.get(name, 0):,}",
            "leased": f"{pinned.get(name, 0):,}",
        }
        table.add_row(*(cells[c] for c in columns))
    return table


class _Fitted:
    """A renderable built for the width it is given (the pools table drops columns when narrow)."""

    def __init__(self, build: Callable[[int], RenderableType]) -> None:
        self.build = build

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.build(options.max_width)


def objects(st: Mapping[str, Any]) -> Text:
    """Objects by state, evictions, the hit rate (when the node counts lookups), the projection cache."""
    text = Text("objects ", style="bold")
    text.append(f"{st.get('objects', 0):,} (ready {st.get('ready', 0):,}, writing {st.get('writing', 0):,})")
    text.append(f"  evictions {sum(st.get('evictions', {}).values()):,}")
    lookups = st.get("lookups")
    if lookups:  # a node before lookup counting reports none
        n, hits = lookups.get("keys", 0), lookups.get("hits", 0)
        rate = f"{hits / n * 100:.1f}%" if n else "-"
        text.append(f"  hit rate {rate} ({hits:,} of {n:,} keys looked up)")
    cache = st.get("projection_cache")
    if cache:
        text.append("\nprojection cache ", style="bold")
        text.append(f"{cache.get('size', 0):,} entries, {cache.get('hits', 0):,} hits, "
                    f"{cache.get('misses', 0):,} misses")
    return text


def operations(st: Mapping[str, Any]) -> Table:
    """Settled keys per operation: done (by status), failed (by code), aborted."""
    table = Table(title="operations (keys settled)", title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, show_edge=False)
    table.add_column("operation")
    table.add_column("done", justify="right")
    table.add_column("failed", justify="right")
    table.add_column("aborted", justify="right")
    table.add_column("by status and code")
    kinds: dict[str, dict[str, int]] = {}
    for name, n in st.get("outcomes", {}).items():
        kind, _, rest = name.partition(".")
        kinds.setdefault(kind, {})[rest] = n
    for kind in sorted(kinds):
        counts = kinds[kind]
        failed = sum(n for rest, n in counts.items() if rest.startswith("FAILED"))
        aborted = sum(n for rest, n in counts.items() if rest.startswith("ABORTED"))
        done = sum(counts.values()) - failed - aborted
        detail = ", ".join(f"{rest.removeprefix('FAILED.')} {n:,}" for rest, n in sorted(counts.items()))
        table.add_row(kind, f"{done:,}", _nonzero(failed), _nonzero(aborted), detail)
    if not kinds:
        table.add_row("none yet", "0", "0", "0", "")
    return table


def claims_and_leases(st: Mapping[str, Any]) -> Table:
    table = Table(title="claims and leases", title_justify="left", title_style="bold", box=None, show_header=False, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    claims = st.get("claims", {})
    if claims:
        table.add_row("claims", ", ".join(f"{name} {claims[name]:,}" for name in ("total", "operations", "handles", "leases")
                                          if name in claims))
    leases = {k: v for k, v in st.get("leases", {}).items() if k != "pinned_slots"}
    if leases:
        table.add_row("leases", ", ".join(f"{name.replace('_', ' ')} {leases[name]:,}" for name in sorted(leases)))
    transfers = st.get("transfers", {})
    if transfers:
        table.add_row("transfers", ", ".join(
            f"{name.replace('_', ' ')} {size(v) if name == 'bytes' else f'{v:,}'}" for name, v in sorted(transfers.items())))
    return table


def peers(st: Mapping[str, Any]) -> RenderableType:
    """Links to source nodes, one row each, with their state and writes; a count by state."""
    links: Mapping[str, Mapping[str, Any]] = st.get("peers", {})
    counters = st.get("counters", {})
    by_state: dict[str, int] = {}
    for link in links.values():
        by_state[str(link.get("state", "?"))] = by_state.get(str(link.get("state", "?")), 0) + 1
    title = f"peers: {len(links)} links" + (" (" + ", ".join(f"{n} {s}" for s, n in sorted(by_state.items())) + ")"
                                            if by_state else "")
    uncertain = sum(int(link.get("uncertain", 0)) for link in links.values())
    summary = Text("uncertain writes ", style="bold")
    summary.append_text(_nonzero(uncertain))
    summary.append(f" now, {counters.get('uncertain_writes', 0):,} ever, "
                   f"{counters.get('uncertain_resolved', 0):,} resolved")
    if not links:
        return Group(Text(title, style="bold"), summary)
    table = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, show_edge=False)
    for name in ("node", "state", "v", "writes", "queued", "uncertain", "leases"):
        table.add_column(name, justify="left" if name in ("node", "state") else "right", no_wrap=True)
    table.add_column("endpoint", overflow="fold")  # last, and folded when narrow: never cut short
    for endpoint in sorted(links):
        link = links[endpoint]
        table.add_row(str(link.get("node", "")), str(link.get("state", "")), str(link.get("version", "")),
                      f"{link.get('writes_outstanding', 0):,}", f"{link.get('queued', 0):,}",
                      _nonzero(int(link.get("uncertain", 0))), f"{link.get('leases', 0):,}", endpoint)
    return Group(table, summary)


def errors(st: Mapping[str, Any]) -> Text:
    text = Text("internal errors ", style="bold")
    text.append_text(_nonzero(int(st.get("counters", {}).get("internal_errors", 0)), "red"))
    text.append("  protocol errors ", style="bold")
    proto: Mapping[str, int] = st.get("protocol_errors", {})
    if proto:
        text.append(", ".join(f"{code} {n:,}" for code, n in sorted(proto.items())), style="yellow")
    else:
        text.append("0")
    return text


def invariants(st: Mapping[str, Any]) -> Text:
    """Green ``ok`` when the accounting check found nothing, else each breach in red."""
    text = Text("invariants ", style="bold")
    if "invariants" not in st:
        text.append("not checked (kvcr stats --audit)")
        return text
    breaches = st["invariants"]
    if not breaches:
        text.append("ok", style="bold green")
        return text
    text.append(f"{len(breaches)} BREACHED", style="bold red")
    for breach in breaches:
        text.append(f"\n  - {breach}", style="red")
    return text


def render(st: Mapping[str, Any]) -> Group:
    """Every section of a ``stats`` reply, top to bottom."""
    counters = {k: v for k, v in st.get("counters", {}).items() if k not in SHOWN_COUNTERS}
    sections: list[RenderableType] = [
        header(st), _Fitted(lambda width: pools(st, width)), objects(st), operations(st), claims_and_leases(st), peers(st), errors(st),
        _kv(counters, "counters", 3), _kv(st.get("tables", {}), "tables (entries)", 3), invariants(st),
    ]
    spaced: list[RenderableType] = []
    for section in sections:
        spaced.extend([section, Text()])
    return Group(*spaced[:-1])


def to_text(st: Mapping[str, Any], width: int = PIPE_WIDTH) -> str:
    """``render`` as plain text ``width`` columns wide, without colour (tests, logs, pipes)."""
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, force_terminal=False, no_color=True,
                      legacy_windows=False, emoji=False, highlight=False)
    console.print(render(st))
    return "".join(line.rstrip() + "\n" for line in out.getvalue().splitlines())
