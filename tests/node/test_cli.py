"""``kvcr-node`` and ``kvcr`` as a user runs them: exit codes and one clear line on error."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

TIMEOUT_S = 60


def run_node(*argv: str, endpoint: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m kvcr_node.cli`` to completion (bounded); a bad config never starts a node."""
    args = [sys.executable, "-m", "kvcr_node.cli"]
    if endpoint is not None:
        args += ["--endpoint", endpoint]
    return subprocess.run([*args, *argv], capture_output=True, text=True, timeout=TIMEOUT_S, check=False)


def run_tool(*argv: str) -> subprocess.CompletedProcess[str]:
    code = "import sys; from kvcr_client.tool import main; sys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvcr-node: error: "), lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (("--pool", "bad"), "--pool"),
        (("--pool", "kv:64KiB:zero"), "--pool.slot_count"),
        (("--pool", "kv:64KiB:4:gpu"), "--pool.memory"),
        (("--pool", "kv:4KiB:4", "--pool", "kv:8KiB:4"), "pools[1].name"),
        (("--low-watermark", "2"), "low_watermark"),
        (("--endpoint", "no-scheme"), "endpoint"),
        (("--log-format", "xml"), "log_format"),
    ],
)
def test_bad_config_exits_non_zero_with_one_line(ipc_dir: Path, argv: tuple[str, ...], field: str) -> None:
    proc = run_node(*argv, endpoint=f"ipc://{ipc_dir}/n.sock")
    assert proc.returncode != 0
    line = one_error_line(proc)
    assert line.startswith(f"kvcr-node: error: {field}: "), line
    assert "listening" not in proc.stdout
    assert "Traceback" not in proc.stderr
    assert list(ipc_dir.iterdir()) == []


def test_bad_config_file(tmp_path: Path, ipc_dir: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('name = "n"\ncolour = "red"\n')
    proc = run_node("--config", str(path), endpoint=f"ipc://{ipc_dir}/n.sock")
    assert proc.returncode != 0
    assert one_error_line(proc) == "kvcr-node: error: colour: unknown configuration field"
    proc = run_node("--config", str(tmp_path / "missing.toml"), endpoint=f"ipc://{ipc_dir}/n.sock")
    assert proc.returncode != 0
    assert one_error_line(proc).startswith("kvcr-node: error: --config: cannot read ")


def _hbm_cases() -> list[Any]:
    cases: list[Any] = [pytest.param("hbm:4096", id="hbm-no-such-device")]
    # With CuPy and a GPU, hbm:0 starts a node: that path belongs to the GPU tests.
    has_cupy = importlib.util.find_spec("cupy") is not None
    cases.append(pytest.param("hbm:0", id="hbm0", marks=pytest.mark.skipif(has_cupy, reason="CuPy is installed")))
    return cases


@pytest.mark.parametrize("memory", _hbm_cases())
def test_hbm_pool_without_a_usable_gpu(ipc_dir: Path, memory: str) -> None:
    proc = run_node("--pool", f"kv:64KiB:4:{memory}", endpoint=f"ipc://{ipc_dir}/n.sock")
    assert proc.returncode != 0
    line = one_error_line(proc)
    assert memory in line, line
    assert "CuPy" in line or "device" in line, line
    assert "Traceback" not in proc.stderr
    assert list(ipc_dir.iterdir()) == []


def test_pool_too_big_to_allocate_names_the_pool_and_its_size(ipc_dir: Path) -> None:
    """100000 slots of 1 GiB cannot be mapped: the one error line says which pool and how big."""
    proc = run_node("--pool", "small:4KiB:4", "--pool", "huge:1GiB:100000", endpoint=f"ipc://{ipc_dir}/n.sock")
    assert proc.returncode != 0
    line = one_error_line(proc)
    assert "'huge'" in line and "'small'" not in line, line
    assert str(100000 * (1 << 30)) in line, line
    assert "Traceback" not in proc.stderr
    assert list(ipc_dir.iterdir()) == []


def test_endpoint_that_cannot_be_bound() -> None:
    proc = run_node("--pool", "kv:4KiB:4", endpoint="tcp://999.1.1.1:5")
    assert proc.returncode != 0
    line = one_error_line(proc)
    assert "cannot start" in line and "999.1.1.1" in line, line


def test_version() -> None:
    proc = run_node("--version")
    assert proc.returncode == 0
    assert proc.stdout.startswith("kvcr-node ")
    tool = run_tool("version")
    assert tool.returncode == 0 and tool.stdout.strip()
    assert tool.stdout.strip() == proc.stdout.strip().removeprefix("kvcr-node ")


def test_tool_stats_of_a_running_node(node_factory: Callable[..., Any]) -> None:
    node = node_factory("--pool", "kv:4KiB:8", "--name", "cli-node")
    proc = run_tool("stats", "--endpoint", node.endpoint, "--timeout", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    st = json.loads(proc.stdout)
    assert st["node"] == "cli-node"
    assert st["pools"]["kv"]["total"] == 8
    assert "invariants" not in st  # the accounting check runs only when asked
    assert st["claims"]["total"] == 0
    proc = run_tool("stats", "--endpoint", node.endpoint, "--timeout", "5", "--json", "--audit")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["invariants"] == []


def test_second_node_on_a_live_ipc_path_is_refused(ipc_dir: Path, node_factory: Callable[..., Any]) -> None:
    """Starting kvcr-node twice on one ipc path fails with one line; the first node keeps serving."""
    from kvcr_client import Client

    first = node_factory("--pool", "kv:4KiB:8", "--name", "first")
    proc = run_node("--pool", "kv:4KiB:8", "--name", "second", endpoint=first.endpoint)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    line = one_error_line(proc)
    assert "another kvcr-node is serving" in line and first.endpoint in line, line
    assert "listening" not in proc.stdout
    with Client(first.endpoint) as client:
        st = client.stats(audit=True).result(10)
    assert st["node"] == "first" and st["invariants"] == []


def test_stale_ipc_socket_of_a_dead_node_is_recovered(ipc_dir: Path, node_factory: Callable[..., Any]) -> None:
    """A node killed with SIGKILL leaves its socket file; the next node on that path replaces it."""
    from kvcr_client import Client

    dead = node_factory("--pool", "kv:4KiB:8", "--name", "dead")
    dead.kill()
    path = Path(dead.endpoint.removeprefix("ipc://"))
    assert path.exists()
    from kvcr_testing.nodes import running_node

    with running_node(ipc_dir, "n0", "--pool", "kv:4KiB:8", "--name", "again") as again:
        assert again.endpoint == dead.endpoint
        with Client(again.endpoint) as client:
            assert client.stats().result(10)["node"] == "again"


def test_ipc_path_served_by_another_process_is_refused(ipc_dir: Path) -> None:
    """A process that holds no kvcr lock (an older node, say) but answers on the socket is not displaced."""
    import zmq

    endpoint = f"ipc://{ipc_dir}/other.sock"
    ctx = zmq.Context()
    other = ctx.socket(zmq.ROUTER)
    other.setsockopt(zmq.LINGER, 0)
    try:
        other.bind(endpoint)
        proc = run_node("--pool", "kv:4KiB:8", endpoint=endpoint)
        assert proc.returncode == 2, (proc.stdout, proc.stderr)
        line = one_error_line(proc)
        assert "another process is serving" in line, line
        assert Path(endpoint.removeprefix("ipc://")).exists()
    finally:
        other.close(0)
        ctx.term()
