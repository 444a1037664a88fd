"""Size limits that every decoded message is checked against."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on one message; a receiver refuses anything larger (``TOO_LARGE``/``TOO_MANY``)."""

    max_frame: int = 8 << 20
    """Bytes in one encoded frame."""
    max_key: int = 256
    """Bytes in one block key."""
    max_name: int = 128
    """Bytes (UTF-8) in a span, pool, client or agent name."""
    max_keys: int = 4096
    """Keys (items) in one message."""
    max_spans: int = 65536
    """Spans in one message, summed over its items."""
    max_regions: int = 1024
    """Regions announced in one message."""
    max_metadata: int = 4 << 20
    """Bytes of NIXL agent metadata in one message."""
    max_text: int = 4096
    """Bytes in an endpoint, request id, reason or path."""
    max_tiers: int = 256
    """Entries in a query reply's tier table (version 3; a tier index is one byte)."""


DEFAULT_LIMITS = Limits()
