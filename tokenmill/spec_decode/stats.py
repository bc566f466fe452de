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


def summarize(steps: list[SpecStepStats]) -> dict:
    """vLLM's spec-decode summary over some steps: drafts, draft tokens, accepted tokens, the acceptance
    rate, the mean acceptance length (1 + accepted per draft) and the acceptance rate per position."""
    drafts = sum(s.num_drafts for s in steps)
    draft_tokens = sum(s.num_draft_tokens for s in steps)
    k = max((len(s.accepted_per_pos) for s in steps), default=0)
    per_pos = [sum(s.accepted_per_pos[i] for s in steps if i < len(s.accepted_per_pos)) for i in range(k)]
    accepted = sum(per_pos)
    return {"spec_num_drafts": drafts, "spec_num_draft_tokens": draft_tokens, "spec_num_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "spec_mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "spec_acceptance_rate_per_pos": [n / drafts if drafts else 0.0 for n in per_pos]}
