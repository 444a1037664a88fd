"""Block keys and the compatibility fingerprint (``kvcr_client.integrations.blocks``).

Two engines share a block only when every field of their fingerprint agrees; each
tensor-parallel rank's slice of a block has a key of its own; a lease of every rank's
slice holds a block whole only when all are held (docs/architecture.md section 5).
"""

from __future__ import annotations

import dataclasses

import pytest

from kvcr_client.integrations.blocks import KV_LAYOUT_VERSION, Fingerprint, block_keys

BASE = Fingerprint(
    model="m", dtype="torch.float32", block_size=4, kv_layout="FullAttentionSpec[2](num_kv_heads=1)", tp_size=2
)
TOKENS = list(range(10, 22))


def test_every_field_changes_every_key() -> None:
    keys = BASE.block_keys(TOKENS)
    assert len(keys) == 3 and BASE.version == KV_LAYOUT_VERSION
    changes = {
        "model": "other",
        "dtype": "torch.bfloat16",
        "kv_layout": "FullAttentionSpec[4](num_kv_heads=1)",
        "tp_size": 4,
        "version": KV_LAYOUT_VERSION + 1,
    }
    for name, value in changes.items():
        other = dataclasses.replace(BASE, **{name: value})
        assert set(other.block_keys(TOKENS)).isdisjoint(keys), name
        assert set(other.all_slices(other.block_keys(TOKENS))).isdisjoint(BASE.all_slices(keys)), name
    # Another block size cuts other blocks: none of the keys agree either.
    assert set(dataclasses.replace(BASE, block_size=3).block_keys(TOKENS)).isdisjoint(keys)


def test_keys_are_a_chain_over_the_tokens() -> None:
    keys = BASE.block_keys(TOKENS)
    assert keys == block_keys(TOKENS, 4, BASE.salt)
    assert BASE.block_keys(TOKENS[:9]) == keys[:2]  # a prefix's blocks are the prompt's first blocks
    assert BASE.block_keys([99, *TOKENS[1:]])[1] != keys[1]  # a block's key covers every token before it


def test_each_rank_has_a_key_of_its_own() -> None:
    keys = BASE.block_keys(TOKENS)
    slices = BASE.all_slices(keys)
    assert len(slices) == len(set(slices)) == 6 and not set(slices) & set(keys)
    assert slices[:2] == [BASE.slice_key(keys[0], 0), BASE.slice_key(keys[0], 1)]  # block by block
    for bad in (-1, 2, True, "0"):
        with pytest.raises(ValueError, match="rank"):
            BASE.slice_key(keys[0], bad)  # type: ignore[arg-type]
    for bad_size in (0, -2, True, 1.5):
        with pytest.raises(ValueError, match="tp_size"):
            dataclasses.replace(BASE, tp_size=bad_size)


def test_a_block_is_whole_only_with_every_rank() -> None:
    keys = BASE.block_keys(TOKENS)
    every = set(BASE.all_slices(keys))
    assert BASE.whole_blocks(keys, every) == (3, set(keys))
    one_missing = every - {BASE.slice_key(keys[1], 1)}
    assert BASE.whole_blocks(keys, one_missing) == (1, {keys[0], keys[2]})
    rank0 = {BASE.slice_key(k, 0) for k in keys}
    assert BASE.whole_blocks(keys, rank0) == (0, set())
    assert BASE.whole_blocks([], every) == (0, set())
