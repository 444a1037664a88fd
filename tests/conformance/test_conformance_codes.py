"""The codes a node sends per request: the spec's table, the code's table and the node agree.

``kvcr_protocol.operations.REQUEST_CODES`` declares, once, which codes a node may send for
each request (an ``error`` that refuses it, and its per-key results). These tests hold
three things to it:

- the spec: section 10.1's table, parsed, says exactly the same, every code is either
  sent for some request or listed as not sent, and the other places that list codes
  (the ``write_done`` table, the requests ``ack`` answers) agree;
- the node's source: every ``ErrorCode.X`` it names is one it may send; every listed
  code is sent by something; and every code named in a handler, or in a method that only
  handlers reach, is listed for each request whose handler reaches it (an AST scan);
- the node at run time: it checks each code it sends against the table and reports a
  code out of place as a breach of its invariants, which every integration test checks.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvcr_node.router as router_module
import kvcr_protocol as kp
from kvcr_node.config import NodeConfig
from kvcr_node.node import Node
from kvcr_node.poolspec import PoolSpec
from kvcr_node.target import from_source
from kvcr_protocol import ErrorCode, KeyResult, KeyStatus
from kvcr_protocol.operations import ANY_REQUEST, EVENT_CODES, REQUEST_CODES, SOURCE_CODES, allowed_result

ROOT = Path(__file__).resolve().parents[2]
SPEC = (ROOT / "spec" / "kvcr-protocol.md").read_text(encoding="utf-8")
NODE_SOURCES = sorted((ROOT / "kvcr_node").rglob("*.py"))
REQUEST_SOURCES = [
    ROOT / "kvcr_node" / f"{name}.py"
    for name in ("node", "router", "outbox", "sessions", "operations", "target", "source", "stats", "leases", "puts", "suspects")
] + sorted((ROOT / "kvcr_node" / "ops").glob("*.py"))
"""The modules a request runs through, from the loop to its handler and back (architecture §1)."""
PROTOCOL_SOURCES = [ROOT / "protocol" / "kvcr_protocol" / name for name in ("codec.py", "wire.py", "descriptors.py", "projection.py", "versions.py")]

CROSS_REQUEST = {("cancel_withdrawal", ErrorCode.ABORTED): "unregions"}
"""Codes a method sends for another request than the one being handled: the refusal of
an ``unregions`` whose withdrawal an ``abort`` cancels."""


def spec_section(title: str) -> str:
    level = title.split(" ", 1)[0]
    body = SPEC.split(f"{title}\n", 1)[1]
    return body.split(f"\n{level} ", 1)[0].split("\n## ", 1)[0]


def codes_in(text: str) -> set[ErrorCode]:
    names = re.findall(r"`([A-Z_]+)`", text)
    assert all(name in ErrorCode.__members__ for name in names), [n for n in names if n not in ErrorCode.__members__]
    return {ErrorCode[name] for name in names}


def paragraph_after(text: str, lead: str) -> str:
    return text.split(lead, 1)[1].split("\n\n", 1)[0]


def spec_table() -> dict[str, tuple[set[ErrorCode], set[ErrorCode]]]:
    table: dict[str, tuple[set[ErrorCode], set[ErrorCode]]] = {}
    for line in spec_section("### 10.1 Codes per request").splitlines():
        m = re.fullmatch(r"\| `([a-z_]+)` \| (.*) \| (.*) \|", line)
        if m:
            assert m.group(1) not in table, f"{m.group(1)} is listed twice"
            table[m.group(1)] = (codes_in(m.group(2)), codes_in(m.group(3)))
    return table


def all_sent() -> set[ErrorCode]:
    """Every code a node may send: for some request, or in an event (``lease_end``)."""
    return set(ANY_REQUEST).union(*(c.refusals | c.results for c in REQUEST_CODES.values()), *EVENT_CODES.values())


# --------------------------------------------------------------------------- the spec


def test_the_spec_table_lists_exactly_the_declared_codes() -> None:
    table = spec_table()
    assert set(table) == set(REQUEST_CODES)
    for tag, codes in REQUEST_CODES.items():
        refusals, results = table[tag]
        assert refusals == set(codes.refusals), (tag, "error codes", refusals ^ set(codes.refusals))
        assert results == set(codes.results), (tag, "per-key codes", results ^ set(codes.results))
    section = spec_section("### 10.1 Codes per request")
    assert codes_in(paragraph_after(section, "Any request:")) == set(ANY_REQUEST)
    for codes in REQUEST_CODES.values():
        assert not codes.refusals & ANY_REQUEST, "a code for any request is listed once, not per request"


def test_every_request_has_a_row_and_nothing_else_does() -> None:
    """A message whose section calls it a request is in the table; every row is a request
    (``heartbeat`` too: the node answers a client's with its own, section 5.2)."""
    requests: set[str] = set()
    for cls in kp.ALL_MESSAGES:
        description = SPEC.split(f"#### `{cls.TAG}`\n", 1)[1].split("|", 1)[0]
        if re.search(r"\brequest;", description):
            requests.add(cls.TAG)
    assert requests == set(REQUEST_CODES)


def test_the_spec_lists_the_codes_of_events() -> None:
    section = spec_section("### 10.1 Codes per request")
    events = paragraph_after(section, "- Events (").split("\n- ", 1)[0]
    assert set(re.findall(r"`([a-z_]+)` \(version", events)) == set(EVENT_CODES)
    assert codes_in(events.split("carries", 1)[1].split("(section", 1)[0]) == EVENT_CODES["lease_end"]
    # lease_end's own description names the same codes.
    description = SPEC.split("#### `lease_end`\n", 1)[1].split("|", 1)[0]
    assert codes_in(description) == EVENT_CODES["lease_end"]
    for tag in EVENT_CODES:
        assert tag not in REQUEST_CODES and kp.MESSAGE_BY_TAG[tag].REPLY is False


def test_every_code_is_sent_for_some_request_or_said_not_to_be() -> None:
    section = spec_section("### 10.1 Codes per request")
    not_sent = codes_in(paragraph_after(section, "Not sent by a node:"))
    assert not_sent.isdisjoint(all_sent()), not_sent & all_sent()
    assert not_sent | all_sent() == set(ErrorCode), set(ErrorCode) - not_sent - all_sent()
    # The client raises the two it reports itself; the spec says so, not that nothing sends them.
    assert {ErrorCode.UNAUTHORIZED, ErrorCode.NODE_LOST} <= not_sent
    weaknesses = spec_section("## 14. Known weaknesses")
    assert "nothing sends it" not in weaknesses
    assert "CurveZMQ" in weaknesses and "`UNAUTHORIZED`" in weaknesses


def test_the_write_done_table_lists_the_write_results() -> None:
    peer = spec_section("### 5.3 Peer session")
    rows = re.findall(r"^\| `(FAILED|ABORTED)` \| `([A-Z_]+)` \|", peer, re.MULTILINE)
    assert {ErrorCode[code] for _, code in rows} == set(REQUEST_CODES["write"].results)


def test_ack_answers_exactly_the_requests_whose_handlers_ack() -> None:
    acked = {tag for tag, method in handlers().items() if "Ack" in called_names(METHODS[method])}
    description = SPEC.split("#### `ack`\n", 1)[1].split("|", 1)[0]
    listed = set(re.findall(r"`([a-z_]+)`", description.split(".", 1)[0]))
    assert acked == listed, (acked, listed)
    assert "bye" in acked


# --------------------------------------------------------------------------- the node's source


def error_code_names(tree: ast.AST) -> Iterator[tuple[ast.AST, ErrorCode]]:
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("ErrorCode", "E"):
            if n.attr in ErrorCode.__members__:
                yield n, ErrorCode[n.attr]


def named_codes(paths: list[Path]) -> set[ErrorCode]:
    return {code for path in paths for _, code in error_code_names(ast.parse(path.read_text()))}


def test_the_node_names_only_codes_it_may_send() -> None:
    named = named_codes(NODE_SOURCES) - {ErrorCode.OK}
    assert named <= all_sent(), named - all_sent()


def test_every_listed_code_is_sent_by_something() -> None:
    named = named_codes(NODE_SOURCES + PROTOCOL_SOURCES)
    missing = all_sent() - named
    assert missing == set(), missing


def functions(paths: list[Path]) -> dict[str, list[ast.FunctionDef]]:
    """Name -> the functions and methods of that name in ``paths`` (a name may be defined in
    more than one part only to hand a call on: ``Node.snapshot`` to ``Stats.snapshot``)."""
    out: dict[str, list[ast.FunctionDef]] = {}
    for path in paths:
        for n in ast.parse(path.read_text()).body:
            for f in n.body if isinstance(n, ast.ClassDef) else [n]:
                if isinstance(f, ast.FunctionDef) and f.name != "__init__":
                    out.setdefault(f.name, []).append(f)
    return out


METHODS = functions(REQUEST_SOURCES)
ROUTER_INIT = next(
    f for n in ast.parse(Path(router_module.__file__).read_text()).body if isinstance(n, ast.ClassDef) and n.name == "Router"
    for f in n.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"
)


def called_names(funcs: list[ast.FunctionDef]) -> set[str]:
    return {n.func.id for func in funcs for n in ast.walk(func) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def method_refs(funcs: list[ast.FunctionDef]) -> set[str]:
    """Functions of the request modules that ``funcs`` call or pass on: by attribute
    (``self.operations.settle``, lambdas included) or by name (a module's own function)."""
    refs = set()
    for func in funcs:
        for n in ast.walk(func):
            if isinstance(n, ast.Attribute) and n.attr in METHODS:
                refs.add(n.attr)
            elif isinstance(n, ast.Name) and n.id in METHODS:
                refs.add(n.id)
    return refs


def test_the_request_modules_define_each_name_once() -> None:
    """The scan follows calls by name: each name is one function, or a hand-on to it."""
    handed_on = {"snapshot", "check_invariants", "internal_failure", "sizes"}  # sizes: each part's tables
    assert {name for name, funcs in METHODS.items() if len(funcs) > 1} <= handed_on


def handlers() -> dict[str, str]:
    """Request tag -> the method that handles it (the router's handler tables, hellos included)."""
    out = {}
    for n in ast.walk(ROUTER_INIT):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add" and len(n.args) == 2:
            key, value = n.args
            if isinstance(key, ast.Name) and isinstance(value, ast.Attribute):
                assert value.attr in METHODS, f"the handler {value.attr} is in none of REQUEST_SOURCES"
                out[getattr(router_module, key.id).TAG] = value.attr
    assert {"hello", "peer_hello"} <= set(out), out
    return out


def reach(start: str, stop: set[str]) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(ref for ref in method_refs(METHODS[name]) if ref not in stop)
    return seen


def test_handlers_name_only_the_codes_of_their_request() -> None:
    """Codes named in a handler, or in a method that only handlers reach, are listed for
    every request whose handler reaches it. Methods the loop reaches on its own (deadlines,
    peers, shutdown) can end any operation: the run-time check covers them. A method that
    sends an event carrying a code (``lease_end``, itself or through what it reaches) may
    also name that event's codes (section 10.1)."""
    by_tag = handlers()
    handler_methods = set(by_tag.values())
    loop = reach("run", handler_methods) | reach("snapshot", handler_methods)
    reached_by: dict[str, set[str]] = {}
    for tag, method in by_tag.items():
        for name in reach(method, handler_methods - {method}):
            reached_by.setdefault(name, set()).add(tag)
    event_classes = {kp.MESSAGE_BY_TAG[tag].__name__: codes for tag, codes in EVENT_CODES.items()}
    checked = 0
    for name, tags in reached_by.items():
        if name in loop:
            continue
        sent = called_names([f for n in reach(name, handler_methods) for f in METHODS[n]])
        event_codes = set().union(*(codes for cls, codes in event_classes.items() if cls in sent))
        for _, code in (found for func in METHODS[name] for found in error_code_names(func)):
            if code in event_codes:
                continue
            if (name, code) in CROSS_REQUEST:
                assert code in REQUEST_CODES[CROSS_REQUEST[(name, code)]].refusals
                continue
            for tag in tags:
                codes = REQUEST_CODES[tag]
                assert code in ANY_REQUEST | codes.refusals | codes.results, (name, code.name, tag)
                checked += 1
    assert checked >= 20, "the scan found almost nothing: has the node's structure changed?"


# --------------------------------------------------------------------------- the node at run time


def test_a_code_out_of_place_is_a_breach_of_the_invariants(tmp_path: Path) -> None:
    config = NodeConfig(endpoint=f"ipc://{tmp_path}/n.sock", pools=(PoolSpec("kv", 4096, 4),))
    node = Node(config)
    try:
        assert node.check_invariants() == []
        node.outbox.check_results("deposit", [KeyResult(KeyStatus.FAILED, ErrorCode.CAPACITY, "fine")])
        node.outbox.check_refusal("hint", ErrorCode.HINT_LIMIT)
        assert node.check_invariants() == []
        node.outbox.check_results("deposit", [KeyResult(KeyStatus.FAILED, ErrorCode.NOT_FOUND, "out of place")])
        node.outbox.check_refusal("stats", ErrorCode.BUSY)
        breaches = node.check_invariants()
        assert len(breaches) == 2 and all("section 10.1" in b for b in breaches), breaches
    finally:
        node.request_stop()
        node.run()


@pytest.mark.parametrize(
    ("result", "passed_on"),
    [
        (KeyResult(KeyStatus.OK), KeyResult(KeyStatus.OK)),
        (KeyResult(KeyStatus.OK, 0, "", 7), KeyResult(KeyStatus.OK)),
        (KeyResult(KeyStatus.FAILED, ErrorCode.NOT_FOUND, "no"), KeyResult(KeyStatus.FAILED, ErrorCode.NOT_FOUND, "no")),
        (KeyResult(KeyStatus.ABORTED, ErrorCode.ABORTED, "a"), KeyResult(KeyStatus.ABORTED, ErrorCode.ABORTED, "a")),
        (KeyResult(KeyStatus.STORED), None),
        (KeyResult(KeyStatus.FAILED, ErrorCode.TOO_MANY_CLIENTS, "odd"), None),
        (KeyResult(KeyStatus.FAILED, 60_000, "unknown"), None),
        (KeyResult(KeyStatus.FAILED, 0, "no code"), None),
        (KeyResult(KeyStatus.OK, ErrorCode.NOT_FOUND, "both"), None),
    ],
)
def test_a_source_result_is_passed_on_only_when_a_source_may_send_it(result: KeyResult, passed_on: KeyResult | None) -> None:
    out = from_source(result)
    if passed_on is None:
        assert (out.status, out.code) == (KeyStatus.FAILED, ErrorCode.TRANSFER_FAILED), out
    else:
        assert out == passed_on
    assert allowed_result("deliver", out.code) and allowed_result("fetch", out.code)
    assert out.code == 0 or out.code in SOURCE_CODES | {ErrorCode.TRANSFER_FAILED}
