"""The node's log lines: text for people, one JSON object per line for log shippers, and the
one line each refusal or failed operation gets.

``configure`` installs the handler on stderr in the chosen format. Structured fields given
with ``extra=`` (``code``, ``session``, ``request``, ``op``, ``keys``, ...) are fields of the
JSON object; in text they are already part of the message. ``refusal`` and ``results`` are
called for every ``error`` reply and every settled operation, so they check the level
before building anything: a node at WARNING pays one comparison per refusal. A flood of
bad requests does not flood the log: past ``LOG_BURST`` lines of one code in
``LOG_WINDOW_S``, lines are counted instead, and the next line of that code says how many
were left out (``suppressed``).
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvcr_protocol import ErrorCode, KeyResult, ProtocolError

LOG_FORMATS = ("text", "json")
"""Values of ``log_format``."""

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

NODE_SIDE = frozenset({
    ErrorCode.TRANSFER_FAILED, ErrorCode.TIMEOUT, ErrorCode.PEER_UNSUPPORTED, ErrorCode.PEER_UNREACHABLE,
    ErrorCode.PEER_RESTARTED, ErrorCode.DESTINATION_UNCERTAIN, ErrorCode.INTERNAL,
})
"""Codes that say the node or its peers failed (logged at WARNING); every other code is the
client's doing or an ordinary answer (a bad request, a miss, BUSY, a limit: INFO)."""

REASON_LOGGED = 200
"""Characters of a failure's reason a log line carries (reasons may quote client input)."""

LOG_BURST = 50
"""Refusal or failure lines of one code logged in one ``LOG_WINDOW_S``; the rest are counted."""
LOG_WINDOW_S = 1.0

_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}
"""Attributes every ``LogRecord`` has: what is left over came from ``extra=``."""

log = logging.getLogger("kvcr.node")


def _plain(value: object) -> object:
    """A JSON-able stand-in for a field value: bytes as hex, anything else unknown as its str."""
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC, ISO 8601), level, logger, message, the record's
    ``extra`` fields, and ``exc`` (the formatted traceback) when it carries an exception."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name not in _RECORD_FIELDS and name not in out:
                out[name] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=_plain, ensure_ascii=False)


class Limiter:
    """At most ``burst`` lines per code per ``window`` seconds; counts what it leaves out.

    Its tables hold one entry per error code at most, whoever sends what."""

    def __init__(self, burst: int = LOG_BURST, window: float = LOG_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst = burst
        self.window = window
        self.clock = clock
        self._since: dict[str, float] = {}
        self._lines: dict[str, int] = {}
        self._left_out: dict[str, int] = {}

    def admit(self, code: str) -> int | None:
        """None: leave this line out. Otherwise log it, saying how many of ``code`` were left out before it."""
        now = self.clock()
        if now - self._since.get(code, -self.window) >= self.window:
            self._since[code] = now
            self._lines[code] = 0
        self._lines[code] += 1
        if self._lines[code] > self.burst:
            self._left_out[code] = self._left_out.get(code, 0) + 1
            return None
        return self._left_out.pop(code, 0)


limiter = Limiter()
"""The node's: refusals and failures are logged from its progress thread only."""


def left_out_note(n: int) -> str:
    """The tail of a line that a ``Limiter`` admitted after leaving ``n`` out."""
    return f" ({n} more like it left out before this line)" if n else ""


def configure(level: str, fmt: str) -> None:
    """Log to stderr at ``level`` (a name; unknown names mean INFO) in ``fmt`` (``LOG_FORMATS``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))


def level_of(code: int) -> int:
    """WARNING for a node-side failure, INFO for the rest."""
    return logging.WARNING if code in NODE_SIDE else logging.INFO


def _name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return str(code)


def who(name: str | None, identity: bytes, peer: bool) -> dict[str, str]:
    """The ``session`` fields of a line: the name a client or peer gave, or its identity before hello."""
    return {"session": name if name is not None else f"identity:{identity.hex()}",
            "role": "peer" if peer else "client" if name is not None else "unknown"}


def refusal(request: str | None, request_id: int, exc: ProtocolError, name: str | None, identity: bytes,
            peer: bool) -> None:
    """Log one ``error`` reply: its code, the request it answers and whom it went to (``who``)."""
    level = level_of(exc.code)
    if not log.isEnabledFor(level):
        return
    code = exc.code.name
    left_out = limiter.admit(code)
    if left_out is None:
        return
    session = who(name, identity, peer)
    log.log(level, "refused %s %d from %s %s: %s %s%s%s", request or "frame", request_id, session["role"],
            session["session"], code, exc.reason[:REASON_LOGGED], f" (at {exc.path})" if exc.path else "",
            left_out_note(left_out),
            extra={"event": "refused", "code": code, "request": request or "frame", "request_id": request_id,
                   "path": exc.path, "suppressed": left_out, **session})


def results(request: str, request_id: int, items: Sequence[KeyResult], name: str, identity: bytes, peer: bool) -> None:
    """Log an operation whose results carry codes, once: counts by code, and the first reason of each
    (never a line per key, however many keys failed)."""
    if not log.isEnabledFor(logging.WARNING):
        return  # not even node-side failures are wanted
    failed = [r for r in items if r.code]
    if not failed:
        return
    level = max(level_of(r.code) for r in failed)
    if not log.isEnabledFor(level):
        return
    codes = collections.Counter(_name(r.code) for r in failed)
    top = codes.most_common(1)[0][0]
    left_out = limiter.admit(top)
    if left_out is None:
        return
    session = who(name, identity, peer)
    reasons: dict[str, str] = {}
    for r in failed:
        reasons.setdefault(_name(r.code), r.reason[:REASON_LOGGED])
    summary = ", ".join(f"{code} {n} ({reasons[code]})" for code, n in codes.most_common())
    log.log(level, "%s %d from %s %s: %d of %d keys failed: %s%s", request, request_id, session["role"],
            session["session"], len(failed), len(items), summary, left_out_note(left_out),
            extra={"event": "failed", "code": top, "codes": dict(codes), "op": request, "request_id": request_id,
                   "keys": len(items), "failed": len(failed), "suppressed": left_out, **session})
