"""What generate() returns: text, token ids, finish reason, logprobs and timings per request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Per-request times in seconds (time.perf_counter clock) and derived latencies."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    token_times: list[float]
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    # per generated token: {token_id: logprob} holding the sampled token and the top-n
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: list[RequestMetrics] = field(default_factory=list)  # one per completion (n > 1)
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then {token_id: logprob}
    # holding that prompt token and the top-n after the tokens before it
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # prompt tokens its first sequence found in the prefix cache (the prefix-cache hits counted for it)
    num_cached_tokens: int = 0
    # a pooling request (SamplingParams.pooling): its vector, an embedding or [score] (vLLM's outputs.data)
    pooled: list[float] | None = None
