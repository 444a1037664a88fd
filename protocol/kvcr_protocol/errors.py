"""Error codes and the typed exceptions of the kvcr protocol.

Codes are grouped in reserved ranges so that a new code never changes the meaning of
an old one:

* ``0``           success
* ``100-199``     malformed or unacceptable frames (the codec raises these)
* ``200-299``     a request that is well formed but cannot be served as asked
* ``300-399``     transfers, peers and deadlines
* ``400-499``     admission: authentication, limits, back-pressure
* ``500-899``     reserved for future versions of this protocol
* ``900-999``     reserved for experiments; never sent by a released node
* ``1000-65535``  reserved for extensions outside this project
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Every error code a kvcr endpoint may send or raise."""

    OK = 0
    """No error."""

    # 100-199: the frame itself is unacceptable.
    MALFORMED = 100
    """Not decodable msgpack, trailing bytes, an extension type, or a repeated map key."""
    NOT_A_MAP = 101
    """The top-level object is not a map."""
    MISSING_FIELD = 102
    """A required field is absent."""
    WRONG_TYPE = 103
    """A field has the wrong msgpack type."""
    OUT_OF_RANGE = 104
    """A number is outside its range or a string outside its allowed values."""
    TOO_LARGE = 105
    """The frame, a key, a name or a blob is longer than the limit."""
    TOO_MANY = 106
    """More keys, spans, regions or handles than one message may carry."""
    UNKNOWN_TYPE = 107
    """The type tag names no message."""
    UNSUPPORTED_VERSION = 108
    """The message's version is not one the receiver speaks, or no common version."""
    MUST_UNDERSTAND = 109
    """The message carries a must-understand field the receiver does not know."""
    BAD_STATE = 110
    """The message is not allowed now (for example before hello)."""

    # 200-299: the request cannot be served as asked.
    CAPACITY = 200
    """Not enough slots, even after evicting every evictable object that could help."""
    LAYOUT_MISMATCH = 201
    """The key is stored with another layout."""
    SIZE_MISMATCH = 202
    """A span length differs from the slot size of its pool."""
    BAD_DESCRIPTOR = 203
    """A span lies outside the region it names, or names an unknown region."""
    LAYOUT_SUBSET_INVALID = 204
    """The destination names are neither the stored layout nor a valid ordered subset."""
    NOT_FOUND = 205
    """The key is not held where it was looked for (a miss)."""
    UNKNOWN_POOL = 206
    """A span names a pool the node does not have."""
    UNKNOWN_HANDLE = 207
    """A release names a handle that is not held."""
    DUPLICATE_KEY = 208
    """The same key appears twice in one batch."""
    UNKNOWN_OP = 209
    """An abort or probe names an operation that is not known."""
    NO_HINT = 210
    """Reserved; not sent: a key neither held nor named by a hint fails `NOT_FOUND`."""
    BAD_ENDPOINT = 211
    """An endpoint is not one this node can connect to (unknown transport, bad address or port)."""
    UNKNOWN_LEASE = 212
    """A renew or release names a lease the session does not hold (never held, released, or ended)."""
    UNKNOWN_PUT = 213
    """A commit or unput names a put the session does not hold (never reserved, another
    session's, committed or abandoned); version 5, spec section 6.13."""

    # 300-399: transfers, peers and deadlines.
    TRANSFER_FAILED = 300
    """NIXL reported an error for the transfer."""
    TIMEOUT = 301
    """The operation's deadline passed."""
    PEER_UNSUPPORTED = 302
    """The peer speaks a version that cannot express the request."""
    PEER_UNREACHABLE = 303
    """The peer did not answer."""
    PEER_RESTARTED = 304
    """The peer restarted (new incarnation); operations of the old one are void."""
    ABORTED = 305
    """The operation was aborted."""
    SHUTTING_DOWN = 306
    """The node is stopping and accepts no new work."""
    DESTINATION_UNCERTAIN = 307
    """The operation failed but a transfer may still have written the destination; or the memory a key names is reserved because one may (section 12)."""
    NODE_LOST = 308
    """The client lost its node before the operation completed."""
    INTERNAL = 309
    """The node failed while handling the request; the failure is logged and counted, the node goes on."""
    LEASE_EXPIRED = 310
    """A lease reached the end of its time to live unrenewed; its keys are no longer held."""
    LEASE_LOST = 311
    """A read under a lease's grant may have overlapped the end of the lease (its session
    ended, it was released, or it could not be confirmed): its bytes are not returned."""
    DIGEST_MISMATCH = 312
    """The bytes read differ from the digest the node took when the object became READY
    (someone overwrote the slot): they are not the key's. A reader under a grant finds it in
    what it read; a node in what it sent itself (section 6.12, "Integrity")."""

    # 400-499: admission.
    BUSY = 400
    """Back-pressure: too many operations pending; retry later."""
    TOO_MANY_CLIENTS = 401
    """The node serves as many clients as it allows."""
    UNAUTHORIZED = 402
    """The sender may not open a session."""
    HINT_LIMIT = 403
    """The session holds as many hints as the node allows; discard some first."""
    PEER_LIMIT = 404
    """The node holds as many peer links as it allows and none is idle enough to close."""
    LEASE_LIMIT = 405
    """The session holds as many leases as the node allows; release some first."""


_KNOWN = frozenset(int(code) for code in ErrorCode)


def code_of(value: int) -> ErrorCode | int:
    """A code read off the wire: its ``ErrorCode``, or the number itself when this side does
    not know it (a newer peer's code; spec section 10 says to treat it by its range)."""
    return ErrorCode(value) if value in _KNOWN else value


class ProtocolError(Exception):
    """The one typed error of kvcr: a code, a reason and the path of the bad field.

    Raised for frames that break the protocol, for spans outside their regions and for
    destination names that are no valid projection alike, so each layer translates it
    once: the node into an error reply or a per-key result, the client into its own
    ``ArgumentError``/``NodeError``.
    """

    def __init__(self, code: ErrorCode, reason: str, path: str = "") -> None:
        self.code = code
        self.reason = reason
        self.path = path
        where = f" at {path}" if path else ""
        super().__init__(f"{code.name}{where}: {reason}")


class LocalProtocolError(ProtocolError):
    """We misused the protocol: a message this side tried to build or send is invalid."""


class RemoteProtocolError(ProtocolError):
    """The peer misused the protocol: bytes it sent are invalid."""
