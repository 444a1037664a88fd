"""What ``kvcr events`` shows: inventory event batches as lines for people or JSON objects for scripts.

Pure but for ``print_events``, which follows a node's stream (``kvcr_client.events.EventStream``)
and prints each event as it comes.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from kvcr_client.errors import KvcrError
from kvcr_client.events import EventStream
from kvcr_protocol.events import Cleared, EventBatch, Removed, Stored


def event_lines(batch: EventBatch, seq: int | None = None) -> list[str]:
    """One line per event, for people: ``seq node stored tier pools key...``."""
    head = f"{'' if seq is None else str(seq) + ' '}{batch.node}:{batch.incarnation:x}"
    lines = []
    for event in batch.events:
        if isinstance(event, Cleared):
            lines.append(f"{head} cleared")
            continue
        what = "stored" if isinstance(event, Stored) else f"removed ({event.reason.value})"
        keys = " ".join(k.hex() for k in event.keys)
        lines.append(f"{head} {what} {event.tier} {','.join(event.pools)} {len(event.keys)}: {keys}")
    return lines


def event_json(batch: EventBatch) -> list[dict[str, Any]]:
    """One JSON-ready object per event: keys in hex."""
    out: list[dict[str, Any]] = []
    for event in batch.events:
        obj: dict[str, Any] = {"node": batch.node, "incarnation": batch.incarnation, "ts": batch.ts,
                               "event": event.KIND.value}
        if not isinstance(event, Cleared):
            obj.update(keys=[k.hex() for k in event.keys], pools=list(event.pools), tier=event.tier)
            if isinstance(event, Removed):
                obj["reason"] = event.reason.value
        out.append(obj)
    return out


def print_events(endpoint: str, replay: str | None, as_json: bool, count: int | None, timeout: float | None) -> int:
    """``kvcr events``: print each event, one a line, until ``count`` events, ``timeout`` seconds
    without a batch, or Ctrl-C. Exit status 0, or 1 when the stream fails."""
    printed = 0
    try:
        with EventStream(endpoint, replay) as stream:
            while count is None or printed < count:
                batches = stream.recv(_PRINT_POLL_S if timeout is None else timeout)
                if not batches and timeout is not None:
                    break
                for seq, batch in batches:
                    lines = ([json.dumps({"seq": seq, **obj}, sort_keys=True) for obj in event_json(batch)] if as_json
                             else event_lines(batch, seq))
                    for line in lines[: None if count is None else count - printed]:
                        print(line, flush=True)
                        printed += 1
            if not stream.complete:
                print(f"kvcr: warning: {stream.lost} batches were gone from the node's ring", file=sys.stderr)
    except KeyboardInterrupt:
        return 0
    except (KvcrError, ValueError) as exc:
        print(f"kvcr: error: {exc}", file=sys.stderr)
        return 1
    return 0


_PRINT_POLL_S = 1.0
"""How often ``print_events`` wakes while waiting with no timeout (so Ctrl-C is prompt)."""
