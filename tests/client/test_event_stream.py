"""``EventStream`` against a hostile or silent publisher: clear errors, bounded waits (spec section 15).

A real node never sends these; the sockets here stand in for a broken or impostor one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from kvcr_client.events import EventStream, EventStreamError
from kvcr_protocol.events import EVENTS_TOPIC, Cleared, EventBatch, encode_batch, encode_seq
from kvcr_testing.health import wait_until

CONNECT_TIMEOUT_S = 5.0


@pytest.fixture
def pub(ipc_dir: Path) -> Iterator[tuple[zmq.Socket[bytes], str]]:
    """A bare PUB at an ipc endpoint (its replay endpoint bound by nobody)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{ipc_dir}/ev"
    sock.bind(endpoint)
    try:
        yield sock, endpoint
    finally:
        sock.close(0)
        ctx.term()


def until_received(pub: zmq.Socket[bytes], stream: EventStream, frames: list[bytes]) -> object:
    """Publish ``frames`` until the stream reacts (a SUB misses what is sent before it subscribed)."""
    outcome: list[object] = []

    def reacted() -> bool:
        pub.send_multipart(frames)
        try:
            outcome.append(stream.recv(0.05))
        except EventStreamError as exc:
            outcome.append(exc)
        return outcome[-1] != []

    assert wait_until(reacted, CONNECT_TIMEOUT_S)
    return outcome[-1]


@pytest.mark.parametrize(
    ("frames", "says"),
    [
        ([EVENTS_TOPIC, encode_seq(0), msgpack.packb({"v": 1, "node": "n", "inc": 1, "ts": 1.0, "events": [{"t": "x"}]})],
         "UNKNOWN_TYPE at events[0].t"),
        ([EVENTS_TOPIC, encode_seq(0), b"\xc1"], "batch 0 does not decode: MALFORMED"),
        ([EVENTS_TOPIC, b"\x00\x01", b""], "sequence number is invalid: MALFORMED at seq"),
        ([EVENTS_TOPIC, b"\xff" * 8, b""], "sequence number is invalid: OUT_OF_RANGE at seq"),
        ([EVENTS_TOPIC, encode_seq(0)], "2 frames"),
    ],
    ids=["unknown-event", "not-msgpack", "short-seq", "negative-seq", "two-frames"],
)
def test_a_hostile_publication_is_a_clear_error(pub: tuple[zmq.Socket[bytes], str], frames: list[bytes],
                                                says: str) -> None:
    sock, endpoint = pub
    with EventStream(endpoint, replay_timeout=0.2) as stream:
        outcome = until_received(sock, stream, frames)
    assert isinstance(outcome, EventStreamError) and says in str(outcome), outcome


def test_a_silent_replay_socket_bounds_the_wait(pub: tuple[zmq.Socket[bytes], str]) -> None:
    sock, endpoint = pub
    batch = encode_batch(EventBatch("n", 9, 1.0, (Cleared(),)))
    with EventStream(endpoint, replay_timeout=0.2) as stream:
        # The first batch of the incarnation arrives: in order, nothing to fill.
        outcome = until_received(sock, stream, [EVENTS_TOPIC, encode_seq(0), batch])
        assert isinstance(outcome, list) and [seq for seq, _ in outcome] == [0]
        # A gap (3 after 0) asks the replay socket, which nobody serves: an error, in bounded time.
        sock.send_multipart([EVENTS_TOPIC, encode_seq(3), batch])
        with pytest.raises(EventStreamError, match="no replay answer"):
            assert wait_until(lambda: stream.recv(0.05) != [], CONNECT_TIMEOUT_S)
        with pytest.raises(EventStreamError, match="no replay answer"):
            stream.sync()
