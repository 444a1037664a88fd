"""What a registered buffer is: its address, length, memory kind and device.

Accepts numpy arrays (DRAM), CuPy arrays and torch tensors (VRAM or DRAM), and anything
exposing ``__array_interface__`` or ``__cuda_array_interface__``. Buffers must be
contiguous: a region is one address range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcr_protocol import MemoryKind


class BufferError(TypeError):
    """The object cannot be registered as a buffer; the message says why."""


@dataclass(frozen=True, slots=True)
class BufferInfo:
    """The memory behind a buffer."""

    kind: MemoryKind
    address: int
    length: int
    device: int


def _contiguous(shape: tuple[int, ...], strides: tuple[int, ...] | None, itemsize: int) -> bool:
    if strides is None:
        return True
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides), strict=True):
        if dim > 1 and stride != expected:
            return False
        expected *= dim
    return True


def _itemsize(typestr: str) -> int:
    try:
        return int(typestr[2:])
    except ValueError as exc:
        raise BufferError(f"buffer: unsupported typestr {typestr!r}") from exc


def _from_interface(iface: dict[str, Any], kind: MemoryKind, device: int) -> BufferInfo:
    shape = tuple(int(d) for d in iface["shape"])
    itemsize = _itemsize(iface["typestr"])
    strides = iface.get("strides")
    if strides is not None:
        strides = tuple(int(s) for s in strides)
    if not _contiguous(shape, strides, itemsize):
        raise BufferError("buffer: must be C-contiguous (a region is one address range)")
    address = int(iface["data"][0])
    if iface["data"][1]:
        raise BufferError("buffer: read-only buffers cannot receive deliveries")
    length = itemsize
    for d in shape:
        length *= d
    if length == 0:
        raise BufferError("buffer: is empty")
    if address == 0:
        raise BufferError("buffer: has a null data pointer")
    return BufferInfo(kind, address, length, device)


def _cuda_device(obj: Any) -> int:
    dev = getattr(obj, "device", None)
    for attr in ("id", "index"):
        value = getattr(dev, attr, None)
        if isinstance(value, int):
            return value
    iface_dev = getattr(obj, "__cuda_array_interface__", {}).get("device")
    return int(iface_dev) if isinstance(iface_dev, int) else 0


def describe(buffer: Any) -> BufferInfo:
    """Describe ``buffer`` or raise ``BufferError`` naming the problem."""
    module = type(buffer).__module__
    if module.startswith("torch") and hasattr(buffer, "data_ptr"):
        if not buffer.is_contiguous():
            raise BufferError("buffer: torch tensor must be contiguous")
        length = int(buffer.numel() * buffer.element_size())
        if length == 0:
            raise BufferError("buffer: is empty")
        if buffer.is_cuda:
            return BufferInfo(MemoryKind.VRAM, int(buffer.data_ptr()), length, int(buffer.get_device()))
        return BufferInfo(MemoryKind.DRAM, int(buffer.data_ptr()), length, 0)
    cuda = getattr(buffer, "__cuda_array_interface__", None)
    if isinstance(cuda, dict):
        return _from_interface(cuda, MemoryKind.VRAM, _cuda_device(buffer))
    host = getattr(buffer, "__array_interface__", None)
    if isinstance(host, dict):
        return _from_interface(host, MemoryKind.DRAM, 0)
    raise BufferError(
        f"buffer: {type(buffer).__name__} exposes neither __array_interface__ nor __cuda_array_interface__"
    )
