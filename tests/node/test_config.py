"""Node configuration: sizes, memories, pools from flags and TOML, defaults (no process started)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from kvcr_io.endpoints import default_endpoint
from kvcr_node.cli import _parser, build_config
from kvcr_node.config import (
    ConfigError,
    NodeConfig,
    from_mapping,
    hbm_device,
    load_toml,
    parse_memory,
    parse_size,
    pool_from_flag,
    pool_from_mapping,
)
from kvcr_node.poolspec import PoolSpec

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


# --------------------------------------------------------------------------- sizes and memories


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("64KiB", 64 * KiB),
        ("1536KiB", 1536 * KiB),
        ("256M", 256 * MiB),
        ("256MiB", 256 * MiB),
        ("256MB", 256 * MiB),  # units are binary whatever the spelling
        ("1GiB", GiB),
        ("2T", 2 << 40),
        ("64kib", 64 * KiB),
        (" 16 KiB ", 16 * KiB),
        ("4096", 4096),
        ("4096B", 4096),
        (65536, 65536),
    ],
)
def test_parse_size(text: Any, size: int) -> None:
    assert parse_size(text, "slot_size") == size


@pytest.mark.parametrize("bad", ["", "KiB", "64 XiB", "1.5MiB", "-1", "0", "0KiB", 0, -4096, 1.5, True, None, [64]])
def test_parse_size_refuses(bad: Any) -> None:
    with pytest.raises(ConfigError) as err:
        parse_size(bad, "pools[0].slot_size")
    assert err.value.field == "pools[0].slot_size"
    assert str(err.value).startswith("pools[0].slot_size: ")


@pytest.mark.parametrize(("text", "device"), [("dram", None), ("hbm:0", 0), ("hbm:1", 1), ("hbm:15", 15)])
def test_parse_memory(text: str, device: int | None) -> None:
    assert parse_memory(text, "memory") == text
    assert hbm_device(text) == device


@pytest.mark.parametrize("bad", ["", "DRAM", "hbm", "hbm:", "hbm:x", "hbm:-1", "gpu:0", "vram", " dram", 0, None])
def test_parse_memory_refuses(bad: Any) -> None:
    with pytest.raises(ConfigError) as err:
        parse_memory(bad, "pools[2].memory")
    assert err.value.field == "pools[2].memory"


# --------------------------------------------------------------------------- pools


@pytest.mark.parametrize(
    ("flag", "spec"),
    [
        ("kv:64KiB:16", PoolSpec("kv", 64 * KiB, 16, "dram")),
        ("kv:64KiB:4096:dram", PoolSpec("kv", 64 * KiB, 4096, "dram")),
        ("state:1536KiB:8", PoolSpec("state", 1536 * KiB, 8, "dram")),
        ("name:64KiB:16:hbm:1", PoolSpec("name", 64 * KiB, 16, "hbm:1")),
        ("full:64KiB:1024:hbm:0", PoolSpec("full", 64 * KiB, 1024, "hbm:0")),
        ("s:4096:2", PoolSpec("s", 4096, 2, "dram")),
        ("kv-disk:64KiB:65536:disk:/var/cache/kvcr", PoolSpec("kv-disk", 64 * KiB, 65536, "disk:/var/cache/kvcr")),
        ("d:4096:2:disk:/a:b", PoolSpec("d", 4096, 2, "disk:/a:b")),
    ],
)
def test_pool_from_flag(flag: str, spec: PoolSpec) -> None:
    assert pool_from_flag(flag) == spec


@pytest.mark.parametrize(
    ("flag", "field"),
    [
        ("bad", "--pool"),
        ("kv:64KiB", "--pool"),
        ("kv:64KiB:16:dram:extra", "--pool.memory"),
        ("kv:64KiB:16:hbm:0:1", "--pool.memory"),
        ("kv:64KiB:16:disk:relative/dir", "--pool.memory"),
        ("kv:64KiB:16:disk:", "--pool.memory"),
        (":64KiB:16", "--pool.name"),
        ("kv:huge:16", "--pool.slot_size"),
        ("kv:0:16", "--pool.slot_size"),
        ("kv:64KiB:0", "--pool.slot_count"),
        ("kv:64KiB:many", "--pool.slot_count"),
        ("kv:64KiB:-3", "--pool.slot_count"),
        ("kv:64KiB:16:gpu", "--pool.memory"),
        ("kv:64KiB:16:hbm:x", "--pool.memory"),
    ],
)
def test_pool_from_flag_refuses(flag: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        pool_from_flag(flag)
    assert err.value.field == field, err.value


def test_pool_size_or_slot_count() -> None:
    by_size = pool_from_mapping({"name": "kv", "slot_size": "64KiB", "size": "256MiB"}, "pools[0]")
    assert by_size == PoolSpec("kv", 64 * KiB, 4096, "dram")
    assert by_size.size == 256 * MiB
    by_count = pool_from_mapping({"name": "kv", "slot_size": 65536, "slot_count": 4096, "memory": "dram"}, "pools[0]")
    assert by_count == by_size
    # Both given and agreeing is fine; disagreeing is an error, not a silent pick.
    both = {"name": "kv", "slot_size": "64KiB", "slot_count": 4096, "size": "256MiB"}
    assert pool_from_mapping(both, "pools[0]") == by_size
    with pytest.raises(ConfigError) as err:
        pool_from_mapping({**both, "slot_count": 16}, "pools[0]")
    assert err.value.field == "pools[0].size"


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ("not a table", "pools[3]"),
        ({"slot_size": "64KiB", "slot_count": 4}, "pools[3].name"),
        ({"name": "", "slot_size": "64KiB", "slot_count": 4}, "pools[3].name"),
        ({"name": 7, "slot_size": "64KiB", "slot_count": 4}, "pools[3].name"),
        ({"name": "kv", "slot_count": 4}, "pools[3].slot_size"),
        ({"name": "kv", "slot_size": "64KiB"}, "pools[3].slot_count"),
        ({"name": "kv", "slot_size": "64KiB", "slot_count": 0}, "pools[3].slot_count"),
        ({"name": "kv", "slot_size": "64KiB", "slot_count": 1.5}, "pools[3].slot_count"),
        ({"name": "kv", "slot_size": "64KiB", "slot_count": True}, "pools[3].slot_count"),
        ({"name": "kv", "slot_size": "64KiB", "slot_count": "4"}, "pools[3].slot_count"),
        ({"name": "kv", "slot_size": "64KiB", "size": "100KiB"}, "pools[3].size"),
        ({"name": "kv", "slot_size": "64KiB", "size": "lots"}, "pools[3].size"),
        ({"name": "kv", "slot_size": "64KiB", "slot_count": 4, "memory": "hbm"}, "pools[3].memory"),
        ({"name": "kv", "slot_size": "64KiB", "slot_count": 4, "colour": "red"}, "pools[3].colour"),
        ({"name": "kv", "slot_size": "64KiB", "slot_count": 1 << 33}, "pools[3]"),
    ],
)
def test_pool_from_mapping_refuses(raw: Any, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        pool_from_mapping(raw, "pools[3]")
    assert err.value.field == field, err.value


# --------------------------------------------------------------------------- whole configs


def test_default_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    config = NodeConfig().validated()
    assert config.pools == (PoolSpec("kv", 64 * KiB, 4096, "dram"),)
    assert config.pools[0].size == 256 * MiB
    assert config.endpoint == f"ipc://{tmp_path}/kvcr/node.sock"
    assert config.policy == "lru"
    assert 0.0 <= config.low_watermark < 1.0
    assert config.deadline_ms > 0 and config.batch > 0

    monkeypatch.delenv("XDG_RUNTIME_DIR")
    import os

    assert default_endpoint() == f"ipc:///tmp/kvcr-{os.getuid()}/node.sock"
    assert NodeConfig().endpoint == default_endpoint()


def test_toml_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text(
        """
endpoint = "tcp://127.0.0.1:5555"
name = "node-a"
policy = "fifo"
low_watermark = 0.25
protocol_version = 1
deadline_ms = 5000
heartbeat_ms = 500
batch = 64
projection_cache = 32
log_level = "DEBUG"

[[pools]]
name = "full"
slot_size = "64KiB"
slot_count = 1024

[[pools]]
name = "swa"
slot_size = 16384
size = "16MiB"

[[pools]]
name = "state"
slot_size = "1536KiB"
slot_count = 8
memory = "hbm:1"
"""
    )
    config = load_toml(path)
    assert config == NodeConfig(
        endpoint="tcp://127.0.0.1:5555",
        name="node-a",
        pools=(
            PoolSpec("full", 64 * KiB, 1024, "dram"),
            PoolSpec("swa", 16 * KiB, 1024, "dram"),
            PoolSpec("state", 1536 * KiB, 8, "hbm:1"),
        ),
        policy="fifo",
        low_watermark=0.25,
        protocol_version=1,
        deadline_ms=5000,
        heartbeat_ms=500,
        batch=64,
        projection_cache=32,
        log_level="DEBUG",
    )
    # Written back field by field and read again: the same config.
    lines = [
        f"{k} = {v!r}".replace("'", '"')
        for k, v in (
            ("endpoint", config.endpoint),
            ("name", config.name),
            ("policy", config.policy),
            ("low_watermark", config.low_watermark),
            ("protocol_version", config.protocol_version),
            ("deadline_ms", config.deadline_ms),
            ("heartbeat_ms", config.heartbeat_ms),
            ("batch", config.batch),
            ("projection_cache", config.projection_cache),
            ("log_level", config.log_level),
        )
    ]
    for pool in config.pools:
        lines += [
            "[[pools]]",
            f'name = "{pool.name}"',
            f"slot_size = {pool.slot_size}",
            f"slot_count = {pool.slot_count}",
            f'memory = "{pool.memory}"',
        ]
    again = tmp_path / "again.toml"
    again.write_text("\n".join(lines) + "\n")
    assert load_toml(again) == config


def test_toml_only_overrides_what_it_names(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('name = "only-name"\n')
    config = load_toml(path, NodeConfig(endpoint="ipc:///tmp/x.sock"))
    assert config.name == "only-name"
    assert config.endpoint == "ipc:///tmp/x.sock"
    assert config.pools == NodeConfig().pools


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"colour": "red"}, "colour"),
        ({"pool": []}, "pool"),
        ({"batch": "64"}, "batch"),
        ({"batch": 1.0}, "batch"),
        ({"batch": True}, "batch"),
        ({"batch": 0}, "batch"),
        ({"deadline_ms": -1}, "deadline_ms"),
        ({"max_hints_per_session": 0}, "max_hints_per_session"),
        ({"max_hinted_keys_per_session": "64"}, "max_hinted_keys_per_session"),
        ({"low_watermark": "0.1"}, "low_watermark"),
        ({"low_watermark": True}, "low_watermark"),
        ({"low_watermark": 1.0}, "low_watermark"),
        ({"low_watermark": -0.1}, "low_watermark"),
        ({"lease_session_fraction": 1.5}, "lease_session_fraction"),
        ({"lease_session_fraction": "0.5"}, "lease_session_fraction"),
        ({"lease_session_fraction": True}, "lease_session_fraction"),
        ({"put_session_fraction": 0}, "put_session_fraction"),
        ({"put_session_fraction": 1.5}, "put_session_fraction"),
        ({"put_session_fraction": "0.5"}, "put_session_fraction"),
        ({"put_session_fraction": True}, "put_session_fraction"),
        ({"put_pool_fraction": 0.0}, "put_pool_fraction"),
        ({"put_pool_fraction": -0.5}, "put_pool_fraction"),
        ({"put_pool_fraction": float("nan")}, "put_pool_fraction"),
        ({"put_pool_fraction": False}, "put_pool_fraction"),
        ({"endpoint": 5555}, "endpoint"),
        ({"endpoint": "localhost:5555"}, "endpoint"),
        ({"name": ""}, "name"),
        ({"policy": "random"}, "policy"),
        ({"protocol_version": 99}, "protocol_version"),
        ({"pools": {"name": "kv"}}, "pools"),
        ({"pools": []}, "pools"),
        (
            {
                "pools": [
                    {"name": "kv", "slot_size": "4KiB", "slot_count": 4},
                    {"name": "kv", "slot_size": "8KiB", "slot_count": 4},
                ]
            },
            "pools[1].name",
        ),
        ({"pools": [{"name": "kv", "slot_size": "4KiB", "slot_count": 4, "memory": "hbm"}]}, "pools[0].memory"),
    ],
)
def test_from_mapping_refuses(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping(raw)
    assert err.value.field == field, err.value


def test_hint_limits_from_the_file_and_flags() -> None:
    assert (NodeConfig().max_hints_per_session, NodeConfig().max_hinted_keys_per_session) == (1024, 65536)
    config = from_mapping({"max_hints_per_session": 8, "max_hinted_keys_per_session": 64})
    assert (config.max_hints_per_session, config.max_hinted_keys_per_session) == (8, 64)
    config = build_config(_args("--max-hints-per-session", "4", "--max-hinted-keys-per-session", "16"))
    assert (config.max_hints_per_session, config.max_hinted_keys_per_session) == (4, 16)


@pytest.mark.parametrize(("flag", "default"), [
    ("client_transfers", True),  # spec section 6.12: read grants are on by default
    ("peer_grants", False),  # sections 6.12 and 14: other nodes' clients only when the operator says so
    ("integrity", True),  # section 6.12, "Integrity": digests taken and sent with grants
])
def test_switches_from_the_file_and_flags(tmp_path: Path, flag: str, default: bool) -> None:
    """Each switch has its default; TOML and a flag (``--x`` / ``--no-x``) set it, the flag
    winning; anything but a boolean is refused naming the field."""
    option = "--" + flag.replace("_", "-")
    assert getattr(NodeConfig(), flag) is default
    assert getattr(from_mapping({flag: not default}), flag) is (not default)
    assert getattr(build_config(_args(option if not default else "--no-" + option[2:])), flag) is (not default)
    path = tmp_path / "node.toml"
    path.write_text(f"{flag} = {str(not default).lower()}\n")
    assert getattr(build_config(_args("--config", str(path))), flag) is (not default)
    assert getattr(build_config(_args("--config", str(path), option if default else "--no-" + option[2:])), flag) is default
    for bad in (1, "false", "true", None, [True]):
        with pytest.raises(ConfigError) as err:
            from_mapping({flag: bad})
        assert err.value.field == flag


def test_heartbeat_zero_disables_heartbeats() -> None:
    """Spec section 5.2: heartbeat_ms 0 disables heartbeats (and with them silence-based expiry)."""
    assert from_mapping({"heartbeat_ms": 0}).heartbeat_ms == 0
    assert build_config(_args("--heartbeat-ms", "0")).heartbeat_ms == 0
    with pytest.raises(ConfigError) as err:
        from_mapping({"heartbeat_ms": -1})
    assert err.value.field == "heartbeat_ms"


def test_toml_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_toml(tmp_path / "missing.toml")
    assert err.value.field == "--config"
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(ConfigError) as err:
        load_toml(bad)
    assert err.value.field == "--config" and "TOML" in err.value.reason


# --------------------------------------------------------------------------- flags over file over defaults


def _args(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(list(argv))


def test_flags_build_a_config() -> None:
    config = build_config(
        _args(
            "--endpoint",
            "ipc:///tmp/kvcr-cfg/n.sock",
            "--name",
            "n1",
            "--pool",
            "full:64KiB:16",
            "--pool",
            "swa:16KiB:16",
            "--pool",
            "state:1536KiB:2:dram",
            "--policy",
            "fifo",
            "--low-watermark",
            "0.5",
            "--protocol-version",
            "1",
            "--deadline-ms",
            "1500",
            "--log-level",
            "WARNING",
        )
    )
    assert config.endpoint == "ipc:///tmp/kvcr-cfg/n.sock"
    assert config.name == "n1"
    assert [p.name for p in config.pools] == ["full", "swa", "state"]
    assert config.pools[2] == PoolSpec("state", 1536 * KiB, 2, "dram")
    assert (config.policy, config.low_watermark, config.protocol_version) == ("fifo", 0.5, 1)
    assert (config.deadline_ms, config.log_level) == (1500, "WARNING")


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('name = "from-file"\npolicy = "fifo"\n[[pools]]\nname = "a"\nslot_size = "4KiB"\nslot_count = 4\n')
    config = build_config(_args("--config", str(path), "--policy", "lru"))
    assert (config.name, config.policy) == ("from-file", "lru")
    assert config.pools == (PoolSpec("a", 4 * KiB, 4, "dram"),)
    config = build_config(_args("--config", str(path), "--pool", "b:8KiB:2"))
    assert config.pools == (PoolSpec("b", 8 * KiB, 2, "dram"),)  # --pool replaces the file's pools


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (("--pool", "bad"), "--pool"),
        (("--pool", "kv:64KiB:4", "--pool", "kv:4KiB:4"), "pools[1].name"),
        (("--low-watermark", "1.5"), "low_watermark"),
        (("--lease-session-fraction", "-0.1"), "lease_session_fraction"),
        (("--put-session-fraction", "2"), "put_session_fraction"),
        (("--put-pool-fraction", "0"), "put_pool_fraction"),
        (("--protocol-version", "0"), "protocol_version"),
        (("--deadline-ms", "0"), "deadline_ms"),
        (("--endpoint", "nowhere"), "endpoint"),
        # Names travel in welcome, peer hello and event batches, each at most max_name bytes.
        (("--name", "n" * 129), "name"),
        (("--name", "é" * 65), "name"),
        (("--pool", "p" * 129 + ":4KiB:4"), "pools[0].name"),
    ],
)
def test_bad_flags_name_the_field(argv: tuple[str, ...], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config(_args(*argv))
    assert err.value.field == field, err.value


# --------------------------------------------------------------------------- peer links


def test_peer_link_settings(tmp_path: Path) -> None:
    """peer_idle_ms, max_peers and max_peer_clients: defaults, TOML, flags over the file, and
    refusals naming the field."""
    config = NodeConfig().validated()
    assert (config.peer_idle_ms, config.max_peers, config.max_peer_clients) == (30_000, 64, 256)
    path = tmp_path / "node.toml"
    path.write_text("peer_idle_ms = 500\nmax_peers = 4\nmax_peer_clients = 3\n")
    config = load_toml(path)
    assert (config.peer_idle_ms, config.max_peers, config.max_peer_clients) == (500, 4, 3)
    config = build_config(_args("--config", str(path), "--peer-idle-ms", "750", "--max-peers", "9",
                                "--max-peer-clients", "7"))
    assert (config.peer_idle_ms, config.max_peers, config.max_peer_clients) == (750, 9, 7)
    for raw, field in (({"peer_idle_ms": 0}, "peer_idle_ms"), ({"max_peers": -1}, "max_peers"),
                       ({"max_peers": "8"}, "max_peers"), ({"peer_idle_ms": True}, "peer_idle_ms"),
                       ({"max_peer_clients": 0}, "max_peer_clients")):
        with pytest.raises(ConfigError) as err:
            from_mapping(raw)
        assert err.value.field == field, err.value
    with pytest.raises(ConfigError) as err:
        build_config(_args("--max-peers", "0"))
    assert err.value.field == "max_peers"


def test_disk_pools_are_read_apart_from_the_memory_pools(tmp_path: Path) -> None:
    """A pool in ``disk:/DIR`` is one of ``disk_pools`` (architecture §9), from TOML as from flags."""
    config = from_mapping({"pools": [
        {"name": "kv", "slot_size": "64KiB", "slot_count": 16},
        {"name": "kv-disk", "slot_size": "64KiB", "slot_count": 1024, "memory": f"disk:{tmp_path}"},
    ]})
    assert config.pools == (PoolSpec("kv", 64 * KiB, 16, "dram"),)
    assert config.disk_pools == (PoolSpec("kv-disk", 64 * KiB, 1024, f"disk:{tmp_path}"),)
    with pytest.raises(ConfigError) as err:
        NodeConfig(pools=config.disk_pools).validated()
    assert err.value.field == "pools[0].memory"
