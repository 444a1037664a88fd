"""``Client`` (blocking) and ``AsyncClient`` (asyncio) over one ``ClientCore``.

Both are ``Operations`` (operations.py: every request; sender.py: its handle and results); what is
here opens the session and waits for what blocks or is awaited: the welcome, a region's
registration and withdrawal (regions.py), the close. Arguments are checked before
anything is sent (checks.py, spans.py): ``ArgumentError`` names the field.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from kvcr_client import checks
from kvcr_client.client_state import DEFAULT_MAX_COMPLETED
from kvcr_client.errors import ArgumentError, KvcrError, NodeLostError
from kvcr_client.operations import Operations
from kvcr_client.regions import RegionHandle
from kvcr_client.requests import CONTROL_TIMEOUT_S
from kvcr_client.spans import Destination, Span
from kvcr_protocol import CURRENT_VERSION, DEFAULT_LIMITS, Welcome, supported_up_to

CONNECT_TIMEOUT_S = 10.0
"""The default wait for the node's welcome."""
LOCAL_CALL_TIMEOUT_S = 30.0
"""How long registering or deregistering a buffer with our own NIXL agent may take."""
ANNOUNCE_TIMEOUT_S = 15.0
"""How long ``register`` waits for the node to accept the new region."""


@dataclass(frozen=True)
class CurveKeys:
    """CurveZMQ keys (z85 text, 40 characters) for a node that requires authentication."""

    server_public: str | bytes
    """The node's public key."""
    public: str | bytes
    secret: str | bytes


def _open(
    client: Operations, endpoint: str, name: str | None, max_version: int, curve: CurveKeys | None, max_completed: int,
) -> None:
    """Check the session's arguments, then set ``client`` up on a new core (nothing is sent yet)."""
    checks.text(endpoint, "endpoint", DEFAULT_LIMITS.max_text, empty=False)
    max_completed = checks.uint(max_completed, "max_completed", 1 << 31, minimum=1)
    if name is not None:
        checks.text(name, "name", DEFAULT_LIMITS.max_name)
    if max_version not in supported_up_to(CURRENT_VERSION):
        raise ArgumentError("max_version", f"{max_version!r} is not one of {list(supported_up_to(CURRENT_VERSION))}")
    keys = None
    if curve is not None:
        keys = (checks.z85(curve.server_public, "curve.server_public"), checks.z85(curve.public, "curve.public"),
                checks.z85(curve.secret, "curve.secret"))
    Operations.__init__(client, client.core_class(endpoint, name, max_version, curve=keys), max_completed)


class Client(Operations):
    """The blocking client. ``with Client(endpoint) as c: ...``"""

    def __init__(
        self, endpoint: str, name: str | None = None, max_version: int = CURRENT_VERSION, timeout: float = CONNECT_TIMEOUT_S,
        curve: CurveKeys | None = None, max_completed: int = DEFAULT_MAX_COMPLETED,
    ) -> None:
        timeout = checks.timeout(timeout)
        _open(self, endpoint, name, max_version, curve, max_completed)
        try:
            self.core.wait(self._hello(timeout), timeout + 5)
        except BaseException:
            self.core.close()
            raise

    @classmethod
    def connect(
        cls, endpoint: str, name: str | None = None, max_version: int = CURRENT_VERSION, timeout: float = CONNECT_TIMEOUT_S,
        curve: CurveKeys | None = None, max_completed: int = DEFAULT_MAX_COMPLETED,
    ) -> Client:
        """Open a session with the node at ``endpoint`` (the same as the constructor)."""
        return cls(endpoint, name, max_version, timeout, curve, max_completed)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def register(self, buffer: Any) -> RegionHandle:
        """Register a numpy/CuPy/torch buffer with NIXL and announce it to the node."""
        regions = self._regions
        handle = regions.describe(buffer)
        self.core.call(lambda: regions.add_on_io(handle)).result(LOCAL_CALL_TIMEOUT_S)
        try:
            self.core.wait(regions.announce(handle, CONTROL_TIMEOUT_S)[1], ANNOUNCE_TIMEOUT_S)
        except BaseException:
            self.core.call(lambda: regions.remove_on_io(handle)).result(LOCAL_CALL_TIMEOUT_S)
            raise
        return handle

    def unregister(self, region: RegionHandle, timeout: float | None = None) -> None:
        """Stop using a buffer: the node forgets the region, then NIXL deregisters it.

        The node acknowledges only once nothing may write the region any more; after a
        ``DESTINATION_UNCERTAIN`` delivery into it, that is when the source confirms or is
        known gone. ``timeout`` (seconds; None: as long as that takes) bounds the wait: past
        it, ``OperationTimeout`` is raised and the region stays registered and announced.
        """
        regions = self._regions
        regions.check_unregister(region)
        checks.optional_timeout(timeout)
        op_id, fut = regions.withdraw(region)
        try:
            self.core.wait(fut, timeout)
        except FutureTimeout:
            regions.cancel_withdrawal(region, op_id, fut, timeout)
        self.core.call(lambda: regions.remove_on_io(region)).result(LOCAL_CALL_TIMEOUT_S)

    def reconnect(self, timeout: float = CONNECT_TIMEOUT_S) -> Welcome:
        """Open a new session (after node loss or restart), announcing every registered region."""
        timeout = checks.timeout(timeout)
        result: Welcome = self.core.wait(self._hello(timeout), timeout + 5)
        return result

    def start_reconnect(self, timeout: float = CONNECT_TIMEOUT_S) -> Future[Welcome]:
        """``reconnect`` without waiting: the hello (every registered region announced) is
        sent, and the returned future gets the welcome, or fails past ``timeout`` (the
        background thread reads the reply when nobody waits). For a caller that must not
        block (an engine's scheduler, ``kvcr_client.reconnect``)."""
        timeout = checks.timeout(timeout)
        return self._hello(timeout)

    def close(self) -> None:
        """Bye to the node, deregister every buffer, stop the I/O thread."""
        core = self.core
        if core.closed:
            return
        try:
            core.close()
        finally:
            self._regions.deregister_all()
            self._end_session()  # its leases and grants end with it


class AsyncClient(Operations):
    """The asyncio client. ``async with await AsyncClient.connect(endpoint) as c: ...``"""

    def __init__(
        self, endpoint: str, name: str | None = None, max_version: int = CURRENT_VERSION, curve: CurveKeys | None = None,
        max_completed: int = DEFAULT_MAX_COMPLETED,
    ) -> None:
        _open(self, endpoint, name, max_version, curve, max_completed)

    @classmethod
    async def connect(
        cls, endpoint: str, name: str | None = None, max_version: int = CURRENT_VERSION, timeout: float = CONNECT_TIMEOUT_S,
        curve: CurveKeys | None = None, max_completed: int = DEFAULT_MAX_COMPLETED,
    ) -> AsyncClient:
        timeout = checks.timeout(timeout)
        client = cls(endpoint, name, max_version, curve, max_completed)
        try:
            await client.core.wait_async(client._hello(timeout))
        except BaseException:
            await asyncio.to_thread(client.core.close)
            raise
        return client

    async def __aenter__(self) -> AsyncClient:
        if self.core.welcome is None:
            await self.core.wait_async(self._hello(CONNECT_TIMEOUT_S))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def register(self, buffer: Any) -> RegionHandle:
        regions = self._regions
        handle = regions.describe(buffer)
        await asyncio.wrap_future(self.core.call(lambda: regions.add_on_io(handle)))
        try:
            await self.core.wait_async(regions.announce(handle, CONTROL_TIMEOUT_S)[1])
        except BaseException:
            await asyncio.wrap_future(self.core.call(lambda: regions.remove_on_io(handle)))
            raise
        return handle

    async def unregister(self, region: RegionHandle, timeout: float | None = None) -> None:
        """As ``Client.unregister``: waits (up to ``timeout`` s) until the node releases the region."""
        regions = self._regions
        regions.check_unregister(region)
        checks.optional_timeout(timeout)
        op_id, fut = regions.withdraw(region)
        done, _ = await asyncio.wait({asyncio.wrap_future(fut)}, timeout=timeout)
        if done:
            done.pop().result()
        else:
            await asyncio.to_thread(regions.cancel_withdrawal, region, op_id, fut, timeout)
        await asyncio.wrap_future(self.core.call(lambda: regions.remove_on_io(region)))

    async def reconnect(self, timeout: float = CONNECT_TIMEOUT_S) -> Welcome:
        timeout = checks.timeout(timeout)
        result: Welcome = await self.core.wait_async(self._hello(timeout))
        return result

    async def close(self) -> None:
        await asyncio.to_thread(Client.close, self)  # type: ignore[arg-type]


__all__ = ["AsyncClient", "Client", "CurveKeys", "Destination", "KvcrError", "NodeLostError", "RegionHandle", "Span"]
