"""Hardware profiles for the roofline cost model: dense peak FLOP/s per dtype, memory bandwidth and size,
the interconnect between devices of a node (NVLink, PCIe: tensor and pipeline parallelism) and the network
link between nodes (a device's NIC: prefill/decode disaggregation ships KV over it). Datasheet figures,
without sparsity; each names its source."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    peak_flops: dict[str, float]  # dtype -> dense FLOP/s (bf16, fp16, fp8, int8, fp32)
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    interconnect_bandwidth: float = 0.0  # bytes/s per device, one direction (NVLink, PCIe)
    interconnect_latency: float = 5e-6  # s per collective step
    # the network between nodes, per device, one direction: the NIC a device's KV leaves or arrives by
    # (InfiniBand, RoCE, Ethernet); the instances of a disaggregated deployment sit on different nodes
    kv_link_bandwidth: float = 0.0  # bytes/s
    kv_link_latency: float = 5e-6  # s per transfer (assumed: a few microseconds for an RDMA write; the
    # connector's own handshake and completion notice are not modelled)
    source: str = ""
    # fractions of peak a real kernel reaches; 1.0 = the pure roofline (the datasheet profiles keep it)
    flops_efficiency: float = 1.0
    bandwidth_efficiency: float = 1.0
    # fp8/int8 matmuls reach a smaller share of their (twice as high) peak; None: flops_efficiency
    low_precision_flops_efficiency: float | None = None
    step_overhead: float = 0.0  # seconds per engine step (launches, scheduling, sampling)
    sequence_overhead: float = 0.0  # seconds per request in a step (its sampling, inputs, outputs)
    extra: dict = field(default_factory=dict)

    def flops(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(f"{self.name} has no {dtype} peak in its profile (it has {', '.join(self.peak_flops)})")
        low = self.low_precision_flops_efficiency
        return self.peak_flops[dtype] * (low if low is not None and dtype in ("fp8", "int8") else self.flops_efficiency)


T, G = 1e12, 1e9
GBIT = 1e9 / 8  # bytes/s of 1 Gb/s
KNOWN: dict[str, HardwareProfile] = {
    "a100": HardwareProfile("A100 80GB SXM", {"bf16": 312 * T, "fp16": 312 * T, "int8": 624 * T, "fp32": 19.5 * T},
                            2039 * G, 80 * G, 300 * G, kv_link_bandwidth=200 * GBIT,
                            source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM: 2,039 GB/s HBM2e, NVLink 600 GB/s "
                                   "bidirectional); DGX A100 datasheet (8 single-port ConnectX-6 VPI, 200 Gb/s HDR "
                                   "InfiniBand: one per GPU)"),
    "h100": HardwareProfile("H100 SXM", {"bf16": 989.4 * T, "fp16": 989.4 * T, "fp8": 1978.9 * T, "int8": 1978.9 * T,
                                         "fp32": 67 * T},
                            3350 * G, 80 * G, 450 * G, kv_link_bandwidth=400 * GBIT,
                            source="NVIDIA H100 Tensor Core GPU datasheet (SXM: 3.35 TB/s HBM3, NVLink 900 GB/s "
                                   "bidirectional; dense figures, half the sparse ones); DGX H100 (DGX BasePOD "
                                   "reference architecture: 8 single-port ConnectX-7 VPI, 400 Gb/s NDR InfiniBand: "
                                   "one per GPU)"),
    "h200": HardwareProfile("H200 SXM", {"bf16": 989.4 * T, "fp16": 989.4 * T, "fp8": 1978.9 * T, "int8": 1978.9 * T,
                                         "fp32": 67 * T},
                            4800 * G, 141 * G, 450 * G, kv_link_bandwidth=400 * GBIT,
                            source="NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB HBM3e at 4.8 TB/s, NVLink "
                                   "900 GB/s bidirectional); DGX H200 (as DGX H100: 8 ConnectX-7, 400 Gb/s NDR "
                                   "InfiniBand, one per GPU)"),
    "l4": HardwareProfile("L4", {"bf16": 121 * T, "fp16": 121 * T, "fp8": 242.5 * T, "int8": 242.5 * T, "fp32": 30.3 * T},
                          300 * G, 24 * G, 32 * G, kv_link_bandwidth=100 * GBIT,
                          source="NVIDIA L4 Tensor Core GPU datasheet (24 GB GDDR6 at 300 GB/s, PCIe Gen4 x16 64 GB/s "
                                 "bidirectional; dense figures); no reference system: 100 Gb/s Ethernet between "
                                 "nodes assumed"),
}


# What engines achieve, fitted to published measurements (benchmarks/fit_gpu_profiles.py over the figures cited
# in benchmarks/data/gpu_published.json: vLLM's CI, TensorRT-LLM's performance overviews, NVIDIA NIM; BENCHMARKS.md
# "GPU profiles fitted to published measurements" has the fit and the figures held out from it):
# (flops_efficiency, fp8/int8 flops efficiency, bandwidth_efficiency, step_overhead s, sequence_overhead s)
FITTED = {
    "a100": (0.69, 0.69, 0.70, 1.6e-3, 17e-6),  # 6 figures (vLLM V0 latency, TensorRT-LLM 0.15 fp16)
    "h100": (0.55, 0.50, 0.76, 2.1e-3, 5e-6),  # 18 figures (vLLM V0, TensorRT-LLM 0.14-1.0 fp16/fp8, NIM fp8)
    "h200": (0.55, 0.53, 0.70, 2.0e-3, 8e-6),  # 11 figures (vLLM V0, TensorRT-LLM 0.14-1.0 fp16/fp8)
}
for _name, (_f, _f8, _b, _o, _so) in FITTED.items():
    KNOWN[f"{_name}-fitted"] = replace(
        KNOWN[_name], name=f"{KNOWN[_name].name} (fitted)", flops_efficiency=_f, low_precision_flops_efficiency=_f8,
        bandwidth_efficiency=_b, step_overhead=_o, sequence_overhead=_so,
        source=KNOWN[_name].source + "; efficiencies and overheads fitted to published measurements "
                                     "(benchmarks/fit_gpu_profiles.py, BENCHMARKS.md)")


def load_hardware(spec: str) -> HardwareProfile:
    """A known name (a100, h100, h200, l4: datasheet rooflines; a100-fitted, h100-fitted, h200-fitted: what
    engines achieve, fitted to published measurements) or a JSON file with HardwareProfile's fields."""
    key = spec.lower()
    if key in KNOWN:
        return KNOWN[key]
    path = Path(spec)
    if path.suffix == ".json" and path.is_file():
        try:
            fields = json.loads(path.read_text())
            return HardwareProfile(**fields)
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"{spec} is not a hardware profile ({e}); give HardwareProfile's fields as JSON") from None
    raise ValueError(f"unknown hardware {spec!r}: known are {', '.join(KNOWN)}, or a JSON profile file")
