"""What the front end and the engine core say to each other.

The same messages serve both layouts: in one process the front end hands them to the EngineCore
as objects; with ``--engine-core-process`` they cross a ZeroMQ socket as msgpack (msgspec), never
pickle. Front end -> core: EngineCoreRequest, AbortRequests, Shutdown. Core -> front end: CoreReady once
at startup (or CoreFailed), then a CoreStep after every step (and after commands that change state
while idle), or CoreFailed when the core dies.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgspec

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.perf.step_cost import StepShape
from tokenmill.core.step_planner import Forecast
from tokenmill.core.sched_output import KVOffloadStats, KVTransferStats
from tokenmill.lora.request import LoRARequest, LoRAStats
from tokenmill.perf.roofline import Roofline
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output import RequestConstraints
from tokenmill.spec_decode.stats import SpecStepStats
from tokenmill.engine.tasks import ServedTask


@dataclass(frozen=True)
class StepStats:
    """One engine step, for metrics and the simulator's calibration."""

    start_time: float
    duration: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_scheduled_requests: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    num_preemptions: int  # preemptions in this step
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache this step
    prefix_cache_hits: int = 0  # of which found cached
    spec: SpecStepStats | None = None  # speculative decoding, when on
    # with a latency target (core/step_planner.py): the step's predicted seconds, its token budget and the
    # running-batch target
    predicted_duration: float | None = None
    token_budget: int | None = None
    batch_target: int | None = None
    cost_ratio: float | None = None  # observed over the cost model's step times, recently (it corrects plans)
    # where the duration went (engine/utilization.py): scheduling (with drafting apart), the forward pass,
    # sampling; the rest is applying the outputs
    schedule_s: float = 0.0
    draft_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    flops: float = 0.0  # the step's model FLOPs and memory traffic, by the roofline formulas (perf/cost.py)
    bytes: float = 0.0
    # mixture of experts: tokens routed to each expert this step, per layer ([] for a dense layer)
    expert_tokens: list[list[int]] | None = None
    kv_transfers: list[KVTransferStats] | None = None  # disaggregation: transfers that ended since the last step
    kv_offload: KVOffloadStats | None = None  # the KV tier on local disk, where one is on (core/kv_tier.py)
    shape: StepShape | None = None  # what the step computed, as the cost models see it (--step-log keeps it)
    # the step's composition, for request timelines (engine/timelines.py): per scheduled request (its id, the
    # position it started at, tokens computed without drafts, drafts verified, tokens emitted)
    requests: list[tuple[str, int, int, int, int]] | None = None
    preempted: dict[str, str] | None = None  # preempted request -> the request that needed its blocks
    lora: LoRAStats | None = None  # with --enable-lora: the adapters running and waiting, loads and evictions


# ---- front end -> core ----------------------------------------------------------------


class EngineCoreRequest(msgspec.Struct, tag="add", omit_defaults=True):
    """One sequence (a request with n > 1 sends n of them) as the front end's input processor validated it
    (engine/input_processor.py), its constraints compiled there: the core queues it as it is."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved
    arrival_time: float  # time.perf_counter (CLOCK_MONOTONIC: the same clock in both processes)
    priority: int = 0
    slo_tpot_ms: float | None = None  # its own TPOT SLO
    kv_transfer: dict | None = None  # prefill/decode disaggregation: the request's kv_transfer_params
    constraints: RequestConstraints | None = None  # a structured-output grammar, bad_words (structured_output.py)
    cache_salt: str | None = None  # its own prefix-cache salt (vLLM's cache_salt)
    lora_request: LoRARequest | None = None  # its adapter (--enable-lora); None: the base model


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]
    status: str = "abort"  # a RequestStatus value: "abort", or "stop" when the front end matched a stop string


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class CheckInvariants(msgspec.Struct, tag="check"):
    """Ask the core to check its KV cache's invariants; the answer is the next CoreStep's state."""


class ReportRequests(msgspec.Struct, tag="report"):
    """Ask the core where each of its requests stands (the dashboard's table); the answer is the next
    CoreStep's state.requests."""


ToCore = EngineCoreRequest | AbortRequests | Shutdown | CheckInvariants | ReportRequests


# ---- core -> front end ----------------------------------------------------------------


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one sequence did in one step: its new tokens, and its end if it ended."""

    request_id: str
    new_token_ids: list[int] = []
    new_token_times: list[float] = []
    # per new token: (sampled token's logprob, [(token, logprob), ...top-n]), where asked
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # once, when the prompt is done
    first_scheduled: float | None = None
    num_preemptions: int = 0
    status: str | None = None  # a finished RequestStatus value; None while it runs
    stop_reason: int | str | None = None
    finished_time: float | None = None
    error: str | None = None  # the core could not run it (it finishes as "abort")
    num_cached_tokens: int = -1  # prompt tokens it found in the prefix cache when admitted (-1: not yet)
    pooled: list[float] | None = None  # a pooling request's vector, with its end


class CoreState(msgspec.Struct, omit_defaults=True):
    """The core as of the end of a step or command batch."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_preemptions: int = 0  # in total
    busy_seconds: float = 0.0  # time spent in steps since the core started
    invariant_error: str | None = None  # after CheckInvariants: what is wrong, or None
    invariants_checked: bool = False
    forecast: Forecast | None = None  # with a latency target: what admission predicts TTFT from
    num_added: int = 0  # sequences the core has added since it started (the forecast includes them)
    # after ReportRequests: (request id, RequestStatus value, tokens whose KV is computed) of each request
    requests: list[tuple[str, str, int]] | None = None
    num_waiting_for_kv: int = 0  # disaggregation: consumer requests whose KV is arriving
    num_kv_held: int = 0  # producer requests whose blocks wait for a consumer


class CoreStep(msgspec.Struct, tag="step", omit_defaults=True):
    outputs: list[CoreOutput] = []
    stats: StepStats | None = None  # None: no step ran (the state changed by commands alone)
    state: CoreState = msgspec.field(default_factory=CoreState)


@dataclass(frozen=True)
class CoreInfo:
    """What the front end needs to know of the loaded engine."""

    model_name: str
    model_path: str
    model_config: ModelConfig
    max_model_len: int
    dtype: str
    quantization: str
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    speculative: bool = False
    config: EngineConfig = field(default_factory=EngineConfig)
    device: str = "cpu"  # the torch device the model runs on
    device_uuid: str | None = None  # a GPU's UUID (NVML finds it by that)
    roofline: Roofline | None = None  # the device's peak FLOP/s and bandwidth
    kv_address: list | None = None  # a producer's (host, port) where consumers pull KV
    served: ServedTask = field(default_factory=lambda: ServedTask("generate"))  # generation, embeddings or scores


def plain_info(info: CoreInfo) -> CoreInfo:
    """``info`` as msgpack can carry it: tensors in the model config (Llama 3's RoPE frequency factors)
    become lists."""
    rope = info.model_config.rope_scaling
    if not rope or not any(hasattr(v, "tolist") for v in rope.values()):
        return info
    rope = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in rope.items()}
    return dataclasses.replace(info, model_config=dataclasses.replace(info.model_config, rope_scaling=rope))


class CoreReady(msgspec.Struct, tag="ready"):
    info: CoreInfo
    pid: int
    state: CoreState | None = None  # as loaded (with a latency target: the idle engine's forecast)


class CoreFailed(msgspec.Struct, tag="failed"):
    """The core could not start, or its loop died: why, and the traceback for the log."""

    error_type: str
    message: str
    traceback: str = ""


FromCore = CoreReady | CoreStep | CoreFailed

to_core_encoder = msgspec.msgpack.Encoder()
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_encoder = msgspec.msgpack.Encoder()
from_core_decoder = msgspec.msgpack.Decoder(FromCore)
