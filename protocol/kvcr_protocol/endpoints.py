"""Which ZeroMQ endpoints a node can dial: the check a hint's source endpoint must pass.

A node connects to a peer only over ``tcp://host:port`` or ``ipc://path`` (spec section
12). Anything else (an unknown or bind-only transport, ``inproc://`` which would reach into
the node's own process, a wildcard, a bad port, a host name that is not a name) is refused
before it reaches a socket, where ZeroMQ would raise. The check is purely syntactic: it
never resolves a name, so it can run on the node's progress loop.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
import sys

IPC_PATH_MAX = 107 if sys.platform.startswith("linux") else 103
"""Bytes in an ipc path: ``sun_path`` (108 bytes on Linux, 104 elsewhere) less its NUL."""
DNS_NAME_MAX = 253
"""Characters in a DNS name (RFC 1035), without the trailing dot."""
PORT_MAX = 65535

_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_DIGITS = re.compile(r"[0-9]{1,5}")


def _host_problem(host: str) -> str | None:
    """Why ``host`` cannot be dialled (None if it can): an IP literal or a DNS name."""
    if not host:
        return "the host is empty"
    if host.startswith("[") or host.endswith("]"):
        if not (host.startswith("[") and host.endswith("]")):
            return f"unbalanced brackets in host {host!r}"
        literal = host[1:-1]
        if "%" in literal:
            return f"scoped IPv6 address {host!r} is not supported"
        try:
            ipaddress.IPv6Address(literal)
        except ValueError:
            return f"{host!r} is not an IPv6 address"
        return None
    if ":" in host:
        return f"an IPv6 address must be in brackets, as in tcp://[{host}]:port"
    labels = host.removesuffix(".").split(".")
    if all(label.isdigit() for label in labels):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"{host!r} is not an IPv4 address"
        return None
    if len(host.removesuffix(".")) > DNS_NAME_MAX:
        return f"the host name has more than {DNS_NAME_MAX} characters"
    for label in labels:
        if not _LABEL.fullmatch(label):
            return f"{host!r} is not a host name (labels of 1-63 letters, digits or inner hyphens)"
    if labels[-1].isdigit():
        return f"{host!r} is not a host name (its last label is numeric)"
    return None


def endpoint_problem(endpoint: object) -> str | None:
    """Why a node cannot dial ``endpoint``, or None when it can.

    Accepted: ``tcp://HOST:PORT`` with HOST an IPv4 literal, a bracketed IPv6 literal or a
    syntactically valid DNS name (not resolved here) and PORT a decimal 1-65535; and
    ``ipc://PATH`` with a non-empty PATH of at most ``IPC_PATH_MAX`` bytes (``@name``
    for Linux's abstract namespace). Nothing else: no other transport, no wildcard, no
    whitespace or control characters anywhere.
    """
    if not isinstance(endpoint, str):
        return f"an endpoint is a str, got {type(endpoint).__name__}"
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in endpoint):
        return "the endpoint contains whitespace or control characters"
    transport, sep, address = endpoint.partition("://")
    if not sep:
        return f"expected tcp://host:port or ipc://path, got {endpoint!r}"
    if transport == "tcp":
        host, colon, port = address.rpartition(":")
        if not colon:
            return f"expected tcp://host:port, got {endpoint!r}"
        if not _DIGITS.fullmatch(port) or not 1 <= int(port) <= PORT_MAX:
            return f"the port must be a number from 1 to {PORT_MAX}, got {port!r}"
        if host == "*":
            return "a wildcard host can be bound, not dialled"
        if ";" in host:
            return "a source address (iface;host) is not supported"
        return _host_problem(host)
    if transport == "ipc":
        if not address:
            return "the ipc path is empty"
        if address == "*":
            return "a wildcard ipc path can be bound, not dialled"
        size = len(address.encode("utf-8", "surrogatepass"))
        if size > IPC_PATH_MAX:
            return f"the ipc path has {size} bytes, more than the {IPC_PATH_MAX} a socket address holds"
        return None
    if transport == "inproc":
        return "inproc endpoints live inside one process: a node never dials them"
    return f"transport {transport!r} is not one a node dials (tcp or ipc)"


def canonical_endpoint(endpoint: object) -> str:
    """One spelling per dialable endpoint, for comparing endpoints (an allow-list against what
    a request names); raises ``ValueError`` with ``endpoint_problem``'s reason when it is not one.

    ``tcp``: the host lower-cased without a trailing dot, an IP literal in its standard form
    (IPv6 compressed, in brackets), the port without leading zeros. ``ipc``: the path with
    repeated slashes and ``.``/``..`` components folded (an abstract ``@name`` as it is).
    Purely syntactic like the check: two spellings of one address through a symlink or a
    DNS alias stay distinct, so compare the canonical forms and dial the spelling that was
    allowed, never the one that was asked for.
    """
    problem = endpoint_problem(endpoint)
    if problem is not None:
        raise ValueError(problem)
    assert isinstance(endpoint, str)
    transport, _, address = endpoint.partition("://")
    if transport == "tcp":
        host, _, port = address.rpartition(":")
        if host.startswith("["):
            host = f"[{ipaddress.IPv6Address(host[1:-1]).compressed}]"
        else:
            host = host.removesuffix(".").lower()
            if all(label.isdigit() for label in host.split(".")):
                host = str(ipaddress.IPv4Address(host))
        return f"tcp://{host}:{int(port)}"
    if address.startswith("@"):
        return endpoint
    path = posixpath.normpath(address)
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    return f"ipc://{path}"
