"""Keys for blocks of tokens: one kvcr object per block, keyed by a hash chain over token ids.

Block b's key covers every token up to the end of block b, so equal keys mean equal
prefixes, and an engine looks up a prompt's blocks in order (``Client.query_prefix`` or a
lease's ``held_prefix``) to learn how much of it is cached. ``salt`` names the model (and
anything else that changes the KV: dtype, layout), so that two models never share keys.
``Fingerprint`` is such a salt for an engine whose KV is split across tensor-parallel
ranks: each rank's slice of a block is an object of its own (``slice_key``), so that no
rank ever loads another's bytes (docs/architecture.md section 5, "Engine block keys").
Pure: no torch, no engine.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

DEFAULT_BLOCK_TOKENS = 16
KV_LAYOUT_VERSION = 1
"""How an engine connector lays a block out in kvcr (one object per rank's slice, one span per
layer, or two: K and V): changed whenever that changes, so that blocks saved the older way are
misses, never loads."""


def block_keys(token_ids: Sequence[int], block_tokens: int = DEFAULT_BLOCK_TOKENS, salt: bytes = b"") -> list[bytes]:
    """One 32-byte key per full block of ``token_ids``, in order (a trailing partial block has none)."""
    keys: list[bytes] = []
    previous = hashlib.sha256(b"kvcr-blocks" + salt).digest()
    for b in range(len(token_ids) // block_tokens):
        chunk = token_ids[b * block_tokens : (b + 1) * block_tokens]
        previous = hashlib.sha256(previous + b"".join(int(t).to_bytes(4, "little") for t in chunk)).digest()
        keys.append(previous)
    return keys


@dataclass(frozen=True)
class Fingerprint:
    """What makes a block's KV usable by an engine: two engines share blocks exactly when their
    fingerprints are equal, and a block saved under another fingerprint is a miss.

    The chain of block keys is salted with every field (``salt``); each tensor-parallel rank's
    slice of block ``key`` is stored as the object ``slice_key(key, rank)``, so that the key
    of every object names the rank too."""

    model: str
    """The model's id (or path): engines that share blocks must agree on it."""
    dtype: str
    block_size: int
    """Tokens a block."""
    kv_layout: str
    """The KV cache's shape as the engine describes it: per layer group, its kind, layers, KV
    heads per rank, head size, dtype."""
    tp_size: int
    """Tensor-parallel ranks: a block is ``tp_size`` objects, one per rank's slice."""
    version: int = KV_LAYOUT_VERSION

    def __post_init__(self) -> None:
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"Fingerprint: tp_size must be a positive int, not {self.tp_size!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"Fingerprint: block_size must be a positive int, not {self.block_size!r}")

    @property
    def salt(self) -> bytes:
        """Every field, canonically encoded: what the chain of block keys starts from."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def block_keys(self, token_ids: Sequence[int]) -> list[bytes]:
        """The chain key of each full block of ``token_ids`` (``block_keys`` under ``salt``)."""
        return block_keys(token_ids, self.block_size, self.salt)

    def slice_key(self, block_key: bytes, rank: int) -> bytes:
        """The key of rank ``rank``'s slice of the block ``block_key``: the object it stores and loads."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.tp_size:
            raise ValueError(f"Fingerprint: rank must be in [0, {self.tp_size}), not {rank!r}")
        return hashlib.sha256(b"kvcr-slice" + block_key + rank.to_bytes(4, "little")).digest()

    def all_slices(self, block_keys: Sequence[bytes]) -> list[bytes]:
        """Every rank's slice key of each block, block by block (block 0 rank 0, block 0 rank 1,
        ...): a lease of them holds block b whole when its ``tp_size`` keys are held."""
        return [self.slice_key(key, rank) for key in block_keys for rank in range(self.tp_size)]

    def whole_blocks(self, block_keys: Sequence[bytes], held: frozenset[bytes] | set[bytes]) -> tuple[int, set[bytes]]:
        """Of ``block_keys``, given the slice keys ``held``: how many leading blocks have every
        rank's slice held, and the set of all blocks that have."""
        whole = {key for key in block_keys if all(self.slice_key(key, r) in held for r in range(self.tp_size))}
        leading = 0
        while leading < len(block_keys) and block_keys[leading] in whole:
            leading += 1
        return leading, whole
