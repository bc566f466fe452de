"""The scheduler-to-runner contract: what a step asks the model runner to compute (``SchedulerOutput``) and what
comes back (``ModelRunnerOutput``). Imports nothing of tokenmill at run time, so the runner, its workers, the
drafters, the KV connector and the simulator depend on these types, not on the scheduler.

A request's data crosses once (``NewRequestData``, its first step); each step then carries only what changed:
the tokens to compute, where they start, and the blocks added to the request's table since the runner last
saw it (``ScheduledRequest.new_block_ids``). The runner keeps its own copy of every table (``BlockTables``);
nothing the scheduler keeps is shared with it by reference."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """Sent once, when the runner first sees a request (it keeps sampling state per request)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    constraints: Any = None  # structured_output.RequestConstraints: a grammar, bad words
    lora_request: Any = None  # lora.request.LoRARequest: the adapter its rows run with (None: the base model)


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the ids to compute this step
    start_pos: int  # position of token_ids[0] == num_computed_tokens before the step
    # blocks appended to the request's table since its last step; with new_table, its whole table (its first
    # step, or its blocks were freed since: a preemption, a failed KV transfer)
    new_block_ids: list[int]
    needs_logits: bool  # this chunk ends the known tokens: sample the next one
    num_draft_tokens: int = 0  # speculative decoding: token_ids[1:] are drafts to verify (logits for each)
    draft_probs: Any = None  # the [drafts, vocab] distributions sampled drafts came from; None: point drafts
    new_table: bool = True


@dataclass(frozen=True)
class ForwardRow:
    """One request's part of a forward pass with its table resolved: what the runner's inputs are built from,
    what it sends the other ranks (they keep no request state) and what a drafter's passes run."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]


class BlockTables(dict):
    """A runner's copy of every request's block table (request id -> block ids), kept from the steps' diffs."""

    def apply(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_request_ids:
            self.pop(rid, None)
        for rid in sched.preempted_request_ids:
            self.pop(rid, None)
        for s in sched.scheduled:
            if s.new_table:
                self[s.request_id] = list(s.new_block_ids)
            elif s.new_block_ids:
                self[s.request_id].extend(s.new_block_ids)

    def row(self, s: ScheduledRequest) -> ForwardRow:
        return ForwardRow(s.token_ids, s.start_pos, self[s.request_id])


@dataclass(frozen=True)
class KVRecv:
    """Disaggregation, consumer side: fill ``block_ids`` (the request's table from ``first_block`` on) with
    the KV of prompt tokens [first_block x block_size, num_tokens) held by the producer ``remote``."""

    request_id: str
    block_ids: list[int]
    first_block: int
    num_tokens: int
    prompt_token_ids: list[int]
    remote: dict | None
    # the KV tier on local disk (core/kv_tier.py) instead of a producer: the hashes of the blocks to read
    block_hashes: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class KVSend:
    """Disaggregation, producer side: a finished request's blocks, held until a consumer pulls them."""

    request_id: str
    block_ids: list[int]
    prompt_token_ids: list[int]


@dataclass(frozen=True)
class KVTransferStats:
    """One KV transfer of prefill/decode disaggregation that ended (kv_transfer/connector.py)."""

    direction: str  # "send" (producer) | "recv" (consumer)
    request_id: str
    num_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None  # None: it succeeded


@dataclass
class KVOffloadStats:
    """The KV tier on local disk (core/kv_tier.py) since the last step: blocks looked up in it at admission and
    found, bytes read and written, each read's seconds (a request's blocks) and each write's (a step's evicted
    blocks), files that failed their check, and the tier's size now."""

    queries: int = 0
    hits: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: list[float] = field(default_factory=list)
    write_seconds: list[float] = field(default_factory=list)
    failures: int = 0
    usage_bytes: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # the runner drops their state
    preempted_request_ids: list[str] = field(default_factory=list)
    # why: each preempted request -> the one that needed its blocks (itself: it needed more than was left)
    preempted_for: dict[str, str] = field(default_factory=dict)
    # preemption by swap, done by the runner before the step's forward pass, in this order:
    # (request id, its blocks in position order) to copy to host memory, then
    # (request id, the fresh blocks) to copy its saved KV back into
    swap_out: list[tuple[str, list[int]]] = field(default_factory=list)
    swap_in: list[tuple[str, list[int]]] = field(default_factory=list)
    kv_recv: list[KVRecv] = field(default_factory=list)  # disaggregation: KV the connector is to pull
    # the KV tier (core/kv_tier.py): cached blocks evicted for reuse this step, as (block, hash), to copy out before
    # the forward pass and write to the tier; then the tier files to delete (by block hash) after those writes
    kv_offload_store: list[tuple[int, bytes]] = field(default_factory=list)
    kv_offload_evict: list[bytes] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What comes back from a step: sampled ids (a list per request, for speculative decoding
    later) and, where asked, logprobs as (sampled token logprob, [(token, logprob), ...top-n])."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[tuple[float, list[tuple[int, float]]]]] = field(default_factory=dict)
    # prompt logprobs, once a request's prompt is done: [None, {token: logprob, top...} per prompt token]
    prompt_logprobs: dict[str, list[dict[int, float] | None]] = field(default_factory=dict)
    # pooling requests whose prompt ended this step: their vector (an embedding, or [score])
    pooled: dict[str, list[float]] = field(default_factory=dict)
