"""Keys for blocks of tokens: one kvcr object per block.

Two ways to key a block. ``block_keys`` chains a hash over token ids, for an engine that
names its blocks by their tokens alone. ``engine_block_keys`` takes the engine's own block
hashes (vLLM's ``Request.block_hashes``), which already chain every token before the block's
end and fold in whatever else decides its KV that the engine knows of (a LoRA adapter,
multimodal inputs, a cache salt): key b is a digest of the salt and the engine's hash at
block b's end. Either way block b's key covers every token up to the end of block b, so
equal keys mean equal prefixes, and an engine looks up a prompt's blocks in order
(``Client.query_prefix`` or a lease's ``held_prefix``) to learn how much of it is cached.
``salt`` names the model (and anything else that changes the KV: dtype, layout,
quantization, revision), so that two models never share keys. ``Fingerprint`` is such a
salt for an engine whose KV is split across tensor-parallel ranks: each rank's slice of a
block is an object of its own (``slice_key``), so that no rank ever loads another's bytes
(docs/architecture.md section 5, "Engine block keys"). Pure: no torch, no engine.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

DEFAULT_BLOCK_TOKENS = 16
KV_LAYOUT_VERSION = 2
"""How an engine connector keys a block and lays it out in kvcr (1: keys chained over token ids;
2: keys from the engine's own block hashes; both: one object per rank's slice, one span per
layer, or two: K and V): changed whenever that changes, so that blocks saved the older way
are misses, never loads."""
ENGINE_KEY_DOMAIN = b"kvcr-engine-blocks"
"""What ``engine_block_keys`` digests first, so that its keys never equal ``block_keys``'s."""


def block_keys(token_ids: Sequence[int], block_tokens: int = DEFAULT_BLOCK_TOKENS, salt: bytes = b"") -> list[bytes]:
    """One 32-byte key per full block of ``token_ids``, in order (a trailing partial block has none)."""
    keys: list[bytes] = []
    previous = hashlib.sha256(b"kvcr-blocks" + salt).digest()
    for b in range(len(token_ids) // block_tokens):
        chunk = token_ids[b * block_tokens : (b + 1) * block_tokens]
        previous = hashlib.sha256(previous + b"".join(int(t).to_bytes(4, "little") for t in chunk)).digest()
        keys.append(previous)
    return keys


def engine_block_keys(engine_hashes: Sequence[bytes], salt: bytes = b"", hashes_per_block: int = 1) -> list[bytes]:
    """One 32-byte key per block from the engine's own block hashes, in order.

    The engine's hash of a block covers every token before the block's end (and whatever else
    the engine folds in), so block b's key is a digest of ``salt`` and the engine's hash at
    its end, and nothing else. An engine that hashes finer than it stores blocks has
    ``hashes_per_block`` hashes a block: the last of each run is the block's (a trailing
    partial run has no key). Anyone who knows the engine's hash of a block and the salt
    (a router fed by the engine's own events) derives its key."""
    if isinstance(hashes_per_block, bool) or not isinstance(hashes_per_block, int) or hashes_per_block < 1:
        raise ValueError(f"engine_block_keys: hashes_per_block must be a positive int, not {hashes_per_block!r}")
    root = hashlib.sha256(ENGINE_KEY_DOMAIN + salt).digest()
    keys: list[bytes] = []
    for engine_hash in engine_hashes[hashes_per_block - 1 :: hashes_per_block]:
        if not isinstance(engine_hash, bytes) or not engine_hash:
            raise ValueError(f"engine_block_keys: a block hash must be non-empty bytes, not {type(engine_hash).__name__}")
        keys.append(hashlib.sha256(root + engine_hash).digest())
    return keys


@dataclass(frozen=True)
class Fingerprint:
    """What makes a block's KV usable by an engine: two engines share blocks exactly when their
    fingerprints are equal, and a block saved under another fingerprint is a miss.

    Block keys are salted with every field (``salt``); each tensor-parallel rank's slice of
    block ``key`` is stored as the object ``slice_key(key, rank)``, so that the key of every
    object names the rank too."""

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
    quantization: str = ""
    """How the weights are quantized ("" for none): other weights, other KV."""
    revision: str = ""
    """The model's revision ("" for whatever the model names): another revision, other weights."""
    version: int = KV_LAYOUT_VERSION

    def __post_init__(self) -> None:
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"Fingerprint: tp_size must be a positive int, not {self.tp_size!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"Fingerprint: block_size must be a positive int, not {self.block_size!r}")

    @property
    def salt(self) -> bytes:
        """Every field, canonically encoded: what every block key is salted with."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def engine_keys(self, engine_hashes: Sequence[bytes], hashes_per_block: int = 1) -> list[bytes]:
        """The key of each block the engine's own block hashes name (``engine_block_keys``
        under ``salt``): what blocks are leased, loaded and saved under (one object per rank's
        slice, ``slice_key``)."""
        return engine_block_keys(engine_hashes, self.salt, hashes_per_block)

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
