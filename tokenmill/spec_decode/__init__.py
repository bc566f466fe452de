"""Speculative decoding: drafters propose tokens, the target verifies them in the scheduler's batch.

- ``ngram.py``: prompt lookup over a request's own tokens (no model).
- ``draft_model.py``: a smaller model on the target's vocabulary, its KV on the target's block ids.
- ``rejection.py``: the acceptance rule that keeps the target's distribution exactly.
- ``stats.py``: vLLM's acceptance counters.

The off rule (how many drafts pay) is the scheduler's: core/draft_policy.py.

- ``step.py``: the drafting step, run after each step's output is applied (``propose_drafts``), and the
  ``Drafter`` interface: ``k``, ``draft_cost``, ``may_draft(request, batch)`` (a draft model first catches up
  on the tokens it has not seen, which must pay), ``propose_batch([(request, most drafts, block table), ...])
  -> [(drafts, q or None), ...]`` once a step for every decoding request whose drafts pay, and
  ``finish(request_id)`` (a scheduler finish hook). The scheduler holds no drafter: it only fits the
  proposed drafts into its next step's budget. A third
drafter goes here behind the same interface without touching the scheduler or the verifier: an
EAGLE-style head would be a ``draft_model``-like proposer whose runner reads the target's last hidden
states (the runner would keep them per request), a suffix tree an ``ngram``-like one over a shared
tree of earlier outputs.
"""
