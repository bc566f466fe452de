"""Request state as the scheduler sees it: token ids, how many have KV, and timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.lora.request import LoRARequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV dropped; recomputed when readmitted
    WAITING_FOR_KV = "waiting_for_kv"  # disaggregation: admitted, its blocks reserved, its KV arriving
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context limit
    FINISHED_ABORTED = "abort"
    FINISHED_REJECTED = "rejected"  # never admitted: cannot fit

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "rejected")


@dataclass
class RequestTimings:
    """Wall-clock times (time.perf_counter seconds) the metrics are built from."""

    arrival: float = 0.0
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per output token, when it was produced
    finished: float | None = None

    @property
    def first_token(self) -> float | None:
        return self.token_times[0] if self.token_times else None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_tokens: int = 16  # resolved: never None here
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    num_drafts: int = 0  # speculative decoding: draft tokens proposed for this request, and accepted
    num_accepted_drafts: int = 0
    draft_acceptance: float = 1.0  # recent per-draft acceptance (core/draft_policy.py); optimistic at first
    num_steps_without_drafts: int = 0
    # drafts proposed after its last step (spec_decode/step.py) for its next one, their slots reserved
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: Any = None  # the draft model's distributions over them (a tensor), or None (n-gram)
    promoted: bool = False  # priority policy: waited past the starvation bound, now ahead of all
    timings: RequestTimings = field(default_factory=RequestTimings)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    constraints: object = None  # structured_output.RequestConstraints, compiled at add_request
    slo_tpot_ms: float | None = None  # its own time-per-output-token SLO (the SLO planner meets the tightest)
    # prefill/decode disaggregation (kv_transfer/): {"do_remote_decode": True} on a producer;
    # {"do_remote_prefill": True, "remote_host", "remote_port", "remote_request_id"} on a consumer
    kv_transfer: dict | None = None
    error: str | None = None  # why the engine ended it (reported with its abort)
    cache_salt: str | None = None  # its own prefix-cache salt: shares blocks only with the same salt
    # prompt tokens found in the prefix cache at its first admission (-1: not admitted yet), vLLM's name
    num_cached_tokens: int = -1
    pooled: list[float] | None = None  # a pooling request's vector (an embedding, or [score]), once computed
    lora_request: LoRARequest | None = None  # its adapter (tokenmill/lora/); None: the base model

    def __post_init__(self) -> None:
        if not self.timings.arrival:
            self.timings.arrival = time.perf_counter()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Token ids in [start, end) of prompt + output, without building the concatenation."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
