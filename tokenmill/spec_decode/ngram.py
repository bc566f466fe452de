"""Prompt-lookup drafting: if the request's last n tokens (n from max_n down to min_n) occurred before in
its prompt or output, propose the tokens that followed their latest earlier occurrence. Free to compute,
and right where text repeats (edits, summaries, code, extraction)."""

from __future__ import annotations

import numpy as np

from tokenmill.core.draft_policy import DRAFT_COST, constant_cost


class NgramProposer:
    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = num_tokens, min_n, max_n
        self.draft_cost = lambda batch: constant_cost(DRAFT_COST)  # the engine measures it (policy.py)

    def propose_batch(self, batch) -> list[tuple[list[int], None]]:
        """batch: (request, most drafts, block table) per decoding request; point drafts (no q)."""
        return [(self.propose(req.all_token_ids, room), None) for req, room, _ in batch]

    def may_draft(self, req, batch: int) -> bool:
        return True  # nothing to catch up on

    def finish(self, request_id: str) -> None:
        pass  # no per-request state

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        k = min(self.k, max_tokens)
        if k <= 0 or len(token_ids) < self.min_n + 1:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            tail = ids[-n:]
            # every start i < len - n where ids[i:i+n] == tail; the latest one wins
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                # copy what followed, reading on into the copy itself where the match runs into the end
                # (a loop of period p then drafts all k tokens, not p - 1)
                src = int(hits[-1]) + n
                out = ids.tolist()
                for i in range(k):
                    out.append(out[src + i])
                return out[len(ids):]
        return []
