"""Speculative decoding: drafters propose tokens, the target verifies them in the scheduler's batch.

- ``ngram.py``: prompt lookup over a request's own tokens (no model).
- ``rejection.py``: the acceptance rule that keeps the target's distribution exactly.

A drafter is anything with ``propose(token_ids, max_tokens) -> list[int]``, called by the scheduler
for each decoding request. A draft model (or an EAGLE-style head, or a suffix tree) goes behind the same
interface: one that needs a forward pass of its own would batch its requests' proposals in one call
(``propose_batch``) from the engine step, before ``Scheduler.schedule``; the scheduler and the
verification stay as they are.
"""
