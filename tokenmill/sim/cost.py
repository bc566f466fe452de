"""Step-time models: how long the engine takes for one scheduled step.

Both read a step's shape (``StepShape.of``: tokens, sampled rows, attention context) and return
seconds; the roofline also says where the time goes. The formulas live here and nowhere else.

Roofline, for a Llama-family model of L layers, hidden size d, H query and G KV heads of size h,
MLP width I, vocabulary V, over a step of T tokens of which S are sampled:
- FLOPs = 2 T L (2 d H h + 2 d G h + 3 d I) + 2 S d V + 4 L H h C, where C sums each token's context
  (QK^T and AV over the tokens before it);
- bytes = weights (read once a step) + KV read (each request's whole context once) + KV written (T);
- time = max(FLOPs / peak, bytes / bandwidth) / tp-share + 2 L all-reduces of T d activations when
  tensor parallel (a ring: 2 (n - 1) / n of the bytes over the link, plus a latency per hop) + overhead.
"""

from __future__ import annotations

from tokenmill.config import ModelConfig
from tokenmill.core.step_cost import StepShape
from tokenmill.sim.hardware import HardwareProfile

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


def layer_params(cfg: ModelConfig, active: bool = True) -> int:
    """Linear-layer parameters of one layer (averaged over the layers). In a mixture of experts, with
    ``active`` those a token passes through (its top-k experts, the shared expert, the router), else all
    of them (what a step reads once every expert has a token)."""
    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    mlp = 3 * d * cfg.intermediate_size
    if cfg.num_experts:
        experts = cfg.num_experts_per_tok if active else cfg.num_experts
        moe = (3 * d * (experts * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size)
               + d * cfg.num_experts)
        sparse = cfg.num_layers - len(cfg.dense_layers)
        mlp = (sparse * moe + len(cfg.dense_layers) * mlp) // cfg.num_layers
    return 2 * d * q + 2 * d * kv + mlp


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "bf16") -> float:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * DTYPE_BYTES[kv_dtype]


def step_flops(cfg: ModelConfig, s: StepShape) -> float:
    """The step's model FLOPs: linear layers over its tokens, the head over its sampled rows, attention over
    each token's context."""
    return (2 * s.tokens * cfg.num_layers * layer_params(cfg) + 2 * s.sampled * cfg.hidden_size * cfg.vocab_size
            + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * s.attention_context)


def step_bytes(weight_bytes: float, kv_token_bytes: float, s: StepShape) -> float:
    """The step's memory traffic: the weights once, each request's KV context once, the new tokens' KV."""
    return weight_bytes + (s.kv_read_tokens + s.tokens) * kv_token_bytes


class RooflineCost:
    def __init__(self, cfg: ModelConfig, hw: HardwareProfile, weight_dtype: str = "bf16", kv_dtype: str = "bf16",
                 compute_dtype: str = "bf16", tensor_parallel_size: int = 1) -> None:
        for name, v in (("weight dtype", weight_dtype), ("KV dtype", kv_dtype)):
            if v not in DTYPE_BYTES:
                raise ValueError(f"unknown {name} {v!r}: one of {', '.join(DTYPE_BYTES)}")
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {tensor_parallel_size}")
        self.cfg, self.hw, self.tp = cfg, hw, tensor_parallel_size
        self.peak = hw.flops(compute_dtype)
        self.bandwidth = hw.memory_bandwidth * hw.bandwidth_efficiency
        self.linear_params = (cfg.num_layers * layer_params(cfg, active=False)
                              + cfg.hidden_size * cfg.vocab_size)  # + LM head
        self.weight_bytes = self.linear_params * DTYPE_BYTES[weight_dtype]
        self.kv_token_bytes = kv_bytes_per_token(cfg, kv_dtype)
        self.act_bytes = DTYPE_BYTES[compute_dtype]

    def flops(self, s: StepShape) -> float:
        return step_flops(self.cfg, s)

    def bytes(self, s: StepShape) -> float:
        return step_bytes(self.weight_bytes, self.kv_token_bytes, s)

    def allreduce_seconds(self, s: StepShape) -> float:
        if self.tp == 1:
            return 0.0
        n, link = self.tp, self.hw.interconnect_bandwidth
        if link <= 0:
            raise ValueError(f"{self.hw.name} has no interconnect bandwidth for tensor parallelism")
        size = s.tokens * self.cfg.hidden_size * self.act_bytes
        one = 2 * (n - 1) / n * size / link + 2 * (n - 1) * self.hw.interconnect_latency
        return 2 * self.cfg.num_layers * one

    def breakdown(self, s: StepShape) -> dict[str, float]:
        compute = self.flops(s) / (self.peak * self.tp)
        memory = self.bytes(s) / (self.bandwidth * self.tp)
        comm = self.allreduce_seconds(s)
        return {"compute_s": compute, "memory_s": memory, "comm_s": comm,
                "seconds": max(compute, memory) + comm + self.hw.step_overhead}

    def __call__(self, s: StepShape) -> float:
        return self.breakdown(s)["seconds"]


class ScaledCost:
    """Another cost model's step times times ``scale``: what a loaded server adds to the steps its profile
    timed alone (HTTP, detokenization, a benchmark client on the same cores), as its planner measured it
    (the ``tokenmill:step_time_ratio`` gauge, the "step time N% of predicted" log line)."""

    def __init__(self, inner, scale: float) -> None:  # noqa: ANN001
        if not scale > 0:
            raise ValueError(f"--step-time-scale must be positive, got {scale}")
        self.inner, self.scale = inner, scale

    def __call__(self, s: StepShape) -> float:
        return self.scale * self.inner(s)

    def breakdown(self, s: StepShape) -> dict[str, float]:
        return {k: self.scale * v for k, v in self.inner.breakdown(s).items()}
