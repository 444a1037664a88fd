"""Reads under read grants (spec section 6.12): the client moves leased bytes itself.

A version-5 ``lease`` asks for a read grant; the node answers with the pool and slot of
every span it holds, and once per session with its agent and pool registrations, which
``Grants`` loads into the client's own agent off the turns (``kvcr_client.agent_loads``:
the lease resolves, and a put WRITEs, once the agent is loaded). A ``deliver`` whose keys are all granted
then posts NIXL READs from the node's pools into the client's registered memory, one
transfer per group of its plan (and per pair of memory kinds), and learns completion from
its own agent: no control message. ``Grants`` owns the granted slots and the node's agent,
and plans the descriptors; ``kvcr_client.reads`` runs the READs group by group in the
core's turns.

A read is valid only if its lease held for the whole read (a slot of an ended lease may
hold another object's bytes). ``Grants`` checks, once the READs completed, that the lease
has not ended in the client's view and that the time is still inside the lease's granted
time to live and the node's grace period, minus a margin; else it confirms with a
``renew`` whose reply must say the lease held without a break. A key that fails fails
``LEASE_EXPIRED`` or ``LEASE_LOST``: its bytes are never reported as the key's.

A key the lease holds at a source may come with the source's grant, passed on by the node
(section 6.12, "Across nodes"): ``Grants`` loads each source's agent once per session and
incarnation, READs those keys from the source directly, and bounds their validity by the
source's grace period too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvcr_client.agent_loads import AgentLoads
from kvcr_client.core import ClientCore
from kvcr_client.counters import Count, Counters
from kvcr_client.digest_checks import on_worker
from kvcr_client.leases import LeaseHandle
from kvcr_client.posted import Gate
from kvcr_client.prepared_reads import PreparedReads
from kvcr_client.readplans import LocalColumns, remote_spans
from kvcr_client.reads import Finished, GrantRead
from kvcr_client.regions import RegionHandle
from kvcr_client.results import when_all
from kvcr_client.session_scope import PRUNE_SLACK, GrantedKey, NodeAgent, NodePool, SessionScope
from kvcr_client.uncertain import Hold
from kvcr_protocol import (
    DEFAULT_LIMITS,
    Completion,
    DeliverItem,
    ErrorCode,
    GrantNode,
    GrantSource,
    GroupEvent,
    GroupLedger,
    KeyResult,
    KeyStatus,
    LeaseGrant,
    LeaseReply,
    Message,
    RenewLease,
    Suspect,
)

MARGIN_S = 0.05
"""The fixed part of the safety margin a read's lease must still have left (spec section 6.12)."""
MARGIN_FRACTION = 1 / 8
"""... and the part in proportion to the shorter of the time to live and the grace period:
clocks of two hosts drift, and the node's turn that ends a lease is not instant."""
CONFIRM_TIMEOUT_S = 10.0
"""How long a confirmation (``renew``) is waited for; no answer fails the keys ``LEASE_LOST``."""
DEFAULT_READ_S = 30.0
"""How long READs of a deliver with deadline 0 may take."""
MAX_SOURCES = 256
"""Sources' agents one session keeps loaded at most (one per endpoint); past it the longest
unused goes, and a lease of its keys loads it again."""



@dataclass(frozen=True)
class GrantedView:
    """One key this client READs itself, under a live lease's read grant (``Client.grants``)."""

    lease: int
    """The lease's id."""
    agent: str
    """The remote agent its READs name: the node's, or a source's (a grant passed on)."""
    spans: int
    """Its stored spans."""
    digests: bool
    """Whether the grant carried digests that its spans are checked against."""


@dataclass(frozen=True)
class GrantsView:
    """What this client may READ itself in its current session (``Client.grants``)."""

    node_agent: str | None
    """The node's NIXL agent as loaded into ours for this session (None: not loaded)."""
    stale_agents: int
    """Agents of ended sessions still loaded (each goes once no READ runs on it)."""
    sources: tuple[str, ...]
    """Endpoints of the sources whose agents are loaded for this session."""
    keys: dict[bytes, GrantedView]
    """The keys under live leases' grants."""


class Grants:
    """The granted slots of this session's leases, the node's agent, and the READs of a deliver."""

    def __init__(self, core: ClientCore, counters: Counters, scope: Callable[[], SessionScope],
                 hold: Hold | None = None) -> None:
        self.core = core
        self.hold = hold
        """Holds the destination of a READ past its deadline until it ends (``kvcr_client.uncertain``)."""
        self.counters = counters
        self.scope = scope
        """The current session's scope: the granted keys and loaded agents live there."""
        self._stale: set[str] = set()
        """Node agents of ended sessions, still loaded in ours: removed once no READ runs on
        them, unless the next session's grant loads the same agent again (a reconnect)."""
        self.columns = LocalColumns()
        """Prepared destinations' spans as arrays, for planning many spans at once."""
        self.prepared = PreparedReads(self.columns, core.agent.prepare)
        """The READs of recent delivers, planned once per destination, grants and plan."""
        self.gate: Gate | None = None
        """Made into each deliver's ``GrantRead`` (``kvcr_client.posted.Gate``; tests only)."""
        self.loads = AgentLoads(core.agent.add_remote, lambda fn: core.call(fn, closed=True), lambda: core.wake())
        """Loads the node's and sources' agents off the turns."""

    # ------------------------------------------------------------------ what is granted

    def view(self) -> GrantsView:
        """What the current session may READ itself, as plain values (lock held)."""
        scope = self.scope()
        keys = {key: GrantedView(g.lease.id, g.peer, len(g.names), bool(g.digests))
                for key, g in scope.granted.items() if g.lease.ended is None and not g.lease.lost_key(key)}
        return GrantsView(None if scope.node is None else scope.node.name, len(self._stale),
                          tuple(sorted(endpoint for endpoint, _ in scope.sources)), keys)

    def wants_node(self) -> bool:
        """Whether a ``lease`` should ask for the node's agent (``!node_md``): not yet loaded
        (nor loading) for this session."""
        scope = self.scope()
        return scope.node is None and scope.node_loading is None

    def add(self, scope: SessionScope, lease: LeaseHandle, keys: Sequence[bytes],
            grant: LeaseGrant) -> Future[frozenset[bytes]]:
        """A ``lease_reply`` of the session ``scope`` carried ``grant`` for ``lease`` (its keys
        in request order); resolves to the keys this client may now READ itself (none when
        that session is over). At once when the agents the grant names are loaded; else once
        the loader thread loaded them (lock held then too): the turn that read the reply
        never waits for NIXL."""
        out: Future[frozenset[bytes]] = Future()
        waits: list[Future[None]] = []
        if scope is self.scope():
            if grant.node is not None and scope.node is None:
                waits.append(self.load(scope, grant.node))
            waits.extend(w for w in (self._load_source(scope, s) for s in grant.sources) if w is not None)

        def granted() -> None:
            try:
                out.set_result(self._granted(scope, lease, keys, grant))
            except Exception as exc:  # never leave the lease's caller waiting
                out.set_exception(exc)

        when_all(waits, granted)  # the last load resolves in the loader thread, lock held
        return out

    def _granted(self, scope: SessionScope, lease: LeaseHandle, keys: Sequence[bytes],
                 grant: LeaseGrant) -> frozenset[bytes]:
        """``add`` once the agents are loaded (lock held)."""
        if scope is not self.scope():
            return frozenset()
        node = scope.node
        if node is None:
            return frozenset()  # no agent to read with: the keys travel by deliver
        sources = [self._source(scope, source) for source in grant.sources]
        added = set()
        at = 0
        for i, names, pools, slots in grant.keys(DEFAULT_LIMITS):
            index = grant.source[i] if grant.source else 0
            agent = sources[index - 1] if index else node
            digests = grant.digest[8 * at:8 * (at + len(names))]
            at += len(names)
            if agent is not None and max(pools, default=0) < len(agent.pools):
                scope.granted[keys[i]] = GrantedKey(lease, names, pools, tuple(slots), agent,
                                                    remote_spans(agent.pools, pools, slots), digests)
                added.add(keys[i])
        if len(scope.granted) > scope.sweep_at:
            # Keys of ended leases go in one sweep once the table doubled since the last, so
            # a sweep costs O(1) per key added, however many keys live leases grant.
            scope.granted = {k: g for k, g in scope.granted.items() if g.lease.ended is None}
            scope.sweep_at = 2 * len(scope.granted) + PRUNE_SLACK
        return frozenset(added)

    def load(self, scope: SessionScope, node: GrantNode) -> Future[None]:
        """Load the node's agent into ours for ``scope`` (its pools must be the session's
        pools) in the loader thread; resolves, lock held, once ``scope.node`` is set (or
        stays None: the grant does not fit, NIXL refused it, or the session is over)."""
        if scope.node_loading is not None:
            return scope.node_loading
        done: Future[None] = Future()
        if scope.node is not None:
            done.set_result(None)
            return done
        welcome = self.core.welcome
        if welcome is None or len(node.pools) != len(welcome.pools):
            done.set_result(None)
            return done
        pools = []
        for i, (region, info) in enumerate(zip(node.pools, welcome.pools, strict=True)):
            if region.region != i or info.slot_size * info.slot_count > region.length:
                done.set_result(None)
                return done
            pools.append(NodePool(region.kind, region.device, region.address, info.slot_size))
        grace = node.grace_ms / 1000 if node.grace_ms else math.inf
        scope.node_loading = done

        def loaded(name: str | None) -> None:
            # Not kept once resolved (a future keeps its callbacks, and they name leases):
            # with no node set after all, a later grant tries again.
            scope.node_loading = None
            if name is not None and self._keep(scope, name):
                scope.node = NodeAgent(name, tuple(pools), grace)
            done.set_result(None)

        self.loads.load(node.agent_md, loaded)
        return done

    def _keep(self, scope: SessionScope, name: str) -> bool:
        """An agent loaded for ``scope`` (lock held): kept when that session is still the
        current one, else it goes with the other agents of ended sessions. The agents of
        ended sessions go now, but this one (the same node again keeps its connection)."""
        current = scope is self.scope()
        if current:
            self._stale.discard(name)
        else:
            self._stale.add(name)
        self.drop_stale()
        return current

    def drop(self, lease: LeaseHandle) -> None:
        """``lease`` ended: its grants go now (they name the lease, which names the client)."""
        keys = self.scope().granted
        for key in lease.keys:
            granted = keys.get(key)
            if granted is not None and granted.lease is lease:
                del keys[key]

    def drop_stale(self) -> None:
        """Remove the node agents of ended sessions that no READ runs on any more (lock held)."""
        if not self._stale:
            return
        running = self.core.reads.remotes()
        for name in self._stale - running:
            self._stale.discard(name)
            try:
                self.core.agent.remove_remote(name)
            except Exception:  # already gone (NIXL refused): nothing more to free
                continue

    def _load_source(self, scope: SessionScope, source: GrantSource) -> Future[None] | None:
        """A source's agent is loading for ``scope``: what to wait for; None when it is
        loaded already, or cannot be (its rows travel by deliver)."""
        name = (source.endpoint, source.incarnation)
        if name in scope.sources:
            return None
        loading = scope.sources_loading.get(name)
        if loading is not None:
            return loading
        if len(scope.sources_loading) >= MAX_SOURCES:
            return None  # a node naming sources faster than they load: those rows go by deliver
        md = source.node
        sizes = md.slot_sizes() if md is not None else []
        if md is None or len(sizes) != len(md.pools) or any(r.region != i for i, r in enumerate(md.pools)):
            return None
        if any(size <= 0 for size in sizes):
            return None
        pools = tuple(NodePool(r.kind, r.device, r.address, size) for r, size in zip(md.pools, sizes, strict=True))
        grace = md.grace_ms / 1000 if md.grace_ms else math.inf
        done = scope.sources_loading[name] = Future()

        def loaded(agent: str | None) -> None:
            del scope.sources_loading[name]
            if agent is not None and scope is self.scope():
                sources = scope.sources
                # One agent per source endpoint: an older incarnation's (the source restarted;
                # its leases ended with it) goes, and past MAX_SOURCES the longest unused;
                # each is removed from ours once no READ runs on it.
                for old in [k for k in sources if k[0] == source.endpoint]:
                    self._stale.add(sources.pop(old).name)
                while len(sources) >= MAX_SOURCES:
                    self._stale.add(sources.pop(next(iter(sources))).name)
                if self._keep(scope, agent):
                    # The node's agent loads first (one loader, in order): its grace bounds too.
                    node_grace = scope.node.grace_s if scope.node is not None else math.inf
                    sources[name] = NodeAgent(agent, pools, min(grace, node_grace))
            elif agent is not None:
                self._keep(scope, agent)
            done.set_result(None)

        self.loads.load(md.agent_md, loaded)
        return done

    @staticmethod
    def _source(scope: SessionScope, source: GrantSource) -> NodeAgent | None:
        """A source's agent as loaded into ours; None when it is not (its rows travel by deliver)."""
        name = (source.endpoint, source.incarnation)
        sources = scope.sources
        cached = sources.get(name)
        if cached is not None:
            sources[name] = sources.pop(name)  # the most recently used goes last
        return cached

    def retire(self, scope: SessionScope) -> None:
        """The session ``scope`` is over (a new hello, or the client closes): its grants went
        with it. Its node agent stays loaded until the next grant loads the node's agent:
        the same one (a reconnect to the same node keeps its connection; removing the agent
        of a live process would leave it open), or another, and then it goes once no READ
        runs on it."""
        self.prepared.clear()  # plans of its grants (which name its leases, which name the client)
        if scope.node is not None:
            self._stale.add(scope.node.name)
        self._stale.update(source.name for source in scope.sources.values())

    @property
    def stale(self) -> int:
        """Node agents of ended sessions still loaded (the node's and its sources')."""
        return len(self._stale)

    def cover(self, items: Sequence[DeliverItem]) -> list[GrantedKey] | None:
        """The grants of every key of a deliver, or None when one key has none (or its lease
        ended): such a deliver goes to the node."""
        scope = self.scope()
        if scope.node is None or not items:
            return None
        keys = scope.granted
        out = []
        for item in items:
            granted = keys.get(item.key)
            if granted is None or granted.lease.ended is not None or granted.lease.lost_key(item.key):
                return None
            out.append(granted)
        return out

    def __len__(self) -> int:
        return len(self.scope().granted)

    # ------------------------------------------------------------------ reading

    def deliver(
        self, items: Sequence[DeliverItem], granted: Sequence[GrantedKey], groups: Sequence[tuple[int, ...]] | None,
        regions: Mapping[int, RegionHandle], deadline_ms: int, ledger: GroupLedger | None,
        report: Callable[[list[GroupEvent]], None] | None, finished: Finished, quiet: Callable[[], None],
    ) -> None:
        """READ ``items`` under their grants: post group 0 here, then leave the rest to the
        core's turns (``GrantRead``), and return at once.

        ``ledger`` is the handle's (None: a whole deliver, nobody waits for groups): the READs
        move it, and ``report`` takes what moved each turn, groups delivered (landed, their
        lease held, their digests matched) or failed; ``finished`` gives per item its result
        and groups delivered in a row (or the error); ``quiet`` says no READ runs any more
        (the destination's regions may go). All three run with the I/O lock held.
        """
        self.counters.inc(Count.GRANT_READS)
        deadline = time.monotonic() + (deadline_ms / 1000 if deadline_ms else DEFAULT_READ_S)
        # Worked out once per destination, grants and plan (kvcr_client.prepared_reads): a
        # repeat posts group 0 with nothing to plan.
        plan = self.prepared.plan(items, granted, groups, regions)
        if plan.in_parts:  # read and checked in parts, it still ends as one group
            ledger, report, finished = None, None, _as_whole(finished)
        if plan.unchecked:
            self.counters.inc(Count.SPANS_UNCHECKED, plan.unchecked)
        core = self.core
        job = GrantRead(self, core.agent, items, granted, plan.counts, plan.posts, list(plan.codes), deadline, report,
                        finished, quiet, checks=plan.checks, ahead=on_worker if plan.in_parts else None, gate=self.gate,
                        ledger=ledger, hold=self.hold)
        # Group 0 is posted, polled and reported in one turn of the lock: the caller may
        # wait on it the moment this returns.
        try:
            running = core.locked(lambda: core.reads.start(job))
        except BaseException:  # closed meanwhile: group 0's READ, if posted, is let go of here
            core.call(job.close, closed=True)
            raise
        if running:
            # Later groups to post, or READs to poll: whoever reads paces them. A deliver
            # that ended in its first turn (a whole one whose copy ran inside the post)
            # wakes nobody: a second thread woken costs the caller a GIL hand-off.
            core.pace()

    # ------------------------------------------------------------------ validity

    def mismatch(self, granted: GrantedKey, key: bytes) -> None:
        """``key``'s bytes, read under ``granted``, did not match their digests (lock held):
        counted, and reported to the node (spec section 6.12), which reads the object itself
        and drops it if it changed, or, for a source's slots, passes the report on to that
        source. Nothing waits for the answer."""
        self.counters.inc(Count.DIGEST_MISMATCHES)
        scope = self.scope()
        if scope.reports_refused:
            return

        def convert(msg: Message) -> bool:
            if not isinstance(msg, Completion) or len(msg.results) != 1:
                raise ValueError(f"expected complete with one result, got {msg.TAG}")
            return msg.results[0].code == ErrorCode.DIGEST_MISMATCH

        def replied(future: Future[Any]) -> None:
            error = future.exception()
            if error is None:
                if future.result():
                    self.counters.inc(Count.SUSPECTS_DROPPED)
            elif getattr(error, "code", None) == ErrorCode.UNKNOWN_TYPE:
                scope.reports_refused = True

        self.counters.inc(Count.SUSPECTS_REPORTED)
        _, future = self.core.request(lambda i: Suspect(i, (key,)), convert, CONFIRM_TIMEOUT_S)
        future.add_done_callback(replied)

    def check(
        self, items: Sequence[DeliverItem], granted: Sequence[GrantedKey], members: list[int], now: float,
    ) -> dict[int, int | None]:
        """Per member: 0 when its lease held through ``now``, a code when it may not have,
        None when only a confirmation (``confirm``) could tell. One check per lease."""
        by_lease: dict[tuple[int, float], int | None] = {}
        out: dict[int, int | None] = {}
        for k in members:
            lease, grace = granted[k].lease, granted[k].agent.grace_s
            if (id(lease), grace) in by_lease:
                verdict = by_lease[id(lease), grace]
            else:
                verdict = by_lease[id(lease), grace] = self._held(lease, now, grace)
            out[k] = ErrorCode.LEASE_LOST if verdict == 0 and lease.lost_key(items[k].key) else verdict
        return out

    def _held(self, lease: LeaseHandle, now: float, grace: float) -> int | None:
        """Whether ``lease`` held through ``now`` (spec section 6.12), its reads' validity
        bounded by ``grace`` too: 0, or the code its keys fail with; None when only a
        ``renew`` could tell."""
        ended = lease.ended
        if ended is not None:
            return ErrorCode.LEASE_EXPIRED if ended == ErrorCode.LEASE_EXPIRED else ErrorCode.LEASE_LOST
        ttl_s = lease.ttl_ms / 1000
        asked = lease.expires_at - ttl_s
        span = min(ttl_s, grace)
        if now < asked + span - (MARGIN_S + span * MARGIN_FRACTION):
            return 0
        return None


    def confirm(self, lease: LeaseHandle, now: float, then: Callable[[int], None]) -> None:
        """Ask the node whether ``lease`` held without a break (a ``renew``, spec section 6.12);
        ``then`` gets 0 or the code its keys fail with once the reply (or its failure) is in,
        lock held. Nothing waits here: whoever takes the core's turns reads the reply."""
        self.counters.inc(Count.GRANT_CONFIRMS)
        expired_by = lease.expires_at
        asked_at = time.monotonic()

        def convert(msg: Message) -> bool:
            if not isinstance(msg, LeaseReply) or msg.lease != lease.id:
                raise ValueError(f"expected lease_reply for lease {lease.id}, got {msg.TAG}")
            if msg.held:
                lease.renewed(msg.ttl_ms, asked_at)
            return msg.held

        def replied(future: Future[Any]) -> None:
            held = future.exception() is None and bool(future.result())
            if held and lease.ended is None:
                then(0)
            else:
                then(ErrorCode.LEASE_EXPIRED if now >= expired_by else ErrorCode.LEASE_LOST)

        _, future = self.core.request(lambda i: RenewLease(i, lease.id, 0), convert, CONFIRM_TIMEOUT_S)
        future.add_done_callback(replied)


def _as_whole(finished: Finished) -> Finished:
    """A whole deliver read in parts ends as one group: done when every part landed."""
    def whole(results: list[KeyResult] | BaseException, done: list[int]) -> None:
        if isinstance(results, BaseException):
            finished(results, done)
            return
        finished(results, [int(r.status is KeyStatus.OK) for r in results])
    return whole

