"""What this machine offers: backend, device name and memory, feature-detected per backend."""

from __future__ import annotations

import contextlib
import os
import platform
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceInfo:
    backend: str  # "metal", "cuda" or "cpu"
    device: str  # e.g. "Apple M2 Ultra"
    memory_bytes: int  # memory the model can use: the GPU working set on Metal, else RAM
    total_memory_bytes: int


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def metal_info() -> dict:
    """MLX's description of the Metal GPU (`max_recommended_working_set_size`, `memory_size`,
    `device_name`); {} where there is no Metal GPU (Linux, CUDA, an MLX without Metal)."""
    import mlx.core as mx

    if not on_metal():
        return {}
    query = (
        getattr(mx, "device_info", None) or mx.metal.device_info
    )  # mx.metal.device_info is deprecated
    return dict(query())


def on_metal() -> bool:
    """MLX has a Metal GPU here (False on Linux, on CUDA, and in an MLX without Metal)."""
    import mlx.core as mx

    metal = getattr(mx, "metal", None)
    return metal is not None and metal.is_available()


def on_cuda() -> bool:
    """MLX computes on a CUDA GPU here: its CUDA build with a device, and the GPU the default
    device (False on Metal, on a CPU build, and with the CPU made the default)."""
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    return (
        cuda is not None
        and bool(getattr(cuda, "is_available", lambda: False)())
        and mx.default_device().type == mx.DeviceType.gpu
    )


def device_info() -> DeviceInfo:
    import mlx.core as mx

    ram = _ram_bytes()
    info = metal_info()
    if info:
        working_set = int(
            info.get("max_recommended_working_set_size") or info.get("memory_size") or ram
        )
        return DeviceInfo(
            "metal",
            str(info.get("device_name", "Apple GPU")),
            working_set,
            int(info.get("memory_size") or ram),
        )
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and getattr(cuda, "is_available", lambda: False)():
        try:
            info = mx.device_info()
            mem = int(info.get("memory_size") or info.get("total_memory") or ram)
            name = str(info.get("device_name") or info.get("name") or "NVIDIA GPU")
        except Exception:  # noqa: BLE001 - older MLX: no device_info on CUDA
            mem, name = ram, "NVIDIA GPU"
        return DeviceInfo("cuda", name, mem, mem)
    return DeviceInfo("cpu", platform.processor() or platform.machine() or "cpu", ram, ram)


def release_memory() -> int:
    """Give back what nothing references any more: collect cycles (a model's modules and state refer
    to each other, so dropping a model frees nothing until then) and MLX's cached buffers. Returns
    the bytes MLX still holds. Whoever drops one model to load or measure another calls this first,
    or both sit in memory at once."""
    import gc

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def ieee_float32(dtype=None):
    """A context in which float32 matmuls are IEEE float32: the CPU stream where the default device
    is a GPU, whose float32 matmuls MLX computes in TF32 unless MLX_ENABLE_TF32=0 (CUDA, M5's NAX;
    ~1e-3 relative); otherwise, or for another `dtype` (half precision has no TF32
    path), no change. For the exactness checks: the structure probe, the load-time check's shares
    and reference."""
    import mlx.core as mx

    if (dtype is not None and dtype != mx.float32) or mx.default_device().type != mx.DeviceType.gpu:
        return contextlib.nullcontext()
    return mx.stream(mx.cpu)
