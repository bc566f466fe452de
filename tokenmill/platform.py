"""What the device offers: the CPU's name and feature flags, fast dtypes and free memory."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _cpuinfo(field: str) -> str:
    """The first ``field`` line's value in /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith(field)), "")
    except OSError:
        return ""


def cpu_flags() -> set[str]:
    """The CPU's feature flags as the kernel reports them (empty off Linux)."""
    return set(_cpuinfo("flags").split())


def cpu_name() -> str:
    import platform

    return _cpuinfo("model name") or platform.processor() or "unknown CPU"


def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX makes bf16 GEMMs several times faster than fp32 on x86 CPUs."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def resolve_dtype(name: str, device: torch.device, cpu_kernels: bool = False) -> torch.dtype:
    """--dtype auto: bf16/fp16 on GPUs; on a CPU float32 where tokenmill's kernels run (``cpu_kernels``:
    every mode is then batch invariant, and they take float32 activations), else bf16 where it is fast."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "cpu" and not cpu_kernels and cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA GPU is available to PyTorch; use --device cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--device mps was asked for but MPS is not available; use --device cpu")
    return device


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
