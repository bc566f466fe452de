"""The endpoints RAG and agent stacks call (issue 47): POST /tokenize and /detokenize, usage's
prompt_tokens_details.cached_tokens (the prefix-cache hits the scheduler counted, as /metrics counts them),
cache_salt (different salts never share a cached block), chat_template_kwargs, and vLLM's fields that would
change the result but are not implemented (a 400 naming the field) beside unknown fields (accepted, one WARNING
per name). Through a real server on the default model; the KV cache's salting and the template's kwargs also
without one."""

from __future__ import annotations

import copy
import json
import logging
import uuid

import httpx
import pytest

from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest

KEY = "tokenize-key"
MSG = [{"role": "user", "content": "Name a color."}]
THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                  "{% endif %}")


# ---- without a server -------------------------------------------------------------------------------


def _fill(kv: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    table = kv.allocate_slots(rid, len(tokens), kv.get_computed_blocks(rid, tokens))
    kv.cache_full_blocks(rid, tokens, len(tokens))
    return table


def test_a_cache_salt_keeps_blocks_apart_and_the_same_salt_shares_them():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    tokens = list(range(13))
    kv.set_request_salt("a1", "alice")
    a = _fill(kv, "a1", tokens)
    kv.set_request_salt("b1", "bob")
    assert kv.get_computed_blocks("b1", tokens) == []  # another salt: not even the first block
    assert kv.get_computed_blocks("n1", tokens) == []  # no salt at all: the same
    kv.set_request_salt("a2", "alice")
    assert kv.get_computed_blocks("a2", tokens) == a[:3]
    # the salt outlives a preemption (its hashes are dropped with its blocks and computed again)
    kv.free("a1")
    assert kv.get_computed_blocks("a1", tokens) == a[:3]
    kv.drop_request_salt("a1")
    kv.free("a1")
    assert kv.get_computed_blocks("a1", tokens) == []
    kv.check_invariants()


def test_chat_template_kwargs_reach_the_template():
    from tokenmill.models.registry import DEFAULT_MODEL
    from tokenmill.models.tokenizer_loader import load_tokenizer

    tok = load_tokenizer(DEFAULT_MODEL)
    tok.chat_template, tok._template = THINK_TEMPLATE, None
    plain = tok.apply_chat_template(MSG, add_generation_prompt=True)
    assert "<think>" not in plain
    assert tok.apply_chat_template(MSG, add_generation_prompt=True, enable_thinking=True) == plain
    assert tok.apply_chat_template(MSG, add_generation_prompt=True, enable_thinking=False) == plain + \
        "<think>\n\n</think>\n\n"


def test_an_unknown_field_is_accepted_and_logged_once_per_name(caplog):
    name = f"x_unknown_{uuid.uuid4().hex[:8]}"
    with caplog.at_level(logging.WARNING, logger="tokenmill.server"):
        req = CompletionRequest.model_validate({"prompt": "hi", name: 1})
        ChatCompletionRequest.model_validate({"messages": MSG, name: {"a": 2}})
        CompletionRequest.model_validate({"prompt": "hi", "temperature": 0.5})  # known fields: nothing logged
    assert req.model_extra == {name: 1}
    hits = [r for r in caplog.records if name in r.getMessage()]
    assert len(hits) == 1 and hits[0].levelno == logging.WARNING and "ignoring unknown field" in hits[0].getMessage()
    assert not [r for r in caplog.records if "temperature" in r.getMessage()]


# ---- through the server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(llm_fp32):
    from helpers import served_engine

    with served_engine(llm_fp32.engine, KEY, live_replay_interval=0) as http:
        yield http
    engine = llm_fp32.engine
    assert not engine.has_unfinished_requests()
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def _error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    return err


def _prose(tok, num_tokens: int) -> list[int]:
    """``num_tokens`` token ids no earlier request began with (a fresh word first)."""
    word = uuid.uuid4().hex[:10]
    ids = tok.encode(f"{word} " + " ".join(f"The {word} river{i} bends west." for i in range(num_tokens)))
    return ids[:num_tokens]


def _hits(http) -> float:
    line = next(x for x in http.get("/metrics").text.splitlines() if x.startswith("vllm:prefix_cache_hits_total{"))
    return float(line.rsplit(" ", 1)[1])


def _cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.slow
def test_tokenize_gives_what_the_endpoints_feed_the_model(served, llm_fp32):
    tok = llm_fp32.tokenizer
    text = "The quick brown fox jumps over the lazy dog"
    body = _ok(served.post("/tokenize", json={"model": served.model, "prompt": text}))
    assert body == {"count": len(tok.encode(text)), "max_model_len": 2048, "tokens": tok.encode(text)}
    strs = _ok(served.post("/tokenize", json={"prompt": text, "return_token_strs": True}))["token_strs"]
    assert strs == [tok.hf.id_to_token(t) for t in body["tokens"]]
    assert _ok(served.post("/detokenize", json={"model": served.model, "tokens": body["tokens"]})) == {"prompt": text}
    chat = _ok(served.post("/tokenize", json={"messages": MSG}))
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(MSG, add_generation_prompt=True),
                                        add_special_tokens=False)
    no_gen = _ok(served.post("/tokenize", json={"messages": MSG, "add_generation_prompt": False}))
    assert no_gen["count"] < chat["count"]
    # the chat endpoint's usage counts the same prompt
    r = _ok(served.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 1, "temperature": 0}))
    assert r["usage"]["prompt_tokens"] == chat["count"]
    # with tools the prompt carries them (SmolLM2's template knows none: the Hermes system message)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    assert _ok(served.post("/tokenize", json={"messages": MSG, "tools": [tool]}))["count"] > chat["count"]


@pytest.mark.slow
def test_tokenizer_endpoints_need_the_key_and_name_bad_fields(served):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        r = httpx.post(served.url + path, json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    vocab = served.app.state.serving.vocab_size
    for path, body, status, param in [
        ("/tokenize", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
        ("/tokenize", {"prompt": ""}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "hi", "messages": MSG}, 400, "messages"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"messages": MSG, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs"),
        ("/tokenize", {"messages": MSG, "chat_template": "{{ 1 }}"}, 400, "chat_template"),
        ("/detokenize", {"tokens": [], "model": served.model}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": [vocab]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "nope"}, 404, "model"),
    ]:
        _error(served.post(path, json=body), status, param)


@pytest.mark.slow
def test_cached_tokens_are_the_prefix_cache_hits_the_metrics_count(served, llm_fp32):
    bs = llm_fp32.engine.info.block_size
    ids = _prose(llm_fp32.tokenizer, 200)
    # two steps at least: the step that admitted it (and counted its hits) is in /metrics before the answer
    req = {"model": served.model, "prompt": ids, "max_tokens": 2, "ignore_eos": True, "temperature": 0}
    before = _hits(served)
    first = _ok(served.post("/v1/completions", json=req))
    assert _cached(first) == 0 and first["usage"]["prompt_tokens"] == 200
    assert _hits(served) == before
    second = _ok(served.post("/v1/completions", json=req))
    cached = _cached(second)
    assert cached > 0 and cached % bs == 0 and cached == (200 - 1) // bs * bs
    assert _hits(served) - before == cached
    # the streamed final usage chunk says the same
    with served.stream("POST", "/v1/completions", json={**req, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert events[-1]["choices"] == [] and _cached(events[-1]) == cached
    assert all(e["usage"] is None for e in events[:-1])
    # chat: a system message no earlier chat had (the template's own default system prompt is shared by all)
    chat = {"messages": [{"role": "system", "content": f"{uuid.uuid4().hex} is the code word."}, *MSG],
            "max_tokens": 2, "ignore_eos": True, "temperature": 0}
    assert _cached(_ok(served.post("/v1/chat/completions", json=chat))) == 0
    before = _hits(served)
    again = _ok(served.post("/v1/chat/completions", json=chat))
    assert _cached(again) > 0 and _cached(again) % bs == 0 and _hits(served) - before == _cached(again)
    with served.stream("POST", "/v1/chat/completions", json={**chat, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert _cached(events[-1]) == _cached(again)


@pytest.mark.slow
def test_different_cache_salts_never_share_blocks(served, llm_fp32):
    ids = _prose(llm_fp32.tokenizer, 100)

    def cached(salt: str | None, path: str = "/v1/completions") -> int:
        body = {"prompt": ids, "max_tokens": 1, "temperature": 0}
        if path != "/v1/completions":
            body = {"messages": [{"role": "user", "content": llm_fp32.tokenizer.decode(ids)}], "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        return _cached(_ok(served.post(path, json=body)))

    assert cached("a") == 0
    assert cached("b") == 0  # the same prompt under another salt finds nothing
    assert cached("a") > 0  # the same salt shares
    assert cached(None) == 0  # no salt shares nothing with a salted one
    assert cached(None) > 0
    assert cached("c", "/v1/chat/completions") == 0
    assert cached("c", "/v1/chat/completions") > 0
    _error(served.post("/v1/completions", json={"prompt": "hi", "cache_salt": ""}), 400, "cache_salt")
    _error(served.post("/v1/chat/completions", json={"messages": MSG, "cache_salt": ""}), 400, "cache_salt")
    _error(served.post("/v1/completions", json={"prompt": "hi", "cache_salt": 5}), 400, "cache_salt")


@pytest.mark.slow
def test_chat_template_kwargs_change_the_prompt(served, llm_fp32):
    serving = served.app.state.serving
    default = serving.tokenizer
    # the default model's template reads no kwarg: accepted, the prompt unchanged
    plain = _ok(served.post("/tokenize", json={"messages": MSG}))["count"]
    kw = {"messages": MSG, "chat_template_kwargs": {"enable_thinking": False}}
    assert _ok(served.post("/tokenize", json=kw))["count"] == plain
    _ok(served.post("/v1/chat/completions", json={**kw, "max_tokens": 1}))
    thinking = copy.copy(default)
    thinking.chat_template, thinking._template = THINK_TEMPLATE, None
    serving.tokenizer = thinking  # a template that branches on a kwarg (this server's alone)
    try:
        on = _ok(served.post("/tokenize", json={"messages": MSG, "chat_template_kwargs": {"enable_thinking": True}}))
        off = _ok(served.post("/tokenize", json=kw))
        assert off["count"] > on["count"] and off["tokens"][:on["count"]] == on["tokens"]
        assert off["tokens"] == thinking.encode(thinking.apply_chat_template(MSG, enable_thinking=False),
                                                add_special_tokens=False)
        r = _ok(served.post("/v1/chat/completions", json={**kw, "max_tokens": 1, "temperature": 0}))
        assert r["usage"]["prompt_tokens"] == off["count"]
    finally:
        serving.tokenizer = default
    _error(served.post("/v1/chat/completions", json={"messages": MSG, "chat_template_kwargs": {
        "add_generation_prompt": False}}), 400, "chat_template_kwargs")
    _error(served.post("/v1/chat/completions", json={"messages": MSG, "chat_template_kwargs": 3}), 400,
           "chat_template_kwargs")


UNSUPPORTED = [
    ("c", {"use_beam_search": True}, "use_beam_search"),
    ("c", {"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ("c", {"logits_processors": ["my.Proc"]}, "logits_processors"),
    ("c", {"guided_regex": "a+", "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ("c", {"guided_regex": "a+", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ("c", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("c", {"return_tokens_as_token_ids": True, "logprobs": 1}, "return_tokens_as_token_ids"),
    ("c", {"spaces_between_special_tokens": False, "skip_special_tokens": False}, "spaces_between_special_tokens"),
    ("c", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("c", {"best_of": 2}, "best_of"),
    ("ch", {"use_beam_search": True, "length_penalty": 0.5}, "use_beam_search"),
    ("ch", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("ch", {"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
    ("ch", {"echo": True}, "echo"),
    ("ch", {"structural_tag": "{}"}, "structural_tag"),
    ("ch", {"functions": [{"name": "f"}]}, "functions"),
    ("ch", {"function_call": "auto"}, "function_call"),
    ("ch", {"prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
]


@pytest.mark.slow
@pytest.mark.parametrize("endpoint,fields,param", UNSUPPORTED, ids=[f"{e}-{p}" for e, _, p in UNSUPPORTED])
def test_a_field_that_would_change_the_result_is_refused_by_name(served, endpoint, fields, param):
    path, base = (("/v1/chat/completions", {"messages": MSG}) if endpoint == "ch"
                  else ("/v1/completions", {"prompt": "hi"}))
    _error(served.post(path, json={**base, "max_tokens": 1, **fields}), 400, param)


@pytest.mark.slow
def test_fields_at_their_default_or_honoured_are_accepted(served, llm_fp32):
    ok = {"prompt": "hi", "max_tokens": 1, "temperature": 0}
    # vLLM's defaults, the llguidance backend by its vLLM names, length_penalty outside beam search (vLLM ignores it)
    _ok(served.post("/v1/completions", json={**ok, "use_beam_search": False, "length_penalty": 0.5,
                                             "spaces_between_special_tokens": False, "x_vendor_field": {"a": 1}}))
    for backend in ("auto", "guidance", "guidance:disable-any-whitespace"):
        r = _ok(served.post("/v1/completions", json={**ok, "max_tokens": 4, "guided_choice": ["yes", "no"],
                                                     "guided_decoding_backend": backend}))
        assert r["choices"][0]["text"] in ("yes", "no")
    # truncate_prompt_tokens keeps the prompt's last N tokens
    ids = _prose(llm_fp32.tokenizer, 30)
    r = _ok(served.post("/v1/completions", json={**ok, "prompt": ids, "truncate_prompt_tokens": 7, "echo": True}))
    assert r["usage"]["prompt_tokens"] == 7
    assert r["choices"][0]["text"].startswith(llm_fp32.tokenizer.decode(ids[-7:], skip_special_tokens=False))
    r = _ok(served.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 1, "truncate_prompt_tokens": 5}))
    assert r["usage"]["prompt_tokens"] == 5
    # chat's prompt_logprobs come back (vLLM's top-level field), none for the first token
    r = _ok(served.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 1, "prompt_logprobs": 0}))
    plp = r["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r["usage"]["prompt_tokens"] and all(len(d) == 1 for d in plp[1:])
    # documents reach the template as a variable (SmolLM2's reads none: accepted, the prompt unchanged)
    r = _ok(served.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 1,
                                                      "documents": [{"title": "t", "text": "x"}]}))


@pytest.mark.slow
def test_cached_tokens_and_cache_salt_cross_to_an_engine_core_process():
    """`serve`'s default layout: the salt goes to the core in its request, the count comes back in its outputs."""
    from helpers import step_until_done

    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.models.registry import DEFAULT_MODEL
    from tokenmill.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig.from_kwargs(model=DEFAULT_MODEL, kv_cache_memory="64MiB", max_model_len=512),
                       core_process=True)
    try:
        bs = engine.info.block_size
        ids = _prose(engine.tokenizer, 70)
        params = SamplingParams(max_tokens=1, temperature=0)

        def cached(rid: str, salt: str | None) -> int:
            engine.add_request(ids, params, rid, cache_salt=salt)
            return step_until_done(engine)[rid].num_cached_tokens

        assert cached("1", "s") == 0
        assert cached("2", "s") == (70 - 1) // bs * bs
        assert cached("3", "t") == 0 and cached("4", None) == 0
        with pytest.raises(ValueError, match="cache_salt"):
            engine.add_request(ids, params, "5", cache_salt="")
    finally:
        engine.shutdown()
