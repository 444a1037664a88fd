"""Twin link proofs (``kvcr_protocol.twins``, spec section 5.3 "Twin links")."""

from __future__ import annotations

from kvcr_protocol.twins import MAX_TWIN_PROOFS, TWIN_PROOF_BYTES, proves_twin, twin_proof, twin_proofs

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


def test_a_proof_names_both_tokens_in_order() -> None:
    proofs = twin_proofs([A, C], B)
    assert proofs == twin_proof(A, B) + twin_proof(C, B) and len(proofs) == 2 * TWIN_PROOF_BYTES
    assert proves_twin(proofs, A, B) and proves_twin(proofs, C, B)
    assert not proves_twin(proofs, B, A) and not proves_twin(proofs, A, C)


def test_nothing_proves_an_empty_token_or_a_malformed_list() -> None:
    assert twin_proofs([A], b"") == b"" and twin_proofs([b"", B], B) == b""
    assert not proves_twin(twin_proof(b"", B), b"", B)
    assert not proves_twin(twin_proof(A, B)[:-1], A, B), "a truncated list proves nothing"
    assert not proves_twin(twin_proof(A, B) + b"x", A, B)
    assert not proves_twin(b"", A, B)


def test_a_welcome_carries_the_latest_proofs_only() -> None:
    tokens = [bytes([i]) * 16 for i in range(1, 40)]
    proofs = twin_proofs(tokens, B)
    assert len(proofs) == MAX_TWIN_PROOFS * TWIN_PROOF_BYTES
    assert proves_twin(proofs, tokens[-1], B) and not proves_twin(proofs, tokens[0], B)
