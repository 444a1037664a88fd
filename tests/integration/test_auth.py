"""CurveZMQ authentication on real nodes: keys from ``kvcr keygen``, an allow-list.

An allowed client works (byte-exact round trip); a client with an unknown key and a plain
(unencrypted) client are refused quickly with ``UNAUTHORIZED``, and the node counts
them (``auth_refused``, ``auth_handshake_failed``). Two CURVE nodes deliver across: each
node's public key is on the other's allow-list, and each names the key the other serves
with (``--curve-peer-key``); a node whose key is not allowed gets no peer session.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from kvcr_client import Client, CurveKeys, ErrorCode, KeyStatus, NodeError, Span
from kvcr_client.transport import Transport
from kvcr_testing.health import assert_clean, stats, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Layout, Registrar
from kvcr_testing.patterns import KiB, assert_bytes_equal, pattern

POOL = ("--pool", "kv:4KiB:64")
SLOT = 4 * KiB
LAYOUT = Layout([(f"L{i}", "kv", SLOT) for i in range(4)])
REFUSAL_S = 5.0


@dataclass
class KeyPair:
    public_file: Path
    secret_file: Path

    @property
    def public(self) -> str:
        return self.public_file.read_text().strip()

    @property
    def secret(self) -> str:
        return self.secret_file.read_text().strip()


def keygen(prefix: Path) -> KeyPair:
    """``kvcr keygen PREFIX``: PREFIX.pub and PREFIX.key (mode 600)."""
    tool = Path(sys.executable).parent / "kvcr"
    cmd = [str(tool)] if tool.exists() else [sys.executable, "-c", "import sys; from kvcr_client.tool import main; sys.exit(main())"]
    done = subprocess.run([*cmd, "keygen", str(prefix)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    pair = KeyPair(prefix.with_suffix(".pub"), prefix.with_suffix(".key"))
    assert len(pair.public) == 40 and len(pair.secret) == 40
    assert pair.secret_file.stat().st_mode & 0o077 == 0, "the secret key must be private"
    return pair


def curve_args(node: KeyPair, allow: list[KeyPair], directory: Path, name: str, peer: KeyPair | None = None) -> list[str]:
    allow_file = directory / f"{name}.allow"
    allow_file.write_text("# allowed keys\n" + "".join(f"{k.public} {k.public_file.stem}\n" for k in allow))
    args = ["--curve-secret-key", str(node.secret_file), "--curve-public-key", str(node.public_file),
            "--curve-allow", str(allow_file)]
    if peer is not None:
        args += ["--curve-peer-key", str(peer.public_file)]
    return args


def curve(node: KeyPair, client: KeyPair) -> CurveKeys:
    return CurveKeys(server_public=node.public, public=client.public, secret=client.secret)


@pytest.fixture
def keys(tmp_path: Path) -> Callable[[str], KeyPair]:
    return lambda name: keygen(tmp_path / name)


def round_trip(client: Client, key: bytes, seed: int) -> None:
    reg = Registrar(client)
    src = pattern(LAYOUT.nbytes, seed)
    region = reg(src)
    assert client.deposit({key: LAYOUT.source_spans(region)}).result(RESULT_TIMEOUT_S)[key].status is KeyStatus.STORED
    dst = pattern(LAYOUT.nbytes, seed + 1)
    dregion = reg(dst)
    spans = [Span(n, dregion, o, s) for (n, _, s), o in zip(LAYOUT.spans, LAYOUT.offsets, strict=True)]
    assert client.deliver({key: spans}).result(RESULT_TIMEOUT_S)[key].status is KeyStatus.OK
    assert_bytes_equal(dst, src, "round trip over CurveZMQ")
    reg.close()


def test_allowed_unknown_and_plain_clients(node_factory: Callable[..., Any], keys: Callable[[str], KeyPair], tmp_path: Path) -> None:
    server, alice, mallory = keys("server"), keys("alice"), keys("mallory")
    node = node_factory(*POOL, *curve_args(server, [alice], tmp_path, "n"))
    with Client(node.endpoint, name="alice", curve=curve(server, alice)) as client:
        round_trip(client, b"k", 1)
        before = stats(client)["counters"]
        assert before.get("auth_accepted", 0) >= 1, before

        # A key that is not on the allow-list: the ZAP handler refuses it.
        t0 = time.monotonic()
        with pytest.raises(NodeError) as err:
            Client(node.endpoint, name="mallory", curve=curve(server, mallory), timeout=REFUSAL_S)
        assert err.value.code == ErrorCode.UNAUTHORIZED, err.value
        assert time.monotonic() - t0 < REFUSAL_S
        assert wait_until(lambda: stats(client)["counters"].get("auth_refused", 0) >= 1, 5), stats(client)["counters"]

        # A plain client cannot even finish the handshake with a CURVE server.
        t0 = time.monotonic()
        with pytest.raises(NodeError) as err:
            Client(node.endpoint, name="plain", timeout=REFUSAL_S)
        assert err.value.code == ErrorCode.UNAUTHORIZED, err.value
        assert time.monotonic() - t0 < REFUSAL_S
        assert wait_until(lambda: stats(client)["counters"].get("auth_handshake_failed", 0) >= 1, 5), stats(client)["counters"]

        # Neither got a session; the allowed client is undisturbed.
        st = stats(client)
        assert st["clients"] == 1 and st["counters"].get("hellos") == 1, st
        round_trip(client, b"k2", 3)
        assert_clean(client)


def test_client_with_the_wrong_server_key_is_refused(
    node_factory: Callable[..., Any], keys: Callable[[str], KeyPair], tmp_path: Path
) -> None:
    server, impostor, alice = keys("server"), keys("impostor"), keys("alice")
    node = node_factory(*POOL, *curve_args(server, [alice], tmp_path, "n"))
    t0 = time.monotonic()
    with pytest.raises(NodeError) as err:
        Client(node.endpoint, name="alice", curve=curve(impostor, alice), timeout=REFUSAL_S)
    assert err.value.code == ErrorCode.UNAUTHORIZED, err.value
    assert time.monotonic() - t0 < REFUSAL_S
    with Client(node.endpoint, name="alice", curve=curve(server, alice)) as client:
        st = assert_clean(client)
        assert st["clients"] == 1
        # The server cannot read the client's handshake (it was sealed for another key).
        assert st["counters"].get("auth_handshake_failed", 0) >= 1, st["counters"]


PIPE_GONE_S = 1.0
"""How long a test waits for a refused socket to drop its pipe (the client saw the mismatch first)."""


@pytest.mark.parametrize("who", ["plain", "unknown key"])
def test_a_refusal_that_lands_before_the_hello_is_sent_still_says_unauthorized(
    node_factory: Callable[..., Any], keys: Callable[[str], KeyPair], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    who: str,
) -> None:
    """On a loaded machine the I/O thread may finish a refused handshake before the caller's
    thread sends its hello. Where the client's side saw the refusal first, libzmq drops the
    socket's only pipe with it, and the hello's send finds no pipe. The socket is held here
    until the monitor has the refusal, so the hello always goes second, and its send fails
    as it does without a pipe (where the node's side saw it first, the pipe stays, and the
    send is made to fail as it would). The client must still answer ``UNAUTHORIZED``, not
    that the node is unreachable."""
    server, alice, mallory = keys("server"), keys("alice"), keys("mallory")
    node = node_factory(*POOL, *curve_args(server, [alice], tmp_path, "n"))
    opened = Transport.open

    def open_until_refused(self: Transport) -> None:
        opened(self)
        sock, monitor = self.sock, self.monitor
        assert sock is not None and monitor is not None
        assert monitor.poll(int(REFUSAL_S * 1000)), "the monitor reported nothing"  # poll reads nothing
        if not wait_until(lambda: not sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT, PIPE_GONE_S):
            self.send = lambda frame: False  # type: ignore[method-assign]

    monkeypatch.setattr(Transport, "open", open_until_refused)
    with pytest.raises(NodeError) as err:
        Client(node.endpoint, name="refused", curve=None if who == "plain" else curve(server, mallory), timeout=REFUSAL_S)
    assert err.value.code == ErrorCode.UNAUTHORIZED, err.value
    monkeypatch.undo()
    with Client(node.endpoint, name="alice", curve=curve(server, alice)) as client:
        assert assert_clean(client)["clients"] == 1


def test_two_curve_nodes_deliver_across(node_factory: Callable[..., Any], keys: Callable[[str], KeyPair], tmp_path: Path) -> None:
    ka, kb, kc = keys("node-a"), keys("node-b"), keys("node-c")
    ca, cb = keys("client-a"), keys("client-b")
    # Each node lets in its client and the other node, and serves peers with the other's key in mind.
    node_b = node_factory(*POOL, *curve_args(kb, [cb, ka], tmp_path, "b", peer=ka))
    node_a = node_factory(*POOL, *curve_args(ka, [ca, kb], tmp_path, "a", peer=kb))
    # C is allowed nowhere: B refuses its peer session.
    node_c = node_factory(*POOL, *curve_args(kc, [ca], tmp_path, "c", peer=kb))
    with (
        Client(node_b.endpoint, name="client-b", curve=curve(kb, cb)) as client_b,
        Client(node_a.endpoint, name="client-a", curve=curve(ka, ca)) as client_a,
        Client(node_c.endpoint, name="client-c", curve=curve(kc, ca)) as client_c,
    ):
        reg_b = Registrar(client_b)
        src = pattern(LAYOUT.nbytes, 7)
        region = reg_b(src)
        assert client_b.deposit({b"x": LAYOUT.source_spans(region)}).result(10)[b"x"].status is KeyStatus.STORED

        reg_a = Registrar(client_a)
        client_a.submit_hint("r", node_b.endpoint, [b"x"]).result(5)
        dst = pattern(LAYOUT.nbytes + 128, 8)
        expected = dst.copy()
        expected[64 : 64 + LAYOUT.nbytes] = src
        dregion = reg_a(dst)
        spans = [Span(n, dregion, 64 + o, s) for (n, _, s), o in zip(LAYOUT.spans, LAYOUT.offsets, strict=True)]
        res = client_a.deliver({b"x": spans}, request_id="r").result(RESULT_TIMEOUT_S)
        assert res[b"x"].status is KeyStatus.OK, res
        assert_bytes_equal(dst, expected, "cross-node delivery between CURVE nodes")
        st_b = stats(client_b)
        assert st_b["peer_sessions"] == 1 and st_b["counters"].get("peer_hellos") == 1, st_b
        assert stats(client_a)["peers"][node_b.endpoint]["state"] == "ready"

        # Node C's key is not on B's list: no peer session, the delivery fails at its deadline.
        reg_c = Registrar(client_c)
        client_c.submit_hint("r", node_b.endpoint, [b"x"]).result(5)
        dst_c = np.zeros(LAYOUT.nbytes, dtype=np.uint8)
        cregion = reg_c(dst_c)
        spans = [Span(n, cregion, o, s) for (n, _, s), o in zip(LAYOUT.spans, LAYOUT.offsets, strict=True)]
        res = client_c.deliver({b"x": spans}, request_id="r", deadline_ms=1500).result(RESULT_TIMEOUT_S)
        assert (res[b"x"].status, res[b"x"].code) == (KeyStatus.FAILED, ErrorCode.PEER_UNREACHABLE), res
        assert not dst_c.any(), "a refused peer wrote into the destination"
        assert wait_until(lambda: stats(client_b)["counters"].get("auth_refused", 0) >= 1, 5), stats(client_b)["counters"]
        assert stats(client_b)["peer_sessions"] == 1

        for client, reg in ((client_a, reg_a), (client_b, reg_b), (client_c, reg_c)):
            assert_clean(client)
            reg.close()


@pytest.mark.parametrize("transfers", ["on", "off"])
def test_only_allowed_clients_get_read_grants(node_factory: Callable[..., Any], keys: Callable[[str], KeyPair],
                                              tmp_path: Path, transfers: str) -> None:
    """A grant hands the node's pool registrations to the client's agent (spec section 14):
    with CURVE only an allowed client ever has a session to ask one in, and with
    ``--no-client-transfers`` not even it gets one (its leased keys travel by the node)."""
    server, alice, mallory = keys("server"), keys("alice"), keys("mallory")
    node = node_factory(*POOL, "--lease-pool-fraction", "1", *curve_args(server, [alice], tmp_path, "n"),
                        *(("--no-client-transfers",) if transfers == "off" else ()))
    with Client(node.endpoint, name="alice", curve=curve(server, alice)) as client:
        reg = Registrar(client)
        src = pattern(LAYOUT.nbytes, 11)
        region = reg(src)
        assert client.deposit({b"g": LAYOUT.source_spans(region)}).result(RESULT_TIMEOUT_S)[b"g"].status is KeyStatus.STORED
        lease = client.lease([b"g"]).result(RESULT_TIMEOUT_S)
        st = stats(client)
        posted = st["transfers"]["posted"]
        granted = 1 if transfers == "on" else 0
        assert client.tables()["granted_keys"] == granted and st["leases"]["with_grants"] == granted, st["leases"]
        dst = pattern(LAYOUT.nbytes, 12)
        dregion = reg(dst)
        spans = [Span(n, dregion, o, s) for (n, _, s), o in zip(LAYOUT.spans, LAYOUT.offsets, strict=True)]
        assert client.deliver({b"g": spans}).result(RESULT_TIMEOUT_S)[b"g"].status is KeyStatus.OK
        assert_bytes_equal(dst, src, "a leased object delivered over CurveZMQ")
        assert client.counters()["grant_reads"] == granted
        assert stats(client)["transfers"]["posted"] == posted + 1 - granted, "who moved the bytes"

        # Others cannot open a session, so they cannot ask for a grant.
        for name, keys_ in (("mallory", curve(server, mallory)), ("plain", None)):
            with pytest.raises(NodeError) as err:
                Client(node.endpoint, name=name, curve=keys_, timeout=REFUSAL_S)
            assert err.value.code == ErrorCode.UNAUTHORIZED, err.value
        st = stats(client)
        assert st["clients"] == 1 and st["counters"].get("hellos") == 1, st
        assert st["leases"].get("read_grants", 0) == granted, st["leases"]
        lease.release().result(RESULT_TIMEOUT_S)
        assert stats(client)["leases"]["with_grants"] == 0
        reg.close()
        assert_clean(client)
