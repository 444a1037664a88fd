"""``kvcr-node``: run a node from flags and a TOML file (``kvcr``, the tool that talks to one, is ``kvcr_client.tool``)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from kvcr_io import package_version
from kvcr_io.endpoints import default_endpoint
from kvcr_node.config import ConfigError, NodeConfig, load_toml, pool_from_flag


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcr-node",
        description="Run a kvcr node: memory pools registered with NIXL, served over ZeroMQ.",
    )
    p.add_argument("--config", type=Path, help="TOML file; flags given here override it")
    p.add_argument("--endpoint", help=f"ZeroMQ endpoint to bind (default {default_endpoint()})")
    p.add_argument("--name", help="node name shown to clients and peers")
    p.add_argument(
        "--pool", action="append", metavar="NAME:SLOT_SIZE:SLOT_COUNT[:MEMORY]",
        help="declare a pool, e.g. kv:64KiB:4096:dram or full:64KiB:1024:hbm:0 (repeatable; replaces the config's pools)",
    )
    p.add_argument("--policy", help="eviction policy: fifo, lru (default) or module:Class for a plug-in")
    p.add_argument("--low-watermark", type=float, help="capacity event threshold, fraction of a pool's slots")
    p.add_argument("--protocol-version", type=int, help="speak protocol versions up to N only")
    p.add_argument("--deadline-ms", type=int, help="deadline of operations that name none")
    p.add_argument("--peer-dead-ms", type=int, help="a peer disconnected this long is taken as gone")
    p.add_argument("--peer-idle-ms", type=int, help="a link to a source with no work, unused this long, is closed")
    p.add_argument("--max-peers", type=int, help="links to source nodes at once (PEER_LIMIT past it when all are busy)")
    p.add_argument("--max-peer-clients", type=int, help="client agents each target node may have announced here (LRU)")
    p.add_argument("--client-grace-ms", type=int, help="a client silent this long is dropped, its handles released")
    p.add_argument("--heartbeat-ms", type=int, help="how often clients must say they are alive")
    p.add_argument("--max-clients", type=int, help="client sessions at once")
    p.add_argument("--max-pending", type=int, help="operations in progress per client before BUSY")
    p.add_argument("--max-hints-per-session", type=int, help="hints one client may hold before HINT_LIMIT")
    p.add_argument("--max-hinted-keys-per-session", type=int, help="keys over one client's hints before HINT_LIMIT")
    p.add_argument("--curve-secret-key", help="file with the node's CurveZMQ secret key (enables authentication)")
    p.add_argument("--curve-public-key", help="file with the node's CurveZMQ public key")
    p.add_argument("--curve-allow", help="file of allowed client and peer public keys, one per line")
    p.add_argument("--curve-peer-key", help="file with the public key peer nodes serve with")
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING, ...")
    p.add_argument("--version", action="version", version=f"kvcr-node {package_version()}")
    return p


def build_config(args: argparse.Namespace) -> NodeConfig:
    """Defaults, then the TOML file, then flags."""
    config = load_toml(args.config) if args.config else NodeConfig()
    changes: dict[str, Any] = {}
    for attr in ("endpoint", "name", "policy", "low_watermark", "protocol_version", "deadline_ms", "log_level",
                 "peer_dead_ms", "peer_idle_ms", "max_peers", "max_peer_clients", "client_grace_ms",
                 "heartbeat_ms", "max_clients", "max_pending", "max_hints_per_session", "max_hinted_keys_per_session",
                 "curve_secret_key", "curve_public_key", "curve_allow", "curve_peer_key"):
        value = getattr(args, attr)
        if value is not None:
            changes[attr] = value
    if args.pool:
        changes["pools"] = tuple(pool_from_flag(text) for text in args.pool)
    return dataclasses.replace(config, **changes).validated()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvcr-node``."""
    args = _parser().parse_args(argv)
    try:
        config = build_config(args)
    except ConfigError as exc:
        print(f"kvcr-node: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, config.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from kvcr_node.gpu import GpuUnavailable
    from kvcr_node.node import Node

    try:
        node = Node(config)
    except (GpuUnavailable, ImportError, ValueError) as exc:
        print(f"kvcr-node: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        print(f"kvcr-node: error: cannot start: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: node.request_stop())
    signal.signal(signal.SIGINT, lambda *_: node.request_stop())
    pools = ", ".join(f"{p.name}={p.slot_count}x{p.slot_size}B@{p.memory}" for p in config.pools)
    print(f"kvcr-node {package_version()} listening on {node.endpoint} (pools: {pools})", flush=True)
    node.run()
    logging.getLogger("kvcr.node").info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
