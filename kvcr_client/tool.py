"""``kvcr``: the command-line tool that talks to a node (``stats``) and makes CurveZMQ keys."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcr_client.client import Client
from kvcr_client.errors import KvcrError
from kvcr_client.eventsview import print_events
from kvcr_io import package_version
from kvcr_io.endpoints import default_endpoint
from kvcr_io.keys import write_keypair

if TYPE_CHECKING:
    from rich.console import Console


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvcr``: ``stats``, ``events``, ``keygen``, ``version``."""
    p = argparse.ArgumentParser(prog="kvcr", description="Talk to a kvcr node.")
    sub = p.add_subparsers(dest="command", required=True)
    kg = sub.add_parser("keygen", help="write a CurveZMQ key pair: PREFIX.key (secret) and PREFIX.pub")
    kg.add_argument("prefix", type=Path)
    st = sub.add_parser("stats", help="show a node's statistics (--json: as JSON)")
    st.add_argument("--endpoint", default=default_endpoint())
    st.add_argument("--timeout", type=float, default=5.0)
    st.add_argument("--json", action="store_true", help="the stats reply as JSON, for scripts")
    st.add_argument("--watch", type=float, nargs="?", const=WATCH_INTERVAL_S, metavar="SECONDS",
                    help=f"refresh every SECONDS (default {WATCH_INTERVAL_S:g}) until Ctrl-C")
    st.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N refreshes")
    st.add_argument("--audit", action="store_true",
                    help="also check the node's accounting (walks every object on the node's loop: "
                         "on a large cache, a pause of the node each time)")
    sub.add_parser("version", help="print the kvcr version")
    ev = sub.add_parser("events", help="print a node's inventory events (stored, removed, cleared), one a line")
    ev.add_argument("endpoint", help="the node's events endpoint (its --events-endpoint)")
    ev.add_argument("--replay", help="its replay endpoint (default: derived as the node derives it)")
    ev.add_argument("--json", action="store_true", help="one JSON object a line")
    ev.add_argument("--count", type=int, help="stop after this many events")
    ev.add_argument("--timeout", type=float, help="stop after this many seconds without an event")
    args = p.parse_args(argv)
    if args.command == "version":
        print(package_version())
        return 0
    if args.command == "events":
        return print_events(args.endpoint, args.replay, args.json, args.count, args.timeout)
    if args.command == "keygen":
        public, secret = write_keypair(args.prefix)
        print(f"wrote {secret} (secret, mode 600) and {public}")
        return 0
    if (args.watch is not None and args.watch <= 0) or (args.count is not None and args.count < 1):
        p.error("--watch SECONDS and --count N must be positive")
    try:
        with Client(args.endpoint, name="kvcr-cli", timeout=args.timeout) as client:
            if args.watch is None:
                show(client.stats(audit=args.audit).result(args.timeout), args.json)
            else:
                watch(client, args)
    except (KvcrError, TimeoutError) as exc:
        print(f"kvcr: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


WATCH_INTERVAL_S = 2.0
"""``kvcr stats --watch`` refreshes this often unless told otherwise."""


def show(stats: dict[str, Any], as_json: bool) -> None:
    """One ``stats`` reply: JSON (sorted, indented) or laid out for a person."""
    if as_json:
        print(json.dumps(stats, indent=2, sort_keys=True), flush=True)
        return
    from kvcr_client.statsview import render

    console().print(render(stats))


def console() -> Console:
    """Rich's console on stdout; into a pipe as wide as ``$COLUMNS`` or ``statsview.PIPE_WIDTH``."""
    from rich.console import Console

    from kvcr_client.statsview import PIPE_WIDTH

    out = Console(highlight=False)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out.width = PIPE_WIDTH
    return out


def watch(client: Client, args: argparse.Namespace) -> None:
    """Ask for ``stats`` every ``args.watch`` seconds, ``args.count`` times or until Ctrl-C.

    On a terminal the view is redrawn in place (rich ``Live``); into a pipe, or with
    ``--json``, each refresh is printed after the last.
    """
    from rich.live import Live

    from kvcr_client.statsview import render

    out = console()
    n = 0
    live = Live(console=out, auto_refresh=False) if out.is_terminal and not args.json else None
    try:
        if live is not None:
            live.start()
        while args.count is None or n < args.count:
            if n:
                time.sleep(args.watch)
            stats = client.stats(audit=args.audit).result(args.timeout)
            n += 1
            if live is not None:
                live.update(render(stats), refresh=True)
            else:
                show(stats, args.json)
    finally:
        if live is not None:
            live.stop()


if __name__ == "__main__":
    sys.exit(main())
