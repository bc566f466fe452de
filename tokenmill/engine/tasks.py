"""What a loaded model serves (EngineConfig.task resolved): generation, embeddings or scores, and how its pooling
requests pool (pooling_params.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import InvalidParameter

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig, ModelConfig
    from tokenmill.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServedTask:
    task: str  # generate | embed | score
    pooling_type: str = "last"  # a pooling request's default
    normalize: bool = True
    score_token_ids: tuple[int, int] | None = None  # a decoder reranker's (no, yes) token ids
    classifier: bool = False  # the model has a classification head (a cross-encoder)


def resolve_task(config: EngineConfig, model: ModelConfig, tokenizer: Tokenizer,
                 classifier: bool = False) -> ServedTask:
    """The task served and its pooling, or a ValueError saying what to change."""
    task = config.task
    if task == "auto":
        task = "score" if classifier else "embed" if model.pooling_type else "generate"
    if task != "generate":
        par = config.parallel
        if par.world_size > 1:
            raise ValueError(f"--task {task} with more than one rank (--tensor-parallel-size, "
                             "--pipeline-parallel-size) is not built yet; serve it on one rank")
        if config.speculative.speculative_method is not None:
            raise ValueError(f"--task {task} generates no tokens: drop --speculative-method")
        if config.kv_transfer.kv_role is not None:
            raise ValueError(f"--task {task} has no decode to disaggregate: drop --kv-role")
    if classifier and task != "score":
        raise ValueError(f"this model is a sequence classifier (a cross-encoder): it serves --task score, not {task}")
    pooling = model.pooling_type or ("cls" if classifier else "last")
    if config.classifier_from_token is not None and task != "score":
        raise ValueError("--classifier-from-token is for --task score (a decoder reranker)")
    score_ids = None
    if task == "score" and not classifier:
        if config.classifier_from_token is None:
            raise ValueError("--task score needs a cross-encoder (a BERT-style sequence classification model) or, "
                             "for a decoder reranker, --classifier-from-token no,yes; an embedding model scores "
                             "pairs by cosine similarity under --task embed")
        score_ids = tuple(_single_token(tokenizer, w) for w in config.classifier_from_token)
    return ServedTask(task, pooling, model.pooling_normalize, score_ids, classifier)


def _single_token(tokenizer: Tokenizer, word: str) -> int:
    ids = tokenizer.encode(word, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"--classifier-from-token: {word!r} is {len(ids)} tokens in this vocabulary ({ids}); "
                         "give words that are one token each")
    return ids[0]


def pooling_params(served: ServedTask, hidden_size: int, want: str = "embed", dimensions: int | None = None,
                   normalize: bool | None = None, token_type_split: int | None = None) -> PoolingParams:
    """A pooling request's parameters: ``want`` embed (the request's dimensions and normalisation) from a model
    served with task embed, or score (the model's classifier, or its yes/no tokens) from one served with score."""
    if served.task != want:
        what = {"embed": "embeddings", "score": "scores of text pairs"}[want]
        raise InvalidParameter(f"this model is served with --task {served.task}: {what} need a server started with "
                               f"--task {want}", "model")
    if want == "embed":
        if dimensions is not None and not (isinstance(dimensions, int) and 0 < dimensions <= hidden_size):
            raise InvalidParameter(f"dimensions must be an integer in [1, {hidden_size}] (the model's embedding "
                                   f"size), got {dimensions!r}", "dimensions")
        return PoolingParams("embed", served.pooling_type, served.normalize if normalize is None else bool(normalize),
                             dimensions)
    if served.classifier:
        return PoolingParams("classify", served.pooling_type, token_type_split=token_type_split)
    return PoolingParams("token_score", "last", score_token_ids=served.score_token_ids)


def pair_prompt(tokenizer: Tokenizer, first: str, second: str) -> tuple[list[int], int | None]:
    """A cross-encoder's prompt for a pair: the tokenizer's pair encoding (BERT's [CLS] a [SEP] b [SEP]; a
    plain concatenation for a tokenizer without a pair template) and where the second segment starts."""
    enc = tokenizer.hf.encode(first, second)
    split = next((i for i, t in enumerate(enc.type_ids) if t == 1), None)
    return list(enc.ids), split


def score_pairs(first, second) -> list[tuple[str, str]]:
    """vLLM's score pairs: one text against each of a list, or two lists of equal length pairwise."""
    firsts = [first] if isinstance(first, str) else list(first)
    seconds = [second] if isinstance(second, str) else list(second)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if not seconds or len(firsts) != len(seconds) or not all(isinstance(t, str) for t in firsts + seconds):
        raise InvalidParameter(f"score takes one text or a list against a list of the same length, got "
                               f"{len(firsts)} and {len(seconds)}", "text_2")
    return list(zip(firsts, seconds))


def encoder_config(config: EngineConfig, max_model_len: int) -> EngineConfig:
    """An encoder's engine settings (models/bert.py): every prompt in one step (each token attends to all the
    others, so a prompt cannot be chunked, nor its prefix taken from the cache), no step-time target to chunk
    for. A latency SLO cannot be planned for it."""
    import dataclasses
    import logging

    sched = config.scheduler
    if sched.slo_tpot_ms or sched.slo_ttft_ms:
        raise ValueError("--slo-tpot-ms and --slo-ttft-ms plan chunked steps; an encoder runs each prompt whole: "
                         "drop them")
    if sched.itl_target_ms:
        logging.getLogger("tokenmill").info("encoder model: no ITL target (it generates no tokens)")
    sched = dataclasses.replace(sched, enable_chunked_prefill=False, itl_target_ms=None,
                                max_num_batched_tokens=max(sched.max_num_batched_tokens, max_model_len))
    cache = dataclasses.replace(config.cache, enable_prefix_caching=False)
    return dataclasses.replace(config, scheduler=sched, cache=cache)
