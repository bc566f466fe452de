"""The device's roofline: its peak FLOP/s and memory bandwidth, against which /metrics sets what the
engine's steps achieve (engine/utilization.py). A datasheet's figures for the GPUs the capacity simulator
knows (perf/hardware.py), else measured once per process: a GEMM and a streaming read in torch."""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Roofline:
    device: str  # what it is, in words
    peak_flops: float  # FLOP/s
    peak_bandwidth: float  # bytes/s
    source: str  # where the peaks come from


@functools.cache
def machine_roofline(device_type: str, device_index: int | None, dtype_name: str,
                     measure: bool = True) -> Roofline | None:
    """The roofline of the device the engine runs on, computing in ``dtype_name`` (a torch dtype's name):
    a known GPU's datasheet, else measured (None when ``measure`` is off)."""
    import torch

    dtype = getattr(torch, dtype_name)
    if device_type == "cuda":
        from tokenmill.perf.hardware import KNOWN

        name = torch.cuda.get_device_name(device_index)
        key = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype_name, "bf16")
        for short, hw in KNOWN.items():
            if re.search(rf"\b{short}\b", name, re.IGNORECASE) and key in hw.peak_flops:  # an L40S is no L4
                return Roofline(name, hw.peak_flops[key], hw.memory_bandwidth, f"datasheet: {hw.source}")
        device = torch.device("cuda", device_index)
    else:
        from tokenmill.platform import cpu_name

        name = f"{cpu_name()}, {torch.get_num_threads()} threads"
        device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    if not measure:
        return None
    flops, bandwidth, how = _measure(device, dtype)
    return Roofline(name, flops, bandwidth, how)


def _measure(device, dtype) -> tuple[float, float, str]:
    """Peak FLOP/s from a square GEMM and bandwidth from summing a buffer far larger than the caches,
    each the best of a few runs (noise only slows a run down). About 0.3 s and 256 MiB on a 2-core CPU."""
    import torch

    cuda = device.type == "cuda"
    n = 8192 if cuda else 1024
    mib = 1024 if cuda else 256

    def best(fn, runs: int) -> float:
        fn()
        times = []
        for _ in range(runs):
            if cuda:
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t)
        return min(times)

    def gemm() -> float:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        return best(lambda: torch.mm(a, b), 4)

    def read() -> float:
        buf = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
        return best(buf.sum, 4)

    with torch.inference_mode():
        gemm_s, read_s = gemm(), read()  # each frees its buffers when it returns
    dname = str(dtype).removeprefix("torch.")
    return (2 * n**3 / gemm_s, mib * 2**20 / read_s,
            f"measured at startup: {n}x{n} {dname} GEMM in torch, a {mib} MiB streaming read")


def weight_bytes_read(model) -> int:
    """Bytes of weights a step reads once: every tensor of the model but those it gathers a few rows of (the
    embedding table, the RoPE tables); the embedding counts when it also serves as the output head."""
    gathered = [m for m in (getattr(model, "embed_tokens", None), getattr(model, "rope", None)) if m is not None]
    skip = {id(t) for m in gathered for t in (*m.parameters(), *m.buffers())}
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        if id(t) in skip or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    embed = getattr(model, "embed_tokens", None)
    if embed is not None and getattr(model, "head", None) is None and getattr(model, "lm_head", None) is None:
        total += embed.weight.numel() * embed.weight.element_size()  # the tied head is the embedding
    return total
