"""Constraints on what a request may generate: structured outputs (a grammar, through llguidance),
logit_bias, allowed_token_ids and bad_words.

The front end's input processor (engine/input_processor.py) turns a request's parameters into
``RequestConstraints`` once, when it is added (so a bad schema or an out-of-vocabulary id is a ValueError
before anything is queued), and the engine core receives them compiled; the runner keeps a grammar
matcher per request and, every step, gives the sampler each constrained row's token mask, computed
after the tokens that row follows (for a drafted position: after the drafts before it, so drafts are
checked against the grammar too).

Why llguidance: it has no dependencies (a 3 MB wheel), computes a 49k-token mask in about 0.1 ms on
this CPU, and takes JSON schemas, regexes and Lark grammars (GBNF converted); xgrammar, the other
choice, pulls triton onto a CPU machine. Both measured by benchmarks/structured_outputs.py.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from tokenmill.sampling_params import InvalidParameter, SamplingParams, StructuredOutputsParams


@dataclass(frozen=True)
class RequestConstraints:
    grammar: str | None = None  # an llguidance grammar, validated against the vocabulary
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()


def grammar_spec(so: StructuredOutputsParams) -> str:
    """The llguidance grammar for one request's structured-output parameters (not yet validated)."""
    import llguidance

    if so.json is not None:
        schema = so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidParameter(f"the JSON schema is not valid JSON: {e}", "structured_outputs") from None
        if not isinstance(schema, dict):
            raise InvalidParameter("the JSON schema must be a JSON object", "structured_outputs")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    if so.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                             defaults={"whitespace_flexible": False})
    if so.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(so.regex)
    if so.choice is not None:
        return llguidance.grammar_from("lark", "start: " + " | ".join(json.dumps(c) for c in so.choice))
    from llguidance.gbnf_to_lark import any_to_lark

    # GBNF (llama.cpp's and vLLM's EBNF) is converted; Lark passes through
    return llguidance.grammar_from("lark", any_to_lark(so.grammar))


class GrammarCompiler:
    """Grammars against one tokenizer's vocabulary (built on first use: about 0.3 s for 49k tokens)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    @functools.cached_property
    def ll_tokenizer(self):
        import llguidance

        eos = self.tokenizer.eos_token_id
        return llguidance.LLTokenizer(self.tokenizer.hf.to_str(), n_vocab=self.vocab_size,
                                      eos_token=eos if eos is not None else 0)

    def compile(self, so: StructuredOutputsParams) -> str:
        """A validated grammar, or a ValueError saying what is wrong with it."""
        try:
            grammar = grammar_spec(so)
        except Exception as e:  # noqa: BLE001 -- llguidance raises its own types for schemas it cannot read
            raise InvalidParameter(f"invalid structured output: {e}", "structured_outputs") from None
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)  # "" when valid
        if error:
            raise InvalidParameter(f"invalid structured output: {error}", "structured_outputs")
        m = self.matcher(grammar)
        if m.is_error():
            raise InvalidParameter(f"invalid structured output: {m.get_error()}", "structured_outputs")
        if not m.is_accepting() and not self.first_mask_allows_any(m):
            raise InvalidParameter("the structured output's grammar matches no text this vocabulary can write",
                                   "structured_outputs")
        return grammar

    def matcher(self, grammar: str):
        import llguidance

        return llguidance.LLMatcher(self.ll_tokenizer, grammar)

    def first_mask_allows_any(self, m) -> bool:
        """Whether the grammar's first step allows any token but end-of-sequence (which llguidance
        allows where nothing else can follow)."""
        bits = bytearray(m.compute_bitmask())
        eos = self.tokenizer.eos_token_id
        if eos is not None:
            bits[eos // 8] &= ~(1 << (eos % 8)) & 0xFF
        return any(bits)


def build_constraints(params: SamplingParams, tokenizer, vocab_size: int,
                      compiler: GrammarCompiler | None) -> RequestConstraints | None:
    """Check a request's constraints against the vocabulary and compile them; None when it has none."""
    for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise InvalidParameter(f"invalid sampling parameter {name}: token id {bad[0]} is outside the vocabulary "
                                   f"[0, {vocab_size})", name)
    grammar = None
    if params.structured_outputs is not None:
        grammar = compiler.compile(params.structured_outputs)
    bad_words = []
    for word in params.bad_words:
        # as vLLM: the word as written and with a leading space (the two ways it begins mid-text)
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in bad_words:
                bad_words.append(ids)
    if grammar is None and not bad_words:
        return None
    return RequestConstraints(grammar, tuple(bad_words))


def banned_by_bad_words(bad_words: tuple[tuple[int, ...], ...], output_ids: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens end the output so far."""
    out = []
    for word in bad_words:
        prefix = word[:-1]
        if not prefix or (len(output_ids) >= len(prefix) and tuple(output_ids[-len(prefix):]) == prefix):
            out.append(word[-1])
    return out
