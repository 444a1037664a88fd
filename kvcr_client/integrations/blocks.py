"""Keys for blocks of tokens: one kvcr object per block, keyed by a hash chain over token ids.

Block b's key covers every token up to the end of block b, so equal keys mean equal
prefixes, and an engine looks up a prompt's blocks in order (``Client.query_prefix`` or a
lease's ``held_prefix``) to learn how much of it is cached. ``salt`` names the model (and
anything else that changes the KV: dtype, layout), so that two models never share keys.
Pure: no torch, no engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

DEFAULT_BLOCK_TOKENS = 16


def block_keys(token_ids: Sequence[int], block_tokens: int = DEFAULT_BLOCK_TOKENS, salt: bytes = b"") -> list[bytes]:
    """One 32-byte key per full block of ``token_ids``, in order (a trailing partial block has none)."""
    keys: list[bytes] = []
    previous = hashlib.sha256(b"kvcr-blocks" + salt).digest()
    for b in range(len(token_ids) // block_tokens):
        chunk = token_ids[b * block_tokens : (b + 1) * block_tokens]
        previous = hashlib.sha256(previous + b"".join(int(t).to_bytes(4, "little") for t in chunk)).digest()
        keys.append(previous)
    return keys
