"""HBM pools through CuPy, imported only when a node declares an ``hbm:N`` pool."""

from __future__ import annotations

from typing import Any


class GpuUnavailable(RuntimeError):
    """CuPy or the requested device is missing."""


def allocate_hbm(size: int, device: int) -> tuple[Any, int]:
    """One CuPy allocation of ``size`` bytes on ``device``; returns (array, address)."""
    try:
        import cupy
    except ImportError as exc:
        raise GpuUnavailable(
            f"pool memory hbm:{device} needs CuPy: install the 'gpu' extra (pip install 'kvcr[gpu]')"
        ) from exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        raise GpuUnavailable(f"pool memory hbm:{device}: no CUDA device is usable ({exc})") from exc
    if device >= count:
        raise GpuUnavailable(f"pool memory hbm:{device}: this machine has {count} CUDA device(s)")
    try:
        dev = cupy.cuda.Device(device)
        with dev:
            array = cupy.zeros(size, dtype=cupy.uint8)
            # zeros() is an asynchronous memset: let it finish before NIXL may write the pool.
            dev.synchronize()
    except (cupy.cuda.memory.OutOfMemoryError, cupy.cuda.runtime.CUDARuntimeError) as exc:
        raise GpuUnavailable(f"pool memory hbm:{device}: cannot allocate {size} bytes ({exc})") from exc
    return array, int(array.data.ptr)
