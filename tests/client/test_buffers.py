"""``kvcr_client.buffers.describe``: what a buffer is, or a BufferError naming ``buffer``.

CUDA objects are stand-ins exposing ``__cuda_array_interface__``: this checks validation
only (no device memory is touched or registered).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvcr_client.buffers import BufferError, BufferInfo, describe
from kvcr_protocol import MemoryKind


def test_contiguous_numpy_arrays() -> None:
    a = np.zeros(4096, dtype=np.uint8)
    assert describe(a) == BufferInfo(MemoryKind.DRAM, a.ctypes.data, 4096, 0)
    b = np.zeros((16, 8, 4), dtype=np.float32)
    assert describe(b) == BufferInfo(MemoryKind.DRAM, b.ctypes.data, 16 * 8 * 4 * 4, 0)
    # A contiguous slice starts where it starts.
    s = a[100:300]
    assert describe(s) == BufferInfo(MemoryKind.DRAM, a.ctypes.data + 100, 200, 0)
    rows = b[3:5]
    assert describe(rows) == BufferInfo(MemoryKind.DRAM, b.ctypes.data + 3 * 8 * 4 * 4, 2 * 8 * 4 * 4, 0)
    # Size-1 dimensions may carry any stride.
    col = np.zeros((8, 1), dtype=np.uint16)[:, :]
    assert describe(col).length == 16
    one = np.zeros(1, dtype=np.float64)
    assert describe(one).length == 8


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.zeros(64, dtype=np.uint8)[::2],
        lambda: np.zeros((8, 8), dtype=np.uint8)[:, :4],
        lambda: np.zeros((8, 8), dtype=np.uint8).T,
        lambda: np.asfortranarray(np.zeros((4, 8), dtype=np.float32)),
        lambda: np.zeros(64, dtype=np.uint8)[::-1],
    ],
    ids=["step-2", "column-slice", "transposed", "fortran", "reversed"],
)
def test_non_contiguous_refused(make: Any) -> None:
    with pytest.raises(BufferError) as err:
        describe(make())
    assert str(err.value).startswith("buffer: ")
    assert "contiguous" in str(err.value)


def test_read_only_refused() -> None:
    a = np.zeros(64, dtype=np.uint8)
    a.setflags(write=False)
    with pytest.raises(BufferError) as err:
        describe(a)
    assert str(err.value).startswith("buffer: ") and "read-only" in str(err.value)
    with pytest.raises(BufferError):
        describe(np.frombuffer(b"immutable bytes!", dtype=np.uint8))


@pytest.mark.parametrize("shape", [(0,), (4, 0), (0, 16)])
def test_empty_refused(shape: tuple[int, ...]) -> None:
    with pytest.raises(BufferError) as err:
        describe(np.zeros(shape, dtype=np.uint8))
    assert str(err.value).startswith("buffer: ") and "empty" in str(err.value)


class _Device:
    def __init__(self, id: int) -> None:
        self.id = id


class FakeCuda:
    """Exposes only ``__cuda_array_interface__`` (and optionally ``.device.id``)."""

    def __init__(self, iface: dict[str, Any], device: int | None = None) -> None:
        self.__cuda_array_interface__ = iface
        if device is not None:
            self.device = _Device(device)


def cai(
    shape: tuple[int, ...] = (1024,),
    typestr: str = "|u1",
    ptr: int = 0x7F0000000000,
    readonly: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    return {"shape": shape, "typestr": typestr, "data": (ptr, readonly), "version": 3, **extra}


def test_cuda_interface_is_vram() -> None:
    info = describe(FakeCuda(cai()))
    assert info == BufferInfo(MemoryKind.VRAM, 0x7F0000000000, 1024, 0)
    info = describe(FakeCuda(cai((16, 64), "<f2", strides=None)))
    assert (info.kind, info.length) == (MemoryKind.VRAM, 16 * 64 * 2)
    info = describe(FakeCuda(cai((16, 64), "<f4", strides=(256, 4))))
    assert info.length == 16 * 64 * 4


def test_cuda_device_from_the_object_or_the_interface() -> None:
    assert describe(FakeCuda(cai(), device=3)).device == 3
    assert describe(FakeCuda(cai(device=2))).device == 2
    # The object's own device wins over the interface's.
    assert describe(FakeCuda(cai(device=2), device=5)).device == 5


def test_cuda_interface_wins_over_the_host_interface() -> None:
    obj = FakeCuda(cai())
    obj.__array_interface__ = np.zeros(8, dtype=np.uint8).__array_interface__  # type: ignore[attr-defined]
    assert describe(obj).kind is MemoryKind.VRAM


@pytest.mark.parametrize(
    ("iface", "words"),
    [
        (cai((16, 64), "<f4", strides=(512, 4)), "contiguous"),
        (cai((16, 64), "<f4", strides=(4, 64)), "contiguous"),
        (cai(readonly=True), "read-only"),
        (cai((0,)), "empty"),
        (cai(ptr=0), "null"),
        (cai(typestr="<M8[ns]"), "typestr"),
    ],
    ids=["row-gap", "column-major", "read-only", "empty", "null-pointer", "bad-typestr"],
)
def test_cuda_interface_refused(iface: dict[str, Any], words: str) -> None:
    with pytest.raises(BufferError) as err:
        describe(FakeCuda(iface))
    assert str(err.value).startswith("buffer: ")
    assert words in str(err.value)


@pytest.mark.parametrize("obj", [b"bytes", bytearray(16), memoryview(bytearray(16)), [1, 2, 3], None, 42, object()])
def test_neither_interface_refused(obj: Any) -> None:
    with pytest.raises(BufferError) as err:
        describe(obj)
    message = str(err.value)
    assert message.startswith("buffer: ")
    assert type(obj).__name__ in message
    assert "__array_interface__" in message and "__cuda_array_interface__" in message


def test_buffer_error_is_a_type_error() -> None:
    assert issubclass(BufferError, TypeError)
