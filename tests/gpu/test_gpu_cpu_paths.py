"""The GPU feature's paths that need no GPU (architecture §6): ``hbm:N`` pools, the missing-CuPy
error, and how CUDA buffers are described and announced.

No device memory is touched. CUDA and torch objects here are stand-ins that expose only
what ``kvcr_client.buffers.describe`` reads: they check validation and the announcement,
never a transfer. The transfers themselves are in ``test_gpu.py`` (marker ``gpu``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvcr_client.buffers import BufferError, BufferInfo, describe
from kvcr_client.errors import ArgumentError
from kvcr_client.regions import RegionHandle, describe_region
from kvcr_node.config import NodeConfig, from_mapping, hbm_device, pool_from_flag
from kvcr_node.gpu import GpuUnavailable, allocate_hbm
from kvcr_node.memory import PoolMemory
from kvcr_node.poolspec import PoolSpec
from kvcr_protocol import MemoryKind, Region, RegisterRegions, decode, encode

KiB = 1024
HAS_CUPY = importlib.util.find_spec("cupy") is not None
VRAM_PTR = 0x7F12_3450_0000


# --------------------------------------------------------------------------- hbm:N pools


def test_a_node_config_mixes_dram_and_hbm_pools() -> None:
    pools = tuple(pool_from_flag(f) for f in ("kv:64KiB:16", "hbmkv:64KiB:16:hbm:0", "state:1536KiB:4:hbm:3"))
    assert pools == (
        PoolSpec("kv", 64 * KiB, 16, "dram"),
        PoolSpec("hbmkv", 64 * KiB, 16, "hbm:0"),
        PoolSpec("state", 1536 * KiB, 4, "hbm:3"),
    )
    assert [hbm_device(p.memory) for p in pools] == [None, 0, 3]
    config = NodeConfig(endpoint="ipc:///tmp/x.sock", pools=pools).validated()
    assert config.pools == pools
    toml_like = {
        "pools": [
            {"name": "kv", "slot_size": "64KiB", "size": "1MiB"},
            {"name": "hbmkv", "slot_size": "64KiB", "size": "1MiB", "memory": "hbm:0"},
        ]
    }
    assert from_mapping(toml_like).pools == (
        PoolSpec("kv", 64 * KiB, 16, "dram"),
        PoolSpec("hbmkv", 64 * KiB, 16, "hbm:0"),
    )


# --------------------------------------------------------------------------- CuPy missing


@pytest.fixture
def no_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import cupy`` fails in this process, whether or not CuPy is installed."""
    monkeypatch.setitem(sys.modules, "cupy", None)


@pytest.mark.usefixtures("no_cupy")
def test_allocate_hbm_without_cupy_names_cupy_and_the_extra() -> None:
    with pytest.raises(GpuUnavailable) as err:
        allocate_hbm(4096, 1)
    message = str(err.value)
    assert "hbm:1" in message and "CuPy" in message and "'gpu' extra" in message, message
    assert isinstance(err.value, RuntimeError)
    with pytest.raises(GpuUnavailable, match=r"hbm:2 needs CuPy"):
        PoolMemory(PoolSpec("h", 4096, 2, "hbm:2"))


def test_dram_pool_memory_needs_no_cupy(no_cupy: None) -> None:
    mem = PoolMemory(PoolSpec("d", 4096, 2, "dram"))
    try:
        assert (mem.kind, mem.device, mem.nixl_device) == (MemoryKind.DRAM, None, 0)
        assert mem.address % 4096 == 0
    finally:
        mem.close()


def _start_node(endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvcr_node.cli", "--endpoint", endpoint, "--log-level", "WARNING", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(HAS_CUPY, reason="CuPy is installed: the missing-CuPy start-up error cannot happen here")
@pytest.mark.parametrize("how", ["flags", "toml"])
def test_node_with_dram_and_hbm_pools_refuses_to_start_without_cupy(ipc_dir: Path, tmp_path: Path, how: str) -> None:
    """The DRAM pool is allocated and registered first; the HBM pool then fails, cleanly."""
    endpoint = f"ipc://{ipc_dir}/n.sock"
    if how == "flags":
        proc = _start_node(endpoint, "--pool", "kv:4KiB:8", "--pool", "hbmkv:4KiB:8:hbm:0")
    else:
        path = tmp_path / "node.toml"
        path.write_text(
            '[[pools]]\nname = "kv"\nslot_size = "4KiB"\nslot_count = 8\n'
            '[[pools]]\nname = "hbmkv"\nslot_size = "4KiB"\nslot_count = 8\nmemory = "hbm:0"\n'
        )
        proc = _start_node(endpoint, "--config", str(path))
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kvcr-node: error:")]
    assert len(errors) == 1, proc.stderr
    assert "hbm:0 needs CuPy" in errors[0] and "'gpu' extra" in errors[0], errors[0]
    assert "Traceback" not in proc.stderr
    assert "listening on" not in proc.stdout
    assert list(ipc_dir.iterdir()) == []


# --------------------------------------------------------------------------- CUDA buffers announced


class _Device:
    def __init__(self, id: int) -> None:
        self.id = id


class CudaStandIn:
    """Exposes ``__cuda_array_interface__`` and ``.device.id`` the way a CuPy array does."""

    def __init__(self, nbytes: int, device: int, ptr: int = VRAM_PTR, **iface: Any) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None, **iface,
        }
        self.device = _Device(device)


class Tensor:
    """Answers what ``describe`` asks a torch tensor; looks like one by its module name."""

    __module__ = "torch"

    def __init__(self, numel: int, element_size: int, device: int | None, contiguous: bool = True) -> None:
        self._numel, self._element_size, self._device, self._contiguous = numel, element_size, device, contiguous

    def data_ptr(self) -> int:
        return VRAM_PTR if self._device is not None else 0x5555_0000_0000

    def is_contiguous(self) -> bool:
        return self._contiguous

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self._element_size

    @property
    def is_cuda(self) -> bool:
        return self._device is not None

    def get_device(self) -> int:
        return -1 if self._device is None else self._device


def _region_of(buffer: Any, region_id: int = 7) -> RegionHandle:
    """The region handle exactly as ``Client.register`` builds it, before NIXL sees it."""
    return describe_region(buffer, region_id)


@pytest.mark.parametrize("device", [0, 1, 7])
def test_a_cuda_array_is_announced_as_vram_on_its_device(device: int) -> None:
    buf = CudaStandIn(64 * KiB, device)
    handle = _region_of(buf)
    assert (handle.kind, handle.device, handle.address, handle.length) == (MemoryKind.VRAM, device, VRAM_PTR, 64 * KiB)
    assert handle.buffer is buf
    wire = handle.wire()
    assert wire == Region(7, MemoryKind.VRAM, device, VRAM_PTR, 64 * KiB)
    # The announcement carries the kind and device to the node unchanged.
    msg = decode(encode(RegisterRegions(1, b"agent-metadata", (wire,))))
    assert isinstance(msg, RegisterRegions)
    assert msg.regions == (wire,)


def test_a_cuda_array_with_a_row_view_announces_its_own_range() -> None:
    # A CuPy view of rows 2..3 of a (4, 1024) float32 array: contiguous, offset pointer.
    ptr = VRAM_PTR + 2 * 4096
    buf = CudaStandIn(0, 0, ptr=ptr, shape=(2, 1024), typestr="<f4", strides=(4096, 4))
    handle = _region_of(buf)
    assert (handle.kind, handle.address, handle.length) == (MemoryKind.VRAM, ptr, 2 * 4096)


@pytest.mark.parametrize(
    ("iface", "words"),
    [
        ({"shape": (16, 64), "typestr": "<f4", "strides": (512, 4)}, "contiguous"),
        ({"data": (VRAM_PTR, True)}, "read-only"),
    ],
    ids=["strided", "read-only"],
)
def test_a_cuda_array_that_cannot_be_a_region_is_an_argument_error(iface: dict[str, Any], words: str) -> None:
    with pytest.raises(ArgumentError) as err:
        _region_of(CudaStandIn(4096, 0, **iface))
    assert err.value.field == "buffer"
    assert words in str(err.value)


def test_torch_cuda_tensor_is_vram_on_its_device_and_a_cpu_tensor_is_dram() -> None:
    assert describe(Tensor(1024, 2, device=3)) == BufferInfo(MemoryKind.VRAM, VRAM_PTR, 2048, 3)
    handle = _region_of(Tensor(4096, 1, device=0))
    assert handle.wire() == Region(7, MemoryKind.VRAM, 0, VRAM_PTR, 4096)
    assert describe(Tensor(16, 4, device=None)) == BufferInfo(MemoryKind.DRAM, 0x5555_0000_0000, 64, 0)


@pytest.mark.parametrize(
    ("tensor", "words"),
    [(Tensor(64, 4, device=0, contiguous=False), "contiguous"), (Tensor(0, 4, device=0), "empty")],
    ids=["non-contiguous", "empty"],
)
def test_torch_tensor_refused(tensor: Tensor, words: str) -> None:
    with pytest.raises(BufferError) as err:
        describe(tensor)
    assert str(err.value).startswith("buffer: ") and words in str(err.value)
