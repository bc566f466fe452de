"""Constrained generation: logit_bias, allowed_token_ids, bad_words and structured outputs (grammars
through llguidance), offline; the server's side is in test_server_api.py."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tokenmill import SamplingParams, StructuredOutputsParams
from tokenmill.layers.sampler import Sampler, SamplingBatch
from tokenmill.structured_output import banned_by_bad_words


def batch(n, **kw):
    return SamplingBatch(temperature=torch.zeros(n), all_greedy=True, top_k=None, top_p=None, min_p=None,
                         generators=[None] * n, **kw)


def test_logit_bias_and_allowed_ids_steer_the_argmax():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0]])
    s = Sampler(torch.Generator().manual_seed(0))
    b = batch(2, logit_bias=[(0, torch.tensor([3]), torch.tensor([5.0]))],
              allowed=[(1, torch.tensor([1, 2]))])
    assert s(logits, b).token_ids.tolist() == [3, 1]


def test_bad_words_ban_the_last_token_after_the_rest():
    words = ((7,), (4, 5, 6))
    assert banned_by_bad_words(words, []) == [7]
    assert banned_by_bad_words(words, [1, 4, 5]) == [7, 6]
    assert banned_by_bad_words(words, [4, 5, 1]) == [7]


@pytest.mark.parametrize("kw,match", [
    (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={-1: 1}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
])
def test_bad_constraint_parameters_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw", [dict(), dict(json={}, regex="a"), dict(choice=[])])
def test_structured_outputs_need_exactly_one_constraint(kw):
    with pytest.raises(ValueError, match="structured outputs"):
        StructuredOutputsParams(**kw)


# ---- the real model ------------------------------------------------------------------------------

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                        "minItems": 1, "maxItems": 4}},
              "required": ["tags"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"type": "string", "enum": ["S", "M", "L"]}},
             "required": ["color", "size"], "additionalProperties": False},
    "bounded": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                                 "score": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.25}},
                "required": ["age", "score"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                "required": ["code"], "additionalProperties": False},
}
PROMPT = "Describe a person as JSON:"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_sampled_json_follows_its_schema(llm_default, name):
    jsonschema = pytest.importorskip("jsonschema")
    schema = SCHEMAS[name]
    so = StructuredOutputsParams(json=schema)
    params = [SamplingParams(temperature=1.0, max_tokens=128, seed=i, structured_outputs=so) for i in range(40)]
    outs = llm_default.generate([PROMPT] * len(params), params, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.slow
def test_without_the_constraint_the_same_samples_do_not_validate(llm_default):
    """Negative control: the model alone does not write valid JSON for the schema."""
    jsonschema = pytest.importorskip("jsonschema")
    outs = llm_default.generate([PROMPT] * 20, [SamplingParams(temperature=1.0, max_tokens=96, seed=i)
                                                for i in range(20)], use_tqdm=False)
    valid = 0
    for o in outs:
        try:
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS["nested"])
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    assert valid < 5


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


EMAIL = r"[a-z]{2,6}@example\.(com|org)"
GBNF = 'root ::= "(" num " " op " " num ")"\nnum ::= [0-9] | [0-9] [0-9] | [0-9] [0-9] [0-9]\nop ::= "+" | "-"'
# (constraint, the check each finished output passes, how many of the eight must finish within 48 tokens: an
# object can go on for ever, the others cannot)
CONSTRAINTS = {
    "regex": (StructuredOutputsParams(regex=EMAIL), lambda t: re.fullmatch(EMAIL, t), 8),
    "choice": (StructuredOutputsParams(choice=["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe"), 8),
    "grammar": (StructuredOutputsParams(grammar=GBNF), lambda t: re.fullmatch(r"\(\d{1,3} [+-] \d{1,3}\)", t), 8),
    "json_object": (StructuredOutputsParams(json_object=True), _json_object, 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_regex_choice_grammar_and_json_object_constraints(llm_default, name):
    """Eight samples (a seed each) finish inside the constraint; the same seeds without it do not (negative
    control: the mask, not the prompt, makes them valid)."""
    so, check, need = CONSTRAINTS[name]

    def gen(so):  # noqa: ANN001
        params = [SamplingParams(temperature=1.0, max_tokens=48, seed=i, structured_outputs=so) for i in range(8)]
        return [o.outputs[0] for o in llm_default.generate(["Answer:"] * 8, params, use_tqdm=False)]

    constrained = gen(so)
    assert len({c.text for c in constrained}) > 1  # eight samples, not one repeated
    finished = [c.text for c in constrained if c.finish_reason == "stop"]
    assert len(finished) >= need and all(check(t) for t in finished), [(c.finish_reason, c.text) for c in constrained]
    assert sum(bool(check(c.text)) for c in gen(None)) <= 1


@pytest.mark.slow
def test_a_stop_string_inside_a_constraint_ends_the_text_there(llm_default):
    sp = SamplingParams(temperature=1.0, max_tokens=32, seed=3, stop=["@"],
                        structured_outputs=StructuredOutputsParams(regex=EMAIL))
    outs = [o.outputs[0] for o in llm_default.generate(["Answer:"] * 4, sp, use_tqdm=False)]
    assert all(re.fullmatch(r"[a-z]{2,6}", c.text) and c.finish_reason == "stop" for c in outs)


@pytest.mark.slow
def test_constrained_and_free_requests_share_a_batch(llm_default):
    """A constrained request does not change its neighbours: greedy outputs of the free ones are the
    bits they are alone."""
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm_default.generate(["The sky is", "Once upon a time"], free, use_tqdm=False)
    so = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMAS["enum"]))
    mixed = llm_default.generate(["The sky is", PROMPT, "Once upon a time"], [free, so, free], use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == [o.outputs[0].token_ids for o in alone]
    json.loads(mixed[1].outputs[0].text)


@pytest.mark.slow
def test_logit_bias_allowed_ids_and_bad_words_offline(llm_default):
    tok = llm_default.tokenizer
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = llm_default.generate(["The capital of France is"], base, use_tqdm=False)[0].outputs[0]
    first = ref.token_ids[0]
    banned = llm_default.generate(["The capital of France is"], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, logit_bias={first: -100}), use_tqdm=False)[0].outputs[0]
    assert first not in banned.token_ids[:1]
    only = tok.encode(" yes no", add_special_tokens=False)
    got = llm_default.generate(["Is it?"], SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True,
                                                          allowed_token_ids=only), use_tqdm=False)[0].outputs[0]
    assert set(got.token_ids) <= set(only)
    word = ref.text.split()[0]
    no_word = llm_default.generate(["The capital of France is"], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, bad_words=[word]), use_tqdm=False)[0].outputs[0]
    assert word not in no_word.text.split()


@pytest.mark.slow
@pytest.mark.parametrize("kw,match", [
    (dict(structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "string", "format": "no-such-format"}}})), "format"),
    (dict(structured_outputs=StructuredOutputsParams(json='{"type": ')), "not valid JSON"),
    (dict(structured_outputs=StructuredOutputsParams(regex="(unclosed")), "structured output"),
    (dict(structured_outputs=StructuredOutputsParams(grammar="start: foo")), "structured output"),
    (dict(structured_outputs=StructuredOutputsParams(regex=r"[^\s\S]")), "matches no text"),  # nothing
    (dict(structured_outputs=StructuredOutputsParams(json={"type": "string", "minLength": 5, "maxLength": 2})),
     "Unsatisfiable"),
    (dict(logit_bias={10**6: 1.0}), "outside the vocabulary"),
    (dict(allowed_token_ids=[10**6]), "outside the vocabulary"),
])
def test_bad_constraints_are_refused_at_admission_and_nothing_leaks(llm_default, kw, match):
    engine = llm_default.engine
    with pytest.raises(ValueError, match=match):
        engine.add_request("hello", SamplingParams(**kw))
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.mark.slow
def test_grammar_with_ngram_speculation_keeps_greedy_bits(llm_default):
    """Drafts are checked against the grammar: speculation on, the constrained greedy output is the
    one without it."""
    from tokenmill import LLM

    spec = LLM(kv_cache_memory="64MiB", max_model_len=2048, speculative_method="ngram", num_speculative_tokens=4)
    spec.engine.core.proposer.draft_cost = lambda batch: (lambda d: 0.0)  # draft whatever the acceptance
    so = StructuredOutputsParams(json=SCHEMAS["array"])
    sp = SamplingParams(temperature=0, max_tokens=60, structured_outputs=so)
    prompts = ['Tags: "red", "red", "red". JSON:', PROMPT]
    want = [o.outputs[0].token_ids for o in llm_default.generate(prompts, sp, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)] == want
    assert sum(s.spec.num_draft_tokens for s in spec.engine.step_stats if s.spec is not None) > 0
