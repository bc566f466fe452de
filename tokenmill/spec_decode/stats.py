"""What one step's speculation did: vLLM's spec-decode counters, from the step's schedule and result."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStepStats:
    num_drafts: int = 0  # requests that carried drafts this step
    num_draft_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.accepted_per_pos)


def step_acceptance(scheduled, sampled: dict[str, list[int]], k: int) -> SpecStepStats:
    """scheduled: the step's ScheduledRequests; sampled: the runner's emitted tokens per request (a
    drafted request emits its accepted drafts and one more token)."""
    out = SpecStepStats(accepted_per_pos=[0] * k)
    for s in scheduled:
        if not s.num_draft_tokens:
            continue
        out.num_drafts += 1
        out.num_draft_tokens += s.num_draft_tokens
        for i in range(len(sampled.get(s.request_id, ())) - 1):
            out.accepted_per_pos[i] += 1
    return out
