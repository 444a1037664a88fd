"""Ask Dynamo's tree, fed by nodes' events, which node holds the longest prefix of some keys
(run in ``.venv-dynamo`` by ``tests/cluster/test_dynamo_router.py``; prints a JSON report).

    route_keys.py --follow 0=ipc:///run/a.ev --follow 1=ipc:///run/b.ev --keys HEX,HEX,... [--want N]

Follows every node given (worker id = the number before ``=``) until the best node holds at
least ``--want`` of the keys in the tree, or ``--timeout`` seconds pass; reports the
scores, the best node and the index's counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from kvcr_client.integrations.dynamo import DynamoIndex


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--follow", action="append", required=True, help="WORKER=EVENTS_ENDPOINT")
    parser.add_argument("--keys", required=True, help="the request's block keys, hex, comma separated, in order")
    parser.add_argument("--want", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    keys = [bytes.fromhex(k) for k in args.keys.split(",")]
    with DynamoIndex() as index:
        for spec in args.follow:
            worker, _, endpoint = spec.partition("=")
            index.follow(int(worker), endpoint)
        deadline = time.monotonic() + args.timeout
        while index.best(keys)[1] < args.want and time.monotonic() < deadline:
            index.poll(0.05)
        best, held = index.best(keys)
        print(json.dumps({"best": best, "held": held, "scores": {str(w): n for w, n in index.scores(keys).items()},
                          "parents": {str(w): len(index.mirror(int(w)).parents) for w in (s.partition("=")[0] for s in args.follow)},
                          "index": dataclasses.asdict(index.counts)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
