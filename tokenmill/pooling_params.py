"""PoolingParams: a request that pools its prompt's hidden states into one vector (an embedding, a score)
instead of generating tokens (vLLM's PoolingParams)."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("last", "mean", "cls")
# what a request's vector is: the pooled hidden state (embed), a classifier's output on it (classify, BERT
# cross-encoders), or P(yes) from the next-token logits of two tokens at the last position (token_score,
# decoder rerankers in the Qwen3-Reranker shape)
POOLING_KINDS = ("embed", "classify", "token_score")


@dataclass(frozen=True)
class PoolingParams:
    kind: str = "embed"
    pooling_type: str = "last"
    normalize: bool = True  # L2-normalise the vector (after truncating it to ``dimensions``)
    dimensions: int | None = None  # Matryoshka embeddings: keep the first ``dimensions`` values
    score_token_ids: tuple[int, int] | None = None  # token_score: (no, yes)
    # BERT cross-encoders: the two segments' boundary in the prompt (token type 1 from here on); None: one
    token_type_split: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in POOLING_KINDS:
            raise ValueError(f"pooling kind must be one of {', '.join(POOLING_KINDS)}, got {self.kind!r}")
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.kind == "token_score" and (self.score_token_ids is None or len(self.score_token_ids) != 2):
            raise ValueError("a token_score request needs score_token_ids (the 'no' and 'yes' token ids)")

    @property
    def needs_all_rows(self) -> bool:
        """Whether every prompt position's hidden state is needed (mean, cls), so a cached prefix, whose
        hidden states are not kept, cannot stand in for computing it."""
        return self.kind != "token_score" and self.pooling_type != "last"
