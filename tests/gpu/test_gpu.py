"""GPU memory end to end (architecture §6): HBM pools, CuPy and torch CUDA buffers, real transfers.

Runs where CuPy sees a CUDA device, and is skipped elsewhere with the reason (never faked).
A real ``kvcr-node`` process holds an HBM pool on device 0 (one CuPy allocation registered
with NIXL as VRAM) beside a DRAM pool; this process registers CuPy arrays (and torch CUDA
tensors when torch is installed) with its client's NIXL agent. Every combination of source
buffer, pool and destination buffer is checked byte for byte on the host, whole objects and
projected subsets, and the node is left clean after every test.

CUDA work is asynchronous and kvcr does not synchronise the caller's streams: like an engine,
these tests finish the device work that fills a buffer before handing it to kvcr.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcr_client import ArgumentError, Client, ErrorCode, KeyStatus, RegionHandle, Span
from kvcr_protocol import MemoryKind
from kvcr_testing.health import assert_clean
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Layout, Registrar, plan_destination
from kvcr_testing.nodes import running_node, short_ipc_dir
from kvcr_testing.patterns import KiB, assert_bytes_equal, pattern, sentinel_like

cupy = pytest.importorskip(
    "cupy", reason="GPU tests need CuPy (the 'gpu' extra) and a CUDA GPU: CuPy is not installed"
)


def _device_count() -> tuple[int, str]:
    try:
        return int(cupy.cuda.runtime.getDeviceCount()), "device count 0"
    except Exception as exc:  # no driver or no device: CUDARuntimeError
        return 0, f"{type(exc).__name__}: {exc}"


DEVICES, _WHY = _device_count()
if DEVICES == 0:
    pytest.skip(f"GPU tests need a CUDA GPU: CuPy is installed but sees none ({_WHY})", allow_module_level=True)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("node_left_clean")]

POOLS = (
    "--pool", "hbmkv:64KiB:128:hbm:0",
    "--pool", "kv:64KiB:128",
    "--pool", "hstate:1536KiB:4:hbm:0",
)


def sync() -> None:
    cupy.cuda.runtime.deviceSynchronize()


def on_device(host: np.ndarray) -> Any:
    """A CuPy copy of ``host`` on device 0, the copy finished."""
    with cupy.cuda.Device(0):
        arr = cupy.asarray(host)
    sync()
    return arr


def to_host(buf: Any) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return buf
    sync()
    return np.asarray(cupy.asnumpy(buf))


def buffer(kind: str, host: np.ndarray) -> Any:
    """``host``'s bytes in a new buffer: ``hbm`` (CuPy, device 0) or ``dram`` (numpy)."""
    return on_device(host) if kind == "hbm" else host.copy()


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def node_args() -> tuple[str, ...]:
    return POOLS


# --------------------------------------------------------------------------- helpers


def deposit(client: Client, register: Registrar, key: bytes, layout: Layout, src_kind: str, seed: int) -> np.ndarray:
    """Deposit patterned bytes from a ``src_kind`` buffer; returns the bytes (host copy)."""
    host = pattern(layout.nbytes, seed)
    region = register(buffer(src_kind, host))
    res = client.deposit({key: layout.source_spans(region)}).result(RESULT_TIMEOUT_S)
    assert res[key].status is KeyStatus.STORED, res[key]
    return host


def deliver_and_check(
    client: Client, register: Registrar, key: bytes, layout: Layout, src: np.ndarray, indices: Sequence[int],
    dst_kind: str, seed: int, gap: int = 0, reverse: bool = False,
) -> None:
    """Deliver spans ``indices`` into a fresh sentinel ``dst_kind`` buffer; check every byte on the host."""
    size, offsets = plan_destination(layout, indices, gap, reverse)
    expected = sentinel_like(size, seed)
    dst = buffer(dst_kind, expected)
    region = register(dst)
    spans = []
    for i, off in zip(indices, offsets, strict=True):
        name, _, span_size = layout.spans[i]
        spans.append(Span(name, region, off, span_size))
        expected[off : off + span_size] = layout.src_bytes(src, i)
    res = client.deliver({key: spans}).result(RESULT_TIMEOUT_S)
    assert res[key].status is KeyStatus.OK, (list(indices), dst_kind, res[key])
    assert_bytes_equal(to_host(dst), expected, f"deliver of spans {list(indices)} into {dst_kind}")


def check_whole_and_subsets(
    client: Client, register: Registrar, key: bytes, layout: Layout, src: np.ndarray, dst_kind: str, seed: int
) -> None:
    n = len(layout.spans)
    subsets = [list(range(n)), [0], [n - 1], [0, 2], list(range(0, n, 2)), list(range(n - 1))]
    for s, indices in enumerate(subsets):
        deliver_and_check(client, register, key, layout, src, indices, dst_kind, seed + s)
    deliver_and_check(client, register, key, layout, src, [1, n // 2, n - 1], dst_kind, seed + 20, gap=4 * KiB + 7, reverse=True)
    deliver_and_check(client, register, key, layout, src, range(n), dst_kind, seed + 21, gap=3, reverse=True)


# --------------------------------------------------------------------------- announcement


def test_hbm_pools_and_cuda_regions_are_announced(client: Client, register: Registrar) -> None:
    pools = client.pools
    assert (pools["hbmkv"].memory, pools["kv"].memory, pools["hstate"].memory) == ("hbm:0", "dram", "hbm:0")
    arr = on_device(pattern(256 * KiB, 1))
    region = register(arr)
    assert (region.kind, region.device, region.address, region.length) == (
        MemoryKind.VRAM, 0, int(arr.data.ptr), 256 * KiB,
    )
    rows = on_device(np.zeros((8, 1024), dtype=np.float16))[2:5]
    view = register(rows)
    assert (view.kind, view.address, view.length) == (MemoryKind.VRAM, int(rows.data.ptr), 3 * 1024 * 2)
    host = register(np.zeros(4096, dtype=np.uint8))
    assert host.kind is MemoryKind.DRAM
    with pytest.raises(ArgumentError) as err:
        client.register(on_device(np.zeros((8, 8), dtype=np.uint8))[:, :4])
    assert err.value.field == "buffer" and "contiguous" in str(err.value)


# --------------------------------------------------------------------------- byte-exact transfers

COMBINATIONS = [
    ("hbm", "hbmkv", "hbm"),
    ("hbm", "kv", "hbm"),
    ("hbm", "hbmkv", "dram"),
    ("dram", "hbmkv", "hbm"),
    ("hbm", "kv", "dram"),
    ("dram", "hbmkv", "dram"),
]


@pytest.mark.parametrize(("src_kind", "pool", "dst_kind"), COMBINATIONS, ids=["-".join(c) for c in COMBINATIONS])
def test_deposit_and_deliver_whole_and_subsets(
    client: Client, register: Registrar, key: Callable[[str], bytes], src_kind: str, pool: str, dst_kind: str
) -> None:
    """Source buffer -> pool -> destination buffer, for every mix of DRAM and HBM."""
    layout = Layout([(f"L{i}", pool, 64 * KiB) for i in range(16)])
    k = key("obj")
    src = deposit(client, register, k, layout, src_kind, seed=10)
    check_whole_and_subsets(client, register, k, layout, src, dst_kind, seed=100)


@pytest.mark.parametrize("dst_kind", ["hbm", "dram"])
def test_object_across_dram_and_hbm_pools(
    client: Client, register: Registrar, key: Callable[[str], bytes], dst_kind: str
) -> None:
    """One object whose spans sit in HBM and DRAM pools: one deliver moves both kinds."""
    spans: list[tuple[str, str, int]] = []
    for i in range(6):
        spans += [(f"L{i}.k", "hbmkv", 64 * KiB), (f"L{i}.v", "kv", 64 * KiB)]
    spans.append(("state", "hstate", 1536 * KiB))
    layout = Layout(spans)
    k = key("mixed")
    src = deposit(client, register, k, layout, "hbm", seed=20)
    check_whole_and_subsets(client, register, k, layout, src, dst_kind, seed=200)
    state = layout.index("state")
    deliver_and_check(client, register, k, layout, src, [state], dst_kind, seed=230)
    deliver_and_check(client, register, k, layout, src, [*range(1, state, 2), state], dst_kind, seed=231)


def test_refused_deliver_leaves_the_device_buffer_untouched(
    client: Client, register: Registrar, key: Callable[[str], bytes]
) -> None:
    layout = Layout([(n, "hbmkv", 64 * KiB) for n in ("a", "b", "c")])
    k = key("refused")
    deposit(client, register, k, layout, "hbm", seed=30)
    before = sentinel_like(3 * 64 * KiB, 31)
    dst = on_device(before)
    region = register(dst)
    bad = {
        "out of order": [Span("b", region, 0, 64 * KiB), Span("a", region, 64 * KiB, 64 * KiB)],
        "unknown name": [Span("d", region, 0, 64 * KiB)],
    }
    for what, dspans in bad.items():
        res = client.deliver({k: dspans}).result(RESULT_TIMEOUT_S)
        assert res[k].status is KeyStatus.FAILED, (what, res[k])
        assert res[k].code is ErrorCode.LAYOUT_SUBSET_INVALID, (what, res[k])
    missing = client.deliver({key("absent"): [Span("a", region, 0, 64 * KiB)]}).result(RESULT_TIMEOUT_S)
    assert missing[key("absent")].code is ErrorCode.NOT_FOUND, missing
    assert_bytes_equal(to_host(dst), before, "device buffer after refused delivers")


def test_many_keys_in_one_operation_into_one_device_buffer(
    client: Client, register: Registrar, key: Callable[[str], bytes]
) -> None:
    """A batch: 8 objects from both pools into one CuPy buffer, each at its own offset."""
    layouts = {key(f"o{j}"): Layout([(f"L{i}", "hbmkv" if j % 2 else "kv", 64 * KiB) for i in range(4)]) for j in range(8)}
    sources = {k: deposit(client, register, k, lay, "hbm", seed=40 + j) for j, (k, lay) in enumerate(layouts.items())}
    per = 4 * 64 * KiB
    expected = sentinel_like(per * len(layouts), 49)
    dst = on_device(expected)
    region = register(dst)
    batch = {}
    for j, (k, lay) in enumerate(layouts.items()):
        batch[k] = lay.source_spans(region, base=j * per)
        expected[j * per : (j + 1) * per] = sources[k]
    res = client.deliver(batch).result(RESULT_TIMEOUT_S)
    assert all(res[k].status is KeyStatus.OK for k in layouts), res
    assert_bytes_equal(to_host(dst), expected, "batched deliver into one device buffer")


# --------------------------------------------------------------------------- torch


def test_torch_cuda_tensors(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed: torch CUDA tensors not checked")
    if not torch.cuda.is_available():
        pytest.skip("torch is installed but sees no CUDA device")
    for pool in ("hbmkv", "kv"):
        layout = Layout([(f"L{i}", pool, 64 * KiB) for i in range(8)])
        k = key(pool)
        host = pattern(layout.nbytes, 50)
        # A float16 tensor: what an engine's KV cache looks like; registered by its bytes.
        src = torch.from_numpy(host.copy()).view(torch.float16).reshape(8, -1).to("cuda:0")
        torch.cuda.synchronize()
        region = register(src)
        assert (region.kind, region.device, region.address, region.length) == (
            MemoryKind.VRAM, 0, src.data_ptr(), layout.nbytes,
        )
        res = client.deposit({k: layout.source_spans(region)}).result(RESULT_TIMEOUT_S)
        assert res[k].status is KeyStatus.STORED, res[k]

        expected = sentinel_like(layout.nbytes, 51)
        dst = torch.from_numpy(expected.copy()).to("cuda:0")
        torch.cuda.synchronize()
        dregion = register(dst)
        subset = [1, 4, 7]
        dspans = [Span(f"L{i}", dregion, i * 64 * KiB, 64 * KiB) for i in subset]
        for i in subset:
            expected[i * 64 * KiB : (i + 1) * 64 * KiB] = layout.src_bytes(host, i)
        out = client.deliver({k: dspans}).result(RESULT_TIMEOUT_S)
        assert out[k].status is KeyStatus.OK, out[k]
        torch.cuda.synchronize()
        assert_bytes_equal(dst.cpu().numpy(), expected, f"torch tensor from pool {pool}")
    with pytest.raises(ArgumentError) as err:
        client.register(torch.zeros((8, 8), dtype=torch.uint8, device="cuda:0")[:, :4])
    assert "contiguous" in str(err.value)


# --------------------------------------------------------------------------- start-up errors


def test_node_refuses_an_hbm_pool_on_a_missing_device() -> None:
    short = Path(f"/tmp/kvcr-gpu-missing-{uuid.uuid4().hex[:8]}")
    short.mkdir()
    try:
        cmd = [
            sys.executable, "-m", "kvcr_node.cli", "--endpoint", f"ipc://{short}/n.sock", "--log-level", "WARNING",
            "--pool", "kv:4KiB:8", "--pool", f"h:4KiB:8:hbm:{DEVICES}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (proc.stdout, proc.stderr)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("kvcr-node: error:")]
        assert len(errors) == 1, proc.stderr
        assert f"hbm:{DEVICES}" in errors[0] and f"{DEVICES} CUDA device" in errors[0], errors[0]
        assert "Traceback" not in proc.stderr
        assert list(short.iterdir()) == []
    finally:
        for p in short.iterdir():
            p.unlink()
        short.rmdir()


# --------------------------------------------------------------------------- across nodes


def test_cross_node_deliver_into_a_device_buffer(key: Callable[[str], bytes]) -> None:
    """An object in node A's HBM pool, delivered through node B (hinted) into a CuPy buffer.

    Skipped where nodes cannot deliver from peers yet; once they can, it must pass.
    """
    if importlib.util.find_spec("kvcr_node.peers") is None:
        pytest.skip("this tree has no cross-node delivery (kvcr_node.peers)")
    layout = Layout([(f"L{i}", "hbmkv", 64 * KiB) for i in range(8)])
    k = key("remote")
    with short_ipc_dir("gpux") as d, running_node(d, "a", *POOLS) as a, running_node(d, "b", "--pool", "kv:64KiB:16") as b:
        with Client(a.endpoint, name="gpu-a") as ca, Client(b.endpoint, name="gpu-b") as cb:
            reg_a, reg_b = Registrar(ca), Registrar(cb)
            try:
                src = deposit(ca, reg_a, k, layout, "hbm", seed=60)
                expected = sentinel_like(layout.nbytes, 61)
                dst = on_device(expected)
                region: RegionHandle = reg_b(dst)
                rid = f"gpu-remote-{uuid.uuid4().hex[:8]}"
                cb.submit_hint(rid, a.endpoint, [k]).result(RESULT_TIMEOUT_S)
                res = cb.deliver({k: layout.source_spans(region)}, request_id=rid).result(RESULT_TIMEOUT_S)
                outcome = res[k]
                if outcome.status is KeyStatus.FAILED and outcome.code is ErrorCode.NOT_FOUND:
                    pytest.skip(f"node B does not deliver from hinted peers yet: {outcome.reason}")
                assert outcome.status is KeyStatus.OK, outcome
                assert_bytes_equal(to_host(dst), src, "cross-node deliver into a device buffer")
                cb.discard_hint(rid).result(RESULT_TIMEOUT_S)
            finally:
                reg_a.close()
                reg_b.close()
            assert_clean(ca)
            assert_clean(cb)
