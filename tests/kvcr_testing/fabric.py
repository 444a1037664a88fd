"""Hosts as network namespaces on one switch, made and removed by the caller itself.

``fabric(tag, hosts, subnet)`` makes a namespace per host and one for the switch, which holds
a Linux bridge; each host has a veth pair whose other end is a port of the bridge, and so
has the switch's namespace itself. Host i has ``subnet.(i+1)``, the switch's namespace
``subnet.254``, so that a process there (a router, the engines' clients) reaches every host
over TCP, and the hosts reach each other. The names carry this process's id, so two processes do not collide; every
namespace (and with them the veth pairs and the bridge) is removed afterwards whatever
happens. Needs root and iproute2; ``FabricError`` says why when it cannot be made.

A process started in a namespace takes its UCX settings from ``ucx``: TCP only, on that
namespace's own interface (shared memory or CMA would still work between namespaces of one
host, and hide the network).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

NAME_PREFIX = "kvcf"
"""The start of every namespace and interface name this module makes (at most 15 bytes in all)."""
IP_TIMEOUT_S = 30.0


class FabricError(RuntimeError):
    """The fabric cannot be made here: not root, no ``ip``, or the kernel refused."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and done.returncode != 0:
        raise FabricError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


@dataclass(frozen=True)
class Host:
    """One host: its namespace, its interface there and its address."""

    index: int
    ns: str
    dev: str
    addr: str

    @property
    def prefix(self) -> list[str]:
        """What runs a command in the host's namespace."""
        return ["ip", "netns", "exec", self.ns]

    @property
    def ucx(self) -> dict[str, str]:
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.dev}


@dataclass(frozen=True)
class Fabric:
    """The hosts and the switch (the namespace with the bridge, itself a host of the subnet)."""

    hosts: tuple[Host, ...]
    switch: Host

    def as_json(self) -> dict[str, object]:
        """What a process told of the fabric needs (``router_driver.py --fabric``)."""
        return {"hosts": [vars(h) for h in self.hosts], "switch": vars(self.switch)}


def fabric_problem() -> str | None:
    """Why no fabric can be made here, or None."""
    if shutil.which("ip") is None:
        return "iproute2 (the ip command) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


@contextmanager
def fabric(tag: str, hosts: int, subnet: str) -> Iterator[Fabric]:
    """``hosts`` namespaces on one bridge in a switch namespace, addresses ``subnet.1``..,
    the bridge ``subnet.254`` (a /24 of the caller's own choosing, such as ``10.211.0``)."""
    if not 1 <= hosts <= 200:
        raise ValueError(f"fabric: 1..200 hosts, not {hosts}")
    problem = fabric_problem()
    if problem is not None:
        raise FabricError(problem)
    base = f"{NAME_PREFIX}{os.getpid() % 100000}{tag}"
    if len(base) + 4 > 15:
        raise ValueError(f"fabric: tag {tag!r} makes names longer than an interface name may be")
    switch = Host(-1, f"{base}s", f"{base}r", f"{subnet}.254")
    bridge = f"{base}br"
    made: list[str] = []

    def attach(host: Host, port: str) -> None:
        """A veth pair from the bridge (``port``) to ``host.dev``, in the host's namespace."""
        # Both ends are made in the switch's namespace (names need only be unique there),
        # then the host's end moves to its namespace (the switch's own stays).
        ip("-n", switch.ns, "link", "add", port, "type", "veth", "peer", "name", host.dev)
        if host.ns != switch.ns:
            ip("-n", switch.ns, "link", "set", host.dev, "netns", host.ns)
        ip("-n", switch.ns, "link", "set", port, "master", bridge)
        ip("-n", switch.ns, "link", "set", port, "up")
        ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", host.dev)
        for dev in ("lo", host.dev):
            ip("-n", host.ns, "link", "set", dev, "up")

    try:
        ip("netns", "add", switch.ns)
        made.append(switch.ns)
        ip("-n", switch.ns, "link", "add", bridge, "type", "bridge")
        ip("-n", switch.ns, "link", "set", bridge, "up")
        # The switch's namespace reaches the bridge through a veth pair of its own, as a host
        # does: UCX takes no bridge for a device.
        attach(switch, f"{base}q")
        made_hosts = []
        for i in range(hosts):
            host = Host(i, f"{base}h{i}", f"{base}h{i}", f"{subnet}.{i + 1}")
            ip("netns", "add", host.ns)
            made.append(host.ns)
            attach(host, f"{base}p{i}")
            made_hosts.append(host)
        yield Fabric(tuple(made_hosts), switch)
    finally:
        for ns in reversed(made):
            ip("netns", "del", ns, check=False)  # takes its interfaces, and so the veth pairs, along
