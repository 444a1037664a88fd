"""Named-span projection (spec section 8) and its bounded cache."""

from __future__ import annotations

import pytest

from kvcr_protocol import ErrorCode, Projection, ProjectionCache, ProtocolError, compute_projection

INVALID = ErrorCode.LAYOUT_SUBSET_INVALID


def names(text: str) -> tuple[str, ...]:
    """``"abc"`` -> ``("a", "b", "c")``."""
    return tuple(text)


# The examples table of the spec, section 8.
VALID_CASES = [
    ("abc", ("b",), (1,), False),
    ("abc", ("a", "c"), (0, 2), False),
    ("abc", ("a", "b"), (0, 1), False),
    ("abc", ("c",), (2,), False),
    ("abc", ("a", "b", "c"), (0, 1, 2), True),
    ("aab", ("a", "a", "b"), (0, 1, 2), True),
    ("a", ("a",), (0,), True),
]
INVALID_CASES = [
    ("abc", ("c", "a")),
    ("abc", ("a", "a")),
    ("abc", ()),
    ("abc", ("",)),
    ("abc", ("d",)),
    ("abc", ("c", "a", "b")),
    ("abc", ("b", "a", "c")),
    ("abc", ("a", "c", "b")),
    ("abc", ("c", "b", "a")),
    ("abc", ("a", "b", "c", "d")),
    ("abc", ("a", "b", "c", "c")),
    ("ab", ("b", "a")),
    ("aab", ("b",)),
    ("aab", ("a",)),
    ("aab", ("a", "b")),
    ("a", ("b",)),
    ("a", ()),
    ("abc", ("a", "d")),
    ("abc", ("b", "b")),
]


@pytest.mark.parametrize(("stored", "requested", "indices", "full"), VALID_CASES)
def test_valid_projection(stored: str, requested: tuple[str, ...], indices: tuple[int, ...], full: bool) -> None:
    assert compute_projection(names(stored), requested) == Projection(indices, full)


@pytest.mark.parametrize(("stored", "requested"), INVALID_CASES)
def test_invalid_projection(stored: str, requested: tuple[str, ...]) -> None:
    with pytest.raises(ProtocolError) as info:
        compute_projection(names(stored), requested)
    assert info.value.code is INVALID


@pytest.mark.parametrize(
    "stored",
    [("L0", "L0"), ("", ""), ("", "x"), ("x", "", "x"), ("a", "a", "b"), ("",)],
)
def test_same_names_same_order_is_full_even_when_names_repeat_or_are_empty(stored: tuple[str, ...]) -> None:
    assert compute_projection(stored, stored) == Projection(tuple(range(len(stored))), True)


def test_subset_of_a_layout_with_empty_names_is_invalid() -> None:
    with pytest.raises(ProtocolError):
        compute_projection(("", "x"), ("x",))


def test_realistic_layer_names() -> None:
    stored = tuple(f"L{i}.{part}" for i in range(32) for part in ("k", "v"))
    first = compute_projection(stored, ("L0.k", "L0.v"))
    assert first == Projection((0, 1), False)
    every_other = tuple(stored[::2])
    assert compute_projection(stored, every_other).indices == tuple(range(0, 64, 2))
    assert compute_projection(stored, stored[:-1]).indices == tuple(range(63))


def test_error_message_names_the_rule() -> None:
    with pytest.raises(ProtocolError, match="order"):
        compute_projection(("a", "b", "c"), ("c", "a"))
    with pytest.raises(ProtocolError, match="not in the stored layout"):
        compute_projection(("a", "b", "c"), ("d",))


# ------------------------------------------------------------------------- cache


def test_cache_is_bounded() -> None:
    cache = ProjectionCache(size=8)
    stored = tuple(f"L{i}" for i in range(100))
    for i in range(80):
        cache.project(stored, (f"L{i}",))
        assert len(cache) <= 8
    assert len(cache) == 8
    assert cache.misses == 80 and cache.hits == 0


def test_cache_bound_includes_failures() -> None:
    cache = ProjectionCache(size=4)
    for i in range(40):
        with pytest.raises(ProtocolError):
            cache.project(("a", "b"), (f"x{i}",))
        assert len(cache) <= 4


def test_cache_hits_return_equal_results() -> None:
    cache = ProjectionCache(size=16)
    stored = ("a", "b", "c")
    first = cache.project(stored, ("a", "c"))
    again = cache.project(stored, ("a", "c"))
    assert first == again == compute_projection(stored, ("a", "c"))
    assert cache.hits == 1 and cache.misses == 1


def test_cache_caches_failures() -> None:
    cache = ProjectionCache(size=16)
    for _ in range(3):
        with pytest.raises(ProtocolError) as info:
            cache.project(("a", "b"), ("b", "a"))
        assert info.value.code is INVALID
    assert cache.misses == 1 and cache.hits == 2
    assert len(cache) == 1


def test_cache_evicts_least_recently_used() -> None:
    cache = ProjectionCache(size=2)
    stored = ("a", "b", "c")
    cache.project(stored, ("a",))
    cache.project(stored, ("b",))
    cache.project(stored, ("a",))  # a is now the most recent
    cache.project(stored, ("c",))  # evicts b
    misses = cache.misses
    cache.project(stored, ("a",))
    assert cache.misses == misses
    cache.project(stored, ("b",))
    assert cache.misses == misses + 1


def test_cache_keys_on_both_name_tuples() -> None:
    cache = ProjectionCache(size=16)
    assert cache.project(("a", "b", "c"), ("b",)).indices == (1,)
    assert cache.project(("b", "c", "d"), ("b",)).indices == (0,)


@pytest.mark.parametrize("size", [0, -1])
def test_cache_size_is_validated(size: int) -> None:
    with pytest.raises(ValueError, match="size"):
        ProjectionCache(size=size)


def test_cache_of_size_one() -> None:
    cache = ProjectionCache(size=1)
    assert cache.project(("a", "b"), ("a",)).indices == (0,)
    assert cache.project(("a", "b"), ("b",)).indices == (1,)
    assert len(cache) == 1
