"""A whole deliver read in parts, each part's digests checked off the turn (spec section 6.12,
"Integrity"; ``kvcr_client.digest_checks``), in process.

A ``GrantRead`` runs against a fake agent whose posts copy inside the post (as CMA does)
and a fake worker whose checks finish only when the test says. The order that makes the
check cheap: part ``g`` is handed to the worker as soon as it landed, part ``g + 1`` is
posted before part ``g`` is reported, and the last part is checked on the turn itself,
since nothing is left to copy meanwhile and its bytes are in this core's cache. A part found changed fails its key ``DIGEST_MISMATCH``
and the key's later parts change nothing; the destination is let go of only once no check
reads it any more.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcr_client.digest_checks import PART_BYTES, SpanChecks, parts, span_checks
from kvcr_client.readplans import LocalColumns
from kvcr_client.reads import GrantRead, Reads
from kvcr_io.agent import XferStatus
from kvcr_io.digests import span_digest
from kvcr_protocol import DeliverItem, DstSpan, ErrorCode, KeyResult, KeyStatus, MemoryKind

from .test_grant_read_clock import Clock, Granted, HeldUntil, Lease


@dataclass
class Agent:
    """Posts that complete inside the post; ``log`` records them among the checks."""

    log: list[str]

    def start_listed(self, op: str, local_kind: MemoryKind, local: Any, remote_kind: MemoryKind, remote: Any,
                     remote_agent: str) -> tuple[Any, XferStatus]:
        self.log.append(f"post {remote_agent}")
        return object(), XferStatus.DONE

    def state(self, handle: Any) -> XferStatus:
        return XferStatus.DONE

    def drain(self, handles: Sequence[Any], timeout_s: float) -> list[XferStatus]:
        return [XferStatus.DONE for _ in handles]

    def release(self, handle: Any) -> None:
        self.log.append("release")


@dataclass
class Worker:
    """The digest worker, played by a thread only while ``alongside`` runs: a check queued
    before stays queued. Each check it finishes is logged ``checked``."""

    log: list[str]
    queued: list[tuple[Callable[[], list[int]], Future[list[int]]]] = field(default_factory=list)

    def __call__(self, work: Callable[[], list[int]]) -> Future[list[int]]:
        future: Future[list[int]] = Future()
        self.queued.append((work, future))
        self.log.append("check queued")
        return future

    def alongside(self, step: Callable[[], None]) -> None:
        """Run ``step`` while a thread plays the worker."""
        stop = threading.Event()

        def play() -> None:
            while not stop.is_set():
                while self.queued:
                    work, future = self.queued.pop(0)
                    result = work()
                    self.log.append("checked")
                    future.set_result(result)
                stop.wait(0.0005)

        thread = threading.Thread(target=play)
        thread.start()
        try:
            step()
        finally:
            stop.set()
            thread.join()


class Logged(HeldUntil):
    """Validity that logs each group reported (its lease checked)."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def check(self, items: Sequence[DeliverItem], granted: Sequence[Any], members: list[int],
              now: float) -> dict[int, int | None]:
        if members:
            self.log.append("report")
        return super().check(items, granted, members, now)


class Changed:
    """Checks in which the parts in ``bad`` of item 0 were changed."""

    def __init__(self, bad: set[int]) -> None:
        self.bad = bad

    def count(self, k: int, g: int) -> int:
        return 1

    def intact(self, k: int, g: int) -> bool:
        return not (k == 0 and g in self.bad)

    def failed(self, g: int, members: Sequence[int]) -> list[int]:
        return [k for k in members if not self.intact(k, g)]


def read(n_parts: int, bad: set[int], log: list[str], out: list[list[KeyResult]]) -> tuple[GrantRead, Worker]:
    """Two keys read whole in ``n_parts`` parts each, checked ahead by a worker run by hand."""
    posts = [(g, MemoryKind.DRAM, [(0, 1, 0)], MemoryKind.DRAM, [(0, 1, 0)], [0, 1], f"part{g}")
             for g in range(n_parts)]
    worker = Worker(log)

    def finished(results: list[KeyResult] | BaseException, done: list[int]) -> None:
        if isinstance(results, list):
            out.append(results)

    job = GrantRead(Logged(log), Agent(log), [DeliverItem(b"a", ()), DeliverItem(b"b", ())],
                    [Granted(Lease(50.0)), Granted(Lease(50.0))], [n_parts, n_parts], posts, [0, 0], deadline=100.0,
                    report=None, finished=finished, quiet=lambda: log.append("quiet"), clock=Clock(),
                    checks=Changed(bad), ahead=worker)
    return job, worker


def test_the_next_part_is_posted_before_a_part_is_reported_and_the_last_is_checked_on_the_turn() -> None:
    log: list[str] = []
    out: list[list[KeyResult]] = []
    job, worker = read(3, set(), log, out)
    reads = Reads()
    reads.start(job)
    # Part 0 landed: its check is queued, and it is not reported while parts are left to post.
    assert log == ["post part0", "check queued"] and job.group == 0
    # One turn posts every part left, then reports them as their checks end; the last part is
    # checked on the turn, not queued.
    worker.alongside(lambda: reads.step(0.0))
    assert [e for e in log if e != "checked"] == [
        "post part0", "check queued", "post part1", "check queued", "post part2",
        "report", "report", "report", "release", "release", "release", "quiet"]
    assert log.count("checked") == 2 and log.index("quiet") > max(i for i, e in enumerate(log) if e == "checked")
    assert out and [r.status for r in out[0]] == [KeyStatus.OK, KeyStatus.OK]
    assert job.ledger.delivered == [3, 3] and not reads.running


def test_a_changed_part_fails_its_key_and_the_other_key_is_ok() -> None:
    log: list[str] = []
    out: list[list[KeyResult]] = []
    job, worker = read(4, {1}, log, out)
    reads = Reads()
    reads.start(job)
    worker.alongside(lambda: reads.step(0.0))
    assert out, "the deliver did not end"
    a, b = out[0]
    assert a.status is KeyStatus.FAILED and a.code == ErrorCode.DIGEST_MISMATCH
    assert b.status is KeyStatus.OK
    assert job.grants.mismatches == [b"a"]  # type: ignore[attr-defined]
    assert job.ledger.delivered == [1, 4], "key a stops at the part that changed"


def test_the_destination_is_let_go_of_only_once_no_check_reads_it() -> None:
    log: list[str] = []
    out: list[list[KeyResult]] = []
    job, worker = read(2, set(), log, out)
    Reads().start(job)
    worker.alongside(job.close)  # the client closes while part 0's check is queued
    assert log.index("quiet") > log.index("checked"), log
    assert job.checking == {} and not out


# ---------------------------------------------------------------- the parts and their checks


@dataclass(frozen=True)
class Key:
    names: tuple[str, ...]
    digests: bytes


@dataclass(frozen=True)
class Region:
    buffer: Any
    address: int
    length: int
    kind: MemoryKind = MemoryKind.DRAM


def test_parts_split_a_whole_deliver_by_where_each_span_begins() -> None:
    span = PART_BYTES // 4
    spans = tuple(DstSpan(f"L{i}", 1, i * span, span) for i in range(10))
    key = Key(tuple(s.name for s in spans), b"\x01" * 8 * 10)
    small = (DstSpan("x", 1, 0, 16),)
    numbers = parts([DeliverItem(b"a", spans), DeliverItem(b"b", small)], [key, Key(("x",), b"\x01" * 8)],
                    LocalColumns())
    assert numbers == [(0, 0, 0, 0, 1, 1, 1, 1, 2, 2), (0,)]
    # No digest to check by, or one part in all: nothing to split.
    assert parts([DeliverItem(b"a", spans)], [Key(key.names, b"")], LocalColumns()) is None
    assert parts([DeliverItem(b"b", small)], [Key(("x",), b"\x01" * 8)], LocalColumns()) is None


def test_span_checks_find_the_changed_span_of_each_part_where_it_landed() -> None:
    data = np.arange(4096, dtype=np.uint8)
    address = data.ctypes.data
    spans = tuple(DstSpan(f"L{i}", 7, i * 512, 512) for i in range(8))
    digests = np.array([span_digest(data[i * 512:(i + 1) * 512]) for i in range(8)], "<u8")
    digests[1] = 0  # a span the node took no digest of is not checked
    key = Key(tuple(s.name for s in spans), digests.tobytes())
    groups = [(0, 0, 0, 0, 1, 1, 1, 1)]
    checks, unchecked = span_checks([DeliverItem(b"a", spans)], [key], groups,
                                    {7: Region(data, address, data.nbytes)}, LocalColumns())  # type: ignore[dict-item]
    assert isinstance(checks, SpanChecks) and unchecked == 1
    assert checks.count(0, 0) == 3 and checks.count(0, 1) == 4
    assert checks.failed(0, [0]) == [] and checks.failed(1, [0]) == []
    data[6 * 512 + 3] ^= 0xFF
    assert checks.failed(0, [0]) == [] and checks.failed(1, [0]) == [0]
    data[512] ^= 0xFF  # unchecked: changes nothing
    assert checks.intact(0, 0)
