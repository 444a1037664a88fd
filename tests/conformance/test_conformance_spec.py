"""The written protocol (spec/kvcr-protocol.md) agrees with the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvcr_protocol as kp
import make_vectors  # spec/make_vectors.py (pythonpath in pyproject.toml): renders the tables from the code

SPEC = (Path(__file__).resolve().parents[2] / "spec" / "kvcr-protocol.md").read_text(encoding="utf-8")


def test_protocol_version_line() -> None:
    lines = [line for line in SPEC.splitlines() if line.startswith("Protocol-Version:")]
    assert len(lines) == 1
    match = re.fullmatch(r"Protocol-Version: (\d+)", lines[0])
    assert match is not None
    assert int(match.group(1)) == kp.CURRENT_VERSION
    assert SPEC.index(lines[0]) < 200, "the version line belongs near the top"


@pytest.mark.parametrize("cls", kp.ALL_MESSAGES, ids=[c.TAG for c in kp.ALL_MESSAGES])
def test_every_message_is_specified_with_its_exact_fields(cls: type[kp.Message]) -> None:
    assert f"#### `{cls.TAG}`" in SPEC
    table = make_vectors.message_table(cls)
    section = SPEC.split(f"#### `{cls.TAG}`\n", 1)[1].split("####", 1)[0]
    assert table in section, f"the table of {cls.TAG} differs from its FIELDS"


@pytest.mark.parametrize("cls", make_vectors.RECORDS, ids=[c.__name__ for c in make_vectors.RECORDS])
def test_every_record_is_specified_with_its_exact_fields(cls: type) -> None:
    section = SPEC.split(f"#### Record `{cls.__name__}`\n", 1)[1].split("####", 1)[0]
    assert make_vectors.record_table(cls) in section


def test_every_record_in_use_is_listed() -> None:
    from kvcr_protocol.wire import Opt, RecordType, Seq, WireType

    found: set[type] = set()

    def walk(wt: WireType[object]) -> None:
        if isinstance(wt, RecordType):
            found.add(wt.cls)
            for f in wt.cls.FIELDS:
                walk(f.type)
        elif isinstance(wt, (Seq,)):
            walk(wt.item)
        elif isinstance(wt, Opt):
            walk(wt.inner)

    for cls in kp.ALL_MESSAGES:
        for f in cls.FIELDS:
            walk(f.type)
    assert found == set(make_vectors.RECORDS)


def test_every_error_code_is_specified() -> None:
    assert make_vectors.error_table() in SPEC
    for code in kp.ErrorCode:
        assert f"`{code.name}`" in SPEC


def test_every_limit_is_specified() -> None:
    assert make_vectors.limits_table() in SPEC


def test_every_enum_value_is_specified() -> None:
    for enum_type in make_vectors.ENUMS:
        for member in enum_type:
            assert f'`"{member.value}"`' in SPEC, f"{enum_type.__name__}.{member.name}"


def test_every_tag_appears_in_the_exchanges() -> None:
    exchanges = SPEC.split("## 5. Sessions and exchanges", 1)[1].split("## 6. Messages", 1)[0]
    for cls in kp.ALL_MESSAGES:
        assert f"`{cls.TAG}`" in exchanges, cls.TAG


def section(title: str) -> str:
    """The text of a section, from its heading to the next heading of the same level."""
    level = title.split(" ", 1)[0]
    body = SPEC.split(f"{title}\n", 1)[1]
    return body.split(f"\n{level} ", 1)[0]


def test_cross_node_rules_are_specified() -> None:
    cross = section("## 12. Cross-node delivery")
    for needle in (
        "`partial`",
        "`!partial`",
        "`PEER_UNSUPPORTED`",
        "`LAYOUT_SUBSET_INVALID`",
        "`DESTINATION_UNCERTAIN`",
        "`peer_dead_ms`",
        "3000 ms",
        "`welcome.pools`",
        "offset = slot",
    ):
        assert needle in cross, needle


def test_peer_session_specifies_write_done_and_probe_states() -> None:
    peer = section("### 5.3 Peer session")
    for state in kp.WriteState:
        assert f"| `{state.value}` |" in peer, state
    for code in ("NOT_FOUND", "LAYOUT_SUBSET_INVALID", "SIZE_MISMATCH", "BAD_DESCRIPTOR", "TIMEOUT", "TRANSFER_FAILED"):
        assert f"| `FAILED` | `{code}` |" in peer, code
    assert "`peer_hello.regions`" in peer and "once per client agent per peer" in peer


def test_versions_section_names_every_later_field() -> None:
    versions = section("## 7. Versions and negotiation")
    for cls in kp.ALL_MESSAGES:
        if cls.SINCE > kp.BASE_VERSION:
            assert f"the message `{cls.TAG}`" in versions, cls.TAG
        for f in cls.FIELDS:
            if f.since > kp.BASE_VERSION:
                assert f"`{f.key}` on `{cls.TAG}`" in versions, (cls.TAG, f.key)


def test_version_3_sections_are_specified() -> None:
    columns = section("### 6.7 Span columns")
    for needle in ("`OUT_OF_RANGE`", "`TOO_MANY`", "key-major", "NUL", "`BAD_DESCRIPTOR`"):
        assert needle in columns, needle
    plans = section("### 6.8 Layer plans and progress")
    for needle in ("fails every later group", "Earlier groups stay delivered", "`done`", "`progress`"):
        assert needle in plans, needle
    prefix = section("### 6.9 Query columns and prefix queries")
    for code, presence in enumerate(("MISS", "HIT", "FETCHING", "FETCHABLE")):
        assert f"{code} `{presence}`" in prefix
    notify = section("### 6.10 NIXL notifications")
    for needle in ("| 0 | 2 | magic |", "| 22 | 2 | group |", "`DESTINATION_UNCERTAIN`", "deadline"):
        assert needle in notify, needle


def test_version_4_leases_are_specified() -> None:
    leases = section("### 6.11 Leases")
    for status in kp.LeaseStatus:
        held = "yes" if status in kp.HELD else "no"
        row = next((line for line in leases.splitlines() if line.startswith(f"| {status.value} | `{status.name}` |")), None)
        assert row is not None, status
        assert row.endswith(f" | {held} |"), (status, row)
    for needle in (
        "`columns.status[i]`", "`columns.tier[i]`", "`columns.tier`", "`max_tiers`",
        "`max_leases_per_session`", "`max_leased_slots_per_session`", "`lease_pool_fraction`",
        "`lease_ttl_ms`", "`max_lease_ttl_ms`", "30000", "600000", "1024", "65536", "0.5",
        "`LEASE_EXPIRED`", "`PEER_RESTARTED`", "`PEER_UNREACHABLE`", "`SHUTTING_DOWN`", "`UNKNOWN_LEASE`",
        "`ADVISORY`", "never a second free", "held once", "pins nothing more", "ignores `request_id`",
    ):
        assert needle in leases, needle
    client = section("### 5.2 Client session")
    peer = section("### 5.3 Peer session")
    for tag in ("lease", "lease_reply", "renew", "unlease", "lease_end"):
        assert f"`{tag}`" in client and f"`{tag}`" in peer, tag
    versions = section("## 7. Versions and negotiation")
    assert "Version 4 and older peers:" in versions and "`ADVISORY`" in versions
    assert "| 1, 2, 3, 4 | 1, 2, 3, 4 | 4 |" in versions
    assert "Version 5 and older peers:" in versions and "Further version-5 additions follow:" in versions
    assert "the optional field `resume` on `welcome` and the optional field `resume` on `hello`" in versions
    assert "| 1, 2, 3, 4, 5 | 1, 2, 3, 4, 5 | 5 |" in versions
    assert "Client gone (peer_forget→ack), version 5:" in peer


def test_every_version_is_in_the_negotiation_examples() -> None:
    versions = section("## 7. Versions and negotiation")
    rows = re.findall(r"^\| ([\d, ]+) \| ([\d, ]+) \| (\d+|none: `UNSUPPORTED_VERSION`) \|$", versions, re.MULTILINE)
    assert rows
    for ours, theirs, agreed in rows:
        a = [int(v) for v in ours.split(", ")]
        b = [int(v) for v in theirs.split(", ")]
        if agreed.isdigit():
            assert kp.negotiate(a, b) == int(agreed), (ours, theirs)
        else:
            with pytest.raises(kp.ProtocolError):
                kp.negotiate(a, b)
    assert {int(v) for ours, _, _ in rows for v in ours.split(", ")} == set(kp.PROTOCOL_VERSIONS)
    assert f"defines versions 1 to {kp.CURRENT_VERSION}" in versions
