"""Speculative decoding in the simulator: a proposer the real Scheduler drives, and the acceptance model.

The scheduler decides who drafts and how many (its off rule, on a cost curve built from the cost models
as the engine builds it from its startup timings), reserves the drafts' KV slots and counts them against
the token budget; ``SimProposer`` answers ``propose_batch`` with stand-in drafts and records the
passes a draft model would run for them (``cost.draft_passes``, tracking the tokens the drafter holds KV
for as ``DraftModelProposer`` does). There are no real tokens to compare, so the simulated runner draws
how many drafts the target accepts: each i.i.d. with probability A until the first rejection
(``accepted_drafts``), then the target's own token, so a request gets 1 to d + 1 tokens a step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tokenmill.perf.cost import draft_passes, probe_shape
from tokenmill.perf.step_cost import StepShape
from tokenmill.core.draft_policy import PROBE_SIZES, DraftCostModel

if TYPE_CHECKING:
    from tokenmill.request import Request

# Per-draft acceptance where none is given: n-gram drafts on recurring text here (BENCHMARKS.md,
# "n-gram drafts": accepted at positions 1..3 of 0.83/0.65/0.48 at batch 1, 0.87/0.66/0.63 at 8 and
# 0.88/0.69/0.58 at 32, i.e. A^i with A = 0.78-0.86).
DEFAULT_ACCEPTANCE = 0.8
DRAFT_TOKEN = 1  # what every stand-in draft is


@dataclass(frozen=True)
class SpecDecoding:
    """What the simulator needs of speculative decoding: the method, most drafts per request and step
    (``--num-speculative-tokens``), the per-draft acceptance A, and a draft-model pass's seconds over a
    StepShape (None: drafting is free, n-gram lookup)."""

    method: str
    k: int
    acceptance: float = DEFAULT_ACCEPTANCE
    drafter: Callable[[StepShape], float] | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"--speculative-acceptance-rate is a probability in [0, 1], got {self.acceptance}")
        if self.k < 1:
            raise ValueError(f"--num-speculative-tokens must be a positive integer, got {self.k}")


def accepted_drafts(rng: np.random.Generator, drafts: int, acceptance: float) -> int:
    """How many of ``drafts`` drafts the target accepts: each with probability ``acceptance``, stopping
    at the first rejection (a geometric number of successes, capped at ``drafts``)."""
    if drafts <= 0 or acceptance <= 0.0:
        return 0
    if acceptance >= 1.0:
        return drafts
    return min(int(rng.geometric(1.0 - acceptance)) - 1, drafts)


class SimProposer:
    """The drafter interface of ``spec_decode`` (spec_decode/step.py's Drafter) without a model: stand-in
    drafts, and for a draft model the passes it would run, proposed after a step as the engine's are and
    priced when the next step launches (``take_passes``), as rank 0 runs them before it."""

    def __init__(self, spec: SpecDecoding, block_size: int, draft_cost: DraftCostModel) -> None:
        self.spec, self.k, self.block_size = spec, spec.k, block_size
        self.draft_cost = draft_cost  # the off rule's DraftCostModel (draft_cost_model below)
        self.passes: list[StepShape] = []
        # a draft model's view of each request: (tokens it holds KV for, the block table they are in,
        # the request's length when it last drafted, its accepted drafts then)
        self.cached: dict[str, tuple[int, list[int], int, int]] = {}

    def may_draft(self, req: Request, batch: int) -> bool:
        """As DraftModelProposer: catching up on a request must pay (n-gram: always)."""
        if self.spec.drafter is None:
            return True
        c = self.cached.get(req.request_id)
        lag = req.num_tokens - (c[0] if c is not None else 0)
        check = getattr(self.draft_cost, "catch_up_pays", None)
        return check is None or check(lag, req.max_tokens - req.num_output_tokens, batch)

    def finish(self, request_id: str) -> None:
        self.cached.pop(request_id, None)

    def propose_batch(self, batch: list[tuple[Request, int, list[int]]]) -> list[tuple[list[int], None]]:
        """batch: (request, most drafts, block table) per drafting request; every one gets all its drafts."""
        if self.spec.drafter is not None:
            rows = []
            for req, room, table in batch:
                n = req.num_tokens
                c = self.cached.get(req.request_id)
                valid = 0
                if c is not None:
                    held, old_table, length, accepted = c
                    # the tokens up to its last length, and of the drafts fed back those the target accepted
                    valid = min(held, length + req.num_accepted_drafts - accepted)
                    same = 0
                    for a, b in zip(old_table, table):  # a preempted request comes back on other blocks
                        if a != b:
                            break
                        same += 1
                    valid = min(valid, same * self.block_size)
                start = min(valid, n - 1)  # the last token's logits are needed
                rows.append((n - start, start, room))
                # it now holds KV for the request's tokens and the drafts fed back (all but the last)
                self.cached[req.request_id] = (n + room - 1, list(table), n, req.num_accepted_drafts)
            self.passes.extend(draft_passes(rows))
        return [([DRAFT_TOKEN] * room, None) for _, room, _ in batch]

    def take_passes(self) -> list[StepShape]:
        passes, self.passes = self.passes, []
        return passes


def draft_cost_model(target: Callable[[StepShape], float], drafter: Callable[[StepShape], float] | None,
                     k: int, max_model_len: int) -> DraftCostModel:
    """The off rule's cost of d drafts against the batch, built as the engine builds it at startup
    (engine/drafting.py ``measure_draft_cost``): the target's and the drafter's times over the probe sizes,
    here from the cost models instead of a stopwatch. drafter None: drafting is free (n-gram)."""
    sizes = sorted({min(n, max_model_len) for n in PROBE_SIZES})
    curve = lambda cost: {n: cost(probe_shape(n)) for n in sizes}  # noqa: E731
    return DraftCostModel(curve(target), curve(drafter) if drafter is not None else None, k)
