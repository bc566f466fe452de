"""The drafting step: after a step's sampled tokens are applied, the drafter proposes the next step's drafts
for every decoding request whose acceptance pays for them (the off rule, core/draft_policy.py), and the
scheduler takes them (``update_draft_token_ids``, vLLM's name): schedule() only fits them into its budget.
The engine core and the simulator both call it, the one with a model, the other with stand-in drafts."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from tokenmill.core.draft_policy import worthwhile_drafts

if TYPE_CHECKING:
    from collections.abc import Callable

    from tokenmill.core.scheduler import Scheduler
    from tokenmill.request import Request


class Drafter(Protocol):
    """What the drafting step asks of a drafter (ngram.py, draft_model.py, the simulator's stand-in)."""

    k: int  # most drafts per request and step
    draft_cost: Callable[[int], Callable[[int], float]]  # batch -> d drafts -> their cost in decode steps

    def may_draft(self, req: Request, batch: int) -> bool:
        """Whether drafting for ``req`` may pay now (a draft model must first catch up on its tokens)."""

    def propose_batch(self, batch: list[tuple[Request, int, list[int]]]) -> list[tuple[list[int], Any]]:
        """(request, most drafts, block table) each -> (drafts, their distributions or None) each."""

    def finish(self, request_id: str) -> None:
        """Drop what is held for a request that ended."""


def propose_drafts(sched: Scheduler, proposer: Drafter) -> float:
    """Ask ``proposer`` once for the drafts of every request that may carry them; returns the seconds it took."""
    t = time.perf_counter()
    batch = sched.draft_batch_size()
    cost = proposer.draft_cost(batch)
    wanted = []
    for req in sched.may_carry_drafts():
        if not proposer.may_draft(req, batch):
            continue
        n = worthwhile_drafts(req.draft_acceptance, req.num_steps_without_drafts, proposer.k, cost)
        if (room := sched.reserve_draft_slots(req, n)) > 0:
            wanted.append((req, room, sched.kv_cache.block_tables[req.request_id]))
    if wanted:
        proposals = proposer.propose_batch(wanted)
        sched.update_draft_token_ids({req.request_id: (list(drafts)[:room], probs)
                                      for (req, room, _), (drafts, probs) in zip(wanted, proposals)})
    return time.perf_counter() - t
