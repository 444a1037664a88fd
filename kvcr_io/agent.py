"""A thin wrapper over one NIXL agent, used by the client and the node alike.

The agent runs without NIXL's own progress thread: that thread spins a whole core while
idle (the Python bindings hard-code its delay to 0). Whoever owns an ``Agent`` progresses
it from its own loop (``progress``, ``state``), at a short interval only while a transfer
that touches its memory is in flight. One thread at a time drives an ``Agent``; NIXL
serializes the calls of its agent itself (``NIXL_THREAD_SYNC_STRICT``, one mutex per call,
uncontended), so that a remote agent's metadata can load in a thread of its own while
another thread posts (``add_remote`` lets go of the GIL for the milliseconds it takes).
"""

from __future__ import annotations

import enum
import importlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from kvcr_protocol import MemoryKind

Desc = tuple[int, int, int]
"""(address, length, device) of one transfer descriptor."""

DRAIN_POLL_S = 0.001
"""How often ``drain`` looks at the transfers it waits for."""

_NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")

FILE = "FILE"
"""The memory kind of a file registered with NIXL's POSIX backend (``Agent.register_file``):
a node's disk pools, moved to and from its own memory pools by transfers of its agent with
itself. Never on the wire: clients only ever name DRAM and VRAM."""

Kind = MemoryKind | str
"""A transfer side's memory kind: a ``MemoryKind``, or ``FILE``."""

_MEM: dict[Kind, str] = {MemoryKind.DRAM: "DRAM", MemoryKind.VRAM: "VRAM", FILE: "FILE"}


class XferStatus(enum.Enum):
    """A NIXL transfer request's state, translated from NIXL's strings once, here."""

    RUNNING = "PROC"
    DONE = "DONE"
    FAILED = "ERR"


def _status(state: str) -> XferStatus:
    try:
        return XferStatus(state)
    except ValueError:  # anything NIXL adds later that is not "running" or "done" is a failure
        return XferStatus.FAILED


def _entries(rows: Any, idx: Any) -> Any:
    """Rows ``idx`` of ``rows`` (an N x 3 array or a list of descriptors), in that order."""
    return rows[np.asarray(idx)] if isinstance(rows, np.ndarray) else [rows[i] for i in idx]


def _rows(descs: Any) -> Any:
    """Descriptors as NIXL takes them: a list of (address, length, device), or an N x 3 array as it is."""
    return descs if isinstance(descs, list) or hasattr(descs, "shape") else list(descs)


@dataclass(frozen=True, slots=True, eq=False)
class Listed:
    """A descriptor list NIXL took once (``Agent.listed``): whoever keeps a transfer's plan
    (a client's READs of one destination under one lease) posts it again as it is, without
    NIXL converting the same rows each time."""

    kind: Kind
    descs: Any
    rows: Any
    """The rows it was made of (an N x 3 array or a list of (address, length, device))."""


@dataclass(eq=False)
class PreparedLists:
    """Both sides of transfers between this agent and one remote agent (or its own files),
    each side one descriptor list prepared with NIXL once: a transfer names entries of the
    two lists by index, pairwise (``Agent.post_prepared``), and NIXL resolves no descriptor
    anew. The one mechanism of node and client alike: a node's planned deliver prepares the
    lists of all its groups at once and posts each group's entries (``kvcr_node.transfers``),
    and so does a client's plan of a deliver's READs under grants, once per remote agent and
    pair of memory kinds (``Agent.prepare``, ``Entries``, ``kvcr_client.prepared_reads``).
    Measured on the 2-core development machine: in a client's deliver, 25 us a request
    against 36 us made from the lists; in a bare probe while another thread computes, 8 us
    against 59 us (docs/performance.md).

    Lists are let go of with ``Agent.release_lists`` (the node, which accounts for them), or
    free themselves when the last holder lets go of them (NIXL's handles release in
    ``__del__``, keeping their agent alive till then), even after the remote agent was
    removed; a request made of them runs on after they are freed. NIXL refuses a post of
    them once the remote agent was removed or loaded anew: lists that keep their ``rows``
    are then posted from those, which NIXL resolves against the agent as it is now (the
    outcome of lists never prepared); without rows the post fails."""

    remote_agent: str
    local: Any
    """The local list (NIXL's prepared handle)."""
    remote: Any
    """The remote list, prepared for ``remote_agent``."""
    owns_local: bool = True
    """Whether the local list is these lists' own (a node's pool lists are shared: they stay)."""
    rows: tuple[Listed, Listed] | None = None
    """Both sides as listed rows, entry for entry (a post NIXL refuses is made from them)."""
    released: bool = False


@dataclass(frozen=True, slots=True, eq=False)
class Entries:
    """Entries of ``PreparedLists`` that go as one transfer, pairwise by index: what a plan
    keeps as both sides of a post (``Agent.start_listed`` takes it as its local side)."""

    lists: PreparedLists
    index: Any
    """The entries, in order (an int32 array), of the local and the remote list alike."""
    bytes: int


class TransferError(RuntimeError):
    """NIXL refused or failed a transfer."""


def load_nixl() -> ModuleType:
    """Import whichever NIXL build is installed (CUDA 12, CUDA 13, or the meta package)."""
    errors = []
    for name in _NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if hasattr(module, "nixl_agent"):
            return module
    raise ImportError("no NIXL Python package found (install nixl-cu12 or nixl-cu13): " + "; ".join(errors))


def _quiet_nixl_logging() -> None:
    # NIXL logs every agent and backend creation at INFO; keep that out of engine logs.
    if "NIXL_LOG_LEVEL" not in os.environ:
        logging.getLogger("nixl").setLevel(logging.WARNING)
        for name in _NIXL_MODULES:
            logging.getLogger(name).setLevel(logging.WARNING)


POSIX_URING: dict[str, str] = {"use_uring": "true"}
"""The POSIX backend's parameters where the kernel allows io_uring: a post hands the request to
the ring and returns (a few microseconds), where its default Linux AIO submits a buffered
write inside the post (the page cache copy on the caller's thread)."""


def create_posix_backend(agent: Any) -> str:
    """Create NIXL's POSIX backend on ``agent``: with io_uring, else its default (a kernel or a
    sandbox without io_uring); which one, ``"uring"`` or ``"aio"``."""
    try:
        agent.create_backend("POSIX", dict(POSIX_URING))
        return "uring"
    except Exception:
        pass
    try:
        agent.create_backend("POSIX")
    except Exception as exc:
        raise RuntimeError(f"the NIXL POSIX backend is not available (disk pools need it): {exc}") from exc
    return "aio"


class Agent:
    """One NIXL agent with UCX, no progress thread; with ``files``, NIXL's POSIX backend too."""

    def __init__(self, name: str, files: bool = False) -> None:
        nixl = load_nixl()
        _quiet_nixl_logging()
        config = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                        sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self._nixl: Any = nixl.nixl_agent(name, config)
        if "UCX" not in self._nixl.backends:
            raise RuntimeError("the NIXL UCX backend is not available")
        self.files_io: str | None = create_posix_backend(self._nixl) if files else None
        """How the POSIX backend moves file bytes, ``"uring"`` or ``"aio"``; None without ``files``."""
        self.name = name

    # -- memory and metadata

    def register(self, kind: MemoryKind, address: int, length: int, device: int) -> Any:
        """Register one region; returns the handle ``deregister`` takes."""
        return self._nixl.register_memory([(address, length, device, "")], _MEM[kind])

    def register_file(self, fd: int, length: int) -> Any:
        """Register the first ``length`` bytes of the open file ``fd`` (memory kind ``FILE``;
        the agent needs ``files``); its descriptors are (file offset, length, ``fd``)."""
        return self._nixl.register_memory([(0, length, fd, "")], "FILE")

    def deregister(self, handle: Any) -> None:
        self._nixl.deregister_memory(handle)

    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registered memory), for peers."""
        md: bytes = self._nixl.get_agent_metadata()
        return md

    def add_remote(self, metadata: bytes) -> str:
        """Load (or refresh) a remote agent's metadata; returns its name."""
        name = self._nixl.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> None:
        self._nixl.remove_remote_agent(name)

    def knows(self, name: str) -> bool:
        """Whether the remote agent ``name`` is loaded (its metadata added, not removed)."""
        return bool(self._nixl.check_remote_metadata(name))

    # -- transfers

    def prep_local(self, kind: MemoryKind, descs: Sequence[Desc]) -> Any:
        """Prepare a local descriptor list; transfers select entries by index."""
        return self._nixl.prep_xfer_dlist("NIXL_INIT_AGENT", list(descs), _MEM[kind])

    def prep_remote(self, agent: str, kind: Kind, descs: Sequence[Desc]) -> Any:
        """Prepare a remote descriptor list; NIXL checks it lies in the remote's registered memory."""
        try:
            return self._nixl.prep_xfer_dlist(agent, list(descs), _MEM[kind])
        except Exception as exc:
            raise TransferError(f"remote descriptors refused by NIXL: {exc}") from exc

    def release_dlist(self, handle: Any) -> None:
        self._nixl.release_dlist_handle(handle)

    def release_lists(self, lists: PreparedLists) -> None:
        """Let go of ``lists`` (its local list only if its own); once, whatever is posted of them may still run."""
        if lists.released:
            return
        lists.released = True
        self.release_dlist(lists.remote)
        if lists.owns_local:
            self.release_dlist(lists.local)

    def post_prepared(
        self, op: str, lists: PreparedLists, local_idx: Any, remote_idx: Any, notif: bytes = b"",
    ) -> tuple[Any, XferStatus]:
        """Create and post a transfer of entries ``local_idx`` and ``remote_idx`` of ``lists``,
        pairwise (lists or int32 arrays); returns its handle and status. ``notif``, when not
        empty, is delivered to the remote agent as a NIXL notification once the transfer's
        bytes are in place (spec section 6.10)."""
        nixl = self._nixl
        try:
            handle = nixl.make_prepped_xfer(op, lists.local, local_idx, lists.remote, remote_idx, notif)
        except Exception as exc:  # the remote agent was removed or loaded anew: from the rows, if kept
            if lists.rows is None:
                raise TransferError(f"NIXL could not create the {op}: {exc}") from exc
            handle = None
        if not handle:
            if lists.rows is None:
                raise TransferError(f"NIXL could not create the {op}")
            return self._from_rows(op, lists, local_idx, remote_idx, lists.remote_agent, notif)
        return handle, self._post(op, handle)

    def _from_rows(
        self, op: str, lists: PreparedLists, local_idx: Any, remote_idx: Any, remote_agent: str, notif: bytes,
    ) -> tuple[Any, XferStatus]:
        """A transfer of those entries made from the rows ``lists`` kept, as if never prepared."""
        assert lists.rows is not None
        local, remote = lists.rows
        return self.start_listed(op, local.kind, _entries(local.rows, local_idx), remote.kind,
                                 _entries(remote.rows, remote_idx), remote_agent, notif)

    def listed(self, kind: Kind, rows: Sequence[Desc] | Any) -> Listed | Any:
        """``rows`` as a descriptor list NIXL took (``start_listed`` posts it as it is), or
        the rows themselves where NIXL refuses them (the post then fails as it would have)."""
        try:
            return Listed(kind, self._nixl.get_xfer_descs(_rows(rows), _MEM[kind]), rows)
        except Exception:  # the post names the failure
            return rows

    def prepare(self, local_kind: Kind, local: Sequence[Desc] | Any, remote_kind: Kind, remote: Sequence[Desc] | Any,
                remote_agent: str) -> PreparedLists | None:
        """Both sides of transfers ``start_listed`` will post again and again, entry ``i`` of
        ``local`` with entry ``i`` of ``remote`` (``Entries``), prepared with NIXL once and
        keeping their rows; None where NIXL refuses them (their posts are made from the rows
        as they are, and name the failure)."""
        local_listed, remote_listed = self.listed(local_kind, local), self.listed(remote_kind, remote)
        if type(local_listed) is not Listed or type(remote_listed) is not Listed:
            return None
        if len(local_listed.rows) != len(remote_listed.rows):  # not pairs by index: the post names the failure
            return None
        nixl = self._nixl
        try:
            local_prepped = nixl.prep_xfer_dlist("NIXL_INIT_AGENT", local_listed.descs)
            remote_prepped = nixl.prep_xfer_dlist(remote_agent, remote_listed.descs)
        except Exception:  # the rows are posted as they are
            return None
        return PreparedLists(remote_agent, local_prepped, remote_prepped, rows=(local_listed, remote_listed))

    def start_listed(
        self, op: str, local_kind: Kind, local: Sequence[Desc] | Any, remote_kind: Kind,
        remote: Sequence[Desc] | Any, remote_agent: str, notif: bytes = b"",
    ) -> tuple[Any, XferStatus]:
        """Create and post a transfer between descriptor lists made for it (a client's READ
        under a grant names slots it learnt a moment ago); each a sequence of (address,
        length, device), an N x 3 ``uint64`` array, or a ``Listed``. ``remote_agent`` may be
        this agent's own ``name``: a move between its own memory and its files (``FILE``:
        rows of (offset, length, fd)) through the POSIX backend. ``Entries`` given as the
        local side name both sides: posted by index (``post_prepared``)."""
        nixl = self._nixl
        if type(local) is Entries:
            entries, lists = local, local.lists
            if lists.remote_agent == remote_agent:
                return self.post_prepared(op, lists, entries.index, entries.index, notif)
            return self._from_rows(op, lists, entries.index, entries.index, remote_agent, notif)
        try:
            local_descs = local.descs if type(local) is Listed else nixl.get_xfer_descs(_rows(local), _MEM[local_kind])
            remote_descs = (remote.descs if type(remote) is Listed
                            else nixl.get_xfer_descs(_rows(remote), _MEM[remote_kind]))
            handle = self._nixl.initialize_xfer(op, local_descs, remote_descs, remote_agent, notif)
        except Exception as exc:
            raise TransferError(f"NIXL could not create the {op}: {exc}") from exc
        if not handle:
            raise TransferError(f"NIXL could not create the {op}")
        return handle, self._post(op, handle)

    def _post(self, op: str, handle: Any) -> XferStatus:
        """Post a created transfer; a request NIXL refuses to post is released here."""
        try:
            state: str = self._nixl.transfer(handle)
        except Exception as exc:
            self.release(handle)
            raise TransferError(f"NIXL could not post the {op}: {exc}") from exc
        return _status(state)

    def drain(self, handles: Sequence[Any], timeout_s: float) -> list[XferStatus]:
        """Wait, polling, at most ``timeout_s`` for the transfers ``handles`` to end (a closing
        owner lets go of their memory only then); each one's state as last seen (RUNNING:
        still running at the bound)."""
        states = [self.state(h) for h in handles]
        end = time.monotonic() + timeout_s
        while XferStatus.RUNNING in states and time.monotonic() < end:
            time.sleep(DRAIN_POLL_S)
            states = [self.state(h) if s is XferStatus.RUNNING else s for h, s in zip(handles, states, strict=True)]
        return states

    def state(self, handle: Any) -> XferStatus:
        """The request's status; polling it also progresses the agent."""
        try:
            state: str = self._nixl.check_xfer_state(handle)
        except Exception:
            return XferStatus.FAILED
        return _status(state)

    def release(self, handle: Any) -> None:
        try:
            self._nixl.release_xfer_handle(handle)
        except Exception:  # releasing a failed request may itself fail; nothing more to free
            logging.getLogger(__name__).debug("release of a NIXL request failed", exc_info=True)

    def progress(self) -> list[bytes]:
        """Progress the agent (the target side of a transfer needs it too); returns the
        notifications that arrived meanwhile, from any remote agent, in arrival order per agent."""
        notifs: dict[Any, list[bytes]] = self._nixl.get_new_notifs()
        if not notifs:
            return []
        return [payload for payloads in notifs.values() for payload in payloads]

    def notify(self, remote_agent: str, payload: bytes) -> None:
        """Send ``payload`` to a loaded remote agent as a NIXL notification of its own."""
        try:
            self._nixl.send_notif(remote_agent, payload)
        except Exception as exc:
            raise TransferError(f"NIXL could not send a notification to {remote_agent}: {exc}") from exc
