"""Draft-model drafting: a cheaper model sharing the target's vocabulary proposes each request's next
tokens, one batched forward pass per drafted position.

The drafter's KV lives in tensors of its own but on the target's block ids: a request's block table,
allocated by the scheduler for its tokens and drafts, addresses both caches, so the pool's accounting
(sized for target + drafter bytes per block) covers both and preemption, prefix caching and freeing
need nothing extra. The drafter remembers which of a request's tokens it holds KV for (and in which
blocks); each step it first catches up on the rest (on first sight the whole context, then the
accepted drafts and the new token) and then drafts one token per pass.

Greedy requests get the drafter's argmax (point drafts). Sampled requests get drafts sampled from the
drafter's own distribution q (its temperature, top-k, top-p, min-p, logit_bias and allowed_token_ids:
the request's; penalties, bad words and grammars left out, as any q keeps the target's distribution
exact and the verification applies them) and q goes to the verifier with them.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmill.core.sched_output import ForwardRow
from tokenmill.core.draft_policy import DRAFT_COST, constant_cost
from tokenmill.spec_decode.rejection import sample_from

# a drafter's private stream for a seeded request differs from the target's stream of the same seed
_DRAFT_SEED_OFFSET = 0x5D2AF7


@dataclasses.dataclass
class _Cached:
    token_ids: list[int]  # the tokens whose drafter KV is written, in position order
    block_table: list[int]  # the blocks they were written into
    params: object  # the request's SamplingParams, penalties removed
    generator: torch.Generator | None
    stable: int = 0  # the request's length at the last proposal: tokens before it are final


class DraftModelProposer:
    def __init__(self, runner, block_size: int, num_tokens: int) -> None:
        """runner: a ModelRunner over the draft model and its KV tensors (same block count and size as
        the target's pool); num_tokens: the most drafts per request and step."""
        self.runner, self.k = runner, num_tokens
        self.draft_cost = lambda batch: constant_cost(DRAFT_COST)  # the engine measures it (policy.py)
        self.block_size = block_size
        self.cached: dict[str, _Cached] = {}

    def may_draft(self, req, batch: int) -> bool:
        """Whether catching the drafter up on this request pays (policy.DraftCostModel.catch_up_pays)."""
        c = self.cached.get(req.request_id)
        lag = req.num_tokens - (len(c.token_ids) if c is not None else 0)
        check = getattr(self.draft_cost, "catch_up_pays", None)
        return check is None or check(lag, req.max_tokens - req.num_output_tokens, batch)

    def finish(self, request_id: str) -> None:
        self.cached.pop(request_id, None)

    def _valid_prefix(self, c: _Cached, token_ids: list[int], table: list[int]) -> int:
        """How many leading tokens still have the right drafter KV: the same tokens, in the same blocks
        (a preempted request comes back on other blocks)."""
        # a request's tokens up to its length at the last proposal never change: compare only after them
        n = min(c.stable, len(c.token_ids), len(token_ids))
        while n < min(len(c.token_ids), len(token_ids)) and c.token_ids[n] == token_ids[n]:
            n += 1
        same_blocks = 0
        for a, b in zip(c.block_table, table):
            if a != b:
                break
            same_blocks += 1
        return min(n, same_blocks * self.block_size)

    @torch.inference_mode()
    def propose_batch(self, batch: list[tuple[object, int, list[int]]]) -> list[tuple[list[int], torch.Tensor | None]]:
        """batch: (request, most drafts, block table) for each decoding request; returns each one's
        drafts and, for sampled requests, the [drafts, vocab] distributions they were drawn from."""
        entries = []
        for req, room, table in batch:
            c = self.cached.get(req.request_id)
            if c is None:
                p = req.sampling_params
                params = dataclasses.replace(p, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
                gen = (None if p.seed is None else
                       torch.Generator(self.runner.device).manual_seed(p.seed + _DRAFT_SEED_OFFSET))
                c = self.cached[req.request_id] = _Cached([], [], params, gen)
            ids = req.all_token_ids
            start = min(self._valid_prefix(c, ids, table), len(ids) - 1)  # the last token's logits are needed
            del c.token_ids[start:]  # in place: the drafter's KV beyond start is stale
            c.block_table, c.stable = list(table), len(ids)
            entries.append((req.request_id, c, ids[start:], start, room))

        drafts: dict[str, list[int]] = {rid: [] for rid, *_ in entries}
        q_rows: dict[str, list[torch.Tensor]] = {rid: [] for rid, *_ in entries}
        # pass 0 catches up and drafts the first token; pass j drafts token j + 1 from token j
        step = [(rid, c, new, start) for rid, c, new, start, _ in entries]
        rooms = {rid: room for rid, _, _, _, room in entries}
        while step:
            scheduled = [ForwardRow(list(new), start, c.block_table) for rid, c, new, start in step]
            order = sorted(range(len(step)), key=lambda i: len(scheduled[i].token_ids) > 1)  # decodes first
            input_ids, positions, meta = self.runner.inputs([scheduled[i] for i in order])
            ends = torch.tensor([len(scheduled[i].token_ids) for i in order]).cumsum(0) - 1
            logits = self.runner.model(input_ids, positions, self.runner.kv_caches, meta, ends.to(self.runner.device))
            cs = [step[i][1] for i in order]
            tokens, probs = self._draw(logits, cs)
            nxt = []
            for row, i in enumerate(order):
                rid, c, new, start = step[i]
                c.token_ids.extend(new)
                drafts[rid].append(tokens[row])
                if probs is not None and not c.params.greedy:
                    q_rows[rid].append(probs[row])
                if len(drafts[rid]) < rooms[rid]:
                    nxt.append((rid, c, [tokens[row]], start + len(new)))
            step = nxt
        return [(drafts[rid], torch.stack(q_rows[rid]) if q_rows[rid] else None) for rid, *_ in entries]

    def _draw(self, logits: torch.Tensor, cs: list[_Cached]) -> tuple[list[int], torch.Tensor | None]:
        """Each row's draft: the argmax for greedy requests, else a sample of q (returned too)."""
        states = [_State(c.params, c.generator) for c in cs]
        probs, greedy = self.runner.sampler.distributions(logits, self.runner.sampling_inputs.batch(states))
        tokens = greedy.tolist()
        for row, c in enumerate(cs):
            if not c.params.greedy:
                gen = c.generator if c.generator is not None else self.runner.sampler.generator
                tokens[row] = sample_from(probs[row], gen)
        return tokens, probs


@dataclasses.dataclass
class _State:
    """What SamplingInputs.batch (worker/sampling_inputs.py) reads of a request: its parameters and generator, no history
    (the drafter applies no penalties) and nothing banned."""

    params: object
    generator: torch.Generator | None
    prompt_token_ids: tuple = ()
    output_token_ids: tuple = ()
    stop_ids: tuple = ()
    constraints: object = None  # no grammar or bad words for drafts: the target's verification has them
    matcher: object = None
