"""The buffers a client registered: each a region on the wire, and what still uses it.

``RegionTable`` owns the table of registered regions: it describes a buffer, registers it
with the client's NIXL agent and announces it to the node, counts the operations the node
may still run on each region, and withdraws a region again (``unregions``, which the node
acknowledges only once nothing may write there any more, spec section 5.2).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from kvcr_client import checks
from kvcr_client.buffers import BufferError, describe
from kvcr_client.core import ClientCore
from kvcr_client.errors import ArgumentError, NodeError, OperationTimeout
from kvcr_protocol import Abort, ErrorCode, Region, RegisterRegions, UnregisterRegions

CANCEL_UNREGISTER_S = 10.0
"""How long ``unregister`` waits for the node to answer the cancellation of a timed-out withdrawal."""


@dataclass(eq=False)
class RegionHandle:
    """A registered buffer: its region id on the wire and the memory behind it."""

    region: int
    kind: Any
    address: int
    length: int
    device: int
    buffer: Any = field(repr=False)
    registration: Any = field(repr=False, default=None)
    users: dict[int, str] = field(repr=False, default_factory=dict)
    """Operations the node may still run on this memory: op id -> kind (changed under the table's use lock)."""

    @property
    def in_use(self) -> int:
        """How many operations the node may still run on this memory (answered ones and timed-out ones)."""
        return len(self.users)

    def wire(self) -> Region:
        return Region(self.region, self.kind, self.device, self.address, self.length)


def describe_region(buffer: Any, region: int) -> RegionHandle:
    """The handle of ``buffer`` as region ``region``, before NIXL sees it; ``ArgumentError``
    naming ``buffer`` when it cannot be a region (not contiguous, read-only, ...)."""
    try:
        info = describe(buffer)
    except BufferError as exc:
        raise ArgumentError("buffer", str(exc).removeprefix("buffer: ")) from exc
    return RegionHandle(region, info.kind, info.address, info.length, info.device, buffer)


class RegionTable:
    """The regions a client registered, by region id, and the operations using each.

    ``by_id`` is changed on the core's I/O thread (``add_on_io``, ``remove_on_io``); the
    users of a region under ``use_lock``, a leaf lock taken with or without the core's
    I/O lock.
    """

    def __init__(self, core: ClientCore) -> None:
        self.core = core
        self.by_id: dict[int, RegionHandle] = {}
        self.use_lock = threading.Lock()
        self._next_region = 1
        self.lingering: dict[int, set[RegionHandle]] = {}
        """Planned delivers answered ``DESTINATION_UNCERTAIN`` -> their regions not yet unregistered (lock held)."""

    def __len__(self) -> int:
        return len(self.by_id)

    def wires(self) -> tuple[Region, ...]:
        """Every registered region as the wire announces it (one step: another thread may register meanwhile)."""
        return tuple(r.wire() for r in list(self.by_id.values()))

    def describe(self, buffer: Any) -> RegionHandle:
        """A handle for ``buffer`` under the next free region id."""
        handle = describe_region(buffer, self._next_region)
        self._next_region += 1
        return handle

    # -- register

    def add_on_io(self, handle: RegionHandle) -> RegionHandle:
        """Register ``handle``'s memory with our NIXL agent and enter it in the table (I/O thread)."""
        handle.registration = self.core.agent.register(handle.kind, handle.address, handle.length, handle.device)
        self.by_id[handle.region] = handle
        return handle

    def announce(self, handle: RegionHandle, timeout_s: float) -> tuple[int, Future[Any]]:
        """Send ``regions`` naming ``handle``, with our agent's metadata."""
        return self.core.request(
            lambda i: RegisterRegions(i, self.core.agent.metadata(), (handle.wire(),)), checks.ack, timeout_s
        )

    # -- use

    def hold(self, op_id: int, kind: str, regions: Iterable[RegionHandle]) -> None:
        """Operation ``op_id`` may run on ``regions`` until ``settle``: ``unregister`` refuses them."""
        with self.use_lock:
            for region in regions:
                region.users[op_id] = kind

    def settle(self, op_id: int, regions: Iterable[RegionHandle]) -> None:
        """The node can no longer touch ``regions`` for operation ``op_id``."""
        with self.use_lock:
            for region in regions:
                region.users.pop(op_id, None)

    def linger(self, op_id: int, regions: Iterable[RegionHandle]) -> None:
        """A source may still write (and notify) into ``regions`` after planned deliver
        ``op_id``: keep our agent progressed until they are unregistered (spec section 12)."""
        self.lingering[op_id] = set(regions)
        self.core.lingering.add(op_id)

    # -- unregister

    def check_unregister(self, region: Any) -> None:
        """``region`` is registered here and no operation the node may still run uses it."""
        if not isinstance(region, RegionHandle) or self.by_id.get(region.region) is not region:
            raise ArgumentError("region", "not a region registered with this client")
        with self.use_lock:
            users = sorted(region.users.items())
        if users:
            late = self.core.timed_out_ids()
            ops = ", ".join(
                f"{kind} #{op_id}" + (" (timed out here, the node has not answered)" if op_id in late else "")
                for op_id, kind in users
            )
            raise ArgumentError("region", f"operations the node may still run on it: {ops}")

    def withdraw(self, region: RegionHandle) -> tuple[int, Future[Any]]:
        """Send ``unregions`` for ``region``; its ack may take as long as a source may still write there."""
        return self.core.request(lambda i: UnregisterRegions(i, (region.region,)), checks.ack, math.inf)

    def cancel_withdrawal(self, region: RegionHandle, op_id: int, fut: Future[Any], timeout: float | None) -> bool:
        """The ack did not come within ``timeout``: ask the node to keep the region (abort the
        ``unregions``). True if the ack came meanwhile after all; else raises, the region
        staying registered here and announced at the node (spec section 5.2)."""
        self.core.request(lambda i: Abort(i, op_id), lambda m: None, CANCEL_UNREGISTER_S)
        try:
            self.core.wait(fut, CANCEL_UNREGISTER_S)
        except NodeError as exc:
            if exc.code != ErrorCode.ABORTED:
                raise
        except FutureTimeout:
            pass
        else:
            return True
        raise OperationTimeout(
            f"region {region.region}: the node did not release it within {timeout} s (a source may still write "
            "into it after a DESTINATION_UNCERTAIN delivery); it stays registered and announced: call unregister again later"
        )

    def remove_on_io(self, region: RegionHandle) -> None:
        """Forget ``region`` and deregister its memory from our NIXL agent (I/O thread)."""
        for op_id, held in list(self.lingering.items()):
            held.discard(region)
            if not held:
                del self.lingering[op_id]
                self.core.lingering.discard(op_id)
        self.by_id.pop(region.region, None)
        if region.registration is not None:
            self.core.agent.deregister(region.registration)
            region.registration = None

    def deregister_all(self) -> None:
        """Deregister every region's memory and empty the table (the session is closed)."""
        for region in list(self.by_id.values()):
            if region.registration is not None:
                self.core.agent.deregister(region.registration)
                region.registration = None
        self.by_id.clear()
