"""Node configuration: flags or a TOML file, with a working default.

Every error names the field it is about (``ConfigError``), so the CLI can print one clear
line and exit non-zero.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvcr_io.endpoints import default_endpoint
from kvcr_node.logs import LOG_FORMATS
from kvcr_node.poolspec import DISK_PREFIX, PoolSpec, disk_directory
from kvcr_node.replays import REPLAY_BYTES, REPLAY_REQUESTERS, REQUESTER_BYTES
from kvcr_protocol import CURRENT_VERSION, PROTOCOL_VERSIONS, Limits
from kvcr_protocol.events import replay_endpoint


class ConfigError(ValueError):
    """A configuration value is wrong; ``field`` names it."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_MEMORY = re.compile(r"^(dram|hbm:(\d+))$")


def parse_size(value: Any, field: str) -> int:
    """Bytes from an int or a string such as ``64KiB``, ``256M`` or ``1GiB`` (binary units)."""
    if isinstance(value, bool):
        raise ConfigError(field, f"expected a size, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        unit = (m.group(2) or "").upper()[:1]
        size = int(m.group(1)) * _UNITS[unit if unit != "B" else ""]
    else:
        raise ConfigError(field, f"expected a size such as 65536 or '64KiB', got {value!r}")
    if size <= 0:
        raise ConfigError(field, f"must be positive, got {value!r}")
    return size


def parse_memory(value: Any, field: str) -> str:
    """``dram``, ``hbm:N`` (GPU N), or ``disk:/DIR`` (a disk pool's file under that directory,
    architecture §9)."""
    if isinstance(value, str) and value.startswith(DISK_PREFIX):
        if not value[len(DISK_PREFIX):].startswith("/"):
            raise ConfigError(field, f"a disk pool names an absolute directory, as 'disk:/var/cache/kvcr', got {value!r}")
        return value
    if not isinstance(value, str) or not _MEMORY.match(value):
        raise ConfigError(field, f"expected 'dram', 'hbm:N' or 'disk:/DIR', got {value!r}")
    return value


def split_pools(pools: Sequence[PoolSpec]) -> dict[str, tuple[PoolSpec, ...]]:
    """Pools as ``NodeConfig`` holds them: ``pools`` in memory, ``disk_pools`` in files."""
    return {"pools": tuple(p for p in pools if disk_directory(p.memory) is None),
            "disk_pools": tuple(p for p in pools if disk_directory(p.memory) is not None)}


def hbm_device(memory: str) -> int | None:
    """The device of an ``hbm:N`` memory, or None for DRAM."""
    m = _MEMORY.match(memory)
    return int(m.group(2)) if m and m.group(2) is not None else None


DEFAULT_PEER_IDLE_MS = 30_000
"""A link to a source with no work outstanding closes after this long unused."""
DEFAULT_MAX_PEERS = 64
"""Links to source nodes held at once."""
DEFAULT_MAX_PEER_CLIENTS = 256
"""Client agents a target may have announced per peer session (the source's table)."""
DEFAULT_METRICS_MAX_CONNECTIONS = 16
"""Connections the metrics port serves at once: a few Prometheus servers and people with curl."""


def default_pools() -> tuple[PoolSpec, ...]:
    """One DRAM pool ``kv`` of 64 KiB slots, 256 MiB in all."""
    return (PoolSpec("kv", 64 << 10, 4096, "dram"),)


DEFAULT_JOURNAL_COMPACT_BYTES = 64 << 20
"""``journal_compact_bytes`` by default."""
DEFAULT_DISK_DEMOTE_MARK = 0.25
"""``disk_demote_mark`` by default: copies run a quarter of a pool ahead of its evictions."""


@dataclass(frozen=True)
class NodeConfig:
    """Everything a node needs to start."""

    endpoint: str = field(default_factory=default_endpoint)
    """The ZeroMQ endpoint clients and peers reach this node at (``ipc://PATH`` or ``tcp://HOST:PORT``);
    by default an ipc socket in a directory of the user's own."""
    name: str = field(default_factory=lambda: f"kvcr-node-{os.getpid()}")
    """The node's name, shown to clients and peers, in logs and in ``kvcr_node_info``."""
    pools: tuple[PoolSpec, ...] = field(default_factory=default_pools)
    policy: str = "lru"
    """The eviction policy: ``fifo``, ``lru``, or ``module:Class`` for a plug-in (docs/node.md)."""
    low_watermark: float = 0.1
    """When a pool's reclaimable slots (free and evictable) fall under this fraction of it, its
    clients get one capacity event (architecture §2; again once it was back above)."""
    protocol_version: int = CURRENT_VERSION
    """The newest protocol version this node speaks: lower it to run beside older nodes during an upgrade."""
    deadline_ms: int = 30_000
    """Deadline of an operation whose request names none."""
    heartbeat_ms: int = 2_000
    """How often clients say they are alive (told to them in welcome); 0 disables heartbeats,
    and with them the dropping of silent sessions (spec section 5.2)."""
    client_grace_ms: int = 10_000
    """A client silent this long is gone: its operations are aborted, its handles released
    (only while heartbeats are on)."""
    max_clients: int = 256
    """Client sessions at once; one more hello is refused with TOO_MANY_CLIENTS."""
    max_pending: int = 1024
    """Operations in progress per client; one more is refused with BUSY (back-pressure)."""
    max_hints_per_session: int = 1024
    """Hints (request ids) one session may hold; one more is refused with HINT_LIMIT."""
    max_hinted_keys_per_session: int = 65536
    """Keys summed over one session's hints; a hint past it is refused with HINT_LIMIT."""
    lease_ttl_ms: int = 30_000
    """Time to live of a lease whose request names none (spec section 6.11)."""
    max_lease_ttl_ms: int = 600_000
    """The longest time to live a lease or renewal is granted; longer asks are cut to it."""
    max_leases_per_session: int = 1024
    """Leases one session may hold; one more is refused with LEASE_LIMIT."""
    max_leased_slots_per_session: int = 65536
    """Slots one session's leases may hold; a key past it answers LEASE_LIMIT."""
    lease_pool_fraction: float = 0.5
    """The fraction of each pool's slots that leased objects may pin, so that leases cannot
    starve the cache; a key past it answers LEASE_LIMIT."""
    lease_session_fraction: float = 0.125
    """The share of each pool's lease budget one session may hold: at most
    ceil(max(this, 1/sessions) * budget) slots, so that one client cannot starve the others
    (spec section 6.11); 1 lets any session take the whole budget."""
    client_transfers: bool = True
    """Grant clients reads of the slots their leases hold (spec section 6.12), so they READ
    leased objects with their own agents; off, leases answer without slots and leased keys
    travel by ``deliver`` (the node-driven path)."""
    integrity: bool = True
    """Take the digest of every span in host memory when its object becomes READY, and
    send them with grants, so that a reader under a grant checks the bytes it read (spec
    section 6.12, "Integrity"). Off, nothing is checked and a slot overwritten by anyone
    with a grant is read as the object's (spec section 14)."""
    suspect_bytes_per_s: int = 1 << 30
    """Bytes a second the node reads, at most, to check objects readers reported as read
    with bytes that did not match their digests (``suspect``, spec section 6.12); one
    session's reports may use a quarter of it. Past it, reported keys are answered BUSY."""
    peer_grants: bool = False
    """Grant target nodes' peer sessions reads of this node's slots, which they pass on to
    their own clients (spec section 6.12, "Across nodes"): those clients' agents then get
    this node's pool registrations, READ and WRITE of every slot (spec section 14), though
    this node never authenticated them. Off (the default), keys a target leases here
    travel node-driven; on only where every client of every target is trusted."""
    put_ttl_ms: int = 30_000
    """Time to live of a put whose request names none (spec section 6.13)."""
    max_put_ttl_ms: int = 600_000
    """The longest time to live a put is granted; longer asks are cut to it."""
    max_puts_per_session: int = 64
    """Puts one session may hold, quarantined ones included; one more is refused BUSY."""
    put_pool_fraction: float = 0.5
    """The share of each pool's slots all open and quarantined puts together may hold, so
    that reservations nobody commits (clients that come, put and go) cannot evict the whole
    cache; a put that could take them past it is refused BUSY (spec section 6.13)."""
    put_session_fraction: float = 0.125
    """The share of each pool's slots one client's open and quarantined puts may hold, at
    least 1/sessions as for leases (counted by the client's agent, so the puts its earlier
    sessions lost count too); a put that could take it past is refused BUSY before anything
    is placed or evicted (spec section 6.13)."""
    put_quarantine_ms: int = 10_000
    """How long the slots of a put that ended unfinished stay quarantined after it ended,
    at least (and until the client's agent is removed): a WRITE its client was posting
    then may still land (spec section 6.13)."""
    max_frame: int = 8 << 20
    """Bytes in one control frame; larger ones are refused (TOO_LARGE) or cut off."""
    curve_secret_key: str = ""
    """File with this node's CurveZMQ secret key (z85); enables authentication."""
    curve_public_key: str = ""
    """File with this node's CurveZMQ public key (z85)."""
    curve_allow: str = ""
    """File listing the client and peer public keys (z85, one per line) allowed in."""
    curve_peer_key: str = ""
    """File with the public key peers serve with (z85); defaults to this node's own."""
    batch: int = 256
    """Control messages drained per progress-loop turn."""
    projection_cache: int = 512
    """Layouts whose slot projections the node keeps computed (least recently used beyond)."""
    peer_dead_ms: int = 3_000
    """A source disconnected this long is taken as gone: its writes can no longer land."""
    peer_idle_ms: int = DEFAULT_PEER_IDLE_MS
    """A link to a source with no write outstanding (sent, queued or uncertain) and unused
    this long is closed (spec section 5.3); the next request for that source opens it again."""
    max_peers: int = DEFAULT_MAX_PEERS
    """Links to sources at once. One more closes the least recently used idle link first;
    with every link busy, the keys that need it fail PEER_LIMIT."""
    max_peer_clients: int = DEFAULT_MAX_PEER_CLIENTS
    """Client agents a target's peer session may have announced here; the least recently
    used beyond are forgotten (their NIXL agents released), and announced again by the
    target when it next needs them (spec section 5.3)."""
    log_format: str = "text"
    """``text`` for people, ``json`` for log shippers: one object per line (``kvcr_node.logs``)."""
    log_level: str = "INFO"
    """The lowest level logged: ``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``."""
    metrics_port: int | None = None
    """TCP port to serve Prometheus metrics on (``/metrics``); 0 takes a free port; None serves none."""
    metrics_address: str = "127.0.0.1"
    """The address the metrics port is bound on (an IP address; 0.0.0.0 for every interface)."""
    metrics_max_connections: int = DEFAULT_METRICS_MAX_CONNECTIONS
    """Connections the metrics port serves at once; one more is answered 503 and closed at once
    (architecture §4: one exporter thread serves them all)."""
    events_endpoint: str = ""
    """Where to publish inventory events (a ZeroMQ PUB endpoint, spec section 15); empty: none."""
    events_replay_endpoint: str = ""
    """Where the event stream's replay socket binds; empty: derived from ``events_endpoint``
    (``ipc://PATH.replay``, or the tcp port after its own)."""
    events_replay_bytes: int = REPLAY_BYTES
    """Bytes the replay requesters' queues may hold together (spec section 15.4): an answer
    that would pass it waits, and is cut (``BUSY``) if it waits ``REPLAY_STALL_S``."""
    events_replay_requesters: int = REPLAY_REQUESTERS
    """Replay requesters tracked at once, each until it disconnects; another is refused ``BUSY``."""
    state_dir: str = ""
    """A directory where the node keeps what a restart keeps (architecture §8): its journal of
    READY objects, and the layout of its pools, whose DRAM pools then live in files under
    ``pool_dir`` and outlive the process. The next node started on it with the same pools
    serves what this one held. Empty: nothing outlives the process."""
    pool_dir: str = "/dev/shm"
    """Where a node with a ``state_dir`` keeps its DRAM pools' files: a memory file system
    (tmpfs, or a hugetlbfs mount for huge pages)."""
    journal_compact_bytes: int = DEFAULT_JOURNAL_COMPACT_BYTES
    """A journal file grows to at least this many bytes before it is compacted."""
    disk_pools: tuple[PoolSpec, ...] = ()
    """Pools kept in files (memory ``disk:/DIR``, architecture §9): the disk tier. Each holds
    copies of what the DRAM pools of its slot size evict; clients never name them."""
    disk_demote_mark: float = DEFAULT_DISK_DEMOTE_MARK
    """While a DRAM pool has fewer free slots than this fraction of it, the node copies to the
    disk tier what that pool would evict next (as many slots' worth as are missing); 1 copies
    everything evictable, as soon as it is."""
    disk_promote: bool = True
    """Whether an object read back from the disk tier for a deliver, fetch or lease stays in
    memory (promoted: the next read finds it there). Off, it is read through: it leaves memory
    with its readers' last claim and its copy stays on disk, so one-off reads of cold prefixes
    take no room from what is read often."""

    def validated(self) -> NodeConfig:
        """Check every field; raise ``ConfigError`` naming the first bad one."""
        if not self.endpoint or "://" not in self.endpoint:
            raise ConfigError("endpoint", f"expected a ZeroMQ endpoint such as ipc:///path or tcp://host:port, got {self.endpoint!r}")
        max_name = Limits().max_name  # names travel in welcome, peer hello and event batches
        if not self.name:
            raise ConfigError("name", "must not be empty")
        if len(self.name.encode()) > max_name:
            raise ConfigError("name", f"{len(self.name.encode())} bytes; at most {max_name}")
        if not self.pools:
            raise ConfigError("pools", "at least one pool is needed")
        seen: set[str] = set()
        for i, pool in enumerate(self.pools):
            if not pool.name or len(pool.name.encode()) > max_name:
                raise ConfigError(f"pools[{i}].name", f"must be 1 to {max_name} bytes, got {pool.name!r}")
            if pool.name in seen:
                raise ConfigError(f"pools[{i}].name", f"pool {pool.name!r} is declared twice")
            seen.add(pool.name)
            parse_memory(pool.memory, f"pools[{i}].memory")
            if disk_directory(pool.memory) is not None:
                raise ConfigError(f"pools[{i}].memory", "a disk pool belongs in disk_pools")
        sizes = {pool.slot_size for pool in self.pools if pool.memory == "dram"}
        if isinstance(self.disk_demote_mark, bool) or not 0.0 < self.disk_demote_mark <= 1.0:
            raise ConfigError("disk_demote_mark", f"expected a fraction in (0, 1], got {self.disk_demote_mark!r}")
        for i, pool in enumerate(self.disk_pools):
            where = f"disk_pools[{i}]"
            if not pool.name or len(pool.name.encode()) > max_name:
                raise ConfigError(f"{where}.name", f"must be 1 to {max_name} bytes, got {pool.name!r}")
            if pool.name in seen:
                raise ConfigError(f"{where}.name", f"pool {pool.name!r} is declared twice")
            seen.add(pool.name)
            directory = disk_directory(parse_memory(pool.memory, f"{where}.memory"))
            if directory is None:
                raise ConfigError(f"{where}.memory", f"expected 'disk:/DIR', got {pool.memory!r}")
            if not directory.is_dir():
                raise ConfigError(f"{where}.memory", f"{directory} is not a directory")
            if pool.slot_size not in sizes:
                raise ConfigError(f"{where}.slot_size", f"no DRAM pool has slots of {pool.slot_size} bytes: "
                                  "nothing would ever be copied to this disk pool")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError("log_format", f"expected one of {list(LOG_FORMATS)}, got {self.log_format!r}")
        if self.policy not in ("fifo", "lru") and ":" not in self.policy:
            raise ConfigError("policy", f"expected 'fifo', 'lru' or 'module:Class', got {self.policy!r}")
        if isinstance(self.lease_pool_fraction, bool) or not 0.0 <= self.lease_pool_fraction <= 1.0:
            raise ConfigError("lease_pool_fraction", f"expected a fraction in [0, 1], got {self.lease_pool_fraction!r}")
        if isinstance(self.lease_session_fraction, bool) or not 0.0 <= self.lease_session_fraction <= 1.0:
            raise ConfigError("lease_session_fraction", f"expected a fraction in [0, 1], got {self.lease_session_fraction!r}")
        for share in ("put_pool_fraction", "put_session_fraction"):
            value = getattr(self, share)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
                raise ConfigError(share, f"expected a fraction in (0, 1], got {value!r}")
        for flag in ("client_transfers", "peer_grants", "integrity", "disk_promote"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(flag, f"expected true or false, got {getattr(self, flag)!r}")
        if not 0.0 <= self.low_watermark < 1.0:
            raise ConfigError("low_watermark", f"expected a fraction in [0, 1), got {self.low_watermark!r}")
        if self.protocol_version not in PROTOCOL_VERSIONS:
            raise ConfigError("protocol_version", f"expected one of {list(PROTOCOL_VERSIONS)}, got {self.protocol_version!r}")
        for name in ("deadline_ms", "heartbeat_ms", "batch", "projection_cache", "peer_dead_ms",
                     "client_grace_ms", "max_clients", "max_pending", "max_frame", "peer_idle_ms", "max_peers",
                     "max_peer_clients", "max_hints_per_session", "max_hinted_keys_per_session", "lease_ttl_ms",
                     "max_lease_ttl_ms", "max_leases_per_session", "max_leased_slots_per_session", "put_ttl_ms",
                     "max_put_ttl_ms", "max_puts_per_session", "put_quarantine_ms", "suspect_bytes_per_s",
                     "journal_compact_bytes"):
            value = getattr(self, name)
            # heartbeat_ms 0 disables heartbeats (spec section 5.2); every other count is positive.
            least = 0 if name == "heartbeat_ms" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                what = "a non-negative" if least == 0 else "a positive"
                raise ConfigError(name, f"expected {what} integer, got {value!r}")
        curve = (self.curve_secret_key, self.curve_public_key, self.curve_allow)
        if any(curve) and not all(curve):
            raise ConfigError("curve_secret_key", "CurveZMQ needs curve_secret_key, curve_public_key and curve_allow together")
        for name in ("curve_secret_key", "curve_public_key", "curve_allow", "curve_peer_key"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(name, f"no such file: {path}")
        if self.metrics_port is not None and (
                isinstance(self.metrics_port, bool) or not isinstance(self.metrics_port, int)
                or not 0 <= self.metrics_port <= 65535):
            raise ConfigError("metrics_port", f"expected a TCP port in [0, 65535], got {self.metrics_port!r}")
        try:
            ipaddress.ip_address(self.metrics_address)
        except ValueError:
            raise ConfigError("metrics_address", f"expected an IP address such as 127.0.0.1, got {self.metrics_address!r}") from None
        if (isinstance(self.metrics_max_connections, bool) or not isinstance(self.metrics_max_connections, int)
                or self.metrics_max_connections < 1):
            raise ConfigError("metrics_max_connections", f"expected a positive integer, got {self.metrics_max_connections!r}")
        self._validate_events()
        if self.state_dir and not self.pool_dir:
            raise ConfigError("pool_dir", "a node with a state_dir needs a directory for its pools' files")
        return self

    def _validate_events(self) -> None:
        for name in ("events_endpoint", "events_replay_endpoint"):
            value = getattr(self, name)
            if value and "://" not in value:
                raise ConfigError(name, f"expected a ZeroMQ endpoint such as ipc:///path or tcp://host:port, got {value!r}")
        if self.events_replay_endpoint and not self.events_endpoint:
            raise ConfigError("events_replay_endpoint", "set events_endpoint too")
        if self.events_endpoint and not self.events_replay_endpoint:
            try:
                replay_endpoint(self.events_endpoint)
            except ValueError as exc:
                raise ConfigError("events_replay_endpoint", str(exc)) from None
        if self.events_endpoint and self.events_endpoint in (self.endpoint, self.events_replay_endpoint):
            raise ConfigError("events_endpoint", "must differ from endpoint and events_replay_endpoint")
        bytes_ = self.events_replay_bytes
        if isinstance(bytes_, bool) or not isinstance(bytes_, int) or bytes_ < REQUESTER_BYTES:
            raise ConfigError("events_replay_bytes", f"expected an integer of at least {REQUESTER_BYTES} "
                                                     f"(one requester's queue), got {bytes_!r}")
        count = self.events_replay_requesters
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError("events_replay_requesters", f"expected a positive integer, got {count!r}")


POOL_FIELDS = ("name", "slot_size", "slot_count", "size", "memory")
"""The keys of a ``[[pools]]`` table in TOML."""


def pool_from_mapping(raw: Any, where: str) -> PoolSpec:
    """A pool from a TOML table: name, slot_size, and slot_count or size, memory."""
    if not isinstance(raw, dict):
        raise ConfigError(where, "expected a table with name, slot_size, slot_count")
    unknown = set(raw) - set(POOL_FIELDS)
    if unknown:
        raise ConfigError(f"{where}.{sorted(unknown)[0]}", "unknown pool field")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name", f"expected a non-empty string, got {name!r}")
    if "slot_size" not in raw:
        raise ConfigError(f"{where}.slot_size", "is required")
    slot_size = parse_size(raw["slot_size"], f"{where}.slot_size")
    if "slot_count" in raw:
        count = raw["slot_count"]
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise ConfigError(f"{where}.slot_count", f"expected a positive integer, got {count!r}")
        if "size" in raw and parse_size(raw["size"], f"{where}.size") != count * slot_size:
            raise ConfigError(f"{where}.size", f"disagrees with slot_count {count} x slot_size {slot_size}; give one of them")
    elif "size" in raw:
        total = parse_size(raw["size"], f"{where}.size")
        if total % slot_size:
            raise ConfigError(f"{where}.size", f"{total} is not a multiple of slot_size {slot_size}")
        count = total // slot_size
    else:
        raise ConfigError(f"{where}.slot_count", "is required (or give size)")
    memory = parse_memory(raw.get("memory", "dram"), f"{where}.memory")
    try:
        return PoolSpec(name, slot_size, count, memory)
    except ValueError as exc:
        raise ConfigError(where, str(exc)) from exc


def pool_from_flag(text: str) -> PoolSpec:
    """A pool from ``NAME:SLOT_SIZE:SLOT_COUNT[:MEMORY]``, e.g. ``kv:64KiB:4096:dram``,
    ``kv-gpu:64KiB:4096:hbm:0`` or ``kv-disk:64KiB:65536:disk:/var/cache/kvcr``."""
    parts = text.split(":", 3)
    if len(parts) not in (3, 4):
        raise ConfigError("--pool", f"expected NAME:SLOT_SIZE:SLOT_COUNT[:MEMORY], got {text!r}")
    count: Any = int(parts[2]) if parts[2].isdigit() else parts[2]
    raw: dict[str, Any] = {"name": parts[0], "slot_size": parts[1], "slot_count": count}
    if len(parts) == 4:
        raw["memory"] = parts[3]
    return pool_from_mapping(raw, "--pool")


TOML_FIELDS: dict[str, type | tuple[type, ...]] = {
    "endpoint": str, "name": str, "policy": str, "low_watermark": (int, float), "protocol_version": int,
    "deadline_ms": int, "heartbeat_ms": int, "batch": int, "projection_cache": int, "log_level": str, "log_format": str,
    "peer_dead_ms": int, "client_grace_ms": int, "max_clients": int, "max_pending": int,
    "max_frame": int, "max_hints_per_session": int, "max_hinted_keys_per_session": int, "curve_secret_key": str,
    "curve_public_key": str, "curve_allow": str, "curve_peer_key": str,
    "peer_idle_ms": int, "max_peers": int, "max_peer_clients": int, "lease_ttl_ms": int, "max_lease_ttl_ms": int,
    "max_leases_per_session": int, "max_leased_slots_per_session": int, "lease_pool_fraction": (int, float),
    "lease_session_fraction": (int, float), "metrics_port": int, "metrics_address": str,
    "metrics_max_connections": int, "client_transfers": bool, "peer_grants": bool, "integrity": bool, "put_ttl_ms": int, "max_put_ttl_ms": int,
    "max_puts_per_session": int, "put_quarantine_ms": int, "suspect_bytes_per_s": int, "put_session_fraction": (int, float), "put_pool_fraction": (int, float),
    "state_dir": str, "pool_dir": str, "journal_compact_bytes": int, "disk_demote_mark": (int, float),
    "disk_promote": bool,
    "events_endpoint": str, "events_replay_endpoint": str, "events_replay_bytes": int, "events_replay_requesters": int,
}
"""The top-level keys of a node's TOML file and their types (``[[pools]]`` besides): the
configuration reference of the documentation site is made from these (``scripts/docs_hooks.py``)."""


def load_toml(path: Path, base: NodeConfig | None = None) -> NodeConfig:
    """Read a TOML config file over ``base`` (defaults when None)."""
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError("--config", f"cannot read {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--config", f"{path} is not valid TOML: {exc}") from exc
    return from_mapping(raw, base)


def from_mapping(raw: dict[str, Any], base: NodeConfig | None = None) -> NodeConfig:
    """Apply a parsed TOML document to ``base``."""
    config = base or NodeConfig()
    changes: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "pools":
            if not isinstance(value, list):
                raise ConfigError("pools", "expected an array of tables ([[pools]])")
            changes.update(split_pools([pool_from_mapping(p, f"pools[{i}]") for i, p in enumerate(value)]))
            continue
        expected = TOML_FIELDS.get(key)
        if expected is None:
            raise ConfigError(key, "unknown configuration field")
        if (expected is bool) != isinstance(value, bool) or not isinstance(value, expected):
            raise ConfigError(key, f"wrong type {type(value).__name__}")
        fractions = ("low_watermark", "lease_pool_fraction", "lease_session_fraction", "disk_demote_mark")
        changes[key] = float(raw[key]) if key in fractions else raw[key]
    return replace(config, **changes).validated()
