"""``kvcr``: the command-line tool that talks to a node (``stats``) and makes CurveZMQ keys."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvcr_client.client import Client
from kvcr_client.errors import KvcrError
from kvcr_client.events import print_events
from kvcr_io import package_version
from kvcr_io.endpoints import default_endpoint
from kvcr_io.keys import write_keypair


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvcr``: ``stats``, ``events``, ``keygen``, ``version``."""
    p = argparse.ArgumentParser(prog="kvcr", description="Talk to a kvcr node.")
    sub = p.add_subparsers(dest="command", required=True)
    kg = sub.add_parser("keygen", help="write a CurveZMQ key pair: PREFIX.key (secret) and PREFIX.pub")
    kg.add_argument("prefix", type=Path)
    st = sub.add_parser("stats", help="print a node's statistics as JSON")
    st.add_argument("--endpoint", default=default_endpoint())
    st.add_argument("--timeout", type=float, default=5.0)
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
    try:
        with Client(args.endpoint, name="kvcr-cli", timeout=args.timeout) as client:
            print(json.dumps(client.stats().result(args.timeout), indent=2, sort_keys=True))
    except (KvcrError, TimeoutError) as exc:
        print(f"kvcr: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
