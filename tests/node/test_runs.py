"""The one kernel of runs (``kvcr_io.runs``) that the node's moves, a client's READs and its
WRITEs all cut their descriptors with: the column form and the span-by-span form cut the
same runs, on random layouts with every kind of break (a gap on either side, a changed
group, a length that differs), and a run covers exactly the bytes of its spans."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest

from kvcr_io.runs import cut, cut_rows, distinct


def layout(rng: random.Random, n: int) -> tuple[list[int], list[int], list[int], list[int]]:
    local, remote, lengths, groups = [], [], [], []
    here, there, g = 1 << 20, 1 << 30, 0
    for _ in range(n):
        length = rng.choice((4096, 4096, 4096, 8192))
        if rng.random() < 0.2:
            here += rng.choice((4096, 1 << 16))  # a gap here
        if rng.random() < 0.2:
            there += rng.choice((4096, 1 << 16))  # a gap there
        if rng.random() < 0.1:
            g += 1
        local.append(here)
        remote.append(there)
        lengths.append(length)
        groups.append(g)
        here += length
        there += length
    return local, remote, lengths, groups


@pytest.mark.parametrize("seed", range(20))
def test_columns_and_rows_cut_the_same_runs_and_cover_every_byte(seed: int) -> None:
    rng = random.Random(seed)
    local, remote, lengths, groups = layout(rng, rng.randint(0, 300))
    starts, sizes = cut(np.array(local, np.uint64), np.array(remote, np.uint64), np.array(lengths, np.uint64),
                        np.array(groups, np.int64))
    rows = cut_rows(zip(groups, local, remote, lengths, strict=True))
    assert [(groups[s], local[s], remote[s], int(size)) for s, size in zip(starts, sizes, strict=True)] == [
        (g, l0, r0, size) for g, l0, r0, size, _ in rows]
    assert sum(count for *_, count in rows) == len(local) and int(sizes.sum()) == sum(lengths)
    for g, l0, r0, size, count in rows:  # a run's spans follow each other on both sides, in one group
        i = local.index(l0)
        assert remote[i] == r0 and sum(lengths[i:i + count]) == size and set(groups[i:i + count]) == {g}


def test_one_length_for_all_and_no_groups() -> None:
    local = np.array([0, 10, 20, 40, 50], np.uint64)
    remote = np.array([100, 110, 120, 130, 140], np.uint64)
    starts, sizes = cut(local, remote, 10)
    assert starts.tolist() == [0, 3] and sizes.tolist() == [30, 20]
    empty = cut(np.zeros(0, np.uint64), np.zeros(0, np.uint64), 10)
    assert len(empty[0]) == 0 and len(empty[1]) == 0
    assert cut_rows([]) == []


def test_distinct_is_np_unique_without_loading_numpy_ma() -> None:
    """``distinct`` answers as ``np.unique`` does, and the client's planners that use it
    (a put's grant columns, a deliver's groups and regions, digest checks) never load
    ``numpy.ma``, whose import is np.unique's first call: 35 ms holding the GIL, an engine's
    event loop stalled on its first put."""
    rng = np.random.default_rng(7)
    for values in (np.array([3], np.uint32), rng.integers(0, 9, 1000, dtype=np.int64), np.arange(5, 0, -1)):
        assert distinct(values) == np.unique(values).tolist()
    code = (
        "import sys, numpy as np\n"
        "from kvcr_client import puts, readplans, digest_checks\n"
        "from kvcr_io.runs import distinct\n"
        "groups = np.array([2, 0, 1, 0], np.int64)\n"
        "assert [g for g, _ in readplans.by_group(groups)] == [0, 1, 2]\n"
        "assert distinct(np.array([4, 4, 1], np.uint32)) == [1, 4]\n"
        "assert 'numpy.ma' not in sys.modules, 'numpy.ma was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
