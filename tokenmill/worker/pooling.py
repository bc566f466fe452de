"""The model runner's pooling requests (SamplingParams.pooling): which rows of a step's flat batch each needs
and, once its prompt is done, its vector: an embedding, a classifier's scores, or a reranker's P(yes).

Every step is per row and per request, in a fixed order that depends on the request alone: a mean is one sum
over a buffer of the prompt's hidden states by position (however the prompt was chunked or recomputed after a
preemption), so a request's vector is the same bits alone or batched, like its tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from tokenmill.core.sched_output import ScheduledRequest
    from tokenmill.pooling_params import PoolingParams


@dataclass
class PoolStep:
    """One step's pooling rows: hidden states wanted (request id, flat row, prompt position), logits rows of
    token-score requests ending (request id, flat row), and the requests whose prompt ends in this step."""

    hidden: list[tuple[str, int, int]] = field(default_factory=list)
    scores: list[tuple[str, int]] = field(default_factory=list)
    done: list[tuple[str, PoolingParams]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.hidden or self.scores or self.done)


class Pooler:
    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}  # mean/cls: [prompt tokens, hidden] by position
        self.last: dict[str, torch.Tensor] = {}  # last: the final row, between its step and the vector

    def drop(self, request_id: str) -> None:
        self.buffers.pop(request_id, None)
        self.last.pop(request_id, None)

    @staticmethod
    def token_types(order: list[ScheduledRequest], states: dict) -> list[int]:
        """Each token's type for an encoder, in the batch's order: 1 from a pair's second segment on."""
        types = []
        for s in order:
            p = states[s.request_id].params.pooling
            split = p.token_type_split if p is not None and p.token_type_split is not None else 1 << 62
            types.extend(int(s.start_pos + i >= split) for i in range(len(s.token_ids)))
        return types

    def plan(self, step: PoolStep, p: PoolingParams, s: ScheduledRequest, first_row: int) -> None:
        """Add request ``s``'s rows (its chunk starts at ``first_row`` of the flat batch)."""
        n = len(s.token_ids)
        if p.kind == "token_score":
            if s.needs_logits:
                step.scores.append((s.request_id, first_row + n - 1))
        elif p.needs_all_rows:
            step.hidden.extend((s.request_id, first_row + i, s.start_pos + i) for i in range(n))
        elif s.needs_logits:
            step.hidden.append((s.request_id, first_row + n - 1, -1))
        if s.needs_logits:
            step.done.append((s.request_id, p))

    def finish(self, step: PoolStep, hidden: torch.Tensor | None, score_logits: torch.Tensor | None,
               num_prompt_tokens: dict[str, int], head=None) -> dict[str, list[float]]:
        """Keep this step's hidden rows ([len(step.hidden), H]) and return the vectors of the requests done.
        ``head``: the model's classifier over a pooled vector (BERT cross-encoders), where it has one."""
        for i, (rid, _, pos) in enumerate(step.hidden):
            if pos < 0:
                self.last[rid] = hidden[i]
                continue
            buf = self.buffers.get(rid)
            if buf is None:
                buf = self.buffers[rid] = hidden.new_zeros(num_prompt_tokens[rid], hidden.shape[1])
            buf[pos] = hidden[i]
        scores = {rid: score_logits[i] for i, (rid, _) in enumerate(step.scores)}
        out = {}
        for rid, p in step.done:
            if p.kind == "token_score":
                no, yes = scores[rid][list(p.score_token_ids)].double()
                out[rid] = [float(torch.sigmoid(yes - no))]  # P(yes) of the two-way softmax
                continue
            if p.pooling_type == "last":
                vec = self.last.pop(rid)
            else:
                buf = self.buffers.pop(rid)
                vec = buf[0] if p.pooling_type == "cls" else buf.sum(0) / buf.shape[0]
            if p.kind == "classify":
                logits = head(vec[None])[0].float()
                out[rid] = (torch.sigmoid(logits) if logits.numel() == 1 else logits.softmax(-1)).tolist()
                continue
            if p.dimensions is not None:
                vec = vec[: p.dimensions]
            out[rid] = (F.normalize(vec, dim=0) if p.normalize else vec).tolist()
        return out
