"""Generate the conformance vectors in ``spec/vectors/`` (and the spec's field tables).

``python spec/make_vectors.py`` rewrites every file of ``spec/vectors/`` deterministically:
``valid.json`` and ``invalid.json`` (versions 1 and 2), ``valid-v3.json`` and
``invalid-v3.json``, ``valid-v4.json`` and ``invalid-v4.json`` (leases), ``valid-v5.json`` and
``invalid-v5.json`` (``peer_forget``, read grants), and
``notify.json``, and ``events.json`` (the inventory event stream). The JSON files, not this script, are
the source of truth: tests read them. ``python spec/make_vectors.py --tables`` prints the
field tables of ``kvcr-protocol.md`` as generated from the code's ``FIELDS``.

Every vector is checked against the codec here before it is written: a valid vector's
``hex`` is what ``encode`` produces and decodes back to the same message; an invalid
vector raises ``RemoteProtocolError`` with the code it states.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import itertools
import json
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

import kvcr_protocol as kp
from kvcr_protocol import events as ev
from kvcr_protocol import messages as m
from kvcr_protocol.columns import (
    PREFIX_ALL,
    U16,
    U32,
    U64,
    DeliverColumns,
    DepositColumns,
    QueryColumns,
    pack,
    prefix_mask,
)
from kvcr_protocol.leases import LeaseColumns, LeaseStatus
from kvcr_protocol.notify import Notification, WriteNotify, decode_notification, encode_notification
from kvcr_protocol.twins import twin_proof
from kvcr_protocol.wire import (
    NUL,
    U64_MAX,
    AnyMap,
    Bool,
    Bytes,
    EnumStr,
    Joined,
    Opt,
    Packed,
    Record,
    RecordType,
    Seq,
    Str,
    UInt,
    UIntOrPacked,
    WireType,
)

HERE = Path(__file__).resolve().parent
VECTORS = HERE / "vectors"

# --------------------------------------------------------------------- field tables


def _str_text(wt: Str) -> str:
    text = f"str (0..`{wt.limit}` bytes)"
    if wt.choices is not None:
        text += ", one of " + ", ".join(f'`"{c}"`' for c in sorted(wt.choices))
    return text


_UINT_NAMES = {U64_MAX: "uint64", (1 << 32) - 1: "uint32", 0xFFFF: "uint16", 0xFF: "uint8"}
_NOTATION: dict[type[Any], Callable[[Any], str]] = {
    UInt: lambda wt: _UINT_NAMES.get(wt.maximum, f"uint (0..{wt.maximum})"),
    Bool: lambda wt: "bool",
    Bytes: lambda wt: f"bin ({wt.minimum}..`{wt.limit}` bytes)",
    Str: _str_text,
    EnumStr: lambda wt: f"`{wt.enum_type.__name__}`",
    Opt: lambda wt: f"nil or {type_text(wt.inner)}",
    Seq: lambda wt: f"array ({wt.minimum}..`{wt.limit}`) of {type_text(wt.item)}",
    RecordType: lambda wt: f"`{wt.cls.__name__}`",
    AnyMap: lambda wt: "map (str keys, any values)",
    Packed: lambda wt: f"packed u{8 * wt.width} (0..`{wt.limit}`)",
    UIntOrPacked: lambda wt: f"{type_text(wt.uint)} or {type_text(wt.packed)}",
    Joined: lambda wt: f"joined names (1..`max_spans`, each 0..`{wt.limit}` bytes)",
}


def type_text(wt: WireType[Any]) -> str:
    """The spec's notation for a wire type (section 6.1 of the spec)."""
    notation = _NOTATION.get(type(wt))
    if notation is None:
        raise TypeError(f"no notation for {type(wt).__name__}")
    return notation(wt)


def default_text(value: Any) -> str:
    """A default value as the msgpack value it stands for."""
    if value is None:
        return "`nil`"
    if value is True or value is False:
        return "`true`" if value else "`false`"
    if isinstance(value, tuple):
        return "`[]`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, bytes):
        return "empty"
    return f"`{value}`"


def message_table(cls: type[m.Message]) -> str:
    """The markdown table of a message's fields."""
    rows = ["| Key | Type | Default | Since |", "|---|---|---|---|"]
    for f in cls.FIELDS:
        default = "required" if f.required else default_text(f.default)
        rows.append(f"| `{f.key}` | {type_text(f.type)} | {default} | {max(f.since, cls.SINCE)} |")
    return "\n".join(rows)


def record_table(cls: type[Record]) -> str:
    """The markdown table of a record's items."""
    rows = ["| Item | Field | Type | Default |", "|---|---|---|---|"]
    for i, f in enumerate(cls.FIELDS):
        default = "required" if f.required else default_text(f.default)
        rows.append(f"| {i} | `{f.name}` | {type_text(f.type)} | {default} |")
    return "\n".join(rows)


RECORDS: tuple[type[Record], ...] = (
    m.Region,
    m.SrcSpan,
    m.DstSpan,
    m.LayoutSpan,
    m.DepositItem,
    m.DeliverItem,
    m.FetchItem,
    m.PoolInfo,
    m.KeyResult,
    m.QueryResult,
    DepositColumns,
    DeliverColumns,
    QueryColumns,
    WriteNotify,
    LeaseColumns,
    kp.GrantNode,
    kp.LeaseGrant,
    kp.GrantSource,
)
ENUMS: tuple[type[enum.Enum], ...] = (m.MemoryKind, m.KeyStatus, m.Presence, m.WriteState)


def attribute_docs(cls: type) -> dict[str, str]:
    """The docstrings written under a class's attributes (``X = 1`` then ``\"\"\"doc\"\"\"``)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in itertools.pairwise(body):
        target = None
        if isinstance(prev, ast.Assign) and isinstance(prev.targets[0], ast.Name):
            target = prev.targets[0].id
        elif isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name):
            target = prev.target.id
        if (
            target is not None
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[target] = " ".join(node.value.value.split())
    return docs


def error_table() -> str:
    """Every ``ErrorCode`` with its number and meaning."""
    docs = attribute_docs(kp.ErrorCode)
    rows = ["| Code | Name | Meaning |", "|---|---|---|"]
    for code in kp.ErrorCode:
        rows.append(f"| {code.value} | `{code.name}` | {docs[code.name]} |")
    return "\n".join(rows)


def limits_table() -> str:
    """Every field of ``Limits`` with its default."""
    docs = attribute_docs(kp.Limits)
    rows = ["| Limit | Default | Bounds |", "|---|---|---|"]
    for f in dataclasses.fields(kp.Limits):
        default = f.default
        size = f" ({default >> 20} MiB)" if isinstance(default, int) and default >= 1 << 20 else ""
        rows.append(f"| `{f.name}` | {default}{size} | {docs[f.name]} |")
    return "\n".join(rows)


def all_tables() -> str:
    """Every record and message table, each under its name."""
    parts = []
    for rec in RECORDS:
        parts.append(f"Record `{rec.__name__}`:\n\n{record_table(rec)}\n")
    for msg in kp.ALL_MESSAGES:
        parts.append(f"Message `{msg.TAG}` ({msg.__name__}):\n\n{message_table(msg)}\n")
    parts.append(f"Error codes:\n\n{error_table()}\n")
    parts.append(f"Limits:\n\n{limits_table()}\n")
    return "\n".join(parts)


# ------------------------------------------------------------------------ JSON form


def value_json(wt: WireType[Any], value: Any, omit_defaults: bool) -> Any:
    """The JSON form of one field value."""
    if isinstance(wt, (Bytes, Packed)) or (isinstance(wt, UIntOrPacked) and isinstance(value, bytes)):
        return {"hex": value.hex()}
    if isinstance(wt, EnumStr):
        return value.value
    if isinstance(wt, Opt):
        return None if value is None else value_json(wt.inner, value, omit_defaults)
    if isinstance(wt, Seq):
        return [value_json(wt.item, v, omit_defaults) for v in value]
    if isinstance(wt, RecordType):
        return fields_json(value, omit_defaults)
    return value


def fields_json(obj: m.Message | Record, omit_defaults: bool = False, version: int = kp.CURRENT_VERSION) -> dict[str, Any]:
    """The JSON form of a message or record: field names to values, in declared order.

    A field of version 3 or later that the vector's ``version`` lacks is left out (it holds
    its default); the vectors of versions 1 and 2 list every field they always listed.
    """
    out: dict[str, Any] = {}
    for f in type(obj).FIELDS:
        value = getattr(obj, f.name)
        if f.since > version and f.since >= kp.COLUMNS_VERSION:
            continue
        if (omit_defaults or f.sparse) and not f.required and value == f.default:
            continue  # a sparse field left out is the vector as it was before the field
        out[f.name] = value_json(f.type, value, omit_defaults)
    return out


# ------------------------------------------------------------------ realistic values

MD_CLIENT = b"NIXL\x01client-0:ucx;shm;tcp\x00\x10\x7f"
MD_NODE_A = b"NIXL\x01node-a:ucx;rc;tcp\x00\x20\x01"
MD_NODE_B = b"NIXL\x01node-b:ucx;rc;tcp\x00\x20\x02"
K1 = bytes.fromhex("3f9a0c11d2e45b7788a1c0ffee0dd15e")
K2 = bytes.fromhex("a41b2c3d4e5f60718293a4b5c6d7e8f9")
K3 = bytes.fromhex("00ff00ff00ff00ff00ff00ff00ff00ff0102030405060708")
KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

INC_A = 0x1D2C3B4A59687766
"""Node A's incarnation."""
INC_B = 0x0BADC0DE00000001
"""Node B's incarnation; ``INC_B + 1`` after a restart."""

R_DRAM = m.Region(1, m.MemoryKind.DRAM, 0, 0x7F3A_2C00_0000, 256 * MiB)
R_VRAM = m.Region(2, m.MemoryKind.VRAM, 3, 0x7F00_0000_0000, 4 * GiB)

# Node A's pools, in the order of its welcome (welcome-full): full, swa, state.
POOLS_A = (
    m.PoolInfo("full", 64 * KiB, 16384, "dram"),
    m.PoolInfo("swa", 16 * KiB, 8192, "dram"),
    m.PoolInfo("state", 1536 * KiB, 512, "hbm:0"),
)
# What A announces in peer_hello.regions: one region per pool, region id = pool index.
POOL_REGIONS_A = (
    m.Region(0, m.MemoryKind.DRAM, 0, 0x7E10_0000_0000, 64 * KiB * 16384),
    m.Region(1, m.MemoryKind.DRAM, 0, 0x7E20_0000_0000, 16 * KiB * 8192),
    m.Region(2, m.MemoryKind.VRAM, 0, 0x7F80_0000_0000, 1536 * KiB * 512),
)


def src_layout(region: int, base: int) -> tuple[m.SrcSpan, ...]:
    """A hybrid layout: two full-attention layers, one SWA layer, one Mamba state."""
    return (
        m.SrcSpan("L0", "full", region, base, 64 * KiB),
        m.SrcSpan("L1", "full", region, base + 64 * KiB, 64 * KiB),
        m.SrcSpan("L2", "swa", region, base + 128 * KiB, 16 * KiB),
        m.SrcSpan("S", "state", region, base + 144 * KiB, 1536 * KiB),
    )


def fetch_dst(slots: dict[str, int]) -> tuple[m.DstSpan, ...]:
    """A fetch's destination in node A: span name -> slot of its pool (offset = slot * slot_size)."""
    pools = {"L0": 0, "L1": 0, "L2": 1, "S": 2}
    out = []
    for name, slot in slots.items():
        index = pools[name]
        size = POOLS_A[index].slot_size
        out.append(m.DstSpan(name, index, slot * size, size))
    return tuple(out)


def dst_layout(region: int, base: int, names: tuple[str, ...] = ("L0", "L1", "L2", "S")) -> tuple[m.DstSpan, ...]:
    sizes = {"L0": 64 * KiB, "L1": 64 * KiB, "L2": 16 * KiB, "S": 1536 * KiB}
    out, off = [], base
    for n in names:
        out.append(m.DstSpan(n, region, off, sizes[n]))
        off += sizes[n]
    return tuple(out)


OK = m.KeyResult(m.KeyStatus.OK)
E = kp.ErrorCode


def failed(code: kp.ErrorCode, reason: str = "") -> m.KeyResult:
    """A ``FAILED`` key result."""
    return m.KeyResult(m.KeyStatus.FAILED, code, reason)


LAYOUT = (m.LayoutSpan("L0", "full"), m.LayoutSpan("L1", "full"), m.LayoutSpan("L2", "swa"), m.LayoutSpan("S", "state"))


# --------------------------------------------------------------------- valid vectors


@dataclass
class Valid:
    """One valid instance; ``accept`` builds extra non-canonical frames for a version."""

    name: str
    message: m.Message
    versions: tuple[int, ...] = (1, 2)
    omit_defaults: bool = False
    description: str = ""
    accept: Callable[[m.Message, int], list[tuple[str, bytes]]] | None = field(default=None)


def _wire(message: m.Message, version: int) -> dict[str, Any]:
    obj: dict[str, Any] = msgpack.unpackb(kp.encode(message, version), raw=False)
    return obj


def _pack(obj: Any) -> bytes:
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


def accept_defaults_omitted(message: m.Message, version: int) -> list[tuple[str, bytes]]:
    """The frame with every field that holds its default left out (none if none is emitted)."""
    obj = _wire(message, version)
    dropped = False
    for f in type(message).FIELDS:
        if not f.required and f.key in obj and getattr(message, f.name) == f.default:
            del obj[f.key]
            dropped = True
    return [("defaulted fields omitted", _pack(obj))] if dropped else []


def accept_variants(message: m.Message, version: int) -> list[tuple[str, bytes]]:
    """Reordered fields, an unknown optional field, a non-minimal id."""
    obj = _wire(message, version)
    out = []
    out.append(("fields in reverse order", _pack(dict(reversed(list(obj.items()))))))
    extra = dict(obj)
    extra["x_future"] = {"added": "by a later version", "n": 7}
    out.append(("an unknown optional field, ignored", _pack(extra)))
    # id as a uint64 (0xcf) instead of its minimal form.
    assert len(obj) < 16
    frame = bytes([0x80 | len(obj)])
    for k, v in obj.items():
        frame += _pack(k) + (b"\xcf" + v.to_bytes(8, "big") if k == "id" else _pack(v))
    out.append(("id encoded as uint64 (not minimal)", frame))
    return out


def accept_short_records(message: m.Message, version: int) -> list[tuple[str, bytes]]:
    """Results with trailing defaulted record items omitted, and with extra trailing items."""
    obj = _wire(message, version)
    short = dict(obj)
    trimmed = []
    for item in obj["results"]:
        item = list(item)
        rec = m.KeyResult.FIELDS if obj["t"] in ("complete", "write_done") else m.QueryResult.FIELDS
        while len(item) > 1 and item[-1] == rec[len(item) - 1].default:
            item.pop()
        trimmed.append(item)
    short["results"] = trimmed
    longer = dict(obj)
    longer["results"] = [[*item, "future item", 42] for item in obj["results"]]
    return [
        ("trailing defaulted record items omitted", _pack(short)),
        ("extra trailing record items, ignored", _pack(longer)),
    ]


def accept_hello_newer(message: m.Message, version: int) -> list[tuple[str, bytes]]:
    """A hello from a newer endpoint (v=3, an unknown optional field) reads as version 1."""
    obj = _wire(message, version)
    obj["v"] = 3
    obj["x_future"] = True
    return [("v=3 from a newer endpoint, read at version 1", _pack(obj))]


def accept_v1_ignores_partial(message: m.Message, version: int) -> list[tuple[str, bytes]]:
    """A ``partial`` key in a v=1 frame: version 1 has no such field, so it is ignored."""
    assert version == 1
    out = []
    for value, what in ((True, "true"), (1, "the integer 1")):
        obj = _wire(message, version)
        obj["partial"] = value
        out.append((f"partial: {what} in a v=1 frame, an unknown optional key, ignored", _pack(obj)))
    return out


def accept_partial_false(message: m.Message, version: int) -> list[tuple[str, bytes]]:
    """``!partial`` present but false (canonical form omits it)."""
    if version < 2:
        return []
    obj = _wire(message, version)
    obj["!partial"] = False
    return [("!partial explicitly false", _pack(obj))]


def valid_instances() -> list[Valid]:
    """Realistic instances of every message."""
    subsets = m.Deliver(
        32,
        (m.DeliverItem(K1, dst_layout(2, 0, ("L0", "L2"))), m.DeliverItem(K2, dst_layout(2, 80 * KiB, ("S",)))),
        request_id="req-7f3a9c",
        deadline_ms=250,
    )
    return [
        # ---- client <-> node
        Valid(
            "hello-minimal",
            m.Hello(1, (1, 2), "sglang-worker-0", "kvcr-client-4711", MD_CLIENT),
            omit_defaults=True,
            accept=accept_hello_newer,
            description="hello before any region is registered; always encoded at v=1",
        ),
        Valid(
            "hello-regions",
            m.Hello(1, (1, 2), "vllm-tp0", "kvcr-client-4712", MD_CLIENT, (R_DRAM, R_VRAM)),
            description="hello announcing a DRAM staging region and a VRAM KV cache region",
        ),
        Valid(
            "hello-v1-only",
            m.Hello(1, (1,), "trtllm-0", "kvcr-client-9", MD_CLIENT, (R_DRAM,)),
            description="hello from a client that speaks version 1 only",
        ),
        Valid(
            "welcome-full",
            m.Welcome(
                1,
                2,
                "node-a",
                INC_A,
                "kvcr-node-a",
                POOLS_A,
                1000,
            ),
            versions=(2,),
            description="welcome agreeing on version 2 with three pools and heartbeats every second",
        ),
        Valid(
            "welcome-v1",
            m.Welcome(
                1, 1, "node-a", INC_A, "kvcr-node-a", (m.PoolInfo("full", 64 * KiB, 16384, "dram"),)
            ),
            versions=(1,),
            description="welcome agreeing on version 1; heartbeat_ms defaulted",
        ),
        Valid("welcome-minimal", m.Welcome(1, 1, "n", 1, "a"), omit_defaults=True, description="welcome with no pools and no heartbeat"),
        Valid(
            "regions",
            m.RegisterRegions(2, MD_CLIENT + b"\x02", (R_VRAM,)),
            description="a newly registered VRAM region with refreshed agent metadata",
        ),
        Valid("unregions", m.UnregisterRegions(3, (1, 2)), description="two regions withdrawn"),
        Valid(
            "deposit-minimal",
            m.Deposit(10, (m.DepositItem(K1, (m.SrcSpan("L0", "full", 1, 0, 64 * KiB),)),)),
            omit_defaults=True,
            accept=accept_defaults_omitted,
            description="one key, one span, every option defaulted",
        ),
        Valid(
            "deposit-hybrid",
            m.Deposit(
                11,
                (m.DepositItem(K1, src_layout(1, 0)), m.DepositItem(K2, src_layout(1, 2 * MiB))),
                no_evict=True,
                optional=False,
                deadline_ms=5000,
            ),
            description="two keys with a hybrid layout (full, swa, state pools), no_evict, 5 s deadline",
        ),
        Valid(
            "deposit-optional",
            m.Deposit(12, (m.DepositItem(K3, src_layout(2, 0)),), optional=True),
            description="an optional deposit from VRAM that the admission policy may drop",
        ),
        Valid(
            "deposit-parents",
            m.Deposit(14, (m.DepositItem(K1, src_layout(1, 0)), m.DepositItem(K2, src_layout(1, 2 * MiB))),
                      parents=(K3, K1)),
            description="blocks K1 and K2 of one sequence, K1's parent K3 (stored earlier) and K2's K1 (section 6.4, Parents)",
        ),
        Valid(
            "query",
            m.Query(20, (K1, K2, K3)),
            omit_defaults=True,
            accept=accept_variants,
            description="three keys, no request id",
        ),
        Valid(
            "query-request", m.Query(21, (K1,), "req-7f3a9c"), description="a query scoped to a request, so hints count"
        ),
        Valid("query-max-key", m.Query(22, (bytes(range(256)),)), description="a key of exactly max_key (256) bytes"),
        Valid("query-empty", m.Query(23, ()), description="a query naming no key"),
        Valid(
            "query-reply",
            m.QueryReply(
                20,
                (
                    m.QueryResult(m.Presence.HIT, "dram"),
                    m.QueryResult(m.Presence.HIT, "hbm:0"),
                    m.QueryResult(m.Presence.FETCHING, "dram"),
                    m.QueryResult(m.Presence.FETCHABLE, "remote"),
                    m.QueryResult(m.Presence.MISS),
                ),
            ),
            accept=accept_short_records,
            description="every presence value",
        ),
        Valid("deliver-whole", m.Deliver(30, (m.DeliverItem(K1, dst_layout(2, 0)),)), omit_defaults=True, description="the whole layout into VRAM"),
        Valid(
            "deliver-subset",
            m.Deliver(
                31,
                (m.DeliverItem(K1, dst_layout(2, 0, ("L0",))), m.DeliverItem(K2, dst_layout(2, 64 * KiB, ("L0",)))),
                request_id="req-7f3a9c",
                deadline_ms=250,
            ),
            accept=accept_defaults_omitted,
            description=(
                "layer 0 of two keys (progressive delivery), with a request id and deadline; without partial "
                "(at version 2 it travels as false), so a key served by a peer must name its whole layout"
            ),
        ),
        Valid(
            "deliver-partial",
            dataclasses.replace(subsets, partial=True),
            versions=(2,),
            accept=accept_variants,
            description=(
                "subsets of two keys with partial set (version 2 only): a key the node must get from a peer "
                "is forwarded as a !partial write"
            ),
        ),
        Valid(
            "deliver-no-partial",
            subsets,
            versions=(1,),
            accept=accept_v1_ignores_partial,
            description=(
                "the same subsets from a version-1 session, which cannot carry partial: local keys are "
                "still projected; a key served by a peer fails LAYOUT_SUBSET_INVALID at the source"
            ),
        ),
        Valid(
            "fetch",
            m.Fetch(40, (m.FetchItem(K1, LAYOUT), m.FetchItem(K2, LAYOUT)), "req-7f3a9c", 2000),
            description="make two keys resident, pulled from the hinted peer",
        ),
        Valid(
            "fetch-minimal",
            m.Fetch(41, (m.FetchItem(K3, (m.LayoutSpan("", "full"),)),)),
            omit_defaults=True,
            description="a one-span layout with an empty span name",
        ),
        Valid("release", m.Release(50, (1, 2, 0xFFFF_FFFF_FFFF)), description="three handles dropped"),
        Valid("abort", m.Abort(51, 31), description="abort operation 31"),
        Valid(
            "hint",
            m.SubmitHint(52, "req-7f3a9c", "tcp://10.0.0.12:5555", (K1, K2)),
            description="keys K1 and K2 may be on the node at 10.0.0.12",
        ),
        Valid("unhint", m.DiscardHint(53, "req-7f3a9c"), description="the request is over"),
        Valid("stats", m.StatsRequest(54), description="ask for statistics"),
        Valid(
            "stats-reply",
            m.StatsReply(
                54,
                {
                    "objects": 1234,
                    "pools": {"full": {"free": 100, "total": 16384}},
                    "evictions": 17,
                    "version": "0.1.0",
                    "hit_ratio": 0.5,
                    "clients": ["a", "b"],
                    "draining": False,
                    "last_error": None,
                },
            ),
            description="nested statistics of every msgpack kind",
        ),
        Valid("stats-reply-empty", m.StatsReply(55, {}), description="no statistics"),
        Valid(
            "complete-deposit",
            m.Completion(
                11,
                (
                    m.KeyResult(m.KeyStatus.STORED, handle=9001),
                    m.KeyResult(m.KeyStatus.DUPLICATE),
                    m.KeyResult(m.KeyStatus.DROPPED),
                    failed(E.CAPACITY, "pool state: 0 of 512 slots reclaimable"),
                    m.KeyResult(m.KeyStatus.ABORTED, E.ABORTED),
                ),
            ),
            accept=accept_short_records,
            description="deposit outcomes: stored with a handle, duplicate, dropped, failed, aborted",
        ),
        Valid(
            "complete-deliver",
            m.Completion(31, (OK, failed(E.LAYOUT_SUBSET_INVALID, "span 'L2' breaks the stored order"))),
            description="a deliver with one key delivered and one refused",
        ),
        Valid("complete-empty", m.Completion(23, ()), description="completion of an empty batch"),
        Valid("ack", m.Ack(52), description="the hint was recorded"),
        Valid(
            "error",
            m.Error(7, kp.ErrorCode.WRONG_TYPE, "expected bin, got str", "keys[0]"),
            description="a request refused whole, with the path of the bad field",
        ),
        Valid(
            "error-unreadable",
            m.Error(0, kp.ErrorCode.MALFORMED),
            omit_defaults=True,
            description="an error for a frame whose request id could not be read",
        ),
        Valid("capacity", m.CapacityEvent(3, "state", 12, 512), description="pool state is under its low watermark"),
        Valid("heartbeat", m.Heartbeat(42), accept=accept_variants, description="heartbeat number 42"),
        Valid("bye", m.Bye(99), description="the client is closing"),
        # ---- node <-> node
        Valid(
            "peer-hello",
            m.PeerHello(1, (1, 2), "node-a", INC_A, "kvcr-node-a", MD_NODE_A, POOL_REGIONS_A),
            accept=accept_hello_newer,
            description=(
                "node A opens a session with node B, announcing its pools (full, swa, state in welcome order) "
                "as regions 0, 1 and 2 for fetches"
            ),
        ),
        Valid(
            "peer-hello-link",
            m.PeerHello(1, (1, 2, 3, 4, 5), "node-a", INC_A, "kvcr-node-a", MD_NODE_A, POOL_REGIONS_A,
                        bytes.fromhex("5f0c3a9e7d21b4486ac09e13f2d7b650")),
            accept=accept_hello_newer,
            description=(
                "node A's hello with its token for this link: a later peer_hello takes this session's leases over "
                "only with the same incarnation and token"
            ),
        ),
        Valid(
            "peer-hello-minimal",
            m.PeerHello(1, (1,), "node-a", 1, "kvcr-node-a", MD_NODE_A),
            omit_defaults=True,
            description="a version-1 node with no regions to announce",
        ),
        Valid(
            "peer-welcome",
            m.PeerWelcome(1, 2, "node-b", INC_B, "kvcr-node-b", MD_NODE_B),
            versions=(2,),
            description="node B agrees on version 2",
        ),
        Valid(
            "peer-welcome-v1",
            m.PeerWelcome(1, 1, "node-b", INC_B, "kvcr-node-b", MD_NODE_B),
            versions=(1,),
            description="node B agrees on version 1",
        ),
        Valid(
            "peer-client",
            m.PeerClient(2, "kvcr-client-4712", MD_CLIENT, (R_DRAM, R_VRAM)),
            description="client C's agent and regions, so B can write into C's memory",
        ),
        Valid(
            "write-whole",
            m.WriteRequest(100, "kvcr-client-4712", (m.DeliverItem(K1, dst_layout(2, 0)),), 1800),
            accept=accept_partial_false,
            description="write the whole object K1 into C's VRAM",
        ),
        Valid(
            "write-minimal",
            m.WriteRequest(101, "kvcr-node-a", (m.DeliverItem(K2, fetch_dst({"L0": 5, "L1": 6, "L2": 3, "S": 2})),)),
            omit_defaults=True,
            description=(
                "a fetch's write into node A's own slots: agent is A's agent, regions are A's pools from "
                "peer_hello (full slots 5 and 6, swa slot 3, state slot 2; offset = slot * slot_size); no deadline"
            ),
        ),
        Valid(
            "write-partial",
            m.WriteRequest(
                102, "kvcr-client-4712", (m.DeliverItem(K1, dst_layout(2, 0, ("L0", "L2"))),), 900, partial=True
            ),
            versions=(2,),
            description="write layers L0 and L2 only: a subset, must-understand !partial (version 2 only)",
        ),
        Valid(
            "write-done",
            m.WriteDone(100, (OK, failed(E.NOT_FOUND, "not held"), failed(E.TRANSFER_FAILED, "NIXL_ERR_BACKEND"))),
            accept=accept_short_records,
            description="per-key outcome of a write",
        ),
        Valid("refuse", m.Refuse(102, kp.ErrorCode.BUSY, "512 writes pending"), description="a write refused whole; nothing moved"),
        Valid("refuse-minimal", m.Refuse(103, kp.ErrorCode.SHUTTING_DOWN), omit_defaults=True, description="refused without a reason"),
        Valid("probe", m.Probe(7, 100), description="what became of write 100?"),
        Valid(
            "probe-reply-in-flight",
            m.ProbeReply(7, 100, m.WriteState.IN_FLIGHT, INC_B),
            description="a transfer may still write the destination",
        ),
        Valid(
            "probe-reply-done",
            m.ProbeReply(8, 100, m.WriteState.DONE, INC_B),
            description="terminal: nothing of write 100 can touch the destination now",
        ),
        Valid(
            "probe-reply-unknown",
            m.ProbeReply(9, 555, m.WriteState.UNKNOWN, INC_B + 1),
            description="never seen by this incarnation (B restarted)",
        ),
        Valid("probe-reply-waiting", m.ProbeReply(10, 101, m.WriteState.WAITING, INC_B), description="accepted, waiting on an object still WRITING"),
    ]


def v3_instances() -> list[Valid]:
    """Version 3: every message of versions 1 and 2 again at version 3, then what version 3 adds."""
    again = [
        dataclasses.replace(inst, versions=(3,))
        for inst in valid_instances()
        if kp.PARTIAL_LAYOUT_VERSION in inst.versions
    ]
    names4 = NUL.join(("L0", "L1", "L2", "S"))
    sizes4 = pack((64 * KiB, 64 * KiB, 16 * KiB, 1536 * KiB), U64)
    whole = DeliverColumns((K1, K2), names4, 2, pack((0, 64 * KiB, 128 * KiB, 144 * KiB, 2 * MiB, 2 * MiB + 64 * KiB, 2 * MiB + 128 * KiB, 2 * MiB + 144 * KiB), U64), sizes4)
    layers = tuple(f"layer.{i}" for i in range(8))
    planned = DeliverColumns(
        (K1,), NUL.join(layers), 2, pack(range(0, 8 * 256 * KiB, 256 * KiB), U64), 256 * KiB, pack((0, 0, 1, 1, 2, 2, 3, 3), U16)
    )
    per_layer = DeliverColumns(
        (K1, K2, K3), NUL.join(layers[:4]), pack((10, 11, 12, 13), U32),
        pack((0, 0, 0, 0, 4 * MiB, 4 * MiB, 4 * MiB, 4 * MiB, 8 * MiB, 8 * MiB, 8 * MiB, 8 * MiB), U64), 4 * MiB,
        pack((0, 1, 2, 3), U16),
    )
    scattered = DeliverColumns(
        (K1, K2), NUL.join(("L0", "L1")), pack((1, 2, 2, 1), U32), pack((0, 65536, 131072, 196608), U64), 64 * KiB
    )
    fetch_into_a = DeliverColumns(
        (K2,), names4, pack((0, 0, 1, 2), U32), pack((5 * 64 * KiB, 6 * 64 * KiB, 3 * 16 * KiB, 2 * 1536 * KiB), U64), sizes4
    )
    deposit = DepositColumns(
        (K1, K2), names4, 1, pack((0, 64 * KiB, 128 * KiB, 144 * KiB, 2 * MiB, 2 * MiB + 64 * KiB, 2 * MiB + 128 * KiB, 2 * MiB + 144 * KiB), U64),
        sizes4, NUL.join(("full", "full", "swa", "state")),
    )
    results = (
        m.QueryResult(m.Presence.HIT, "dram"), m.QueryResult(m.Presence.HIT, "hbm:0"),
        m.QueryResult(m.Presence.FETCHING, "dram"), m.QueryResult(m.Presence.FETCHABLE, "remote"),
        m.QueryResult(m.Presence.MISS), m.QueryResult(m.Presence.HIT, "dram"),
    )
    return [
        *again,
        Valid("welcome-agreed-3", m.Welcome(1, 3, "node-a", INC_A, "kvcr-node-a", POOLS_A, 1000), versions=(3,), description="welcome agreeing on version 3"),
        Valid("peer-welcome-agreed-3", m.PeerWelcome(1, 3, "node-b", INC_B, "kvcr-node-b", MD_NODE_B), versions=(3,), description="node B agrees on version 3"),
        Valid(
            "deposit-columns",
            m.Deposit(13, (), no_evict=True, deadline_ms=5000, columns=(deposit,)),
            versions=(3,),
            description="deposit-hybrid as columns: names and pools once, one region, offsets packed, a length per span",
        ),
        Valid(
            "deliver-columns",
            m.Deliver(33, (), "req-7f3a9c", 250, columns=(whole,)),
            versions=(3,),
            accept=accept_short_columns,
            description="two keys of the hybrid layout as one block of columns: one region, a length per span, no plan",
        ),
        Valid(
            "deliver-plan",
            m.Deliver(34, (), "req-7f3a9c", 250, partial=True, columns=(planned,), notify=0x5EED0001),
            versions=(3,),
            description=(
                "one key of 8 layers of 256 KiB in 4 groups of two layers (a layer plan), one length for all, "
                "with NIXL notifications under token 0x5eed0001"
            ),
        ),
        Valid(
            "deliver-plan-per-layer-regions",
            m.Deliver(35, (), deadline_ms=250, columns=(per_layer,)),
            versions=(3,),
            description="three keys whose layer i lives in region 10 + i (one region per span), one group per layer",
        ),
        Valid(
            "deliver-columns-scattered",
            m.Deliver(36, (), columns=(scattered,)),
            versions=(3,),
            description="a region per entry: span L0 of K1 in region 1, span L1 of K1 and L0 of K2 in region 2, ...",
        ),
        Valid(
            "write-columns",
            m.WriteRequest(
                104, "kvcr-client-4712", (), 900, partial=True, columns=(planned,),
                notify=WriteNotify(0x5EED0001, 34, pack((0,), U32)),
            ),
            versions=(3,),
            description=(
                "the target forwards deliver-plan's block to the source as it came, with what the source needs "
                "to notify the client (token, the client's request id, the deliver's item index per write item)"
            ),
        ),
        Valid(
            "write-columns-fetch",
            m.WriteRequest(105, "kvcr-node-a", (), columns=(fetch_into_a,)),
            versions=(3,),
            description="write-minimal as columns: a fetch into node A's pools (a region per span: the pool index)",
        ),
        Valid(
            "complete-plan",
            m.Completion(34, (OK, failed(E.TRANSFER_FAILED, "group 1: NIXL_ERR_BACKEND")), pack((4, 1), U32)),
            versions=(3,),
            description="a planned deliver of two keys: K1 whole (4 groups), K2 failed in group 1 (group 0 stays delivered)",
        ),
        Valid(
            "write-done-plan",
            m.WriteDone(104, (failed(E.TRANSFER_FAILED, "NIXL_ERR_REMOTE_DISCONNECT"),), pack((2,), U32)),
            versions=(3,),
            description="the source's result for a planned key: groups 0 and 1 landed, group 2 failed",
        ),
        Valid(
            "progress",
            m.Progress(34, pack((0, 1), U32), pack((2, 1), U32)),
            versions=(3,),
            description="groups landed so far: 2 of key 0, 1 of key 1 (not a reply: the deliver goes on)",
        ),
        Valid("query-prefix", m.Query(24, (K1, K2, K3), prefix=prefix_mask(m.Presence.HIT)), versions=(3,), description="how many keys in a row, from K1, this node holds"),
        Valid(
            "query-prefix-any",
            m.Query(25, (K1, K2, K3), "req-7f3a9c", prefix=PREFIX_ALL),
            versions=(3,),
            description="how many keys in a row are held, being filled, or hinted",
        ),
        Valid(
            "query-reply-columns",
            m.QueryReply(20, (), QueryColumns.from_results(results)),
            versions=(3,),
            description="every presence as one byte per key, tiers through a table",
        ),
        Valid(
            "query-reply-prefix",
            m.QueryReply(24, (), QueryColumns.from_results(results[:2])),
            versions=(3,),
            description="the answer to query-prefix: the first two keys are held, the third is not (so 2 answers)",
        ),
        Valid("query-reply-columns-empty", m.QueryReply(26, (), QueryColumns(b"", b"", ())), versions=(3,), description="a prefix query whose first key is missing"),
    ]


def lease_columns(rows: list[tuple[LeaseStatus, str]]) -> LeaseColumns:
    """A lease's answers as columns, the tier table in the order tiers first appear."""
    table: list[str] = []
    status, tier = bytearray(), bytearray()
    for answer, where in rows:
        if where not in table:
            table.append(where)
        status.append(answer)
        tier.append(table.index(where))
    return LeaseColumns(bytes(status), bytes(tier), tuple(table))


LEASE_ID = 42
"""The lease node A grants client C in the version-4 vectors."""
SOURCE_LEASE = 0x0BAD_0000_0000_0007
"""The lease source B holds for node A (B's own id, unrelated to A's)."""
LK = tuple(bytes.fromhex(h) for h in (
    "5b1e0a7d3c2f4e6a8b9c0d1e2f3a4b5c", "6c2f1b8e4d3a5f7b9cad1e2f3a4b5c6d", "7d3a2c9f5e4b6a8cadbe2f3a4b5c6d7e",
    "8e4b3dab6f5c7b9dbecf3a4b5c6d7e8f", "9f5c4ebc7a6d8caecfda4b5c6d7e8f90",
))
"""More keys, for a lease that shows every status."""


def v4_instances() -> list[Valid]:
    """Version 4: every message of versions 1 to 3 again at version 4, then the lease messages."""
    again = [
        dataclasses.replace(inst, versions=(4,))
        for inst in v3_instances()
        if inst.name not in ("welcome-agreed-3", "peer-welcome-agreed-3")
    ]
    S = LeaseStatus
    every = lease_columns([
        (S.LEASED, "dram"), (S.LEASED, "hbm:0"), (S.LEASED_REMOTE, "remote"), (S.PENDING, "dram"),
        (S.LEASE_LIMIT, "dram"), (S.ADVISORY, "remote"), (S.UNREACHABLE, "remote"), (S.MISS, ""), (S.LEASED, "dram"),
    ])
    return [
        *again,
        Valid("welcome-agreed-4", m.Welcome(1, 4, "node-a", INC_A, "kvcr-node-a", POOLS_A, 1000), versions=(4,), description="welcome agreeing on version 4"),
        Valid("peer-welcome-agreed-4", m.PeerWelcome(1, 4, "node-b", INC_B, "kvcr-node-b", MD_NODE_B), versions=(4,), description="node B agrees on version 4"),
        # ---- client <-> node
        Valid(
            "lease",
            m.Lease(60, (K1, K2, K3), "req-7f3a9c", 5000),
            versions=(4,),
            accept=accept_variants,
            description="hold three keys for 5 s; the session's hint for req-7f3a9c names a source for keys the node lacks",
        ),
        Valid(
            "lease-minimal",
            m.Lease(61, (K1,)),
            versions=(4,),
            omit_defaults=True,
            accept=accept_defaults_omitted,
            description="one key, no hint, the node's default time to live (lease_ttl_ms)",
        ),
        Valid(
            "lease-reply",
            m.LeaseReply(60, LEASE_ID, 5000, lease_columns([(S.LEASED, "dram"), (S.LEASED_REMOTE, "remote"), (S.MISS, "")])),
            versions=(4,),
            description="the answer to lease: K1 held here in DRAM, K2 held by the hinted source, K3 nowhere",
        ),
        Valid(
            "lease-every-status",
            m.Lease(62, (K1, *LK, K2, K3, K1), "req-7f3a9c", 600_000),
            versions=(4,),
            description="nine keys, the last one K1 again (held once), for the longest time to live the node grants by default",
        ),
        Valid(
            "lease-reply-every-status",
            m.LeaseReply(62, LEASE_ID + 1, 600_000, every),
            versions=(4,),
            description=(
                "every status: leased in DRAM and in HBM, leased at the source, pending, over a lease limit, "
                "advisory (a source below version 4), unreachable, miss, and the repeated K1 as its first"
            ),
        ),
        Valid(
            "lease-reply-nothing",
            m.LeaseReply(61, 0, 30_000, lease_columns([(S.MISS, "")])),
            versions=(4,),
            description="the answer to lease-minimal when K1 is not here: lease 0, nothing held, nothing to renew or release",
        ),
        Valid(
            "lease-reply-nothing-held",
            m.LeaseReply(63, 0, 30_000, lease_columns([(S.PENDING, "dram"), (S.ADVISORY, "remote"), (S.LEASE_LIMIT, "hbm:0")])),
            versions=(4,),
            description="no key held (pending, advisory, over a limit): lease 0",
        ),
        Valid(
            "lease-reply-empty",
            m.LeaseReply(64, 0, 30_000, LeaseColumns(b"", b"", ())),
            versions=(4,),
            description="the answer to a lease of no key",
        ),
        Valid("renew", m.RenewLease(65, LEASE_ID, 60_000), versions=(4,), accept=accept_variants, description="keep lease 42 for 60 s from now"),
        Valid(
            "renew-minimal",
            m.RenewLease(66, LEASE_ID),
            versions=(4,),
            omit_defaults=True,
            accept=accept_defaults_omitted,
            description="keep lease 42 for its own time to live again",
        ),
        Valid(
            "lease-reply-renew",
            m.LeaseReply(65, LEASE_ID, 60_000),
            versions=(4,),
            omit_defaults=True,
            accept=accept_defaults_omitted,
            description="the answer to renew: the granted time to live, no columns",
        ),
        Valid("unlease", m.ReleaseLease(67, LEASE_ID), versions=(4,), accept=accept_variants, description="end lease 42 now (answered ack)"),
        Valid(
            "error-unknown-lease",
            m.Error(68, kp.ErrorCode.UNKNOWN_LEASE, "lease 42 is not held by this session (never granted, released or ended)", "lease"),
            versions=(4,),
            description="a second unlease of lease 42: a clean error, never a second free",
        ),
        Valid(
            "error-lease-limit",
            m.Error(69, kp.ErrorCode.LEASE_LIMIT, "this session holds 1024 leases, the most the node allows"),
            versions=(4,),
            description="a lease refused whole: the session holds max_leases_per_session leases",
        ),
        Valid(
            "lease-end-expired",
            m.LeaseEnded(4, LEASE_ID, kp.ErrorCode.LEASE_EXPIRED),
            versions=(4,),
            omit_defaults=True,
            accept=accept_defaults_omitted,
            description="the session's event 4: lease 42 was not renewed in time and ended whole (no keys)",
        ),
        Valid(
            "lease-end-source",
            m.LeaseEnded(5, LEASE_ID + 1, kp.ErrorCode.PEER_RESTARTED, "the source tcp://10.0.0.12:5555 restarted", (K2,)),
            versions=(4,),
            description="the source that held K2 restarted: lease 43 no longer holds K2 and goes on for the rest",
        ),
        Valid(
            "lease-end-unreachable",
            m.LeaseEnded(7, LEASE_ID + 3, kp.ErrorCode.PEER_UNREACHABLE, "the source tcp://10.0.0.12:5555 is unreachable", (K1, K3)),
            versions=(4,),
            description="the link to the source that held K1 and K3 stayed down past peer_dead_ms: lease 45 holds them no more",
        ),
        Valid(
            "lease-end-taken-back",
            m.LeaseEnded(8, LEASE_ID + 4, kp.ErrorCode.LEASE_LIMIT,
                         "lease 46 was ended: its session held more than its share of pool 'kv''s lease budget"),
            versions=(4,),
            description="the session held more than its share of the pool's lease budget when another needed it",
        ),
        Valid(
            "lease-end-shutdown",
            m.LeaseEnded(6, LEASE_ID + 2, kp.ErrorCode.SHUTTING_DOWN, "the node is stopping"),
            versions=(4,),
            description="the node stops: every lease ends",
        ),
        # ---- node <-> node
        Valid(
            "peer-lease",
            m.Lease(300, (K2,), None, 5000),
            versions=(4,),
            description="node A asks source B to hold K2 for a client's lease, with the time to live A granted; no request id",
        ),
        Valid(
            "peer-lease-reply",
            m.LeaseReply(300, SOURCE_LEASE, 5000, lease_columns([(S.LEASED, "dram")])),
            versions=(4,),
            description="B holds K2 in DRAM under its own lease; A answers its client LEASED_REMOTE",
        ),
        Valid("peer-renew", m.RenewLease(301, SOURCE_LEASE, 5000), versions=(4,), description="the client renewed: A renews its lease at B"),
        Valid("peer-unlease", m.ReleaseLease(302, SOURCE_LEASE), versions=(4,), description="the client's lease ended: A releases its lease at B"),
        Valid(
            "peer-lease-end",
            m.LeaseEnded(1, SOURCE_LEASE, kp.ErrorCode.LEASE_EXPIRED, "lease was not renewed within 5000 ms"),
            versions=(4,),
            description="B expired A's lease; A tells its client, naming the keys B held",
        ),
    ]


TWINS = twin_proof(bytes(range(0x10, 0x20)), bytes(range(0x20, 0x30))) + twin_proof(bytes(range(0x30, 0x40)), bytes(range(0x20, 0x30)))
"""Two proofs: node A's links with tokens 0x10.. and 0x30.. reach B, as does this one (token 0x20..)."""
RESUME_TOKEN = bytes(range(0xA0, 0xB0))
"""A session's resume token as the reference node draws it: 16 bytes (section 5.2)."""


def v5_instances() -> list[Valid]:
    """Version 5: every message of versions 1 to 4 again at version 5, then ``peer_forget``."""
    again = [
        dataclasses.replace(inst, versions=(5,))
        for inst in v4_instances()
        if inst.name not in ("welcome-agreed-4", "peer-welcome-agreed-4")
    ]
    return [
        *again,
        Valid("welcome-agreed-5", m.Welcome(1, 5, "node-a", INC_A, "kvcr-node-a", POOLS_A, 1000), versions=(5,), description="welcome agreeing on version 5"),
        Valid("peer-welcome-agreed-5", m.PeerWelcome(1, 5, "node-b", INC_B, "kvcr-node-b", MD_NODE_B), versions=(5,), description="node B agrees on version 5"),
        Valid(
            "peer-welcome-twins",
            m.PeerWelcome(1, 5, "node-b", INC_B, "kvcr-node-b", MD_NODE_B, TWINS),
            versions=(5,),
            description="node B proves that two of node A's links reach it (section 5.3, \"Twin links\")",
        ),
        Valid(
            "welcome-resume",
            m.Welcome(1, 5, "node-a", INC_A, "kvcr-node-a", POOLS_A, 1000, RESUME_TOKEN),
            versions=(5,),
            description="welcome agreeing on version 5 with the session's resume token (section 5.2)",
        ),
        Valid(
            "welcome-kept",
            m.Welcome(1, 5, "node-a", INC_A + 2, "kvcr-node-a", POOLS_A, 1000, RESUME_TOKEN, INC_A),
            versions=(5,),
            description="a node restarted on its state took back incarnation INC_A's cache (section 6.4, welcome)",
        ),
        Valid(
            "stats-audit",
            m.StatsRequest(56, True),
            versions=(5,),
            description="ask for statistics and the node's accounting check (section 5.2, \"Statistics\")",
        ),
        Valid(
            "hello-resume",
            m.Hello(1, (1, 2, 3, 4, 5), "vllm-tp0", "kvcr-client-4712", MD_CLIENT, (R_DRAM, R_VRAM), RESUME_TOKEN),
            versions=(5,),
            description="a reconnecting client presents its previous session's resume token; always encoded at v=1",
        ),
        Valid(
            "peer-forget",
            m.PeerForget(310, "kvcr-client-4712"),
            versions=(5,),
            accept=accept_variants,
            description="the client announced in peer-client left node A: B forgets it (answered ack)",
        ),
        Valid("ack-peer-forget", m.Ack(310), versions=(5,), description="B forgot the client, or held no such client"),
        Valid(
            "lease-read",
            m.Lease(320, (K1, K2, K3), None, 5000, read=True, node_md=True),
            versions=(5,),
            accept=accept_variants,
            description="a read lease (section 6.12) that also asks for the node's agent metadata and pool registrations",
        ),
        Valid(
            "lease-reply-grant",
            m.LeaseReply(320, LEASE_ID, 5000, GRANT_COLUMNS, True, GRANT),
            versions=(5,),
            description="K1 (two spans in pool full) and K3 (one span in swa) granted, K2 missed; the node's agent once",
        ),
        Valid(
            "lease-reply-grant-cached",
            m.LeaseReply(321, LEASE_ID + 1, 5000, GRANT_COLUMNS, True, dataclasses.replace(GRANT, node=None)),
            versions=(5,),
            description="a read lease that did not ask for node_md: the client cached the node's agent",
        ),
        Valid(
            "lease-reply-grant-digests",
            m.LeaseReply(323, LEASE_ID + 3, 5000, GRANT_COLUMNS, True, dataclasses.replace(
                GRANT, node=None, digest=kp.columns.pack([0x9E3779B97F4A7C15, 0x0123456789ABCDEF, 0], "Q"))),
            versions=(5,),
            description=(
                "a grant with the digest of each granted span (section 6.12, Integrity): K1's two spans, and 0 for "
                "K3's span, which the node did not digest (GPU memory)"
            ),
        ),
        Valid(
            "lease-reply-no-grant",
            m.LeaseReply(322, LEASE_ID + 2, 5000, GRANT_COLUMNS, True),
            versions=(5,),
            description="a read lease answered without a grant (client_transfers off): the node-driven path",
        ),
        Valid("lease-reply-renew-held", m.LeaseReply(323, LEASE_ID, 5000, None, True), versions=(5,),
              description="a renewal: the lease held every key without a break"),
        Valid("lease-reply-renew-broken", m.LeaseReply(324, LEASE_ID, 5000, None, False), versions=(5,),
              description="a renewal of a lease that lost keys at a source: not held without a break"),
        # ---- grants across nodes (section 6.12, "Across nodes")
        Valid(
            "peer-lease-read",
            m.Lease(330, (K2,), None, 5000, read=True, node_md=True),
            versions=(5,),
            description="a client's read lease of K2, hinted at B: A asks B for a grant too, and B's agent (none cached yet)",
        ),
        Valid(
            "peer-lease-reply-grant",
            m.LeaseReply(330, SOURCE_LEASE, 5000, lease_columns([(LeaseStatus.LEASED, "dram")]), True, SOURCE_GRANT),
            versions=(5,),
            description="B holds K2 in slots 3 and 4 of its pool 0 and grants them, with its agent and its pools' slot sizes",
        ),
        Valid(
            "lease-reply-grant-remote",
            m.LeaseReply(325, LEASE_ID + 3, 5000, REMOTE_GRANT_COLUMNS, True, REMOTE_GRANT),
            versions=(5,),
            description="A's grant to its client: K1 in A's pool 0, K2 passed on from B (source 1, with B's agent once), K3 missed",
        ),
        Valid(
            "lease-reply-grant-remote-cached",
            m.LeaseReply(326, LEASE_ID + 4, 5000, REMOTE_GRANT_COLUMNS, True, dataclasses.replace(
                REMOTE_GRANT, sources=(kp.GrantSource(SOURCE_B, INC_B),))),
            versions=(5,),
            description="a later grant of B's rows to the same client session: B's agent is cached, not sent again",
        ),
        *put_instances(),
    ]


PUT_ID = 77
"""The put node A reserves in the version-5 write-grant vectors."""


def put_instances() -> list[Valid]:
    """Version 5's write grants (section 6.13): put, put_reply, commit, unput."""
    cols = kp.deposit_columns([m.DepositItem(K1, src_layout(1, 0)), m.DepositItem(K2, src_layout(1, 1664 * KiB))])
    grant = kp.grant_columns([(("L0", "L1", "L2", "S"), [(0, 7), (0, 8), (1, 3), (2, 0)]), None],
                             kp.GrantNode("kvcr-node-a", MD_NODE_A, POOL_REGIONS_A[:3], 10_000))
    return [
        Valid("put", kp.Put(330, (m.DepositItem(K1, src_layout(1, 0)),), ttl_ms=2000, node_md=True), versions=(5,),
              accept=accept_variants, description="reserve K1's four spans; the node's agent with the slots"),
        Valid("put-columns", kp.Put(331, (), no_evict=True, columns=(cols,)), versions=(5,),
              description="K1 and K2 as one column block, a release handle per stored key"),
        Valid("put-reply", kp.PutReply(331, PUT_ID, 2000, (OK, failed(E.BUSY, "items[1]: another writer holds the key")), grant),
              versions=(5,), description="K1 reserved (slots 7, 8 of pool 0, 3 of pool 1, 0 of pool 2), K2 written by another"),
        Valid("put-reply-nothing", kp.PutReply(332, 0, 0, (m.KeyResult(m.KeyStatus.DUPLICATE),)), versions=(5,),
              description="K1 is already READY: nothing reserved, no put to commit"),
        Valid("put-parents", kp.Put(338, (), columns=(cols,), parents=(b"", K1)), versions=(5,),
              description="K1 and K2 as one column block; K1 names no parent, K2's parent is K1"),
        Valid("commit", kp.Commit(333, PUT_ID), versions=(5,), description="every WRITE of put 77 is done"),
        Valid("complete-commit", m.Completion(333, (m.KeyResult(m.KeyStatus.STORED, handle=9), failed(E.BUSY, "items[1]: another writer holds the key"))),
              versions=(5,), description="the commit's results: K1 stored with its handle, K2 as the put said"),
        Valid("unput", kp.Unput(334, PUT_ID), versions=(5,), description="abandon put 77: no WRITE of it can land any more"),
        Valid("error-unknown-put", m.Error(335, E.UNKNOWN_PUT, "put 77 is not held by this session", "put"), versions=(5,),
              description="a second commit of put 77"),
        Valid("suspect", kp.Suspect(336, (K1, K2, K3)), versions=(5,),
              description="K1, K2 and K3 were read under a grant with bytes that did not match their digests"),
        Valid("complete-suspect", m.Completion(336, (
            OK, failed(E.DIGEST_MISMATCH, "keys[1]: its bytes no longer match their digests; the node dropped it"),
            failed(E.NOT_FOUND, "keys[2] is not stored on this node"))), versions=(5,),
              description="the node read them: K1 intact and kept, K2 changed and dropped, K3 not stored here"),
        Valid("complete-suspect-passed-on", m.Completion(337, (
            failed(E.DIGEST_MISMATCH, "keys[0]: the source at tcp://10.0.0.2:5555: keys[0]: its bytes no longer match "
                                      "their digests; the node dropped it"),
            failed(E.PEER_UNREACHABLE, "keys[1]: the source at tcp://10.0.0.3:5555 did not check it (no verdict came)"))),
              versions=(5,), description="a target's answer to keys its client read from sources' pools: the first "
                                         "source dropped K1, the second never answered"),
    ]


GRANT_COLUMNS = LeaseColumns(bytes([LeaseStatus.LEASED, LeaseStatus.MISS, LeaseStatus.LEASED]), bytes([0, 1, 0]), ("dram", ""))
"""K1 and K3 held here in DRAM, K2 missed: the answers of the version-5 grant vectors."""
GRANT = kp.grant_columns(
    [(("k", "v"), [(0, 7), (0, 8)]), None, (("state",), [(1, 4095)])],
    kp.GrantNode("kvcr-node-a", MD_NODE_A, POOL_REGIONS_A[:2], 10_000),
)
"""A read grant of K1 (slots 7 and 8 of pool 0) and K3 (slot 4095 of pool 1), with the node's agent."""
SOURCE_B = "tcp://10.0.0.12:5555"
"""Source B's endpoint, as the client's hint names it."""
NODE_B = kp.GrantNode(
    "kvcr-node-b", MD_NODE_B, (m.Region(0, m.MemoryKind.DRAM, 0, 0x7D10_0000_0000, 64 * KiB * 1024),), 10_000,
    kp.columns.pack([64 * KiB], "I"),
)
"""B's agent as it grants it to a peer session: one pool, with its slot size."""
SOURCE_GRANT = kp.grant_columns([(("k", "v"), [(0, 3), (0, 4)])], NODE_B)
"""B's grant to A of K2 (slots 3 and 4 of B's pool 0)."""
REMOTE_GRANT_COLUMNS = LeaseColumns(
    bytes([LeaseStatus.LEASED, LeaseStatus.LEASED_REMOTE, LeaseStatus.MISS]), bytes([0, 1, 2]), ("dram", "remote", ""))
REMOTE_GRANT = kp.grant_columns(
    [(("k", "v"), [(0, 7), (0, 8)]), (("k", "v"), [(0, 3), (0, 4)]), None], None, [0, 1, 0],
    (kp.GrantSource(SOURCE_B, INC_B, NODE_B),),
)
"""A's grant to its client: K1 here, K2's rows from B (source 1 of the table), K3 none."""


def accept_short_columns(message: m.Message, version: int) -> list[tuple[str, bytes]]:
    """A block of columns without its trailing (empty) groups column."""
    obj = _wire(message, version)
    obj["!columns"] = [block[:-1] for block in obj["!columns"]]
    return [("trailing empty groups column omitted", _pack(obj))]


def build_valid(instances: list[Valid]) -> list[dict[str, Any]]:
    """Every valid vector of ``instances``, checked against the codec."""
    out = []
    for inst in instances:
        for version in inst.versions:
            msg = inst.message
            frame = kp.encode(msg, version)
            assert kp.decode(frame, version) == msg, inst.name
            wire_version = msgpack.unpackb(frame)["v"]
            vec: dict[str, Any] = {
                "name": f"{inst.name}-v{version}",
                "version": version,
                "wire_version": wire_version,
                "tag": type(msg).TAG,
                "description": inst.description,
                "fields": fields_json(msg, inst.omit_defaults, version),
                "hex": frame.hex(),
            }
            if inst.accept is not None:
                accepted = []
                for what, alt in inst.accept(msg, version):
                    assert alt != frame, (inst.name, what)
                    assert kp.decode(alt, version) == msg, (inst.name, what)
                    accepted.append({"description": what, "hex": alt.hex()})
                if accepted:
                    vec["accept"] = accepted
            out.append(vec)
    return out


# ------------------------------------------------------------------- invalid vectors


def _fix(n: int, body: bytes) -> bytes:
    """A fixmap header for ``n`` pairs followed by ``body`` (hand-built maps)."""
    return bytes([0x80 | n]) + body


def _kv(key: str, value: Any) -> bytes:
    return _pack(key) + _pack(value)


def invalid_inputs() -> Iterator[tuple[str, bytes, int, str, str]]:
    """(name, frame, max_version, expected code name, description)."""
    hb = kp.encode(m.Heartbeat(1), 1)
    dep = kp.encode(m.Deposit(10, (m.DepositItem(K1, src_layout(1, 0)),)), 1)
    dep_obj = _wire(m.Deposit(10, (m.DepositItem(K1, src_layout(1, 0)),)), 1)
    write1 = _wire(m.WriteRequest(100, "c", (m.DeliverItem(K1, dst_layout(2, 0, ("L0",))),), 100), 1)
    write2 = _wire(m.WriteRequest(100, "c", (m.DeliverItem(K1, dst_layout(2, 0, ("L0",))),), 100, True), 2)
    deliver2 = _wire(m.Deliver(30, (m.DeliverItem(K1, dst_layout(2, 0, ("L0",))),), partial=True), 2)

    def q1(**fields: Any) -> bytes:
        return _pack({"v": 1, "t": "query", "id": 5, **fields})

    def with_(obj: dict[str, Any], **changes: Any) -> bytes:
        new = dict(obj)
        for k, v in changes.items():
            new[k.replace("_bang_", "!")] = v
        return _pack(new)

    def without(obj: dict[str, Any], key: str) -> bytes:
        return _pack({k: v for k, v in obj.items() if k != key})

    # -- framing and msgpack
    yield ("empty-frame", b"", 2, "MALFORMED", "a zero-length frame")
    yield ("truncated-last-byte", hb[:-1], 2, "MALFORMED", "a heartbeat missing its last byte")
    yield ("truncated-mid-str", dep[: len(dep) // 2], 2, "MALFORMED", "a deposit cut in the middle")
    # -- parents (section 6.4)
    yield ("parents-count", with_(dep_obj, parents=[K2, K3]), 2, "OUT_OF_RANGE", "two parents for a deposit of one key")
    yield ("parents-self", with_(dep_obj, parents=[K1]), 2, "OUT_OF_RANGE", "a key named as its own parent")
    yield ("parents-str", with_(dep_obj, parents=["k0"]), 2, "WRONG_TYPE", "a parent as str")
    yield ("parents-257", with_(dep_obj, parents=[b"p" * 257]), 2, "TOO_LARGE", "a parent longer than max_key")
    yield ("truncated-map-header", b"\x83", 2, "MALFORMED", "a map header announcing 3 pairs and nothing else")
    yield ("truncated-array", _fix(4, _kv("v", 1) + _kv("t", "release") + _kv("id", 1) + _pack("handles") + b"\x93\x01"), 2, "MALFORMED", "an array announcing 3 items holding 1")
    yield ("truncated-bin-length", _fix(4, _kv("v", 1) + _kv("t", "query") + _kv("id", 1) + _pack("keys") + b"\x91\xc6\xff\xff\xff\xff"), 2, "MALFORMED", "a bin32 claiming 4 GiB")
    yield ("reserved-byte", b"\xc1", 2, "MALFORMED", "0xc1 is never used in msgpack")
    yield ("json-not-msgpack", b'{"v":1,"t":"heartbeat","id":1}', 2, "MALFORMED", "JSON text, not msgpack")
    yield ("trailing-bytes", hb + b"\x00", 2, "MALFORMED", "a valid heartbeat followed by one more byte")
    yield ("two-frames", hb + hb, 2, "MALFORMED", "two heartbeats in one frame")
    yield ("invalid-utf8", _fix(3, _kv("v", 1) + _kv("t", "heartbeat") + _pack("id"))[:] + b"\xa3\xff\xfe\xfd", 2, "MALFORMED", "a str that is not UTF-8")
    yield ("ext-fixext1", _fix(3, _kv("v", 1) + _kv("t", "heartbeat") + _pack("id") + b"\xd4\x01\x00"), 2, "MALFORMED", "an extension type (fixext 1) as the id")
    yield ("ext-empty", _fix(3, _kv("v", 1) + _kv("t", "heartbeat") + _pack("id") + b"\xc7\x00\x05"), 2, "MALFORMED", "a zero-length extension type (ext 8) as the id")
    yield ("ext-timestamp", _fix(3, _kv("v", 1) + _kv("t", "heartbeat") + _pack("id") + b"\xd6\xff\x00\x00\x00\x01"), 2, "MALFORMED", "a msgpack timestamp as the id")
    yield ("duplicate-key", _fix(4, _kv("v", 1) + _kv("t", "heartbeat") + _kv("id", 1) + _kv("id", 2)), 2, "MALFORMED", "the key id twice in one map")
    yield ("duplicate-v", _fix(4, _kv("v", 1) + _kv("t", "heartbeat") + _kv("id", 1) + _kv("v", 2)), 2, "MALFORMED", "the key v twice, with different versions")
    yield ("list-map-key", _fix(3, _kv("v", 1) + _kv("t", "heartbeat") + b"\x91\x01\x01"), 2, "MALFORMED", "an array as a map key")
    yield (
        "too-deep",
        _fix(
            4,
            _kv("v", 1)
            + _kv("t", "stats_reply")
            + _kv("id", 1)
            + _pack("stats")
            + b"\x81\xa1a"
            + b"\x91" * 2000
            + b"\xc0",
        ),
        2,
        "MALFORMED",
        "statistics nested 2000 arrays deep",
    )
    # -- envelope
    yield ("array-frame", _pack([1, "heartbeat", 1]), 2, "NOT_A_MAP", "the envelope as an array")
    yield ("int-frame", _pack(1), 2, "NOT_A_MAP", "a bare integer")
    yield ("str-frame", _pack("heartbeat"), 2, "NOT_A_MAP", "a bare str")
    yield ("nil-frame", b"\xc0", 2, "NOT_A_MAP", "nil")
    yield ("missing-v", _pack({"t": "heartbeat", "id": 1}), 2, "MISSING_FIELD", "no version")
    yield ("nil-v", _pack({"v": None, "t": "heartbeat", "id": 1}), 2, "MISSING_FIELD", "version nil (same as absent)")
    yield ("missing-t", _pack({"v": 1, "id": 1}), 2, "MISSING_FIELD", "no type tag")
    yield ("str-v", _pack({"v": "1", "t": "heartbeat", "id": 1}), 2, "WRONG_TYPE", "version as a str")
    yield ("bool-v", _pack({"v": True, "t": "heartbeat", "id": 1}), 2, "WRONG_TYPE", "version as a bool")
    yield ("float-v", _pack({"v": 1.0, "t": "heartbeat", "id": 1}), 2, "WRONG_TYPE", "version as a float")
    yield ("int-t", _pack({"v": 1, "t": 7, "id": 1}), 2, "WRONG_TYPE", "type tag as an integer")
    yield ("bin-t", _pack({"v": 1, "t": b"heartbeat", "id": 1}), 2, "WRONG_TYPE", "type tag as bin")
    yield ("unknown-tag", _pack({"v": 1, "t": "teleport", "id": 1}), 2, "UNKNOWN_TYPE", "no message has this tag")
    yield ("tag-case", _pack({"v": 1, "t": "Heartbeat", "id": 1}), 2, "UNKNOWN_TYPE", "tags are case-sensitive")
    yield ("unknown-tag-v99", _pack({"v": 99, "t": "teleport", "id": 1}), 2, "UNKNOWN_TYPE", "the tag is checked before the version")
    yield ("version-0", _pack({"v": 0, "t": "heartbeat", "id": 1}), 2, "UNSUPPORTED_VERSION", "version 0 does not exist")
    yield ("version-negative", _pack({"v": -1, "t": "heartbeat", "id": 1}), 2, "UNSUPPORTED_VERSION", "version -1")
    yield ("version-3", _pack({"v": 3, "t": "heartbeat", "id": 1}), 2, "UNSUPPORTED_VERSION", "version 3 is not spoken")
    yield ("version-99", _pack({"v": 99, "t": "query", "id": 1, "keys": []}), 2, "UNSUPPORTED_VERSION", "version 99")
    yield ("version-2-at-1", _pack({"v": 2, "t": "query", "id": 1, "keys": []}), 1, "UNSUPPORTED_VERSION", "a version-2 query reaching an endpoint that speaks version 1 only")
    yield ("welcome-version-3", _pack({"v": 3, "t": "welcome", "id": 1, "version": 3, "node": "n", "incarnation": 1, "agent": "a"}), 2, "UNSUPPORTED_VERSION", "only hello and peer_hello tolerate any v")
    # -- fields
    yield ("missing-id", _pack({"v": 1, "t": "heartbeat"}), 2, "MISSING_FIELD", "no request id")
    yield ("missing-items", without(dep_obj, "items"), 2, "MISSING_FIELD", "a deposit without items")
    yield ("hello-v5-missing-client", _pack({"v": 5, "t": "hello", "id": 1, "versions": [1, 5], "agent": "a", "agent_md": b""}), 2, "MISSING_FIELD", "a hello from a newer version is still validated at version 1")
    yield ("str-id", _pack({"v": 1, "t": "heartbeat", "id": "1"}), 2, "WRONG_TYPE", "id as a str")
    yield ("negative-id", _pack({"v": 1, "t": "heartbeat", "id": -1}), 2, "OUT_OF_RANGE", "a negative id")
    yield ("float-id", _pack({"v": 1, "t": "heartbeat", "id": 1.0}), 2, "WRONG_TYPE", "id as a float")
    yield ("nil-id", _pack({"v": 1, "t": "heartbeat", "id": None}), 2, "WRONG_TYPE", "id nil")
    yield ("int-for-bool", with_(dep_obj, no_evict=1), 2, "WRONG_TYPE", "no_evict as the integer 1")
    yield ("str-key", q1(keys=["3f9a0c11"]), 2, "WRONG_TYPE", "a block key as str instead of bin")
    yield ("empty-key", q1(keys=[b""]), 2, "OUT_OF_RANGE", "a zero-length block key")
    yield ("key-257", q1(keys=[b"\x01" * 257]), 2, "TOO_LARGE", "a block key of 257 bytes (limit 256)")
    yield ("keys-4097", q1(keys=[bytes([i % 251 + 1]) for i in range(4097)]), 2, "TOO_MANY", "4097 keys in one query (limit 4096)")
    yield ("keys-not-array", q1(keys=b"\x01\x02"), 2, "WRONG_TYPE", "keys as one bin")
    yield ("request-id-int", q1(keys=[], request_id=7), 2, "WRONG_TYPE", "request_id as an integer")
    yield ("name-129", _pack({**dep_obj, "items": [[K1, [["L" * 129, "full", 1, 0, 65536]]]]}), 2, "TOO_LARGE", "a span name of 129 bytes (limit 128)")
    yield ("name-129-utf8", _pack({**dep_obj, "items": [[K1, [["€" * 43, "full", 1, 0, 65536]]]]}), 2, "TOO_LARGE", "a span name of 43 characters but 129 UTF-8 bytes")
    yield ("deadline-over-u32", with_(dep_obj, deadline_ms=1 << 32), 2, "OUT_OF_RANGE", "deadline_ms above 2^32-1")
    yield ("region-over-u32", _pack({**dep_obj, "items": [[K1, [["L0", "full", 1 << 32, 0, 65536]]]]}), 2, "OUT_OF_RANGE", "a region id above 2^32-1")
    yield ("negative-offset", _pack({**dep_obj, "items": [[K1, [["L0", "full", 1, -64, 65536]]]]}), 2, "OUT_OF_RANGE", "a negative span offset")
    yield ("error-code-65536", _pack({"v": 1, "t": "error", "id": 1, "code": 65536}), 2, "OUT_OF_RANGE", "an error code above 65535")
    yield ("welcome-version-65536", _pack({"v": 1, "t": "welcome", "id": 1, "version": 65536, "node": "n", "incarnation": 1, "agent": "a"}), 2, "OUT_OF_RANGE", "an agreed version above 65535")
    yield ("unknown-memory-kind", _pack({"v": 1, "t": "regions", "id": 1, "agent_md": b"", "regions": [[1, "hbm", 0, 4096, 4096]]}), 2, "OUT_OF_RANGE", "memory kind hbm is not dram or vram")
    yield ("unknown-status", _pack({"v": 1, "t": "complete", "id": 1, "results": [["MAYBE"]]}), 2, "OUT_OF_RANGE", "a key status that does not exist")
    yield ("presence-lowercase", _pack({"v": 1, "t": "query_reply", "id": 1, "results": [["hit", "dram"]]}), 2, "OUT_OF_RANGE", "presence values are upper case")
    yield ("unknown-write-state", _pack({"v": 1, "t": "probe_reply", "id": 1, "op": 1, "state": "GONE", "incarnation": 1}), 2, "OUT_OF_RANGE", "a write state that does not exist")
    yield ("empty-spans", _pack({**dep_obj, "items": [[K1, []]]}), 2, "OUT_OF_RANGE", "a deposit item with no span")
    yield ("empty-layout", _pack({"v": 1, "t": "fetch", "id": 1, "items": [[K1, []]]}), 2, "OUT_OF_RANGE", "a fetch item with an empty layout")
    yield ("empty-versions", _pack({"v": 1, "t": "hello", "id": 1, "versions": [], "client": "c", "agent": "a", "agent_md": b""}), 2, "OUT_OF_RANGE", "a hello offering no version")
    yield ("agent-md-str", _pack({"v": 1, "t": "regions", "id": 1, "agent_md": "md", "regions": []}), 2, "WRONG_TYPE", "agent metadata as str instead of bin")
    yield ("record-too-short", _pack({**dep_obj, "items": [[K1, [["L0", "full", 1, 0]]]]}), 2, "MISSING_FIELD", "a source span with 4 of its 5 items")
    yield ("item-too-short", _pack({**dep_obj, "items": [[K1]]}), 2, "MISSING_FIELD", "a deposit item without spans")
    yield ("key-result-empty", _pack({"v": 1, "t": "complete", "id": 1, "results": [[]]}), 2, "MISSING_FIELD", "a key result with no status")
    yield ("record-as-map", _pack({**dep_obj, "items": [{"key": K1, "spans": []}]}), 2, "WRONG_TYPE", "a record as a map instead of an array")
    yield ("regions-as-map", _pack({"v": 1, "t": "regions", "id": 1, "agent_md": b"", "regions": {}}), 2, "WRONG_TYPE", "regions as a map")
    yield ("stats-not-map", _pack({"v": 1, "t": "stats_reply", "id": 1, "stats": [1, 2]}), 2, "WRONG_TYPE", "statistics as an array")
    yield ("stats-int-key", _pack({"v": 1, "t": "stats_reply", "id": 1, "stats": {1: 2}}), 2, "WRONG_TYPE", "statistics with an integer key")
    yield ("int-map-key", _fix(4, _kv("v", 1) + _kv("t", "heartbeat") + _kv("id", 1) + _pack(5) + _pack(1)), 2, "WRONG_TYPE", "an integer key in the envelope")
    yield ("bin-map-key", _fix(4, _kv("v", 1) + _kv("t", "heartbeat") + _kv("id", 1) + _pack(b"x") + _pack(1)), 2, "WRONG_TYPE", "a bin key in the envelope")
    # -- versions and must-understand
    yield ("partial-in-v1-at-1", with_(write1, _bang_partial=True), 1, "MUST_UNDERSTAND", "a v=1 write carrying !partial, read by a version-1 endpoint")
    yield ("partial-in-v1-at-2", with_(write1, _bang_partial=True), 2, "MUST_UNDERSTAND", "a v=1 write carrying !partial: version 1 has no such field, whoever reads it")
    yield ("partial-v2-at-1", _pack(write2), 1, "UNSUPPORTED_VERSION", "a v=2 partial write reaching a version-1 endpoint")
    yield ("partial-on-deliver", _pack({"v": 2, "t": "deliver", "id": 1, "items": [], "!partial": True}), 2, "MUST_UNDERSTAND", "!partial exists on write only; deliver's flag is the optional partial")
    yield ("deliver-partial-not-bool", with_(deliver2, partial=1), 2, "WRONG_TYPE", "deliver's partial as the integer 1")
    yield ("deliver-partial-str", with_(deliver2, partial="true"), 2, "WRONG_TYPE", "deliver's partial as a str")
    yield ("deliver-partial-nil", with_(deliver2, partial=None), 2, "WRONG_TYPE", "deliver's partial nil: not a bool, and not the same as absent")
    yield ("deliver-partial-v2-at-1", _pack(deliver2), 1, "UNSUPPORTED_VERSION", "a v=2 partial deliver reaching a node that speaks version 1 only")
    yield ("unknown-bang-v2", _pack({"v": 2, "t": "deliver", "id": 1, "items": [], "!priority": 1}), 2, "MUST_UNDERSTAND", "an unknown must-understand field on a version-2 message")
    yield ("unknown-bang-heartbeat", _pack({"v": 2, "t": "heartbeat", "id": 1, "!x": None}), 2, "MUST_UNDERSTAND", "an unknown must-understand field, even nil")
    yield (
        "unknown-bang-hello",
        _pack(
            {
                "v": 3,
                "t": "hello",
                "id": 1,
                "versions": [3],
                "client": "c",
                "agent": "a",
                "agent_md": b"",
                "!auth": b"x",
            }
        ),
        2,
        "MUST_UNDERSTAND",
        "a newer hello with a must-understand field this side lacks",
    )
    yield ("partial-not-bool", with_(write2, _bang_partial=1), 2, "WRONG_TYPE", "!partial as an integer")


def build_invalid(inputs: Iterator[tuple[str, bytes, int, str, str]]) -> list[dict[str, Any]]:
    """Every invalid vector of ``inputs``, checked against the codec."""
    out = []
    names = set()
    for name, frame, max_version, code, description in inputs:
        assert name not in names, name
        names.add(name)
        try:
            kp.decode(frame, max_version)
        except kp.RemoteProtocolError as exc:
            assert exc.code.name == code, (name, exc)
            path = exc.path
        else:
            raise AssertionError(f"{name}: decoded")
        out.append(
            {
                "name": name,
                "max_version": max_version,
                "error": code,
                "path": path,
                "description": description,
                "hex": frame.hex(),
            }
        )
    return out


def invalid_v3_inputs() -> Iterator[tuple[str, bytes, int, str, str]]:
    """Version 3's invalid frames: (name, frame, max_version, expected code name, description)."""
    block = [[K1, K2], NUL.join(("L0", "L1")), 2, pack(range(0, 4 * 65536, 65536), U64), 65536, b""]
    deliver = {"v": 3, "t": "deliver", "id": 40, "items": [], "request_id": None, "deadline_ms": 0, "partial": False}
    deposit = {"v": 3, "t": "deposit", "id": 41, "items": [], "no_evict": False, "optional": False, "deadline_ms": 0}
    write = {"v": 3, "t": "write", "id": 42, "agent": "c", "items": [], "deadline_ms": 0}
    reply = {"v": 3, "t": "query_reply", "id": 43, "results": []}

    def cols(**changes: Any) -> bytes:
        """A deliver whose one block has ``changes`` (by column name) applied."""
        fields = ["keys", "names", "regions", "offsets", "lengths", "groups"]
        changed = list(block)
        for name, value in changes.items():
            changed[fields.index(name)] = value
        return _pack({**deliver, "!columns": [changed]})

    def answers(presence: bytes, tier: bytes, tiers: list[str]) -> bytes:
        return _pack({**reply, "!columns": [presence, tier, tiers]})

    # -- versions and must-understand
    yield ("columns-v3-at-2", cols(), 2, "UNSUPPORTED_VERSION", "a version-3 deliver of columns reaching a node that speaks up to 2")
    yield ("columns-in-v2-frame", _pack({**deliver, "v": 2, "!columns": [block]}), 3, "MUST_UNDERSTAND", "!columns in a v=2 frame: version 2 has no such field")
    yield ("notify-in-v2-frame", _pack({**deliver, "v": 2, "!notify": 7}), 3, "MUST_UNDERSTAND", "!notify in a v=2 frame")
    yield ("prefix-in-v2-frame", _pack({"v": 2, "t": "query", "id": 5, "keys": [K1], "!prefix": 2}), 3, "MUST_UNDERSTAND", "!prefix in a v=2 query")
    yield ("progress-in-v2-frame", _pack({"v": 2, "t": "progress", "id": 34, "items": b"", "done": b""}), 3, "UNKNOWN_TYPE", "progress does not exist at version 2")
    yield ("progress-at-2", _pack({"v": 3, "t": "progress", "id": 34, "items": b"", "done": b""}), 2, "UNKNOWN_TYPE", "an endpoint that speaks up to 2 knows no progress message")
    yield ("unknown-bang-v3", _pack({**deliver, "!columns": [block], "!priority": 1}), 3, "MUST_UNDERSTAND", "an unknown must-understand field on a version-3 message")
    # -- span columns
    yield ("columns-and-items", _pack({**deliver, "items": [[K3, [["L0", 2, 0, 65536]]]], "!columns": [block]}), 3, "OUT_OF_RANGE", "items as records and as columns in one message")
    yield ("columns-as-map", _pack({**deliver, "!columns": [{"keys": [K1]}]}), 3, "WRONG_TYPE", "a block of columns as a map")
    yield ("columns-too-short", _pack({**deliver, "!columns": [block[:4]]}), 3, "MISSING_FIELD", "a block without its lengths column")
    yield ("columns-no-key", cols(keys=[], offsets=b""), 3, "OUT_OF_RANGE", "a block of no key")
    yield ("columns-key-str", cols(keys=["k1", K2]), 3, "WRONG_TYPE", "a key as str")
    yield ("columns-names-array", cols(names=["L0", "L1"]), 3, "WRONG_TYPE", "names as an array, not one NUL-joined str")
    yield ("columns-name-129", cols(names="L0" + NUL + "L" * 129), 3, "TOO_LARGE", "the second name is 129 bytes (limit 128)")
    yield ("offsets-short", cols(offsets=pack(range(3), U64)), 3, "OUT_OF_RANGE", "3 offsets for 2 keys of 2 spans")
    yield ("offsets-long", cols(offsets=pack(range(5), U64)), 3, "OUT_OF_RANGE", "5 offsets for 2 keys of 2 spans")
    yield ("offsets-ragged", cols(offsets=pack(range(4), U64)[:-1]), 3, "OUT_OF_RANGE", "31 bytes: not a whole number of u64")
    yield ("offsets-array", cols(offsets=[0, 65536, 131072, 196608]), 3, "WRONG_TYPE", "offsets as an array of integers, not packed")
    yield ("regions-count", cols(regions=pack((1, 2, 3), U32)), 3, "OUT_OF_RANGE", "3 regions: neither one per span (2) nor one per entry (4)")
    yield ("columns-region-over-u32", cols(regions=1 << 32), 3, "OUT_OF_RANGE", "a region id above 2^32-1")
    yield ("region-negative", cols(regions=-1), 3, "OUT_OF_RANGE", "a negative region id")
    yield ("regions-str", cols(regions="2"), 3, "WRONG_TYPE", "a region as str")
    yield ("lengths-count", cols(lengths=pack((65536,), U64)), 3, "OUT_OF_RANGE", "one length for 2 spans (a uniform length is an integer)")
    yield ("length-negative", cols(lengths=-65536), 3, "OUT_OF_RANGE", "a negative length")
    yield ("groups-count", cols(groups=pack((0, 0, 1), U16)), 3, "OUT_OF_RANGE", "a plan naming 3 spans of a 2-span layout")
    yield ("groups-short", cols(groups=pack((0,), U16)), 3, "OUT_OF_RANGE", "a plan leaving a span out")
    yield ("groups-gap", cols(groups=pack((0, 2), U16)), 3, "OUT_OF_RANGE", "group 1 has no span")
    yield ("groups-huge", cols(groups=pack((0, 65535), U16)), 3, "OUT_OF_RANGE", "a 2-span plan naming group 65535: refused before 65536 groups are built")
    yield ("groups-ragged", cols(groups=b"\x00\x00\x01"), 3, "OUT_OF_RANGE", "3 bytes: not a whole number of u16")
    yield ("pools-count", _pack({**deposit, "!columns": [[[K1], NUL.join(("L0", "L1")), 1, pack((0, 65536), U64), 65536, "full"]]}), 3, "OUT_OF_RANGE", "one pool for 2 spans")
    yield ("pools-missing", _pack({**deposit, "!columns": [[[K1], "L0", 1, pack((0,), U64), 65536]]}), 3, "MISSING_FIELD", "a deposit block without pools")
    yield (
        "columns-spans-65538",
        cols(names=NUL.join(["x"] * 32769), offsets=b""),
        3,
        "TOO_MANY",
        "2 keys of 32769 spans: 65538 spans in one block (limit 65536)",
    )
    wide = [[bytes([1 + i % 250, i // 250]) for i in range(2049)], "L0", 2, pack(range(2049), U64), 65536, b""]
    yield ("columns-keys-4098", _pack({**deliver, "!columns": [wide, wide]}), 3, "TOO_MANY", "two blocks of 2049 keys: 4098 keys (limit 4096)")
    # -- layer plans, progress, notifications
    yield ("notify-over-u32", _pack({**deliver, "!columns": [block], "!notify": 1 << 32}), 3, "OUT_OF_RANGE", "a notification token above 2^32-1")
    yield ("write-notify-token-0", _pack({**write, "!columns": [block], "!notify": [0, 40, pack((0, 1), U32)]}), 3, "OUT_OF_RANGE", "token 0 (no notification is sent by leaving !notify out)")
    yield ("write-notify-items", _pack({**write, "!columns": [block], "!notify": [7, 40, pack((0,), U32)]}), 3, "OUT_OF_RANGE", "one deliver item index for a write of 2 items")
    yield ("done-count", _pack({"v": 3, "t": "complete", "id": 34, "results": [["OK"], ["OK"]], "done": pack((4,), U32)}), 3, "OUT_OF_RANGE", "one group count for 2 results")
    yield ("progress-count", _pack({"v": 3, "t": "progress", "id": 34, "items": pack((0, 1), U32), "done": pack((1,), U32)}), 3, "OUT_OF_RANGE", "two items, one count")
    yield ("progress-missing-done", _pack({"v": 3, "t": "progress", "id": 34, "items": pack((0,), U32)}), 3, "MISSING_FIELD", "progress without its counts")
    # -- query columns and prefix queries
    yield ("prefix-miss-bit", _pack({"v": 3, "t": "query", "id": 5, "keys": [K1], "!prefix": 1}), 3, "OUT_OF_RANGE", "a prefix counting misses")
    yield ("prefix-over-u8", _pack({"v": 3, "t": "query", "id": 5, "keys": [K1], "!prefix": 256}), 3, "OUT_OF_RANGE", "a prefix mask above 255")
    yield ("prefix-bool", _pack({"v": 3, "t": "query", "id": 5, "keys": [K1], "!prefix": True}), 3, "WRONG_TYPE", "a prefix mask as a bool")
    yield ("answers-unknown-presence", answers(b"\x01\x00\x04", b"\x00\x01\x01", ["dram", ""]), 3, "OUT_OF_RANGE", "presence code 4 does not exist")
    yield ("answers-tier-outside", answers(b"\x01\x01", b"\x00\x02", ["dram", "hbm:0"]), 3, "OUT_OF_RANGE", "tier index 2 of a table of 2")
    yield ("answers-length-mismatch", answers(b"\x01\x01\x00", b"\x00\x00", ["dram", ""]), 3, "OUT_OF_RANGE", "3 presence codes, 2 tier indices")
    yield ("answers-and-results", _pack({**reply, "results": [["HIT", "dram"]], "!columns": [b"\x01", b"\x00", ["dram"]]}), 3, "OUT_OF_RANGE", "answers as records and as columns")
    yield ("answers-4097", answers(bytes(4097), bytes(4097), [""]), 3, "TOO_MANY", "4097 answers (limit 4096)")
    yield ("answers-tiers-257", answers(b"\x00", b"\x00", [f"t{i}" for i in range(257)]), 3, "TOO_MANY", "a tier table of 257 entries (an index is one byte)")
    yield ("answers-presence-array", answers([1, 0], b"\x00\x00", [""]), 3, "WRONG_TYPE", "presence as an array, not packed")


def invalid_v4_inputs() -> Iterator[tuple[str, bytes, int, str, str]]:
    """Version 4's invalid frames: (name, frame, max_version, expected code name, description)."""
    lease = {"v": 4, "t": "lease", "id": 60, "keys": [K1, K2], "request_id": None, "ttl_ms": 0}
    reply = {"v": 4, "t": "lease_reply", "id": 60, "lease": LEASE_ID, "ttl_ms": 30000}
    renew = {"v": 4, "t": "renew", "id": 65, "lease": LEASE_ID, "ttl_ms": 0}
    unlease = {"v": 4, "t": "unlease", "id": 67, "lease": LEASE_ID}
    ended = {"v": 4, "t": "lease_end", "id": 4, "lease": LEASE_ID, "code": 310, "reason": "", "keys": []}

    def answers(status: Any, tier: Any, tiers: Any) -> bytes:
        return _pack({**reply, "columns": [status, tier, tiers]})

    # -- versions
    yield ("lease-in-v3-frame", _pack({**lease, "v": 3}), 4, "UNKNOWN_TYPE", "lease does not exist at version 3")
    yield ("lease-at-3", _pack(lease), 3, "UNKNOWN_TYPE", "an endpoint that speaks up to 3 knows no lease message")
    yield ("lease-reply-in-v3-frame", _pack({**reply, "v": 3, "columns": None}), 4, "UNKNOWN_TYPE", "lease_reply does not exist at version 3")
    yield ("renew-in-v2-frame", _pack({**renew, "v": 2}), 4, "UNKNOWN_TYPE", "renew does not exist at version 2")
    yield ("unlease-in-v1-frame", _pack({**unlease, "v": 1}), 4, "UNKNOWN_TYPE", "unlease does not exist at version 1")
    yield ("lease-end-in-v3-frame", _pack({**ended, "v": 3}), 4, "UNKNOWN_TYPE", "lease_end does not exist at version 3")
    yield ("unlease-at-3", _pack(unlease), 3, "UNKNOWN_TYPE", "an endpoint that speaks up to 3 knows no unlease message")
    yield ("lease-v5-at-4", _pack({**lease, "v": 5}), 4, "UNSUPPORTED_VERSION", "a lease of version 5 reaching an endpoint that speaks up to 4")
    yield ("lease-unknown-bang", _pack({**lease, "!exclusive": True}), 4, "MUST_UNDERSTAND", "an unknown must-understand field on a version-4 message")
    # -- lease
    yield ("lease-keys-missing", _pack({k: v for k, v in lease.items() if k != "keys"}), 4, "MISSING_FIELD", "a lease without keys")
    yield ("lease-keys-4097", _pack({**lease, "keys": [bytes([1 + i % 250, i // 250]) for i in range(4097)]}), 4, "TOO_MANY", "4097 keys (limit 4096)")
    yield ("lease-key-empty", _pack({**lease, "keys": [K1, b""]}), 4, "OUT_OF_RANGE", "an empty key")
    yield ("lease-key-257", _pack({**lease, "keys": [bytes(257)]}), 4, "TOO_LARGE", "a key of 257 bytes (limit 256)")
    yield ("lease-key-str", _pack({**lease, "keys": ["k1"]}), 4, "WRONG_TYPE", "a key as str")
    yield ("lease-keys-bin", _pack({**lease, "keys": K1 + K2}), 4, "WRONG_TYPE", "keys as one bin, not an array")
    yield ("lease-request-id-int", _pack({**lease, "request_id": 7}), 4, "WRONG_TYPE", "a request id as an integer")
    yield ("lease-ttl-over-u32", _pack({**lease, "ttl_ms": 1 << 32}), 4, "OUT_OF_RANGE", "a time to live above 2^32-1 ms")
    yield ("lease-ttl-negative", _pack({**lease, "ttl_ms": -1}), 4, "OUT_OF_RANGE", "a negative time to live")
    yield ("lease-ttl-float", _pack({**lease, "ttl_ms": 5000.0}), 4, "WRONG_TYPE", "a time to live as a float")
    # -- lease_reply and its columns
    yield ("lease-reply-lease-missing", _pack({k: v for k, v in reply.items() if k != "lease"}), 4, "MISSING_FIELD", "a lease_reply without its lease id")
    yield ("lease-reply-ttl-missing", _pack({k: v for k, v in reply.items() if k != "ttl_ms"}), 4, "MISSING_FIELD", "a lease_reply without its time to live")
    yield ("lease-reply-lease-str", _pack({**reply, "lease": "42"}), 4, "WRONG_TYPE", "a lease id as str")
    yield ("lease-reply-lease-negative", _pack({**reply, "lease": -42}), 4, "OUT_OF_RANGE", "a negative lease id")
    yield ("lease-reply-length-mismatch", answers(b"\x01\x02\x00", b"\x00\x01", ["dram", "remote"]), 4, "OUT_OF_RANGE", "3 status codes, 2 tier indices")
    yield ("lease-reply-unknown-status", answers(b"\x01\x00\x07", b"\x00\x01\x01", ["dram", ""]), 4, "OUT_OF_RANGE", "status code 7 does not exist")
    yield ("lease-reply-tier-outside", answers(b"\x01\x01", b"\x00\x02", ["dram", "hbm:0"]), 4, "OUT_OF_RANGE", "tier index 2 of a table of 2")
    yield ("lease-reply-status-array", answers([1, 0], b"\x00\x00", [""]), 4, "WRONG_TYPE", "status as an array, not packed")
    yield ("lease-reply-status-str", answers("\x01", b"\x00", [""]), 4, "WRONG_TYPE", "status as a str, not a bin")
    yield ("lease-reply-tiers-str", answers(b"\x01", b"\x00", "dram"), 4, "WRONG_TYPE", "the tier table as one str")
    yield ("lease-reply-columns-short", _pack({**reply, "columns": [b"\x01", b"\x00"]}), 4, "MISSING_FIELD", "columns without the tier table")
    yield ("lease-reply-columns-map", _pack({**reply, "columns": {"status": b"\x01"}}), 4, "WRONG_TYPE", "columns as a map")
    yield ("lease-reply-4097", answers(bytes(4097), bytes(4097), [""]), 4, "TOO_MANY", "4097 statuses (limit 4096)")
    yield ("lease-reply-tiers-257", answers(b"\x00", b"\x00", [f"t{i}" for i in range(257)]), 4, "TOO_MANY", "a tier table of 257 entries (an index is one byte)")
    # -- renew, unlease, lease_end
    yield ("renew-lease-missing", _pack({k: v for k, v in renew.items() if k != "lease"}), 4, "MISSING_FIELD", "a renew naming no lease")
    yield ("renew-lease-bool", _pack({**renew, "lease": True}), 4, "WRONG_TYPE", "a lease id as a bool")
    yield ("renew-ttl-over-u32", _pack({**renew, "ttl_ms": 1 << 32}), 4, "OUT_OF_RANGE", "a renewal above 2^32-1 ms")
    yield ("unlease-lease-negative", _pack({**unlease, "lease": -1}), 4, "OUT_OF_RANGE", "a negative lease id")
    yield ("unlease-lease-nil", _pack({**unlease, "lease": None}), 4, "WRONG_TYPE", "a lease id nil")
    yield ("lease-end-code-missing", _pack({k: v for k, v in ended.items() if k != "code"}), 4, "MISSING_FIELD", "a lease_end without its code")
    yield ("lease-end-code-over-u16", _pack({**ended, "code": 1 << 16}), 4, "OUT_OF_RANGE", "a code above 65535")
    yield ("lease-end-reason-4097", _pack({**ended, "reason": "x" * 4097}), 4, "TOO_LARGE", "a reason of 4097 bytes (limit 4096)")
    yield ("lease-end-keys-4097", _pack({**ended, "keys": [bytes([1 + i % 250, i // 250]) for i in range(4097)]}), 4, "TOO_MANY", "4097 keys (limit 4096)")
    yield ("lease-end-key-str", _pack({**ended, "keys": ["k2"]}), 4, "WRONG_TYPE", "a key as str")


def invalid_v5_inputs() -> Iterator[tuple[str, bytes, int, str, str]]:
    """Version 5's invalid frames: (name, frame, max_version, expected code name, description)."""
    forget = {"v": 5, "t": "peer_forget", "id": 310, "agent": "kvcr-client-4712"}
    yield ("peer-forget-in-v4-frame", _pack({**forget, "v": 4}), 5, "UNKNOWN_TYPE", "peer_forget does not exist at version 4")
    yield ("peer-forget-in-v1-frame", _pack({**forget, "v": 1}), 5, "UNKNOWN_TYPE", "peer_forget does not exist at version 1")
    yield ("peer-forget-at-4", _pack(forget), 4, "UNKNOWN_TYPE", "an endpoint that speaks up to 4 knows no peer_forget message")
    yield ("peer-forget-v6-at-5", _pack({**forget, "v": 6}), 5, "UNSUPPORTED_VERSION", "a frame of version 6 reaching an endpoint that speaks up to 5")
    yield ("peer-forget-agent-missing", _pack({k: v for k, v in forget.items() if k != "agent"}), 5, "MISSING_FIELD", "a peer_forget naming no agent")
    yield ("peer-forget-agent-bin", _pack({**forget, "agent": b"kvcr-client-4712"}), 5, "WRONG_TYPE", "the agent name as bin, not str")
    yield ("peer-forget-agent-list", _pack({**forget, "agent": ["kvcr-client-4712"]}), 5, "WRONG_TYPE", "a list of agents, not one")
    yield ("peer-forget-agent-129", _pack({**forget, "agent": "a" * 129}), 5, "TOO_LARGE", "an agent name of 129 bytes (limit 128)")
    yield ("peer-forget-id-negative", _pack({**forget, "id": -1}), 5, "OUT_OF_RANGE", "a negative request id")
    yield ("peer-forget-unknown-bang", _pack({**forget, "!all": True}), 5, "MUST_UNDERSTAND", "an unknown must-understand field on a version-5 message")
    twins = _wire(m.PeerWelcome(1, 5, "node-b", INC_B, "kvcr-node-b", MD_NODE_B, TWINS), 5)
    yield ("peer-welcome-twins-list", _pack({**twins, "twins": [TWINS[:16], TWINS[16:]]}), 5, "WRONG_TYPE",
           "the proofs as a list, not one bin")
    yield ("peer-welcome-twins-257", _pack({**twins, "twins": bytes(257)}), 5, "TOO_LARGE", "proofs of 257 bytes (limit 256)")
    welcome = _wire(m.Welcome(1, 5, "node-a", INC_A, "kvcr-node-a", POOLS_A, 1000, RESUME_TOKEN), 5)
    yield ("welcome-resume-str", _pack({**welcome, "resume": RESUME_TOKEN.hex()}), 5, "WRONG_TYPE", "a resume token as str, not bin")
    yield ("welcome-resume-257", _pack({**welcome, "resume": bytes(257)}), 5, "TOO_LARGE", "a resume token of 257 bytes (limit 256)")
    yield ("welcome-kept-str", _pack({**welcome, "kept": str(INC_A)}), 5, "WRONG_TYPE", "the kept incarnation as str")
    yield ("welcome-kept-negative", _pack({**welcome, "kept": -1}), 5, "OUT_OF_RANGE", "a negative kept incarnation")
    stats = _wire(m.StatsRequest(56, True), 5)
    yield ("stats-audit-int", _pack({**stats, "audit": 1}), 5, "WRONG_TYPE", "audit as an integer, not a bool")
    yield ("stats-audit-nil", _pack({**stats, "audit": None}), 5, "WRONG_TYPE", "audit nil")
    hello = _wire(m.Hello(1, (1, 2, 3, 4, 5), "vllm-tp0", "kvcr-client-4712", MD_CLIENT, (), RESUME_TOKEN), 1)
    yield ("hello-resume-int", _pack({**hello, "resume": 7}), 5, "WRONG_TYPE", "a resume token as an integer, not bin")
    yield ("hello-resume-257", _pack({**hello, "resume": bytes(257)}), 5, "TOO_LARGE", "a resume token of 257 bytes (limit 256)")
    lease = {"v": 5, "t": "lease", "id": 320, "keys": [K1], "request_id": None, "ttl_ms": 0, "!read": True}
    yield ("lease-read-int", _pack({**lease, "!read": 1}), 5, "WRONG_TYPE", "read as an integer, not a bool")
    yield ("lease-node-md-nil", _pack({**lease, "!node_md": None}), 5, "WRONG_TYPE", "node_md nil")
    reply = _wire(m.LeaseReply(320, LEASE_ID, 5000, GRANT_COLUMNS, True, GRANT), 5)
    grant = reply["!grant"]
    yield ("lease-read-at-4", _pack({**lease, "v": 4}), 5, "MUST_UNDERSTAND", "a version-4 lease knows no !read")
    yield ("lease-reply-grant-at-4", _pack({**reply, "v": 4}), 5, "MUST_UNDERSTAND", "a version-4 lease_reply knows no !held or !grant")
    yield ("lease-reply-held-int", _pack({**reply, "!held": 1}), 5, "WRONG_TYPE", "held as an integer")
    yield ("lease-reply-grant-without-columns", _pack({**reply, "columns": None}), 5, "OUT_OF_RANGE",
           "a grant with no per-key answers")
    yield ("lease-reply-grant-short", _pack({**reply, "!grant": [grant[0][:8], *grant[1:]]}), 5, "OUT_OF_RANGE",
           "a grant of two keys for three answers")
    yield ("lease-reply-grant-layout-past-table", _pack({**reply, "!grant": [bytes([3, 0, 0, 0]) + grant[0][4:], *grant[1:]]}), 5,
           "OUT_OF_RANGE", "a key's layout index past the table of two layouts")
    yield ("lease-reply-grant-spans-short", _pack({**reply, "!grant": [grant[0], grant[1], grant[2][:2], grant[3][:8], grant[4]]}), 5,
           "OUT_OF_RANGE", "two granted spans where the layouts name three")
    yield ("lease-reply-grant-slot-mismatch", _pack({**reply, "!grant": [grant[0], grant[1], grant[2], grant[3][:8], grant[4]]}), 5,
           "OUT_OF_RANGE", "two slots for three pools")
    yield ("lease-reply-grant-slot-odd", _pack({**reply, "!grant": [grant[0], grant[1], grant[2], grant[3][:11], grant[4]]}), 5,
           "OUT_OF_RANGE", "a slot column that is not whole u32s")
    yield ("lease-reply-grant-65537-spans", _pack({**reply, "!grant": [grant[0], grant[1], bytes(65537), bytes(4 * 65537), grant[4]]}), 5,
           "TOO_MANY", "65537 granted spans (limit 65536)")
    remote = _wire(m.LeaseReply(325, LEASE_ID + 3, 5000, REMOTE_GRANT_COLUMNS, True, REMOTE_GRANT), 5)
    rg = remote["!grant"]
    yield ("lease-reply-grant-source-short", _pack({**remote, "!grant": [*rg[:5], rg[5][:2], rg[6]]}), 5, "OUT_OF_RANGE",
           "a source column of two entries for three keys")
    yield ("lease-reply-grant-source-past-table", _pack({**remote, "!grant": [*rg[:5], bytes([0, 2, 0]), rg[6]]}), 5, "OUT_OF_RANGE",
           "a key's source index past the table of one source")
    yield ("lease-reply-grant-source-slot-sizes", _pack({**remote, "!grant": [*rg[:6], [[rg[6][0][0], rg[6][0][1],
           [*rg[6][0][2][:4], rg[6][0][2][4] * 2]]]]}), 5, "OUT_OF_RANGE", "a source's agent with two slot sizes for one pool")
    yield ("lease-reply-grant-source-endpoint-bin", _pack({**remote, "!grant": [*rg[:6], [[b"tcp://10.0.0.12:5555", *rg[6][0][1:]]]]}), 5,
           "WRONG_TYPE", "a source endpoint as bin, not str")
    put = _wire(kp.Put(330, (m.DepositItem(K1, src_layout(1, 0)),), ttl_ms=2000), 5)
    yield ("put-in-v4-frame", _pack({**put, "v": 4}), 5, "UNKNOWN_TYPE", "put does not exist at version 4")
    yield ("put-at-4", _pack(put), 4, "UNKNOWN_TYPE", "an endpoint that speaks up to 4 knows no put message")
    yield ("put-ttl-negative", _pack({**put, "ttl_ms": -1}), 5, "OUT_OF_RANGE", "a negative time to live")
    yield ("put-ttl-2-32", _pack({**put, "ttl_ms": 1 << 32}), 5, "OUT_OF_RANGE", "a time to live past u32")
    yield ("put-items-missing", _pack({k: v for k, v in put.items() if k != "items"}), 5, "MISSING_FIELD", "a put with no items field")
    yield ("put-node-md-int", _pack({**put, "node_md": 1}), 5, "WRONG_TYPE", "node_md as an integer")
    commit = {"v": 5, "t": "commit", "id": 333, "put": PUT_ID}
    yield ("commit-put-missing", _pack({"v": 5, "t": "commit", "id": 333}), 5, "MISSING_FIELD", "a commit naming no put")
    yield ("commit-put-str", _pack({**commit, "put": "77"}), 5, "WRONG_TYPE", "the put id as a string")
    yield ("commit-in-v4-frame", _pack({**commit, "v": 4}), 5, "UNKNOWN_TYPE", "commit does not exist at version 4")
    yield ("put-reply-in-v4-frame", _pack({**_wire(kp.PutReply(331, 0, 0, ()), 5), "v": 4}), 5, "UNKNOWN_TYPE",
           "put_reply does not exist at version 4")
    yield ("unput-in-v4-frame", _pack({**commit, "t": "unput", "v": 4}), 5, "UNKNOWN_TYPE", "unput does not exist at version 4")
    suspect = {"v": 5, "t": "suspect", "id": 336, "keys": [K1]}
    yield ("suspect-in-v4-frame", _pack({**suspect, "v": 4}), 5, "UNKNOWN_TYPE", "suspect does not exist at version 4")
    yield ("suspect-keys-empty", _pack({**suspect, "keys": []}), 5, "OUT_OF_RANGE", "a report of no key")
    yield ("suspect-key-empty", _pack({**suspect, "keys": [b""]}), 5, "OUT_OF_RANGE", "an empty key")
    yield ("suspect-keys-str", _pack({**suspect, "keys": ["k1"]}), 5, "WRONG_TYPE", "a key as a string")
    yield ("suspect-keys-missing", _pack({k: v for k, v in suspect.items() if k != "keys"}), 5, "MISSING_FIELD",
           "a report naming no keys field")
    preply = _wire(kp.PutReply(331, PUT_ID, 2000, (OK, OK), kp.grant_columns([(("L0",), [(0, 7)]), (("L0",), [(0, 8)])])), 5)
    yield ("put-reply-grant-short", _pack({**preply, "results": preply["results"][:1]}), 5, "OUT_OF_RANGE",
           "a grant of two keys for one result")
    yield ("lease-reply-grant-md-too-large", _pack({**reply, "!grant": [*grant[:4], [grant[4][0], bytes((4 << 20) + 1), grant[4][2]]]}), 5,
           "TOO_LARGE", "node agent metadata above max_metadata")


def notify_vectors() -> dict[str, Any]:
    """NIXL notification payloads (spec section 6.9): valid ones with their fields, invalid ones with their error."""
    valid = [
        ("one-key", Notification(0x5EED0001, 34, 0, 0), "group 0 of item 0 of request 34"),
        ("group-3", Notification(0x5EED0001, 34, 1, 3), "group 3 of item 1"),
        ("batch", Notification(0xFFFFFFFF, (1 << 64) - 1, 100, 65535, 64), "group 65535 of items 100..163, largest token and id"),
    ]
    good = encode_notification(valid[0][1])
    invalid = [
        ("short", good[:-1], "MALFORMED", "notification", "23 bytes"),
        ("long", good + b"\x00", "MALFORMED", "notification", "25 bytes"),
        ("magic", b"KW" + good[2:], "MALFORMED", "notification.magic", "another magic: not a kvcr notification"),
        ("version-2", good[:2] + b"\x02" + good[3:], "UNSUPPORTED_VERSION", "notification.version", "layout version 2"),
        ("kind-0", good[:3] + b"\x00" + good[4:], "OUT_OF_RANGE", "notification.kind", "kind 0 is unknown"),
        ("token-0", good[:4] + bytes(4) + good[8:], "OUT_OF_RANGE", "notification.token", "token 0 is never sent"),
        ("count-0", good[:20] + bytes(2) + good[22:], "OUT_OF_RANGE", "notification.count", "a notification of no item"),
    ]
    vectors: list[dict[str, Any]] = []
    for name, note, description in valid:
        payload = encode_notification(note)
        assert decode_notification(payload) == note
        fields = {"token": note.token, "request": note.request, "key": note.key, "count": note.count, "group": note.group}
        vectors.append({"name": f"notify-{name}", "description": description, "fields": fields, "hex": payload.hex()})
    refused: list[dict[str, Any]] = []
    for name, payload, code, path, description in invalid:
        try:
            decode_notification(payload)
        except kp.RemoteProtocolError as exc:
            assert (exc.code.name, exc.path) == (code, path), (name, exc)
        else:
            raise AssertionError(f"{name}: decoded")
        refused.append({"name": f"notify-{name}", "error": code, "path": path, "description": description, "hex": payload.hex()})
    return {
        "protocol_version": kp.COLUMNS_VERSION,
        "about": (
            "NIXL notification payloads. decode_notification(hex) == fields for valid[]; it raises "
            "RemoteProtocolError with code error at path for invalid[]."
        ),
        "valid": vectors,
        "invalid": refused,
    }


def batch_json(batch: ev.EventBatch) -> dict[str, Any]:
    """A batch's fields in JSON: keys as hex, enums as their values."""
    events: list[dict[str, Any]] = []
    for e in batch.events:
        if isinstance(e, ev.Cleared):
            events.append({"t": "cleared"})
            continue
        obj: dict[str, Any] = {"t": e.KIND.value, "keys": [k.hex() for k in e.keys], "pools": list(e.pools), "tier": e.tier}
        if isinstance(e, ev.Removed):
            obj["why"] = e.reason.value
        elif e.parents:
            obj["parents"] = [p.hex() for p in e.parents]
        events.append(obj)
    return {"node": batch.node, "incarnation": batch.incarnation, "ts": batch.ts, "events": events}


def _refused(decode: Callable[[Any], Any], name: str, payload: Any, code: str, path: str) -> None:
    """Check that ``decode(payload)`` raises ``RemoteProtocolError`` with ``code`` at ``path``."""
    try:
        decode(payload)
    except kp.RemoteProtocolError as exc:
        assert (exc.code.name, exc.path) == (code, path), (name, exc)
    else:
        raise AssertionError(f"{name}: decoded")


def event_batches() -> list[dict[str, Any]]:
    inc = EVENTS_INCARNATION
    batches = [
        ("start", ev.EventBatch("node-a", inc, 1767225600.0, (ev.Cleared(),)), "a fresh incarnation's first batch"),
        ("stored", ev.EventBatch("node-a", inc, 1767225600.25, (
            ev.Stored((b"k1", b"k2"), ("kv",), "dram"),
            ev.Stored((bytes(range(32)),), ("full", "swa", "state"), "hbm:0"),
        )), "two stored events: one pool in DRAM, a hybrid layout in HBM"),
        ("evicted", ev.EventBatch("node-a", inc, 1767225601.5, (
            ev.Removed((b"k1",), ("kv",), "dram"),
            ev.Stored((b"k3",), ("kv",), "dram"),
        )), "an eviction to make room, then the deposit that needed it"),
        ("removed", ev.EventBatch("node-a", inc, 1767225602.0, (
            ev.Removed((b"k2", b"k3"), ("kv",), "dram", ev.RemovedReason.REMOVED),
        )), "keys dropped for another reason than eviction"),
        ("disk-tier", ev.EventBatch("node-a", inc, 1767225602.5, (
            ev.Stored((b"k4",), ("kv-disk",), "disk"),
            ev.Removed((b"k4",), ("kv",), "dram"),
            ev.Removed((b"k5",), ("kv-disk",), "disk", ev.RemovedReason.REMOVED),
        )), "a copy written to the disk tier, its memory object evicted (k4 is still held, on disk), "
            "and another copy dropped"),
        ("parents", ev.EventBatch("node-a", inc, 1767225602.75, (
            ev.Stored((b"k6", b"k7", b"k8"), ("kv",), "dram", (b"", b"k6", b"k7")),
        )), "three blocks of one sequence stored with their parents: k6 names none, k7's is k6, k8's is k7"),
        ("stop", ev.EventBatch("node-a", (1 << 64) - 1, 1767225603.0, (ev.Cleared(),)),
         "the last batch of a node that stops; the largest incarnation"),
        ("empty", ev.EventBatch("n", 1, 0.0, ()), "a batch of no event"),
    ]
    valid: list[dict[str, Any]] = []
    for name, batch, description in batches:
        payload = ev.encode_batch(batch)
        assert ev.decode_batch(payload) == batch, name
        valid.append({"name": f"events-{name}", "description": description, "fields": batch_json(batch), "hex": payload.hex()})
    return valid


def replay_ends() -> list[dict[str, Any]]:
    ends = [
        ("served", ev.ReplayEnd(0, 42, EVENTS_INCARNATION), "every batch from the start was held and sent"),
        ("truncated", ev.ReplayEnd(4096, 8192, EVENTS_INCARNATION), "the ring holds 4096 to 8191: earlier batches are lost"),
        ("refused", ev.ReplayEnd(0, 3, (1 << 64) - 1, int(kp.ErrorCode.OUT_OF_RANGE), "start 7 is past the next seq 3",
                                 "replay.start"),
         "a start past the next seq"),
    ]
    out: list[dict[str, Any]] = []
    for name, end, description in ends:
        payload = ev.encode_replay_end(end)
        assert ev.decode_replay_end(payload) == end, name
        fields = {"oldest": end.oldest, "next": end.next, "incarnation": end.incarnation, "code": end.code,
                  "reason": end.reason, "path": end.path}
        out.append({"name": f"replay-end-{name}", "description": description, "fields": fields, "hex": payload.hex()})
    return out


def refused_batches() -> list[dict[str, Any]]:
    good = {"v": 1, "node": "node-a", "inc": EVENTS_INCARNATION, "ts": 1767225600.0}
    stored = {"t": "stored", "keys": [b"k1"], "pools": ["kv"], "tier": "dram"}

    def batch(*events: Any, **changes: Any) -> bytes:
        return _pack({**good, "events": list(events), **changes})

    def without(obj: dict[str, Any], key: str) -> dict[str, Any]:
        return {k: v for k, v in obj.items() if k != key}

    many = [i.to_bytes(2, "big") for i in range(4097)]
    refused = [
        ("not-msgpack", b"\xc1", "MALFORMED", "", "0xc1 is never used by msgpack"),
        ("trailing", batch() + b"\x00", "MALFORMED", "", "bytes after the map"),
        ("not-a-map", _pack([1.0, [], 0]), "NOT_A_MAP", "", "an array (vLLM's array-like batch) is not a kvcr batch"),
        ("no-version", _pack({**without(good, "v"), "events": []}), "MISSING_FIELD", "v", "no v"),
        ("version-2", batch(v=2), "UNSUPPORTED_VERSION", "v", "a later format"),
        ("version-bool", batch(v=True), "WRONG_TYPE", "v", "v as a boolean"),
        ("no-node", _pack({**without(good, "node"), "events": []}), "MISSING_FIELD", "node", "no node name"),
        ("node-empty", batch(node=""), "OUT_OF_RANGE", "node", "an empty node name"),
        ("node-129", batch(node="n" * 129), "TOO_LARGE", "node", "a node name of 129 bytes (limit 128)"),
        ("inc-0", batch(inc=0), "OUT_OF_RANGE", "inc", "incarnation 0"),
        ("inc-negative", batch(inc=-1), "OUT_OF_RANGE", "inc", "a negative incarnation"),
        ("inc-str", batch(inc="1"), "WRONG_TYPE", "inc", "an incarnation as str"),
        ("ts-int", batch(ts=1), "WRONG_TYPE", "ts", "a time as an integer"),
        ("ts-nan", batch(ts=float("nan")), "OUT_OF_RANGE", "ts", "a time that is NaN"),
        ("ts-negative", batch(ts=-1.0), "OUT_OF_RANGE", "ts", "a time before the epoch"),
        ("events-map", _pack({**good, "events": {}}), "WRONG_TYPE", "events", "events as a map"),
        ("event-array", batch(["stored", [b"k1"], ["kv"], "dram"]), "WRONG_TYPE", "events[0]", "an event as an array"),
        ("event-no-type", batch(without(stored, "t")), "MISSING_FIELD", "events[0].t", "an event without t"),
        ("event-unknown", batch({"t": "moved", "keys": [b"k1"]}), "UNKNOWN_TYPE", "events[0].t", "an unknown event type"),
        ("event-type-int", batch({"t": 1}), "WRONG_TYPE", "events[0].t", "an event type as integer"),
        ("keys-missing", batch(without(stored, "keys")), "MISSING_FIELD", "events[0].keys", "stored without keys"),
        ("keys-empty", batch({**stored, "keys": []}), "OUT_OF_RANGE", "events[0].keys", "stored of no key"),
        ("key-str", batch({"t": "cleared"}, {**stored, "keys": [b"k1", "k2"]}), "WRONG_TYPE", "events[1].keys[1]",
         "a key as str"),
        ("key-empty", batch({**stored, "keys": [b""]}), "OUT_OF_RANGE", "events[0].keys[0]", "an empty key"),
        ("key-257", batch({**stored, "keys": [b"k" * 257]}), "TOO_LARGE", "events[0].keys[0]",
         "a key of 257 bytes (limit 256)"),
        ("keys-4097", batch({**stored, "keys": many}), "TOO_MANY", "events[0].keys", "4097 keys in one event"),
        ("batch-keys-4097", batch({**stored, "keys": many[:4096]}, stored), "TOO_MANY", "events",
         "4097 keys summed over a batch"),
        ("pools-empty", batch({**stored, "pools": []}), "OUT_OF_RANGE", "events[0].pools", "no pool"),
        ("pool-empty", batch({**stored, "pools": ["kv", ""]}), "OUT_OF_RANGE", "events[0].pools[1]", "an empty pool name"),
        ("tier-missing", batch(without(stored, "tier")), "MISSING_FIELD", "events[0].tier", "no tier"),
        ("tier-bin", batch({**stored, "tier": b"dram"}), "WRONG_TYPE", "events[0].tier", "a tier as bin"),
        ("why-unknown", batch({**stored, "t": "removed", "why": "expired"}), "OUT_OF_RANGE", "events[0].why",
         "an unknown reason"),
        ("parents-count", batch({**stored, "parents": [b"p", b"q"]}), "OUT_OF_RANGE", "events[0].parents",
         "two parents for one key"),
        ("parent-str", batch({**stored, "parents": ["q"]}), "WRONG_TYPE", "events[0].parents[0]", "a parent as str"),
        ("parents-map", batch({**stored, "parents": {}}), "WRONG_TYPE", "events[0].parents", "parents as a map"),
        ("must-understand", batch(stored, **{"!order": 1}), "MUST_UNDERSTAND", "!order",
         "a must-understand key this side does not know"),
        ("event-must-understand", batch({**stored, "!lease": 1}), "MUST_UNDERSTAND", "events[0].!lease",
         "a must-understand key in an event"),
    ]
    invalid: list[dict[str, Any]] = []
    for name, payload, code, path, description in refused:
        _refused(ev.decode_batch, name, payload, code, path)
        invalid.append({"name": f"events-{name}", "kind": "batch", "error": code, "path": path,
                        "description": description, "hex": payload.hex()})
    end_refused = [
        ("oldest-past-next", _pack({"v": 1, "oldest": 5, "next": 4, "inc": 1}), "OUT_OF_RANGE", "oldest", "oldest past next"),
        ("next-negative", _pack({"v": 1, "oldest": 0, "next": -1, "inc": 1}), "OUT_OF_RANGE", "next", "a negative next"),
        ("no-next", _pack({"v": 1, "oldest": 0, "inc": 1}), "MISSING_FIELD", "next", "no next"),
        ("no-inc", _pack({"v": 1, "oldest": 0, "next": 0}), "MISSING_FIELD", "inc", "no incarnation"),
        ("inc-0", _pack({"v": 1, "oldest": 0, "next": 0, "inc": 0}), "OUT_OF_RANGE", "inc", "incarnation 0"),
        ("code-over-u16", _pack({"v": 1, "oldest": 0, "next": 0, "inc": 1, "code": 1 << 16}), "OUT_OF_RANGE", "code",
         "a code above 65535"),
    ]
    for name, payload, code, path, description in end_refused:
        _refused(ev.decode_replay_end, name, payload, code, path)
        invalid.append({"name": f"replay-end-{name}", "kind": "replay_end", "error": code, "path": path,
                        "description": description, "hex": payload.hex()})
    return invalid


def refused_replay_requests() -> list[dict[str, Any]]:
    requests = [
        ("negative", [b"", b"\xff" * 8], "OUT_OF_RANGE", "replay.start", "start -1"),
        ("short", [b"", b"\x00" * 7], "MALFORMED", "replay.start", "a start of 7 bytes"),
        ("no-delimiter", [b"\x00" * 8], "MALFORMED", "replay", "one frame: no empty delimiter"),
        ("three-frames", [b"", b"\x00" * 8, b""], "MALFORMED", "replay", "a frame after the start"),
    ]
    out: list[dict[str, Any]] = []
    for name, frames, code, path, description in requests:
        _refused(ev.decode_replay_request, name, frames, code, path)
        out.append({"name": f"replay-request-{name}", "error": code, "path": path, "description": description,
                    "frames": [f.hex() for f in frames]})
    return out


EVENTS_INCARNATION = 0x1D2C3B4A59687701


def events_vectors() -> dict[str, Any]:
    """The inventory event stream (spec section 15): batches, replay ends, refused payloads and requests."""
    return {
        "events_version": ev.EVENTS_VERSION,
        "about": (
            "The inventory event stream (spec section 15). For batches[]: encode_batch(batch from fields) == hex and "
            "decode_batch(hex) gives it back; for replay_ends[]: encode_replay_end(fields) == hex and back. For "
            "invalid[]: decode_batch(hex) (decode_replay_end for kind replay_end) raises RemoteProtocolError with "
            "code error at path; for replay_requests[], decode_replay_request(frames) likewise. Keys are hex."
        ),
        "batches": event_batches(),
        "replay_ends": replay_ends(),
        "invalid": refused_batches(),
        "replay_requests": refused_replay_requests(),
    }


VALID_ABOUT = (
    "Valid frames. For each vector: encode(message from fields, version) == hex; "
    "decode(hex, max_version=version) == that message; every accept[].hex decodes to it too. "
    'In fields, bin is {"hex": ...}, enums are their values, records are objects, '
    "and a field left out holds its default."
)
INVALID_ABOUT = (
    "Invalid frames. decode(hex, max_version) raises RemoteProtocolError with code error "
    "(an ErrorCode name) at path."
)


def write_json(path: Path, doc: dict[str, Any]) -> None:
    text = json.dumps(doc, indent=1, ensure_ascii=False) + "\n"
    path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tables", action="store_true", help="print the spec's field tables and exit")
    args = parser.parse_args(argv)
    if args.tables:
        sys.stdout.write(all_tables())
        return 0
    VECTORS.mkdir(exist_ok=True)
    files: list[tuple[str, int, str, Callable[[], list[dict[str, Any]]]]] = [
        ("valid.json", kp.PARTIAL_LAYOUT_VERSION, VALID_ABOUT, lambda: build_valid(valid_instances())),
        ("invalid.json", kp.PARTIAL_LAYOUT_VERSION, INVALID_ABOUT, lambda: build_invalid(invalid_inputs())),
        ("valid-v3.json", kp.COLUMNS_VERSION, VALID_ABOUT, lambda: build_valid(v3_instances())),
        ("invalid-v3.json", kp.COLUMNS_VERSION, INVALID_ABOUT, lambda: build_invalid(invalid_v3_inputs())),
        ("valid-v4.json", kp.LEASES_VERSION, VALID_ABOUT, lambda: build_valid(v4_instances())),
        ("invalid-v4.json", kp.LEASES_VERSION, INVALID_ABOUT, lambda: build_invalid(invalid_v4_inputs())),
        ("valid-v5.json", kp.CLIENT_GONE_VERSION, VALID_ABOUT, lambda: build_valid(v5_instances())),
        ("invalid-v5.json", kp.CLIENT_GONE_VERSION, INVALID_ABOUT, lambda: build_invalid(invalid_v5_inputs())),
    ]
    names: set[str] = set()
    for name, version, about, build in files:
        vectors = build()
        assert names.isdisjoint(v["name"] for v in vectors), name
        names.update(v["name"] for v in vectors)
        write_json(VECTORS / name, {"protocol_version": version, "about": about, "vectors": vectors})
    write_json(VECTORS / "notify.json", notify_vectors())
    write_json(VECTORS / "events.json", events_vectors())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
