"""Patterned bytes, so that a misplaced or missing byte shows, and byte-exact comparison."""

from __future__ import annotations

import numpy as np

KiB = 1024


def pattern(n: int, seed: int) -> np.ndarray:
    """Patterned, seed-dependent bytes (never zeros), so misplaced bytes show."""
    rng = np.random.default_rng(seed)
    data = rng.integers(1, 256, size=n, dtype=np.uint8)
    return data


def sentinel_like(n: int, seed: int) -> np.ndarray:
    """A destination pre-filled with a pattern of its own, so untouched bytes are checkable."""
    return pattern(n, seed)


def assert_bytes_equal(actual: np.ndarray, expected: np.ndarray, what: str = "buffer") -> None:
    """Every byte equal; on failure say how many differ and where the first one is."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    diff = np.flatnonzero(actual != expected)
    if diff.size:
        first = int(diff[0])
        raise AssertionError(
            f"{what}: {diff.size} of {actual.size} bytes differ; first at {first}: "
            f"got {int(actual[first])}, expected {int(expected[first])}"
        )
