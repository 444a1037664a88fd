"""The TCP sockets a process holds, from ``/proc`` (Linux): the socket inodes of its
descriptors joined with its network namespace's TCP tables (``net/tcp`` and ``net/tcp6``).
No ``ss`` needed, and a process in another namespace is read in its own."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address
from pathlib import Path

LISTEN = "0A"
"""The kernel's TCP state number for a listening socket, as the tables print it."""


@dataclass(frozen=True)
class TcpSocket:
    """One TCP socket of a process: its local address and port, and whether it listens."""

    address: IPv4Address | IPv6Address
    port: int
    listening: bool

    @property
    def loopback(self) -> bool:
        """Bound to 127.0.0.0/8 or ::1 (a wildcard address is not loopback)."""
        address = self.address
        if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return address.is_loopback

    def __str__(self) -> str:
        host = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        return f"{host}:{self.port}{' (listening)' if self.listening else ''}"


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets among ``pid``'s open descriptors."""
    inodes: set[int] = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:[") and target.endswith("]"):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def _address(hex_address: str) -> IPv4Address | IPv6Address:
    # The tables print the address 32 bits at a time, each word as a number in this machine's
    # byte order: packed back with "=I", the words give the address's bytes in network order.
    words = (int(hex_address[i : i + 8], 16) for i in range(0, len(hex_address), 8))
    return ip_address(b"".join(struct.pack("=I", word) for word in words))


def tcp_sockets(pid: int) -> list[TcpSocket]:
    """Every TCP socket (IPv4 and IPv6, any state) that process ``pid`` holds a descriptor of."""
    inodes = socket_inodes(pid)
    found: list[TcpSocket] = []
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue  # a kernel without IPv6
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if inode in inodes:
                address, port = local.split(":")
                found.append(TcpSocket(_address(address), int(port, 16), state == LISTEN))
    return found
