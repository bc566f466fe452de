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

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenmill.config import ModelConfig
from tokenmill.sim.hardware import HardwareProfile

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


@dataclass(frozen=True)
class StepShape:
    prefill_tokens: int
    decode_tokens: int
    sampled: int  # rows whose logits are computed
    attention_context: int  # sum over the step's tokens of the context each attends to
    kv_read_tokens: int  # sum over the step's requests of their context (read once each)
    decode_context: int  # sum of the decoding requests' contexts
    num_seqs: int

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @classmethod
    def of(cls, sched) -> "StepShape":  # noqa: ANN001 -- a core.scheduler.SchedulerOutput
        attn = kv = dec_ctx = sampled = 0
        for s in sched.scheduled:
            n, start = len(s.token_ids), s.start_pos
            attn += n * start + n * (n + 1) // 2
            kv += start + n
            if n == 1:
                dec_ctx += start + 1
            if s.needs_logits:
                sampled += 1 + s.num_draft_tokens
        return cls(sched.num_prefill_tokens, sched.num_decode_tokens, sampled, attn, kv, dec_ctx, len(sched.scheduled))


def layer_params(cfg: ModelConfig) -> int:
    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return 2 * d * q + 2 * d * kv + 3 * d * cfg.intermediate_size


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "bf16") -> float:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * DTYPE_BYTES[kv_dtype]


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
        self.linear_params = cfg.num_layers * layer_params(cfg) + cfg.hidden_size * cfg.vocab_size  # + LM head
        self.weight_bytes = self.linear_params * DTYPE_BYTES[weight_dtype]
        self.kv_token_bytes = kv_bytes_per_token(cfg, kv_dtype)
        self.act_bytes = DTYPE_BYTES[compute_dtype]

    def flops(self, s: StepShape) -> float:
        c = self.cfg
        return (2 * s.tokens * c.num_layers * layer_params(c) + 2 * s.sampled * c.hidden_size * c.vocab_size
                + 4 * c.num_layers * c.num_heads * c.head_dim * s.attention_context)

    def bytes(self, s: StepShape) -> float:
        return self.weight_bytes + (s.kv_read_tokens + s.tokens) * self.kv_token_bytes

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


FEATURES = ("1", "prefill_tokens", "decode_tokens", "decode_context", "prefill_attention", "sampled")


def features(s: StepShape) -> list[float]:
    prefill_attn = s.attention_context - s.decode_context  # the decodes' share is their context
    return [1.0, s.prefill_tokens, s.decode_tokens, s.decode_context / 1e3, prefill_attn / 1e3, s.sampled]


class CalibratedCost:
    """A linear model of measured step times over the step's shape (FEATURES), fitted by least squares
    to ``tokenmill profile``'s grid on the machine at hand."""

    def __init__(self, coef: list[float], meta: dict | None = None) -> None:
        self.coef, self.meta = np.asarray(coef, dtype=float), meta or {}
        self.floor = float(self.meta.get("min_seconds", 0.0))

    @classmethod
    def fit(cls, shapes: list[StepShape], seconds: list[float], meta: dict | None = None) -> "CalibratedCost":
        x, y = np.asarray([features(s) for s in shapes]), np.asarray(seconds)
        # least squares with no negative per-token cost: a term that comes out negative is dropped and
        # the rest refitted (an active set), so "where the time goes" never reads below zero
        active = list(range(x.shape[1]))
        coef = np.zeros(x.shape[1])
        while True:
            sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
            neg = [a for a, c in zip(active, sol) if c < 0 and a != 0]
            if not neg:
                coef[active] = sol
                break
            active.remove(min(neg, key=lambda a: sol[active.index(a)]))
        return cls(coef.tolist(), {**(meta or {}), "min_seconds": float(min(seconds))})

    def __call__(self, s: StepShape) -> float:
        return max(float(np.dot(self.coef, features(s))), self.floor)

    def breakdown(self, s: StepShape) -> dict[str, float]:
        f = features(s)
        prefill = self.coef[1] * f[1] + self.coef[4] * f[4]
        decode = self.coef[2] * f[2] + self.coef[3] * f[3]
        return {"prefill_s": prefill, "decode_s": decode, "seconds": self(s)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"kind": "calibrated", "features": FEATURES, "coef": self.coef.tolist(),
                                          **self.meta}, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "CalibratedCost":
        try:
            doc = json.loads(Path(path).read_text())
            if doc.get("kind") != "calibrated" or list(doc["features"]) != list(FEATURES):
                raise ValueError("not a calibrated profile of this tokenmill version")
            meta = {k: v for k, v in doc.items() if k not in ("kind", "features", "coef")}
            return cls(doc["coef"], meta)
        except (OSError, json.JSONDecodeError, KeyError, ValueError) as e:
            raise ValueError(f"{path} is not a profile written by `tokenmill profile` ({e})") from None
