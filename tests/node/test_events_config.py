"""Configuring the inventory event stream, and ``kvcr events`` as an operator runs it (spec section 15)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvcr_client.tool import main as tool_main
from kvcr_node.cli import _parser, build_config
from kvcr_node.config import ConfigError, NodeConfig, from_mapping
from kvcr_node.node import Node
from kvcr_node.poolspec import PoolSpec
from kvcr_node.replays import REPLAY_BYTES, REPLAY_REQUESTERS, REQUESTER_BYTES
from kvcr_testing.nodes import NodeProcess


def test_events_are_off_by_default() -> None:
    config = NodeConfig()
    assert config.events_endpoint == "" and config.events_replay_endpoint == ""


def test_replay_budgets_have_defaults_flags_and_toml_keys() -> None:
    config = NodeConfig()
    assert (config.events_replay_bytes, config.events_replay_requesters) == (REPLAY_BYTES, REPLAY_REQUESTERS)
    config = build_config(_parser().parse_args(["--events-replay-bytes", str(8 << 20), "--events-replay-requesters", "5"]))
    assert (config.events_replay_bytes, config.events_replay_requesters) == (8 << 20, 5)
    config = from_mapping({"events_replay_bytes": 1 << 30, "events_replay_requesters": 1})
    assert (config.events_replay_bytes, config.events_replay_requesters) == (1 << 30, 1)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"events_replay_bytes": REQUESTER_BYTES - 1}, "events_replay_bytes"),  # less than one requester's queue
        ({"events_replay_bytes": "64MiB"}, "events_replay_bytes"),
        ({"events_replay_requesters": 0}, "events_replay_requesters"),
        ({"events_replay_requesters": True}, "events_replay_requesters"),
    ],
    ids=["bytes-below-one-queue", "bytes-str", "no-requester", "requesters-bool"],
)
def test_bad_replay_budgets_name_the_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping(fields)
    assert info.value.field == field


def test_flags_and_toml_set_the_endpoints(ipc_dir: Path) -> None:
    ev = f"ipc://{ipc_dir}/ev"
    config = build_config(_parser().parse_args(["--events-endpoint", ev, "--events-replay-endpoint", ev + ".r"]))
    assert (config.events_endpoint, config.events_replay_endpoint) == (ev, ev + ".r")
    config = from_mapping({"events_endpoint": "tcp://127.0.0.1:5600"})
    assert config.events_endpoint == "tcp://127.0.0.1:5600" and config.events_replay_endpoint == ""


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"events_endpoint": "no-scheme"}, "events_endpoint"),
        ({"events_endpoint": "tcp://127.0.0.1:0"}, "events_replay_endpoint"),  # nothing to derive the replay port from
        ({"events_replay_endpoint": "ipc:///tmp/r"}, "events_replay_endpoint"),  # a replay socket of no stream
        ({"events_endpoint": "ipc:///tmp/e", "events_replay_endpoint": "ipc:///tmp/e"}, "events_endpoint"),
        ({"events_endpoint": 5600}, "events_endpoint"),
    ],
    ids=["no-scheme", "tcp-port-0", "replay-alone", "same-endpoint", "not-a-str"],
)
def test_bad_event_settings_name_the_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping(fields)
    assert info.value.field == field


def test_a_node_that_cannot_bind_its_event_stream_does_not_start(ipc_dir: Path) -> None:
    busy = zmq.Context.instance().socket(zmq.PUB)
    try:
        port = busy.bind_to_random_port("tcp://127.0.0.1")
        config = NodeConfig(endpoint=f"ipc://{ipc_dir}/n.sock", pools=(PoolSpec("kv", 4096, 4, "dram"),),
                            events_endpoint=f"tcp://127.0.0.1:{port}", events_replay_endpoint=f"ipc://{ipc_dir}/r")
        with pytest.raises(zmq.ZMQError):
            Node(config)
        assert not (ipc_dir / "n.sock").exists() and not (ipc_dir / "r").exists()
    finally:
        busy.close(0)


def test_tool_prints_a_nodes_events(node_factory: Callable[..., NodeProcess], ipc_dir: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    ev = f"ipc://{ipc_dir}/ev"
    node_factory("--pool", "kv:4KiB:8", "--name", "ev-node", "--events-endpoint", ev)
    # Connecting after the node started, the tool asks for the incarnation from its start.
    assert tool_main(["events", ev, "--json", "--count", "1"]) == 0
    [line] = capsys.readouterr().out.splitlines()
    obj = json.loads(line)
    assert (obj["seq"], obj["event"], obj["node"]) == (0, "cleared", "ev-node")
    assert tool_main(["events", ev, "--timeout", "0.5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("0 ev-node:") and out[0].endswith(" cleared")


def test_tool_needs_a_replay_endpoint_it_can_derive(capsys: pytest.CaptureFixture[str]) -> None:
    assert tool_main(["events", "tcp://127.0.0.1:0", "--timeout", "0.1"]) == 1
    assert "give one" in capsys.readouterr().err
