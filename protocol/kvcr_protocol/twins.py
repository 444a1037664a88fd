"""Twin links (spec section 5.3, "Twin links"): a source proves to a target that two of the
target's links reach the same source process.

A target dials a source per endpoint as spelled, and sends each link its own token
(``peer_hello.link``), which only the target and the process that received it know. When a
``peer_hello`` arrives, a version-5 source lists in ``peer_welcome.twins`` one proof per
other live peer session of the same target incarnation: ``twin_proof(that session's token,
this hello's token)``. The target, which knows every token it sent, checks a proof against
its other links of the same incarnation: only a process that received both tokens can make
it, so an incarnation (which statistics show) forged in a welcome proves nothing.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

TWIN_PROOF_BYTES = 16
"""The length of one proof: a truncated HMAC-SHA256."""
MAX_TWIN_PROOFS = 16
"""The most proofs one ``peer_welcome`` carries (``max_key`` bytes in all)."""


def twin_proof(earlier: bytes, later: bytes) -> bytes:
    """The proof that the holder of link token ``earlier`` also received ``later``."""
    return hmac.new(earlier, later, hashlib.sha256).digest()[:TWIN_PROOF_BYTES]


def twin_proofs(earlier: Iterable[bytes], later: bytes) -> bytes:
    """``peer_welcome.twins`` for a hello with token ``later``: one proof per token of
    ``earlier`` (non-empty, other than ``later``), the last ``MAX_TWIN_PROOFS`` of them."""
    if not later:
        return b""
    proofs = [twin_proof(token, later) for token in earlier if token and not hmac.compare_digest(token, later)]
    return b"".join(proofs[-MAX_TWIN_PROOFS:])


def proves_twin(proofs: bytes, earlier: bytes, later: bytes) -> bool:
    """Whether ``proofs`` (a ``peer_welcome.twins``) holds ``twin_proof(earlier, later)``."""
    if not earlier or not later or len(proofs) % TWIN_PROOF_BYTES:
        return False
    want = twin_proof(earlier, later)
    found = False
    for start in range(0, len(proofs), TWIN_PROOF_BYTES):
        found |= hmac.compare_digest(proofs[start:start + TWIN_PROOF_BYTES], want)
    return found
