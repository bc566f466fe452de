"""Speculative decoding's startup on the engine core: the draft model loaded and checked against the target, and
the off rule's draft cost measured on this machine (core/draft_policy.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tokenmill.models.loader import LoadedModel, load_model
from tokenmill.models.registry import resolve_model
from tokenmill.core.draft_policy import PROBE_SIZES, DraftCostModel

if TYPE_CHECKING:
    from tokenmill.config import SpeculativeConfig
    from tokenmill.engine.calibration import StartupState
    from tokenmill.spec_decode.draft_model import DraftModelProposer
    from tokenmill.spec_decode.ngram import NgramProposer

logger = logging.getLogger("tokenmill")


def load_drafter(core: StartupState, spec: SpeculativeConfig, phase: Callable[[str], None]) -> LoadedModel:
    """The draft model, on the target's device and dtype, checked to speak the target's vocabulary
    and to reach its context length."""
    source = resolve_model(spec.speculative_model)
    draft = load_model(source, core.dtype, core.device, quantization=spec.speculative_quantization)
    ours, theirs = core.tokenizer.hf.get_vocab(), draft.tokenizer.hf.get_vocab()
    if draft.config.vocab_size != core.model_config.vocab_size or ours != theirs:
        raise ValueError(
            f"--speculative-model {spec.speculative_model!r} has a different vocabulary from the target "
            f"({draft.config.vocab_size} vs {core.model_config.vocab_size} ids, "
            f"{len(set(ours.items()) ^ set(theirs.items()))} entries differ): a draft model must share the "
            "target's tokenizer")
    if draft.max_model_len < core.max_model_len:
        raise ValueError(f"--speculative-model reaches {draft.max_model_len} tokens of context, the target "
                         f"{core.max_model_len}: pass --max-model-len {draft.max_model_len} or less")
    phase("draft model")
    logger.info("speculative decoding: draft model %s (%s, weights %s), up to %d drafts per step",
                source.name, draft.config.architecture, draft.quantization, spec.num_speculative_tokens)
    return draft


@torch.inference_mode()
def measure_draft_cost(core: StartupState, proposer: DraftModelProposer | NgramProposer) -> DraftCostModel:
    """The off rule's c on this machine, against the batch: a draft's share of a decode step
    (core/draft_policy.py), from the target's and the drafter's step times over a few sizes."""
    k = proposer.k
    sizes = sorted({min(n, core.max_model_len) for n in PROBE_SIZES})
    table = core.kv_cache.allocate_slots("__probe__", sizes[-1])
    if table is None:  # a pool too small to probe in: the constant
        return proposer.draft_cost
    try:
        # The fastest of 3 rounds over all sizes (noise only ever slows a step down, and rounds spread
        # it over the sizes instead of one size taking a burst); one pass for the slow large sizes.
        def curve(runner) -> dict[int, float]:
            runner.time_forward(1, table, 1)  # warm-up
            best: dict[int, float] = {}
            for r in range(3):
                for n in sizes:
                    if r == 0 or n <= 64:
                        t = runner.time_forward(n, table, 1, warm_up=False)
                        best[n] = min(best.get(n, t), t)
            return best

        target = curve(core.runner)
        drafter = getattr(proposer, "runner", None)
        drafts = None if drafter is None else curve(drafter)
    finally:
        core.kv_cache.free("__probe__")
    cost = DraftCostModel(target, drafts, k)
    logger.info("speculative decoding: %d drafts cost %s decode steps at batch 1/8/32 here; each request "
                "drafts what its acceptance pays for", k, "/".join(f"{cost(b)(k):.2f}" for b in (1, 8, 32)))
    return cost
