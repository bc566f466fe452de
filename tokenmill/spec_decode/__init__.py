"""Speculative decoding: drafters propose tokens, the target verifies them in the scheduler's batch.

- ``ngram.py``: prompt lookup over a request's own tokens (no model).
- ``draft_model.py``: a smaller model on the target's vocabulary, its KV on the target's block ids.
- ``rejection.py``: the acceptance rule that keeps the target's distribution exactly.
- ``policy.py``: the off rule (how many drafts pay), with the draft cost measured at startup.
- ``stats.py``: vLLM's acceptance counters.

A drafter has ``k`` (most drafts per request and step), ``draft_cost`` (set by the engine),
``may_draft(request, batch)`` (a draft model first catches up on the tokens it has not seen, which must
pay), ``propose_batch([(request, most drafts, block table), ...]) -> [(drafts, q or None), ...]``, called
by the scheduler once a step for every decoding request that may draft, and ``finish(request_id)``. A third
drafter goes here behind the same interface without touching the scheduler or the verifier: an
EAGLE-style head would be a ``draft_model``-like proposer whose runner reads the target's last hidden
states (the runner would keep them per request), a suffix tree an ``ngram``-like one over a shared
tree of earlier outputs.
"""
