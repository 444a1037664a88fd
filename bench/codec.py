"""Codec cost: decoding and validating large messages, record form (versions 1-2) against
the column form of version 3 (spec sections 6.7 to 6.9).

Measured in this process, with ``timeit`` (best of a few short repeats; a second or two in
all): a deliver of one key of 1024 spans, the same with a layer plan of 32 groups, the
reply to a 1000-key query, and the 1000-key query itself. Times are per message.

Run: ``python bench/codec.py`` (``--json`` prints one JSON object as the last line).
"""

from __future__ import annotations

import argparse
import json
import timeit
from collections.abc import Callable

import kvcr_protocol as kp
from kvcr_protocol import DeliverItem, DstSpan, Presence, QueryResult
from kvcr_protocol.descriptors import resolve_columns, resolve_spans

SPANS = 1024
SPAN = 64 << 10
KEYS = 1000
REPEATS = 5
"""Repeats of each timing; the best is reported (the least disturbed by other work)."""
BUDGET_S = 0.05
"""Time per repeat, so the whole run stays short."""


def per_call_us(fn: Callable[[], object]) -> float:
    """Best time of one call, in microseconds."""
    start = timeit.default_timer()
    fn()
    once = max(timeit.default_timer() - start, 1e-7)
    number = max(1, int(BUDGET_S / once))
    return min(timeit.repeat(fn, number=number, repeat=REPEATS)) / number * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args(argv)

    region = kp.Region(2, kp.MemoryKind.VRAM, 0, 0x7F00_0000_0000, SPANS * SPAN)
    regions = {2: region}
    spans = tuple(DstSpan(f"layer.{j // 2}.{'kv'[j % 2]}", 2, j * SPAN, SPAN) for j in range(SPANS))
    item = DeliverItem(bytes(range(16)), spans)
    records = kp.Deliver(7, (item,), "req", 250)
    block = kp.deliver_columns([item])
    planned = kp.deliver_columns([item], [j // 32 for j in range(SPANS)])
    columns = kp.Deliver(7, (), "req", 250, columns=(block,))
    plan = kp.Deliver(7, (), "req", 250, columns=(planned,))
    results = tuple(
        [QueryResult(Presence.HIT, "dram"), QueryResult(Presence.FETCHING, "dram"), QueryResult(Presence.FETCHABLE, "remote"),
         QueryResult(Presence.MISS)][i % 4] for i in range(KEYS)
    )
    reply_records = kp.QueryReply(9, results)
    reply_columns = kp.QueryReply(9, (), kp.QueryColumns.from_results(results))
    query = kp.Query(9, tuple(i.to_bytes(16, "little") for i in range(KEYS)))

    frames = {
        "deliver_1024_v2": kp.encode(records, 2),
        "deliver_1024_v3": kp.encode(columns, 3),
        "deliver_1024_plan_v3": kp.encode(plan, 3),
        "query_reply_1000_v2": kp.encode(reply_records, 2),
        "query_reply_1000_v3": kp.encode(reply_columns, 3),
        "query_1000": kp.encode(query, 3),
    }
    out: dict[str, float] = {}
    for name, frame in frames.items():
        version = 2 if name.endswith("v2") else 3
        out[f"{name}_decode_us"] = per_call_us(lambda f=frame, v=version: kp.decode(f, v))  # type: ignore[misc]
        out[f"{name}_bytes"] = len(frame)
    out["deliver_1024_v2_encode_us"] = per_call_us(lambda: kp.encode(records, 2))
    out["deliver_1024_v3_encode_us"] = per_call_us(lambda: kp.encode(columns, 3))
    out["deliver_1024_v2_resolve_us"] = per_call_us(lambda: resolve_spans(regions, [s[1:] for s in spans], "items[0].spans"))
    out["deliver_1024_v3_resolve_us"] = per_call_us(lambda: resolve_columns(regions, block, "columns[0]"))
    out["columns_from_records_us"] = per_call_us(lambda: kp.deliver_columns([item]))
    decoded = kp.decode(frames["query_reply_1000_v3"], 3)
    assert isinstance(decoded, kp.QueryReply) and decoded.columns is not None
    view = decoded.columns
    out["query_reply_1000_v3_prefix_us"] = per_call_us(lambda: view.prefix_length(kp.PREFIX_ALL))
    transfer_us = SPANS * SPAN / 20e9 * 1e6
    out["deliver_1024_v2_decode_share_of_20GBps"] = out["deliver_1024_v2_decode_us"] / transfer_us
    out["deliver_1024_v3_decode_share_of_20GBps"] = out["deliver_1024_v3_decode_us"] / transfer_us

    width = max(map(len, out))
    for key, value in out.items():
        print(f"{key:<{width}}  {value:10.3f}" if isinstance(value, float) else f"{key:<{width}}  {value:10d}")
    if args.json:
        print(json.dumps({k: round(v, 3) for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
