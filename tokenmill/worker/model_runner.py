"""ModelRunner: turns a SchedulerOutput into tensors, runs one forward pass, samples.

It owns the KV-cache tensors and a small per-request state (sampling parameters, token
history for penalties, private generator). Only plain data comes in and goes out.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from tokenmill.config import ModelConfig
from tokenmill.core.sched_output import (BlockTables, ForwardRow, ModelRunnerOutput, NewRequestData, ScheduledRequest,
                                         SchedulerOutput)
from tokenmill.distributed.pipeline import pipelined_forward
from tokenmill.layers.attention import AttentionMetadata, PrefillChunk
from tokenmill.layers.sampler import Sampler
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.perf.cost import kv_bytes_per_token
from tokenmill.spec_decode.rejection import verify_drafts
from tokenmill.structured_output import GrammarCompiler, RequestConstraints
from tokenmill.worker.pooling import Pooler, PoolStep
from tokenmill.worker.sampling_inputs import SamplingInputs
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from collections.abc import Callable

    from tokenmill.distributed.pipeline import PendingLogits


@dataclass
class _RequestState:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None
    stop_ids: list[int] = field(default_factory=list)  # banned until min_tokens
    constraints: RequestConstraints | None = None
    matcher: object = None  # the grammar's llguidance matcher, advanced by every emitted token
    prompt_logprobs: dict[int, dict[int, float]] | None = None  # position -> logprobs, until emitted
    lora: Any = None  # its adapter (a lora.request.LoRARequest), or None


KV_STORAGE = {"int8": torch.int8, "fp8": torch.uint8}  # fp8 e4m3 kept as its bits (layers/attention.py)


@dataclass
class _Launched:
    """A step between launch() and finish(): its logits (or the pass in flight) and how to sample them."""

    logits: Any  # torch.Tensor, or distributed/pipeline.py's PendingLogits
    sample_reqs: list
    prompt_rows: list
    sample_rows: list[int]
    forward_s: float  # the driver's own part of the forward pass, at launch
    pool: PoolStep | None = None  # pooling requests' rows (worker/pooling.py), where the step has any


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of K and V (and their scales) per token over all layers: what admission and metrics count, by
    the one formula (perf/cost.py ``kv_bytes_per_token``) for the pool ``allocate_kv_cache`` lays out."""
    return int(kv_bytes_per_token(cfg, _DTYPE_NAMES[dtype] if kv_cache_dtype == "auto" else kv_cache_dtype))


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device, kv_cache_dtype: str = "auto",
                      zeroed: bool = True) -> list[tuple[torch.Tensor, ...]]:
    """One (K, V[, K scales, V scales]) per layer. zeroed: the torch attention paths read padding slots
    under a mask, and 0 * NaN from stale memory would still poison the output; where attention reads
    only written slots (zeroed=False), the pool is left uninitialized and its pages touched as used."""
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    new = torch.zeros if zeroed else torch.empty
    if kv_cache_dtype == "auto":
        return [(new(shape, dtype=dtype, device=device), new(shape, dtype=dtype, device=device))
                for _ in range(cfg.num_layers)]
    store = KV_STORAGE[kv_cache_dtype]
    return [(new(shape, dtype=store, device=device), new(shape, dtype=store, device=device),
             new(shape[:3], device=device), new(shape[:3], device=device))
            for _ in range(cfg.num_layers)]


def _advance(st: _RequestState, tokens: list[int]) -> None:
    """Move a request's grammar past its emitted tokens (each one allowed by its mask)."""
    if st.matcher is not None:
        st.matcher.consume_tokens(tokens)


class Forwarder(Protocol):
    """How a forward pass reaches every rank (an executor, executor/): the runner calls ``run_forward`` with
    its own share (``local_forward``); under pipeline parallelism the pass comes back in flight (``wait``)."""

    def run_forward(self, order: list[ForwardRow], logits_rows: list[int],
                    local_forward: Callable[[list[ForwardRow], list[int]], object]) -> object: ...

    def wait(self, pending: PendingLogits) -> torch.Tensor: ...


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches, block_size: int, device: torch.device, seed: int,
                 executor: Forwarder | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.vocab_size = model.cfg.vocab_size
        self.sampler = Sampler(torch.Generator(device).manual_seed(seed))
        self.states: dict[str, _RequestState] = {}
        self.block_tables = BlockTables()  # every request's table, kept from the steps' diffs
        self.swapped: dict[str, list[tuple[torch.Tensor, ...]]] = {}  # preempted by swap: KV in host memory
        self.kv_tier = None  # the KV tier on local disk (worker/kv_tier.py), with --kv-offload-size
        self.grammars: GrammarCompiler | None = None  # set by the engine: structured outputs
        # on the driver (rank 0) under tensor or pipeline parallelism: every forward pass is first sent to the
        # other ranks, which run the same one on their shards (executor/); None: this process is every rank
        self.executor = executor
        self.pipeline = None  # (group, micro-batches) when this rank is a pipeline stage (distributed/pipeline.py)
        self.pooler = Pooler()  # pooling requests (embeddings, scores)
        self.sampling_inputs = SamplingInputs(device, self.vocab_size)  # what each step's sampler reads
        self.lora = None  # --enable-lora: the adapters' pool and slots (lora/manager.py), set by the builder

    # ---- request state ---------------------------------------------------------------

    def _add(self, r: NewRequestData) -> None:
        p = r.sampling_params
        gen = None if p.seed is None else torch.Generator(self.device).manual_seed(p.seed)
        stop_ids = sorted(t for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
                          if t < self.vocab_size)
        st = _RequestState(list(r.prompt_token_ids), list(r.output_token_ids), p, r.eos_token_ids, gen, stop_ids,
                           r.constraints, lora=r.lora_request)
        if p.prompt_logprobs is not None and not r.output_token_ids:
            st.prompt_logprobs = {}
        if r.constraints is not None and r.constraints.grammar is not None:
            st.matcher = self.grammars.matcher(r.constraints.grammar)
            st.matcher.consume_tokens(list(r.output_token_ids))  # a request resumed with outputs so far
        self.states[r.request_id] = st

    # ---- preemption by swap ----------------------------------------------------------
    # Before the forward pass: blocks freed by a swap-out may be written by this very step.

    def _swap_out(self, request_id: str, blocks: list[int]) -> None:
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        self.swapped[request_id] = [tuple(t.index_select(0, idx).to("cpu") for t in layer)
                                    for layer in self.kv_caches]

    def _swap_in(self, request_id: str, blocks: list[int]) -> None:
        saved = self.swapped.pop(request_id)
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        for layer, host in zip(self.kv_caches, saved):
            for t, h in zip(layer, host):
                t.index_copy_(0, idx, h.to(t.device))

    # ---- one step --------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.finish(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> _Launched | None:
        """A step's bookkeeping and its forward pass started; finish() samples it. Under pipeline
        parallelism rank 0 returns with the pass still in flight through the other stages, and the engine
        may launch the next step (other requests) before finishing this one."""
        self.forward_s = self.sample_s = 0.0  # this step's phases (engine/utilization.py)
        for rid in sched.finished_request_ids:  # (one aborted in flight comes once its step was applied)
            self.states.pop(rid, None)
            self.swapped.pop(rid, None)
            self.pooler.drop(rid)
        if self.kv_tier is not None:  # evicted blocks go to the tier before anything here writes them
            self.kv_tier.before_forward(sched)
        for rid, blocks in sched.swap_out:
            self._swap_out(rid, blocks)
        for rid, blocks in sched.swap_in:
            self._swap_in(rid, blocks)
        for r in sched.new_requests:
            self._add(r)
        self.block_tables.apply(sched)
        if not sched.scheduled:
            return None

        # Decodes first, then prefill chunks: attention batches the decode block as one call.
        t0 = time.perf_counter()
        decodes = [s for s in sched.scheduled if len(s.token_ids) == 1]
        order = decodes + [s for s in sched.scheduled if len(s.token_ids) > 1]
        if self.lora is not None:  # an adapter's rows side by side (each row's result is the same in any order)
            order = self.lora.order_rows(order, len(decodes), self.states)

        # Logits only for rows that end their request's known tokens, for each drafted position, and
        # for the prompt rows of requests that asked for prompt logprobs.
        sample_rows, sample_reqs, prompt_rows, offset, pool = [], [], [], 0, PoolStep()
        for s in order:
            st = self.states[s.request_id]
            if st.params.pooling is not None:  # hidden states (or a reranker's logits) instead of a token
                self.pooler.plan(pool, st.params.pooling, s, offset)
                offset += len(s.token_ids)
                continue
            if st.prompt_logprobs is not None:  # row i predicts the prompt token at start_pos + i + 1
                last = min(len(s.token_ids), len(st.prompt_token_ids) - 1 - s.start_pos)
                prompt_rows.extend((st, offset + i, s.start_pos + i + 1) for i in range(max(last, 0)))
            offset += len(s.token_ids)
            if s.needs_logits:
                sample_rows.extend(range(offset - 1 - s.num_draft_tokens, offset))
                sample_reqs.append(s)
        rows = [self.block_tables.row(s) for s in order]
        logits_rows = sample_rows + [r for _, r, _ in prompt_rows] + [r for _, r in pool.scores]
        with self._adapters(order):
            if pool.hidden:  # (one process only: the builder refuses pooling under tensor or pipeline parallelism)
                types = self.pooler.token_types(order, self.states) if getattr(self.model, "is_encoder", False) else None
                logits = self._pooling_forward(rows, logits_rows, [r for _, r, _ in pool.hidden], types)
            else:
                logits = self._start_forward(rows, logits_rows)
        return _Launched(logits, sample_reqs, prompt_rows, sample_rows, time.perf_counter() - t0, pool or None)

    def _adapters(self, order: list[ScheduledRequest]) -> contextlib.AbstractContextManager:
        """The pass with each row's adapter (--enable-lora; one process, so the pass is done when this exits)."""
        if self.lora is None:
            return contextlib.nullcontext()
        return self.lora.step([(self.states[s.request_id].lora, len(s.token_ids)) for s in order])

    @torch.inference_mode()
    def finish(self, step: _Launched | None) -> ModelRunnerOutput:
        """A launched step's logits (waiting for them if they are in flight) sampled."""
        if step is None:
            return ModelRunnerOutput({})
        t0 = time.perf_counter()
        logits = step.logits if isinstance(step.logits, (torch.Tensor, tuple)) else self.executor.wait(step.logits)
        if self.device.type == "cuda":  # the kernels are queued: wait for them, or sampling's wait counts them
            # (this stream's only: a device-wide sync would also wait for the next step's pass in flight)
            torch.cuda.current_stream(self.device).synchronize()
        t1 = time.perf_counter()
        self.forward_s = step.forward_s + t1 - t0
        try:
            if step.pool is None:
                return self._sample_step(logits, step.sample_reqs, step.prompt_rows, step.sample_rows)
            logits, hidden = logits if isinstance(logits, tuple) else (logits, None)
            first_score = len(logits) - len(step.pool.scores)
            out = self._sample_step(logits[:first_score], step.sample_reqs, step.prompt_rows, step.sample_rows)
            sizes = {rid: len(self.states[rid].prompt_token_ids) for rid, _, _ in step.pool.hidden}
            out.pooled.update(self.pooler.finish(step.pool, hidden, logits[first_score:], sizes,
                                                 getattr(self.model, "classifier", None)))
            return out
        finally:
            self.sample_s = time.perf_counter() - t1

    def _sample_step(self, logits: torch.Tensor, sample_reqs: list, prompt_rows: list,
                     sample_rows: list) -> ModelRunnerOutput:
        if prompt_rows:
            self._record_prompt_logprobs(logits[len(sample_rows):], prompt_rows)
            logits = logits[: len(sample_rows)]
        if not sample_reqs:
            return ModelRunnerOutput({})
        if any(s.num_draft_tokens for s in sample_reqs):
            out = self._verify(logits, sample_reqs)
        else:
            out = self._sample(logits, [s.request_id for s in sample_reqs])
        for s in sample_reqs:  # the prompt is done: its logprobs go out with the first token
            st = self.states[s.request_id]
            if st.prompt_logprobs is not None:
                n = len(st.prompt_token_ids)
                out.prompt_logprobs[s.request_id] = [None] + [st.prompt_logprobs.get(p) for p in range(1, n)]
                st.prompt_logprobs = None
        return out

    def _record_prompt_logprobs(self, logits: torch.Tensor, rows: list) -> None:
        """Each prompt row's log-probability of the prompt token that follows it, and its top-n; kept
        by position, so a chunk computed again after a preemption overwrites rather than repeats."""
        lps = logits.float().log_softmax(-1)
        targets = torch.tensor([st.prompt_token_ids[p] for st, _, p in rows], device=lps.device)
        chosen = lps.gather(1, targets[:, None]).squeeze(1).tolist()
        n = max(st.params.prompt_logprobs for st, _, _ in rows)
        top_lp, top_ids = lps.topk(n, dim=-1) if n else (None, None)
        for i, (st, _, p) in enumerate(rows):
            k = st.params.prompt_logprobs
            entry = {int(targets[i]): chosen[i]}
            if k:
                entry.update(zip(top_ids[i, :k].tolist(), top_lp[i, :k].tolist()))
                entry[int(targets[i])] = chosen[i]
            st.prompt_logprobs[p] = entry

    def prompt_logits(self, token_ids: list[int], block_table: list[int]) -> torch.Tensor:
        """Next-token logits after every prefix of token_ids ([len - 1, vocab]), computed as one prefill
        chunk into block_table's blocks through the same inputs a scheduled step gets."""
        return self._forward([ForwardRow(list(token_ids), 0, list(block_table))], list(range(len(token_ids) - 1)))

    def time_forward(self, num_tokens: int, block_table: list[int], repeats: int = 3, warm_up: bool = True) -> float:
        """Median seconds of a forward pass over num_tokens of one request at position 0 (logits for
        each), after a warm-up: what the speculative off rule is calibrated with."""
        s = ForwardRow([0] * num_tokens, 0, list(block_table))
        times = []
        for _ in range(repeats + int(warm_up)):
            t = time.perf_counter()
            self._forward([s], list(range(num_tokens)))
            times.append(time.perf_counter() - t)
        return sorted(times[int(warm_up):])[repeats // 2]

    def _forward(self, order: list[ForwardRow], logits_rows: list[int]) -> torch.Tensor:
        """One forward pass over ``order`` (decodes first), logits for ``logits_rows`` of the flat batch."""
        out = self._start_forward(order, logits_rows)
        return out if isinstance(out, torch.Tensor) else self.executor.wait(out)

    def _start_forward(self, order: list[ForwardRow], logits_rows: list[int]):
        """The forward pass started: its logits, or on a pipeline's rank 0 the pass in flight. Under tensor
        or pipeline parallelism the driver sends the same pass to every worker first."""
        if self.executor is not None:
            return self.executor.run_forward(order, logits_rows, self.local_forward)
        return self.local_forward(order, logits_rows)

    def _pooling_forward(self, order: list[ForwardRow], logits_rows: list[int], hidden_rows: list[int],
                         token_types: list[int] | None = None):
        """A forward pass that also returns the final hidden states of ``hidden_rows``: (logits, hidden); an
        encoder takes each token's type (a cross-encoder's second segment is type 1)."""
        input_ids, pos_t, meta = self.inputs(order)
        idx = torch.tensor(logits_rows, dtype=torch.long, device=self.device)
        hidden = torch.tensor(hidden_rows, dtype=torch.long, device=self.device)
        if token_types is None:
            return self.model(input_ids, pos_t, self.kv_caches, meta, idx, hidden)
        types = torch.tensor(token_types, dtype=torch.long, device=self.device)
        return self.model(input_ids, pos_t, self.kv_caches, meta, idx, hidden, token_types=types)

    def local_forward(self, order: list[ForwardRow], logits_rows: list[int]) -> torch.Tensor:
        if self.pipeline is not None:
            group, micro_batches = self.pipeline
            return pipelined_forward(self, group, order, logits_rows, micro_batches)
        input_ids, pos_t, meta = self.inputs(order)
        rows = torch.tensor(logits_rows, dtype=torch.long, device=self.device)
        return self.model(input_ids, pos_t, self.kv_caches, meta, rows)

    def inputs(self, order: list[ForwardRow]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat token ids, positions and attention metadata for requests laid out decodes first (one
        token each), then prefill chunks."""
        decodes = [s for s in order if len(s.token_ids) == 1]
        prefills = order[len(decodes):]
        bs = self.block_size

        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for s in decodes:
            p = s.start_pos
            ids.append(s.token_ids[0])
            positions.append(p)
            slots.append(s.block_table[p // bs] * bs + p % bs)
        chunks: list[PrefillChunk] = []
        for s in prefills:
            n, start = len(s.token_ids), len(ids)
            pos = np.arange(s.start_pos, s.start_pos + n)
            table = np.asarray(s.block_table, dtype=np.int64)
            ids.extend(s.token_ids)
            positions.extend(pos.tolist())
            slots.extend((table[pos // bs] * bs + pos % bs).tolist())
            n_blk = -(-(s.start_pos + n) // bs)
            chunks.append(PrefillChunk(start, start + n, s.start_pos,
                                       torch.tensor(s.block_table[:n_blk], dtype=torch.long, device=self.device)))

        dev = self.device
        decode_tables = decode_lens = None
        max_len = 0
        if decodes:
            max_len = max(s.start_pos for s in decodes) + 1
            width = -(-max_len // bs)
            table = np.zeros((len(decodes), width), dtype=np.int64)
            for i, s in enumerate(decodes):
                row = s.block_table[:width]
                table[i, : len(row)] = row
            decode_tables = torch.from_numpy(table).to(dev)
            decode_lens = torch.tensor([s.start_pos + 1 for s in decodes], dtype=torch.long, device=dev)
        # Every token's context through one table (paged_attention): row i is request order[i]'s blocks.
        ends = [s.start_pos + len(s.token_ids) for s in order]
        tables = np.zeros((len(order), -(-max(ends) // bs)), dtype=np.int64)
        for i, (s, end) in enumerate(zip(order, ends)):
            n_blk = -(-end // bs)
            tables[i, :n_blk] = s.block_table[:n_blk]
        seq_of = np.repeat(np.arange(len(order)), [len(s.token_ids) for s in order])
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=dev), len(decodes),
                                 decode_tables, decode_lens, max_len, chunks,
                                 block_tables=torch.from_numpy(tables).to(dev),
                                 seq_of=torch.from_numpy(seq_of).to(dev),
                                 ctx_lens=torch.tensor(positions, dtype=torch.long, device=dev) + 1)

        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(positions, dtype=torch.long, device=dev),
                meta)

    def _sample(self, logits: torch.Tensor, req_ids: list[str]) -> ModelRunnerOutput:
        states = [self.states[r] for r in req_ids]
        batch = self.sampling_inputs.batch(states)
        out = self.sampler(logits, batch)
        tokens = out.token_ids.tolist()
        sampled = {}
        logprobs = {}
        lp = out.sampled_logprobs.tolist() if out.sampled_logprobs is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        for i, (rid, st) in enumerate(zip(req_ids, states)):
            st.output_token_ids.append(tokens[i])
            _advance(st, [tokens[i]])
            sampled[rid] = [tokens[i]]
            n = st.params.logprobs
            if n is not None:
                top = list(zip(top_ids[i][:n], top_lp[i][:n])) if n else []
                logprobs[rid] = [(lp[i], top)]
        return ModelRunnerOutput(sampled, logprobs)

    def _verify(self, logits: torch.Tensor, scheduled: list[ScheduledRequest]) -> ModelRunnerOutput:
        """A step with drafts: each request's rows are its drafted positions and the one after; the
        drafts are accepted or rejected against the target's distributions (spec_decode/rejection.py),
        and every request, drafted or not, emits its tokens from those rows."""
        states, extras = [], []
        for s in scheduled:
            st = self.states[s.request_id]
            drafts = list(s.token_ids[len(s.token_ids) - s.num_draft_tokens:])
            for j in range(s.num_draft_tokens + 1):  # row j follows the drafts before it
                states.append(st)
                extras.append(drafts[:j])
        batch = self.sampling_inputs.batch(states, extras)
        probs, greedy_tokens = self.sampler.distributions(logits, batch)
        logprobs = logits.log_softmax(-1) if batch.num_logprobs is not None else None
        sampled, lps, row = {}, {}, 0
        for s in scheduled:
            st = self.states[s.request_id]
            d = s.num_draft_tokens
            rows = slice(row, row + d + 1)
            gen = st.generator if st.generator is not None else self.sampler.generator
            tokens = verify_drafts(probs[rows] if probs is not None else None, greedy_tokens[rows],
                                   list(s.token_ids[len(s.token_ids) - d:]), st.params.greedy, gen, s.draft_probs)
            st.output_token_ids.extend(tokens)
            _advance(st, tokens)
            sampled[s.request_id] = tokens
            n = st.params.logprobs
            if n is not None:
                lps[s.request_id] = []
                for j, t in enumerate(tokens):
                    lp = logprobs[row + j]
                    top = lp.topk(n) if n else None
                    lps[s.request_id].append((float(lp[t]), list(zip(top.indices.tolist(), top.values.tolist()))
                                              if n else []))
            row += d + 1
        return ModelRunnerOutput(sampled, lps)
