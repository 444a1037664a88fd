"""``kvcr-node``: run a node from flags and a TOML file (``kvcr``, the tool that talks to one, is ``kvcr_client.tool``)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcr_io import package_version
from kvcr_io.endpoints import default_endpoint
from kvcr_node.config import ConfigError, NodeConfig, load_toml, pool_from_flag, split_pools
from kvcr_node.logs import configure as configure_logs

if TYPE_CHECKING:
    from kvcr_node.node import Node

SETTINGS: tuple[tuple[str, type, str], ...] = (
    ("name", str, "node name shown to clients and peers"),
    ("policy", str, "eviction policy: fifo, lru (default) or module:Class for a plug-in"),
    ("low_watermark", float, "capacity event threshold, fraction of a pool's slots"),
    ("protocol_version", int, "speak protocol versions up to N only"),
    ("deadline_ms", int, "deadline of operations that name none"),
    ("peer_dead_ms", int, "a peer disconnected this long is taken as gone"),
    ("peer_idle_ms", int, "a link to a source with no work, unused this long, is closed"),
    ("max_peers", int, "links to source nodes at once (PEER_LIMIT past it when all are busy)"),
    ("max_peer_clients", int, "client agents each target node may have announced here (LRU)"),
    ("client_grace_ms", int, "a client silent this long is dropped, its handles released"),
    ("heartbeat_ms", int, "how often clients must say they are alive"),
    ("max_clients", int, "client sessions at once"),
    ("max_pending", int, "operations in progress per client before BUSY"),
    ("max_hints_per_session", int, "hints one client may hold before HINT_LIMIT"),
    ("max_hinted_keys_per_session", int, "keys over one client's hints before HINT_LIMIT"),
    ("lease_ttl_ms", int, "time to live of a lease that names none"),
    ("max_lease_ttl_ms", int, "the longest time to live a lease is granted"),
    ("put_ttl_ms", int, "time to live of a put that names none (spec section 6.13)"),
    ("max_puts_per_session", int, "puts one client may hold, quarantined ones included (BUSY past it)"),
    ("put_quarantine_ms", int, "how long the slots of a put its client lost stay quarantined, at least"),
    ("suspect_bytes_per_s", int, "bytes a second the node reads to check objects readers reported (BUSY past it)"),
    ("put_pool_fraction", float, "share of each pool's slots all open and quarantined puts may hold together"),
    ("put_session_fraction", float, "share of each pool's slots one client's open and quarantined puts may hold, at least 1/clients"),
    ("max_leases_per_session", int, "leases one client may hold before LEASE_LIMIT"),
    ("max_leased_slots_per_session", int, "slots one client's leases may hold (LEASE_LIMIT past it)"),
    ("lease_pool_fraction", float, "fraction of each pool's slots leases may pin (LEASE_LIMIT past it)"),
    ("lease_session_fraction", float, "share of each pool's lease budget one client may hold, at least 1/clients"),
    ("curve_secret_key", str, "file with the node's CurveZMQ secret key (enables authentication)"),
    ("curve_public_key", str, "file with the node's CurveZMQ public key"),
    ("curve_allow", str, "file of allowed client and peer public keys, one per line"),
    ("curve_peer_key", str, "file with the public key peer nodes serve with"),
    ("log_format", str, "text (default) or json: one JSON object per line, for log shippers"),
    ("log_level", str, "DEBUG, INFO, WARNING, ..."),
    ("metrics_port", int, "serve Prometheus metrics on http://ADDRESS:N/metrics (0: a free port)"),
    ("metrics_address", str, "the address the metrics port is bound on (default 127.0.0.1)"),
    ("metrics_max_connections", int, "metrics connections served at once; one more is answered 503 (default 16)"),
    ("events_endpoint", str, "publish inventory events (stored/removed/cleared) on this ZeroMQ PUB endpoint"),
    ("events_replay_endpoint", str, "bind the event replay socket here (default: ipc PATH.replay, or the next tcp port)"),
    ("events_replay_bytes", int, "bytes the event replay requesters' queues may hold together (BUSY past it)"),
    ("events_replay_requesters", int, "event replay requesters tracked at once (BUSY past it)"),
    ("disk_demote_mark", float, "copy to the disk tier what a DRAM pool would evict next while fewer than this "
                                "fraction of its slots are free (default 0.25; 1: everything evictable)"),
    ("state_dir", str, "keep a journal here and the DRAM pools in files, so a restart on it keeps the cache"),
    ("pool_dir", str, "where a node with a state dir keeps its pools' files (default /dev/shm; a hugetlbfs mount)"),
    ("journal_compact_bytes", int, "bytes a journal file grows to at least before it is compacted"),
)
"""``NodeConfig`` fields a flag of the same name sets (``--max-peers`` sets ``max_peers``): (field, type, help)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcr-node",
        description="Run a kvcr node: memory pools registered with NIXL, served over ZeroMQ.",
    )
    p.add_argument("--config", type=Path, help="TOML file; flags given here override it")
    p.add_argument("--endpoint", help=f"ZeroMQ endpoint to bind (default {default_endpoint()})")
    p.add_argument(
        "--pool", action="append", metavar="NAME:SLOT_SIZE:SLOT_COUNT[:MEMORY]",
        help="declare a pool, e.g. kv:64KiB:4096:dram or full:64KiB:1024:hbm:0 (repeatable; replaces the config's pools)",
    )
    for field, kind, text in SETTINGS:
        p.add_argument("--" + field.replace("_", "-"), type=kind, help=text)
    p.add_argument(
        "--client-transfers", action=argparse.BooleanOptionalAction, default=None,
        help="grant clients reads of leased slots, so they move the bytes themselves (default on; spec section 6.12)",
    )
    p.add_argument(
        "--integrity", action=argparse.BooleanOptionalAction, default=None,
        help="digest every stored span and send the digests with grants, so readers check what they read "
             "(default on; spec section 6.12)",
    )
    p.add_argument(
        "--peer-grants", action=argparse.BooleanOptionalAction, default=None,
        help="grant target nodes' clients reads of this node's slots (default off: they get this node's "
             "pool registrations, read and write; spec sections 6.12 and 14)",
    )
    p.add_argument(
        "--disk-promote", action=argparse.BooleanOptionalAction, default=None,
        help="keep what is read back from the disk tier in memory (default on; off: read through, "
             "it leaves memory once read and stays on disk)",
    )
    p.add_argument("--version", action="version", version=f"kvcr-node {package_version()}")
    return p


def build_config(args: argparse.Namespace) -> NodeConfig:
    """Defaults, then the TOML file, then flags."""
    config = load_toml(args.config) if args.config else NodeConfig()
    changes: dict[str, Any] = {}
    for attr in ("endpoint", "client_transfers", "peer_grants", "integrity", "disk_promote", *(field for field, _, _ in SETTINGS)):
        value = getattr(args, attr)
        if value is not None:
            changes[attr] = value
    if args.pool:
        changes.update(split_pools([pool_from_flag(text) for text in args.pool]))
    return dataclasses.replace(config, **changes).validated()


def settle_heap() -> None:
    """Collect once, then leave what the start made to reference counting alone.

    A full cyclic collection walks every tracked object of the process, on the node's loop:
    the start-up heap (about 38,000 objects: the imports, NIXL, the pools) and every object a
    restart took back (several per copy). Frozen (``gc.freeze``), a later full collection
    walks only what serving made. Nothing the start made is freed by the collector: a stored
    object's entry holds no cycle, so eviction frees it by its count as before.
    """
    gc.collect()
    gc.freeze()


def main(argv: list[str] | None = None, node_class: type[Node] | None = None) -> int:
    """Entry point of ``kvcr-node``; ``node_class`` runs a subclass of ``Node`` instead (a
    benchmark's, ``bench/deferred_source.py``), with the same flags."""
    args = _parser().parse_args(argv)
    try:
        config = build_config(args)
    except ConfigError as exc:
        print(f"kvcr-node: error: {exc}", file=sys.stderr)
        return 2
    configure_logs(config.log_level, config.log_format)
    from kvcr_node.gpu import GpuUnavailable
    from kvcr_node.node import Node

    try:
        node = (node_class or Node)(config)
    except (GpuUnavailable, ImportError, ValueError) as exc:
        print(f"kvcr-node: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        print(f"kvcr-node: error: cannot start: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: node.request_stop())
    signal.signal(signal.SIGINT, lambda *_: node.request_stop())
    settle_heap()
    pools = ", ".join(f"{p.name}={p.slot_count}x{p.slot_size}B@{p.memory}" for p in (*config.pools, *config.disk_pools))
    metrics = ""
    if node.metrics_port is not None:
        host = f"[{config.metrics_address}]" if ":" in config.metrics_address else config.metrics_address
        metrics = f"; metrics on http://{host}:{node.metrics_port}/metrics"
    print(f"kvcr-node {package_version()} listening on {node.endpoint} (pools: {pools}){metrics}", flush=True)
    if node.events is not None:
        print(f"kvcr-node inventory events on {node.events.endpoint} (replay {node.events.replay_endpoint})", flush=True)
    node.run()
    logging.getLogger("kvcr.node").info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
