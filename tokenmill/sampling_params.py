"""SamplingParams: how one request picks its tokens and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenmill.pooling_params import PoolingParams

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_BAD_WORDS = 64


class InvalidParameter(ValueError):
    """A request's parameter is invalid; ``param`` names it (the canonical name: max_tokens, prompt,
    structured_outputs, or a SamplingParams field), for an API error's ``param`` to come from."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's StructuredOutputsParams): exactly one of a JSON schema
    (``json``, a dict or its JSON text), any JSON object (``json_object``), a regular expression
    (``regex``), one of some strings (``choice``) or a Lark/GBNF grammar (``grammar``)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidParameter("structured outputs need exactly one of json, json_object, regex, choice, grammar; "
                                   f"got {', '.join(given) or 'none'}", "structured_outputs")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidParameter("structured outputs choice must be a non-empty list of non-empty strings",
                                   "structured_outputs")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise InvalidParameter(f"structured outputs {name} must be a non-empty string", "structured_outputs")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidParameter("structured outputs json must be a JSON schema (an object or its JSON text)",
                                   "structured_outputs")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping rules (vLLM's names and meanings).

    temperature 0 means greedy. top_k 0 or -1 disables top-k; top_p 1.0 disables
    nucleus sampling; min_p 0 disables min-p. ``seed`` gives a private random stream:
    the same seed yields the same output whatever else shares the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0 = only the sampled one)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100] (OpenAI's)
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled
    bad_words: tuple[str, ...] = ()  # words never generated (their last token is banned after the rest)
    structured_outputs: StructuredOutputsParams | None = None
    # a pooling request (embeddings, scores): the prompt's hidden states pooled, no token generated
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        # Accept lists and single strings for convenience, store tuples so the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
        if isinstance(self.logit_bias, dict):  # JSON keys arrive as strings ("50256": -100)
            try:
                object.__setattr__(self, "logit_bias", {int(k): v for k, v in self.logit_bias.items()})
            except (TypeError, ValueError):
                raise InvalidParameter(f"invalid sampling parameter logit_bias: keys must be token ids, got "
                                       f"{list(self.logit_bias)[:3]!r}", "logit_bias") from None
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return InvalidParameter(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}", name)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or math.isnan(v) or math.isinf(v):
                raise bad(name, "must be a finite number")
        for name in ("n", "top_k", "min_tokens"):
            if not is_int(getattr(self, name)):
                raise bad(name, "must be an integer")
        if self.n < 1:
            raise bad("n", "must be at least 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < -1 or self.top_k >= 2**31:
            raise bad("top_k", "must be -1 or 0 (disabled) or a positive integer")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0 (1 disables it)")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            raise bad("seed", "must be a 64-bit integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be a positive integer or None (fill the context)")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", "must be >= 0 and <= max_tokens")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must map token ids to numbers")
            for k, v in self.logit_bias.items():
                if k < 0:
                    raise bad("logit_bias", f"token id {k} is negative")
                if not is_num(v) or not -100 <= v <= 100:
                    raise bad("logit_bias", f"the bias of token {k} must be a number in [-100, 100], got {v!r}")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or any(not is_int(t) or t < 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if len(self.bad_words) > MAX_BAD_WORDS or any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise bad("bad_words", f"must be at most {MAX_BAD_WORDS} non-empty strings")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")

    @property
    def needs_all_prompt_rows(self) -> bool:
        """Whether every prompt position is computed here (its logprobs or hidden states are wanted), so
        the prefix cache cannot stand in for any of them."""
        return self.prompt_logprobs is not None or (self.pooling is not None and self.pooling.needs_all_rows)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

