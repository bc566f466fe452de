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

Pipeline parallel, P stages of L / P layers and a step cut into m micro-batches (distributed/pipeline.py,
GPipe-style within the step; default m = 1): a stage's turn on one micro-batch reads the stage's weights
(1/P of them) and does 1/(m P) of the step's FLOPs and KV traffic, so stage = max(FLOPs / (m P peak),
(weights / P + KV / (m P)) / bandwidth), each divided over a stage's T tensor-parallel devices, plus their
all-reduces over the stage's L / P layers; a step alone takes (m + P - 1) such turns, of which (P - 1) are
the bubble, plus the last micro-batch's hidden states over P - 1 links (T / m x d activations each) and its
logits back to the first stage (S / m x V x 4 bytes), each with the link's latency. Every micro-batch past
the first reads the weights again: micro-batching shrinks the bubble and costs bandwidth. With N steps in
flight (the engine's default N = P, each of other requests: the scheduler's lanes) the first stage takes
the next step after its m turns on this one (``pipeline_times``), so in the steady state no stage idles and
a request's tokens come every max(latency, N x m turns).

Speculative decoding, k drafts per decoding request, each accepted i.i.d. with probability A:
- verification: the target's step carries 1 + k tokens per decoding request, each with logits, at the
  request's context C (``verify_shape``): T = B (1 + k), S = B (1 + k), attention B ((1 + k) C +
  (1 + k)(2 + k) / 2), KV read B (C + 1 + k); the weights are read once as before, so on a
  bandwidth-bound decode a verification costs about what one token does;
- drafting: n-gram lookup is free; a draft model runs ``draft_passes``: pass 0 over each request's
  tokens it has no KV for (on first sight its whole context, then the token after the accepted drafts,
  two when all were accepted), drafting the first token, then one pass per further draft, one token a
  request, each priced by the draft model's own cost model (its roofline, or a calibrated profile's
  prediction scaled by the draft/target weight bytes, ``draft_weight_ratio``);
- tokens per step: accepted drafts plus the one the target samples after them,
  E = 1 + A + ... + A^k = (1 - A^(k+1)) / (1 - A) (Leviathan et al. 2023, eq. 1), k + 1 at A = 1;
- the off rule (core/draft_policy.py) prices d drafts from the target's and the drafter's step times
  over n tokens of one request at position 0 (``probe_shape``), as the engine times them at startup.

Prefill/decode disaggregation (sim/simulator.py ``Disaggregation``): a producer instance computes a prompt
of n tokens and ships the KV of tokens 0..n-2 to a decode instance, which recomputes token n-1 itself and
samples the first output from it (vLLM's NIXL connector does the same): n - 1 tokens (less any prefix the
consumer holds) of ``kv_bytes_per_token`` each, L x 2 x G x h x element bytes, plus 2 L G x 4 bytes of
float32 scales for an int8/fp8 cache. The transfer takes bytes / bandwidth + latency over the link between
the two nodes (the hardware profile's ``kv_link_bandwidth``: a device's NIC; each device of a tensor or
pipeline parallel instance ships its shard over its own, so an instance's link is the devices' sum).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenmill.config import ModelConfig
from tokenmill.perf.step_cost import StepShape
from tokenmill.perf.hardware import HardwareProfile

if TYPE_CHECKING:
    from tokenmill.perf.step_cost import CalibratedCost

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


SCALED_KV_DTYPES = ("int8", "fp8")  # the engine's quantized KV caches (worker/model_runner.py KV_STORAGE)
KV_SCALE_BYTES = 4  # their float32 scale per token, KV head, layer, for K and for V


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "bf16") -> float:
    """Bytes of K and V of one token over all layers, as the engine lays them out (model_runner.py
    ``allocate_kv_cache``): L x 2 x G x h elements, and for an int8/fp8 cache one float32 scale per token
    and KV head for K and for V in every layer (scale tensors of [num_blocks, block_size, G] float32):
    2 L G (h x element bytes + 4)."""
    scale = KV_SCALE_BYTES if kv_dtype in SCALED_KV_DTYPES else 0
    return 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim * DTYPE_BYTES[kv_dtype] + scale)


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
                 compute_dtype: str = "bf16", tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 micro_batches: int = 0) -> None:
        for name, v in (("weight dtype", weight_dtype), ("KV dtype", kv_dtype)):
            if v not in DTYPE_BYTES:
                raise ValueError(f"unknown {name} {v!r}: one of {', '.join(DTYPE_BYTES)}")
        for name, v in (("tensor", tensor_parallel_size), ("pipeline", pipeline_parallel_size)):
            if v < 1:
                raise ValueError(f"{name} parallel size must be >= 1, got {v}")
        self.cfg, self.hw, self.tp = cfg, hw, tensor_parallel_size
        self.pp, self.micro_batches = pipeline_parallel_size, micro_batches or 1
        self.peak = hw.flops(compute_dtype)
        self.bandwidth = hw.memory_bandwidth * hw.bandwidth_efficiency
        self.linear_params = (cfg.num_layers * layer_params(cfg, active=False)
                              + cfg.hidden_size * cfg.vocab_size)  # + LM head
        self.weight_bytes = self.linear_params * DTYPE_BYTES[weight_dtype]
        self.kv_token_bytes = kv_bytes_per_token(cfg, kv_dtype)
        # activations between layers and devices stay 16-bit where the matmuls run in fp8/int8 (W8A8
        # quantizes each GEMM's input, its output and the residual stream are bf16)
        self.act_bytes = DTYPE_BYTES[compute_dtype] if compute_dtype in ("fp32", "bf16", "fp16") else 2

    def flops(self, s: StepShape) -> float:
        return step_flops(self.cfg, s)

    def bytes(self, s: StepShape) -> float:
        return step_bytes(self.weight_bytes, self.kv_token_bytes, s)

    def allreduce_seconds(self, s: StepShape, tokens: float | None = None, layers: float | None = None) -> float:
        """Tensor parallelism's 2 ring all-reduces a layer of ``tokens`` (the step's) x d activations, over
        ``layers`` (all of them)."""
        if self.tp == 1:
            return 0.0
        n, link = self.tp, self._link()
        size = (s.tokens if tokens is None else tokens) * self.cfg.hidden_size * self.act_bytes
        one = 2 * (n - 1) / n * size / link + 2 * (n - 1) * self.hw.interconnect_latency
        return 2 * (self.cfg.num_layers if layers is None else layers) * one

    def _link(self) -> float:
        if self.hw.interconnect_bandwidth <= 0:
            raise ValueError(f"{self.hw.name} has no interconnect bandwidth for tensor or pipeline parallelism")
        return self.hw.interconnect_bandwidth

    def pipeline_seconds(self, s: StepShape) -> dict[str, float]:
        """One stage's turn on one micro-batch, and the transfers on the step's critical path."""
        p, m = self.pp, min(self.micro_batches, max(s.num_seqs, 1))  # whole requests per micro-batch
        compute = self.flops(s) / (m * p * self.peak * self.tp)
        memory = (self.weight_bytes / p + (self.bytes(s) - self.weight_bytes) / (m * p)) / (self.bandwidth * self.tp)
        reduce = self.allreduce_seconds(s, s.tokens / m, self.cfg.num_layers / p)  # a stage's TP ranks
        link, lat = self._link(), self.hw.interconnect_latency
        comm = ((p - 1) * (s.tokens / m * self.cfg.hidden_size * self.act_bytes / link + lat)
                + s.sampled / m * self.cfg.vocab_size * 4 / link + lat)
        return {"stage_s": max(compute, memory) + reduce, "turns": m + p - 1, "comm_s": comm, "micro_batches": m,
                "compute_s": compute * m * p, "memory_s": memory * m * p, "reduce_s": reduce * m * p}

    def pipeline_times(self, s: StepShape) -> tuple[float, float]:
        """Steps in flight (engine/core.py): (the first stage's turns on this step, after which it takes
        the next one; the step's latency through every stage and back). The engine's per-step overhead is
        the first stage's (rank 0 schedules and samples)."""
        pl = self.pipeline_seconds(s)
        over = self.overhead(s)
        return pl["micro_batches"] * pl["stage_s"] + over, pl["turns"] * pl["stage_s"] + pl["comm_s"] + over

    def overhead(self, s: StepShape) -> float:
        """What a step costs outside the model's kernels: per step, and per request in it."""
        return self.hw.step_overhead + self.hw.sequence_overhead * s.num_seqs

    def breakdown(self, s: StepShape) -> dict[str, float]:
        if self.pp > 1:
            pl = self.pipeline_seconds(s)
            return {"compute_s": pl["compute_s"] / self.pp, "memory_s": pl["memory_s"] / self.pp,
                    "comm_s": pl["comm_s"] + pl["reduce_s"] / self.pp, "bubble_s": (self.pp - 1) * pl["stage_s"],
                    "seconds": pl["turns"] * pl["stage_s"] + pl["comm_s"] + self.overhead(s)}
        compute = self.flops(s) / (self.peak * self.tp)
        memory = self.bytes(s) / (self.bandwidth * self.tp)
        comm = self.allreduce_seconds(s)
        return {"compute_s": compute, "memory_s": memory, "comm_s": comm,
                "seconds": max(compute, memory) + comm + self.overhead(s)}

    def __call__(self, s: StepShape) -> float:
        return self.breakdown(s)["seconds"]


class ScaledCost:
    """Another cost model's step times times ``scale``: what a loaded server adds to the steps its profile
    timed alone (HTTP, detokenization, a benchmark client on the same cores), as its planner measured it
    (the ``tokenmill:step_time_ratio`` gauge, the "step time N% of predicted" log line)."""

    def __init__(self, inner: RooflineCost | CalibratedCost | ScaledCost, scale: float) -> None:
        if not scale > 0:
            raise ValueError(f"--step-time-scale must be positive, got {scale}")
        self.inner, self.scale = inner, scale

    def __call__(self, s: StepShape) -> float:
        return self.scale * self.inner(s)

    def breakdown(self, s: StepShape) -> dict[str, float]:
        return {k: self.scale * v for k, v in self.inner.breakdown(s).items()}

    def pipeline_times(self, s: StepShape) -> tuple[float, float]:
        turn, latency = self.inner.pipeline_times(s)
        return self.scale * turn, self.scale * latency


# ---- prefill/decode disaggregation ------------------------------------------------------------------

def kv_transfer_tokens(prompt_len: int, cached: int = 0) -> int:
    """Prompt tokens whose KV a producer ships: 0..n-2 of an n-token prompt (the consumer recomputes the
    last one to sample the first output token), less the ``cached`` prefix the consumer already holds."""
    return max(prompt_len - 1 - cached, 0)


def kv_transfer_bytes(cfg: ModelConfig, prompt_len: int, kv_dtype: str = "bf16", cached: int = 0) -> float:
    """Bytes of KV (and int8/fp8 scales) a request of ``prompt_len`` prompt tokens ships from the producer
    to the decode instance."""
    return kv_transfer_tokens(prompt_len, cached) * kv_bytes_per_token(cfg, kv_dtype)


def kv_transfer_seconds(nbytes: float, bandwidth: float, latency: float = 0.0) -> float:
    """One transfer over a link of ``bandwidth`` bytes/s that it has to itself: bytes / bandwidth + latency."""
    if not bandwidth > 0:
        raise ValueError(f"a KV link needs a positive bandwidth, got {bandwidth} bytes/s")
    return nbytes / bandwidth + latency


# ---- speculative decoding ----------------------------------------------------------------------------

def expected_tokens_per_step(acceptance: float, drafts: int) -> float:
    """Tokens a request gets from a step with ``drafts`` drafts, each accepted i.i.d. with probability
    ``acceptance`` until the first rejection: the accepted ones plus the target's own token,
    (1 - A^(k+1)) / (1 - A)."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"an acceptance rate is a probability in [0, 1], got {acceptance}")
    if acceptance == 1.0:
        return drafts + 1.0
    return (1.0 - acceptance ** (drafts + 1)) / (1.0 - acceptance)


def rows_shape(rows: Sequence[tuple[int, int]], drafted: bool = False) -> StepShape:
    """The shape of one forward pass over rows of (tokens, start position), as ``StepShape.of`` reads a
    scheduled step. A row of one token is a decode. Otherwise, with ``drafted``, a decode carrying
    tokens - 1 drafts (logits at each, its first token's context a decode's); else a prefill chunk
    (logits at its last token)."""
    prefill = decode = sampled = attn = kv = dec_ctx = 0
    for n, start in rows:
        attn += n * start + n * (n + 1) // 2
        kv += start + n
        if n == 1 or drafted:
            decode += n
            dec_ctx += start + 1
            sampled += n
        else:
            prefill += n
            sampled += 1
    return StepShape(prefill, decode, sampled, attn, kv, dec_ctx, len(rows))


def verify_shape(batch: int, context: int, drafts: int) -> StepShape:
    """The target's step for ``batch`` decoding requests with ``context`` tokens of KV each, verifying
    ``drafts`` drafts each: 1 + drafts tokens a request from position ``context``, logits at every one
    (what the scheduler schedules; ``StepShape.of`` of that step gives the same)."""
    return rows_shape([(1 + drafts, context)] * batch, drafted=True)


def draft_passes(rows: Sequence[tuple[int, int, int]]) -> list[StepShape]:
    """A draft model's forward passes for one step, as ``DraftModelProposer.propose_batch`` runs them.
    rows: (tokens it catches up on, their start position, drafts) per drafting request. Pass 0 runs each
    request's catch-up tokens (logits at the last: the first draft); pass j > 0 feeds draft j back, one
    token a request, for the requests drafting more than j."""
    rows = [r for r in rows if r[2] > 0]
    if not rows:
        return []
    passes = [rows_shape([(n, start) for n, start, _ in rows])]
    for j in range(1, max(d for _, _, d in rows)):
        passes.append(rows_shape([(1, start + n + j - 1) for n, start, d in rows if d > j]))
    return passes


def draft_weight_ratio(target: ModelConfig, draft: ModelConfig, target_dtype: str = "bf16",
                       draft_dtype: str = "bf16") -> float:
    """The draft model's weight bytes over the target's (linear layers and LM head, as the roofline
    reads them): what a calibrated profile's step time is scaled by to price a drafter pass."""
    def weights(cfg: ModelConfig, dtype: str) -> float:
        return (cfg.num_layers * layer_params(cfg, active=False) + cfg.hidden_size * cfg.vocab_size) * DTYPE_BYTES[dtype]
    return weights(draft, draft_dtype) / weights(target, target_dtype)


def probe_shape(n: int) -> StepShape:
    """The engine's off-rule probe (ModelRunner.time_forward): n tokens of one request at position 0,
    logits at each."""
    return StepShape(n, 0, n, n * (n + 1) // 2, n, 0, 1)

