"""Block keys and the compatibility fingerprint (``kvcr_client.integrations.blocks``).

Two engines share a block only when every field of their fingerprint agrees; a block's key
is a digest of the fingerprint and the engine's own hash of the block (vLLM's, which chains
the prefix and folds in the request's LoRA adapter, multimodal inputs and cache salt), and
nothing else, so anyone who knows both derives it; each tensor-parallel rank's slice of a
block has a key of its own; a lease of every rank's slice holds a block whole only when all
are held (docs/architecture.md section 5, "Engine block keys").
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from kvcr_client.integrations.blocks import (
    ENGINE_KEY_DOMAIN,
    KV_LAYOUT_VERSION,
    Fingerprint,
    block_keys,
    engine_block_keys,
)

BASE = Fingerprint(
    model="m", dtype="torch.float32", block_size=4, kv_layout="FullAttentionSpec[2](num_kv_heads=1)", tp_size=2
)
TOKENS = list(range(10, 22))


def chain(blocks: int, root: bytes = b"none") -> list[bytes]:
    """Stand-ins for an engine's block hashes: a chain, each over its parent and its block."""
    hashes, parent = [], hashlib.sha256(root).digest()
    for b in range(blocks):
        parent = hashlib.sha256(parent + b.to_bytes(4, "little")).digest()
        hashes.append(parent)
    return hashes


HASHES = chain(3)


def test_every_field_changes_every_key() -> None:
    keys = BASE.engine_keys(HASHES)
    assert len(keys) == 3 and BASE.version == KV_LAYOUT_VERSION == 2
    assert BASE.quantization == BASE.revision == ""
    changes = {
        "model": "other",
        "dtype": "torch.bfloat16",
        "block_size": 8,
        "kv_layout": "FullAttentionSpec[4](num_kv_heads=1)",
        "tp_size": 4,
        "quantization": "fp8",
        "revision": "0123abc",
        "version": KV_LAYOUT_VERSION + 1,
    }
    assert set(changes) == {f.name for f in dataclasses.fields(Fingerprint)}  # every field, none left out
    for name, value in changes.items():
        other = dataclasses.replace(BASE, **{name: value})
        assert set(other.engine_keys(HASHES)).isdisjoint(keys), name
        assert set(other.all_slices(other.engine_keys(HASHES))).isdisjoint(BASE.all_slices(keys)), name


def test_a_key_is_the_engine_hash_at_the_block_end_under_the_salt() -> None:
    keys = BASE.engine_keys(HASHES)
    assert keys == engine_block_keys(HASHES, BASE.salt)
    assert len(set(keys)) == 3 and all(len(k) == 32 for k in keys)
    assert BASE.engine_keys(HASHES[:2]) == keys[:2]  # a prefix's blocks are the prompt's first blocks
    # Only the engine's hash decides: where it differs (other tokens before, another LoRA
    # adapter, image or cache salt in the engine's hash) every later key differs, where it
    # is equal the key is.
    other = chain(3, b"salted")
    assert set(BASE.engine_keys(other)).isdisjoint(keys)
    assert BASE.engine_keys([other[0], HASHES[1]])[1] == keys[1]
    # Derivable by anyone who knows the salt and the engine's hash (a router fed by the
    # engine's own events): the formula is the documented one.
    root = hashlib.sha256(ENGINE_KEY_DOMAIN + BASE.salt).digest()
    assert keys == [hashlib.sha256(root + h).digest() for h in HASHES]
    assert BASE.slice_key(keys[0], 1) == hashlib.sha256(b"kvcr-slice" + keys[0] + (1).to_bytes(4, "little")).digest()
    # Never a key of the token chain, whatever the tokens.
    assert set(keys).isdisjoint(block_keys(TOKENS, 4, BASE.salt))


def test_an_engine_hashing_finer_keys_each_block_by_its_last_hash() -> None:
    fine = chain(7)
    assert engine_block_keys(fine, BASE.salt, 2) == engine_block_keys([fine[1], fine[3], fine[5]], BASE.salt)
    assert BASE.engine_keys(fine, 3) == BASE.engine_keys([fine[2], fine[5]])  # a trailing partial block has none
    assert BASE.engine_keys([]) == [] and BASE.engine_keys(fine[:1], 2) == []
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="hashes_per_block"):
            engine_block_keys(fine, b"", bad)  # type: ignore[arg-type]
    # A hash that is not bytes (vLLM's events may carry 64-bit ints) is refused, never keyed.
    for bad_hash in (12345, b"", "abc", None):
        with pytest.raises(ValueError, match="block hash"):
            BASE.engine_keys([HASHES[0], bad_hash])  # type: ignore[list-item]


def test_token_keys_are_a_chain_over_the_tokens() -> None:
    keys = block_keys(TOKENS, 4, BASE.salt)
    assert len(keys) == 3
    assert block_keys(TOKENS[:9], 4, BASE.salt) == keys[:2]  # a prefix's blocks are the prompt's first blocks
    assert block_keys([99, *TOKENS[1:]], 4, BASE.salt)[1] != keys[1]  # a block's key covers every token before it
    assert set(block_keys(TOKENS, 4, b"other")).isdisjoint(keys)


def test_each_rank_has_a_key_of_its_own() -> None:
    keys = BASE.engine_keys(HASHES)
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
    keys = BASE.engine_keys(HASHES)
    every = set(BASE.all_slices(keys))
    assert BASE.whole_blocks(keys, every) == (3, set(keys))
    one_missing = every - {BASE.slice_key(keys[1], 1)}
    assert BASE.whole_blocks(keys, one_missing) == (1, {keys[0], keys[2]})
    rank0 = {BASE.slice_key(k, 0) for k in keys}
    assert BASE.whole_blocks(keys, rank0) == (0, set())
    assert BASE.whole_blocks([], every) == (0, set())
