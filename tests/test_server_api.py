"""The API surface beyond plain sampling, through a real server and the official openai client:
structured outputs (response_format, vLLM's guided_* and structured_outputs), tool calls (named,
required and auto, streamed and not, the whole round trip), logit_bias, and echo with logprobs (prompt
logprobs). The tool-call parsers' table is at the end (no server)."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server.app import ServerConfig, build_app
from tokenmill.server.run import BackgroundServer
from tokenmill.server.tool_parsers import StreamingToolParser, parse_hermes, parse_llama3_json, parse_required

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


ECHO_PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def refs(llm_default):
    """Computed offline before the server takes the engine."""
    ids = llm_default.tokenizer.encode(ECHO_PROMPT)
    return {"ids": ids, "score": llm_default.engine.score(ids).tolist()}


@pytest.fixture(scope="module")
def server(llm_default, refs):
    ae = AsyncEngine(llm_default.engine, max_waiting_requests=256, log_interval=None)
    srv = BackgroundServer(build_app(ae, ServerConfig())).start()
    srv.async_engine = ae
    yield srv
    srv.stop(60)
    engine = llm_default.engine
    assert not engine.has_unfinished_requests()
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.mark.slow
def test_response_format_json_schema_with_the_openai_client(client):
    jsonschema = pytest.importorskip("jsonschema")
    schema = WEATHER["function"]["parameters"]
    for seed in range(6):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, temperature=1.0, seed=seed, max_tokens=80,
            response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}})
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.slow
def test_guided_fields_and_structured_outputs_on_completions(client, http):
    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=1.0,
                                  seed=1, n=3, extra_body={"guided_choice": ["yes", "no"]})
    assert {c.text for c in r.choices} <= {"yes", "no"}
    r = http.post("/v1/completions", json={"prompt": "Phone:", "max_tokens": 20, "temperature": 1.0, "seed": 2,
                                           "structured_outputs": {"regex": r"\+33 [0-9]{9}"}})
    assert re.fullmatch(r"\+33 [0-9]{9}", r.json()["choices"][0]["text"])
    # streamed, the pieces join to a match as well
    chunks = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, temperature=1.0, seed=3,
                                       stream=True, extra_body={"guided_regex": "[A-Z]{3}-[0-9]{3}"})
    assert re.fullmatch("[A-Z]{3}-[0-9]{3}", "".join(c.choices[0].text for c in chunks))


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip_with_the_openai_client(client, stream):
    """Request with tools and a forced function, tool_calls back, the tool's answer sent as a tool
    message, a final text answer: the openai client's own round trip, unchanged."""
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kw):
            ch = chunk.choices[0]
            for tc in ch.delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                c["id"] = tc.id or c["id"]
                c["name"] = (tc.function.name if tc.function and tc.function.name else c["name"])
                c["arguments"] += tc.function.arguments or "" if tc.function else ""
            finish = ch.finish_reason or finish
        assert finish == "tool_calls" and len(calls) == 1
        call = calls[0]
        name, args, call_id = call["name"], call["arguments"], call["id"]
    else:
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
        (tc,) = msg.tool_calls
        name, args, call_id = tc.function.name, tc.function.arguments, tc.id
    assert name == "get_weather" and call_id
    parsed = json.loads(args)
    assert set(parsed) == {"city", "unit"} and parsed["unit"] in ("celsius", "fahrenheit")
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    r = client.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER, TIME], max_tokens=24,
                                       temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


@pytest.mark.slow
def test_tool_choice_required_and_auto(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=120, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
    for c in calls:
        json.loads(c.function.arguments)
    # auto: the output is parsed; a Hermes block (forced here with a regex) comes back as tool_calls
    block = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}\n</tool_call>'
    for stream in (False, True):
        kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
                  extra_body={"guided_regex": block})
        if stream:
            deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kw)]
            got = [tc for d in deltas for tc in d.tool_calls or []]
            assert "".join(d.content or "" for d in deltas) == ""
        else:
            got = client.chat.completions.create(**kw).choices[0].message.tool_calls
        assert len(got) == 1 and got[0].function.name == "get_time"
        assert json.loads(got[0].function.arguments) == {"zone": "UTC"}
    # tool_choice none: plain text, nothing parsed
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


@pytest.mark.slow
def test_echo_with_logprobs_gives_the_prompt_logprobs(client, http, refs):
    """echo + logprobs: the prompt's tokens first, with the logprobs LLM.score computes offline (the same
    bits: one prefill either way), then the completion's; vLLM's prompt_logprobs field and a stream agree."""
    ids, score = refs["ids"], refs["score"]
    r = client.completions.create(model=MODEL, prompt=ECHO_PROMPT, max_tokens=2, temperature=0, echo=True,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(ECHO_PROMPT)
    assert len(lp.tokens) == len(ids) + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == score
    assert all(len(t) >= 2 for t in lp.top_logprobs[1:])
    body = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0,
                                              "prompt_logprobs": 0}).json()
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and [plp[i][str(ids[i])]["logprob"] for i in range(1, len(ids))] == score
    chunks = list(client.completions.create(model=MODEL, prompt=ECHO_PROMPT, max_tokens=2, temperature=0,
                                            echo=True, logprobs=1, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[: len(ids)] == [None] + score


@pytest.mark.slow
def test_logit_bias_bans_a_token_through_the_server(client, llm_default):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    (first, *_) = llm_default.tokenizer.encode(r.choices[0].text, add_special_tokens=False)
    r2 = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                   logit_bias={str(first): -100})
    assert llm_default.tokenizer.encode(r2.choices[0].text, add_special_tokens=False)[:1] != [first]


@pytest.mark.slow
def test_bad_constraints_then_the_server_still_serves(http):
    bad = http.post("/v1/chat/completions", json={"messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
            "a": {"type": "string", "format": "no-such-format"}}}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
    ok = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2})
    assert ok.status_code == 200


# ---- the parsers ----------------------------------------------------------------------------------

HERMES = [
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', None, [("f", {"x": 1})]),
    ('Sure.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": '
     '{"y": "z"}}</tool_call>', "Sure.", [("f", {}), ("g", {"y": "z"})]),
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}', None, [("f", {"x": 1})]),  # EOS before the tag closed
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>', None, [("f", {"x": 2})]),  # string args
    ("plain text", "plain text", []),
    ('<tool_call>{"name": "f", "arguments": {"x": </tool_call>', '<tool_call>{"name": "f", "arguments": {"x": '
     '</tool_call>', []),  # malformed JSON: content
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ('<tool_call>[1, 2]</tool_call>', '<tool_call>[1, 2]</tool_call>', []),
]
LLAMA = [
    ('{"name": "f", "parameters": {"x": 1}}', None, [("f", {"x": 1})]),
    ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"a": [1]}}', None,
     [("f", {}), ("g", {"a": [1]})]),
    ('The answer is 4.', 'The answer is 4.', []),
    ('{"name": "f", "parameters": {"x": ', '{"name": "f", "parameters": {"x": ', []),
    ('{"nome": "f"}', '{"nome": "f"}', []),
]


@pytest.mark.parametrize("parser,text,content,calls", [(parse_hermes, *c) for c in HERMES] +
                         [(parse_llama3_json, *c) for c in LLAMA])
def test_tool_call_parsers(parser, text, content, calls):
    got_content, got = parser(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("text,content,calls", HERMES)
def test_streaming_hermes_parser_agrees_with_the_whole_text(text, content, calls):
    for step in (1, 3, 7):
        p = StreamingToolParser("hermes")
        out, got = "", []
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        for i, piece in enumerate(pieces):
            c, new = p.feed(piece, i == len(pieces) - 1)
            out += c
            got += new
        assert [(c.name, json.loads(c.arguments)) for c in got] == calls
        assert out.strip() == (content or "").strip() if calls else out == text


def test_required_parser():
    assert [c.name for c in parse_required('[{"name": "f", "parameters": {}}]')] == ["f"]
    assert parse_required("[]") is None and parse_required("{") is None and parse_required('[{"x": 1}]') is None
