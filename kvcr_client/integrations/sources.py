"""Which source node an engine's request may have its blocks looked for at: the operator's choice.

An engine connector learns of a source in two ways: its own configuration (the operator's)
and a request's transfer parameters (vLLM's ``kv_transfer_params``), which in an API server
are fields of the request body, written by whoever sends the request. A source named there
is dialled by the node and leased at, so a request must not be able to pick it: it may name
only a source the operator listed (``allowed``, plus the configured default) or the engine's
own node (what the engine itself advertises to a decode engine elsewhere). Anything else is
refused before any socket sees it, and the request is looked up as if it named nothing.

Why the engine does not simply trust the endpoint a producer engine advertises (what
vLLM's ``request_finished`` returns, for a decode engine elsewhere): it reaches the decode
engine through the client or a proxy, inside the request, where a forged one reads the
same. Trusting it would need it authenticated by the producer (a MAC under a key the
engines share), which is one more secret to deploy and rotate; the allow-list needs none and
fails closed: a decode engine's operator lists the producer nodes it may load from, and a
producer's self-naming then selects among them.

Endpoints are compared in canonical form (``kvcr_protocol.canonical_endpoint``); the
endpoint handed on is always the operator's spelling, never the request's. Pure: no I/O, no
engine, a clock passed in, so that the policy and its logging are tested in process.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kvcr_protocol import DEFAULT_LIMITS, canonical_endpoint

SOURCE_PARAM = "kvcr_endpoint"
"""The transfer parameter that names a source (what ``request_finished`` hands a decode engine)."""
LOG_WINDOW_S = 60.0
"""A cause of refusal or failure is logged at most once per this many seconds (with the count
of those left out since), whatever the requests that cause it."""


class Refusal(enum.Enum):
    """Why a source a request named is not used."""

    PARAMS_TYPE = "transfer parameters that are not a mapping"
    ENDPOINT_TYPE = "a source endpoint that is not a str"
    ENDPOINT_SIZE = f"a source endpoint over {DEFAULT_LIMITS.max_text} bytes"
    BAD_ENDPOINT = "a source endpoint no node can dial"
    NOT_ALLOWED = "a source that is not in allowed_sources"


@dataclass(frozen=True, slots=True)
class Verdict:
    """Where to look for a request's blocks: ``source`` (an allowed endpoint, as the operator
    spelled it) or None for the engine's own node only; ``refused`` says why what the request
    named was ignored, when it was."""

    source: str | None
    refused: Refusal | None = None


def _configured(endpoint: object, what: str) -> str:
    """An endpoint from the operator's configuration, canonical; a clear error naming it otherwise."""
    try:
        return canonical_endpoint(endpoint)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


class SourcePolicy:
    """The operator's sources: the engine's own node, a default source, and those a request may name."""

    def __init__(self, own: str, default: str | None = None, allowed: Iterable[object] = (),
                 config_name: str = "kv_connector_extra_config") -> None:
        self.own = _configured(own, f"{config_name}['endpoint']")
        self.default = default
        if default is not None:
            _configured(default, f"{config_name}['source']")
        if isinstance(allowed, (str, bytes)) or not isinstance(allowed, Iterable):
            raise ValueError(f"{config_name}['allowed_sources'] must be a list of endpoints, not {type(allowed).__name__}")
        self._allowed: dict[str, str] = {}
        """Canonical form -> the operator's spelling."""
        for i, endpoint in enumerate(allowed):
            self._allowed.setdefault(_configured(endpoint, f"{config_name}['allowed_sources'][{i}]"), str(endpoint))
        if default is not None:
            self._allowed.setdefault(canonical_endpoint(default), default)

    def judge(self, params: object) -> Verdict:
        """Where a request with transfer parameters ``params`` is looked up; never raises."""
        if params is None:
            return self._fallback(None)
        if not isinstance(params, Mapping):
            return self._fallback(Refusal.PARAMS_TYPE)
        named = params.get(SOURCE_PARAM)
        if named is None:
            return self._fallback(None)
        return self.resolve(named)

    def resolve(self, named: object) -> Verdict:
        """Where an endpoint a request named (or metadata carried) lets it be looked up."""
        if not isinstance(named, str):
            return self._fallback(Refusal.ENDPOINT_TYPE)
        if len(named) > DEFAULT_LIMITS.max_text:  # before any work on it: a huge string costs nothing more
            return self._fallback(Refusal.ENDPOINT_SIZE)
        try:
            canonical = canonical_endpoint(named)
        except ValueError:
            return self._fallback(Refusal.BAD_ENDPOINT)
        if canonical == self.own:
            return Verdict(None)  # this engine's own node: nothing to hint
        allowed = self._allowed.get(canonical)
        if allowed is None:
            return self._fallback(Refusal.NOT_ALLOWED)
        return Verdict(allowed)

    def permits(self, endpoint: str) -> bool:
        """Whether ``endpoint`` is one of the allowed sources (as the operator spelled it or not)."""
        verdict = self.resolve(endpoint)
        return verdict.refused is None and verdict.source is not None

    def _fallback(self, refused: Refusal | None) -> Verdict:
        return Verdict(self.default, refused)


class CauseLog:
    """Logs each cause at most once per ``window`` seconds, with how many were left out since.

    Its table holds one entry per cause, and causes are a closed set (enum members, error
    names), whoever sends what, so a flood of bad requests costs one line a window."""

    def __init__(self, logger: logging.Logger, window: float = LOG_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.window = window
        self.clock = clock
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def warn(self, cause: str, fmt: str, *args: object) -> bool:
        """Log ``fmt % args`` under ``cause`` unless that cause was logged within the window;
        whether it was logged."""
        now = self.clock()
        last = self._last.get(cause)
        if last is not None and now - last < self.window:
            self._left_out[cause] = self._left_out.get(cause, 0) + 1
            return False
        self._last[cause] = now
        left_out = self._left_out.pop(cause, 0)
        suffix = f" ({left_out} more like it in the last {now - last:.0f} s)" if left_out and last is not None else ""
        self.logger.warning(fmt + "%s", *args, suffix)
        return True
