"""The Responses API (issue 47): POST /v1/responses through the chat path, streamed as OpenAI's events, the
bounded store behind previous_response_id and GET/DELETE /v1/responses/{id}. The item conversion and the output
items are tested on canned outputs (every split of a streamed one included); one real server (the default model,
the llama3_json tool parser so a JSON schema can force a tool call) checks the whole path with the official
client, every response and event validated against its own types."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from helpers import metric, served_engine
from pydantic import TypeAdapter

from tokenmill.sampling_params import SamplingParams
from tokenmill.server.protocol import OpenAIError
from tokenmill.server.reasoning import reasoning_for
from tokenmill.server.responses_output import OutputBuilder, ResponseStore
from tokenmill.server.responses_protocol import chat_messages, input_items, response_tools
from tokenmill.server.serving import _Prepared

KEY = "responses-key"
EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
PARIS = {"type": "object", "properties": {"city": {"const": "Paris"}}, "required": ["city"],
         "additionalProperties": False}


# ---- without a server -------------------------------------------------------------------------------


def test_items_become_chat_messages():
    items = input_items([
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                        {"type": "input_text", "text": "Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # sent back: dropped
        {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Lyon"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rain"},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
    ])
    calls = [{"id": c, "type": "function", "function": {"name": "get_weather", "arguments": a}}
             for c, a in (("c1", '{"city":"Paris"}'), ("c2", '{"city":"Lyon"}'))]
    assert chat_messages(items, "Answer in French.") == [
        {"role": "system", "content": "Answer in French."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls},  # the calls join the message before
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ]
    assert input_items("Hi") == [{"type": "message", "role": "user", "content": "Hi"}]


@pytest.mark.parametrize("given,param", [
    ([{"role": "tool", "content": "x"}], "input[0].role"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input[0].content"),
    ([{"role": "user", "content": 5}], "input[0].content"),
    ([{"role": "user", "content": "a"}, {"type": "function_call", "name": "f", "arguments": "{}"}],
     "input[1].call_id"),
    ([{"type": "function_call_output", "call_id": "c"}], "input[0].output"),
    ([{"type": "item_reference", "id": "x"}], "input[0].type"),
])
def test_bad_items_name_the_item(given, param):
    with pytest.raises(OpenAIError) as e:
        input_items(given)
    assert (e.value.status, e.value.param) == (400, param)


def test_only_function_tools():
    assert response_tools([WEATHER])[0]["name"] == "get_weather"
    with pytest.raises(OpenAIError, match="'web_search'.*'file_search'|'web_search', 'file_search'") as e:
        response_tools([WEATHER, {"type": "web_search"}, {"type": "file_search"}])
    assert e.value.param == "tools"


def _prep(tool_choice="auto", parser="hermes", reasoning=None) -> _Prepared:
    return _Prepared([[1]], [""], SamplingParams(), "max_tokens", "messages", tool_choice=tool_choice,
                     tool_parser=parser, tools=[{"type": "function", "function": WEATHER}],
                     reasoning=reasoning_for(reasoning, None, False))


def _strip_ids(x):
    """Items or events without their random ids (item ids, call ids)."""
    if isinstance(x, list):
        return [_strip_ids(v) for v in x]
    if isinstance(x, dict):
        return {k: _strip_ids(v) for k, v in x.items() if k not in ("id", "item_id", "call_id")}
    return x


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
CANNED = [  # (output, tool choice, reasoning parser, [(item type, its text or name+arguments)])
    ("Hello there", None, None, [("message", "Hello there")]),
    ("", None, None, [("message", "")]),  # nothing: an empty message, as OpenAI sends
    (f"Let me check.{CALL}", "auto", None, [("message", "Let me check."), ("function_call", "get_weather", {
        "city": "Paris"})]),
    (f"<think>hmm</think>{CALL}", "auto", "qwen3", [("reasoning", "hmm"), ("function_call", "get_weather", {
        "city": "Paris"})]),
    ("<think>a<b</think>Hi", None, "qwen3", [("reasoning", "a<b"), ("message", "Hi")]),
    ('{"city": "Paris"}', "get_weather", None, [("function_call", "get_weather", {"city": "Paris"})]),
    ('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]', "required", None,
     [("function_call", "get_weather", {"city": "Oslo"})]),
]


def _summary(items: list[dict]) -> list[tuple]:
    out = []
    for it in items:
        if it["type"] == "message":
            assert [p["type"] for p in it["content"]] == ["output_text"]
            out.append(("message", it["content"][0]["text"]))
        elif it["type"] == "reasoning":
            out.append(("reasoning", it["content"][0]["text"]))
        else:
            out.append(("function_call", it["name"], json.loads(it["arguments"])))
    return out


@pytest.mark.parametrize("text,choice,reasoning,want", CANNED)
def test_output_items_from_a_canned_output_whole_and_streamed_at_every_split(text, choice, reasoning, want):
    whole = OutputBuilder(_prep(choice, reasoning=reasoning))
    whole.feed(text, True)
    assert _summary(whole.items) == want
    assert all(it["status"] == "completed" for it in whole.items)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text) or [""]]
    for pieces in splits:
        b = OutputBuilder(_prep(choice, reasoning=reasoning))
        events = [e for i, p in enumerate(pieces) for e in b.feed(p, i == len(pieces) - 1)]
        assert _strip_ids(b.items) == _strip_ids(whole.items), pieces
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        for e in events:
            EVENTS.validate_python(e)  # the official client's own event types
        # each item's events: added first, done last with the item itself; the deltas join to its text
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert done == b.items
        for idx, item in enumerate(b.items):
            mine = [e for e in events if e.get("output_index") == idx]
            assert mine[0]["type"] == "response.output_item.added" and mine[-1]["type"] == "response.output_item.done"
            joined = "".join(e["delta"] for e in mine if e["type"].endswith(".delta"))
            assert joined == _summary([item])[0][1] if item["type"] != "function_call" else \
                json.loads(joined) == json.loads(item["arguments"])
    # negative control: with no reasoning parser the thinking stays in the message
    if reasoning:
        b = OutputBuilder(_prep(choice))
        b.feed(text, True)
        assert "reasoning" not in [t[0] for t in _summary(b.items)]


def test_an_output_cut_off_is_an_incomplete_message():
    b = OutputBuilder(_prep(None))
    events = b.feed("Hel", False) + b.feed("lo", True, "incomplete")
    assert b.items[0]["status"] == "incomplete" and events[-1]["item"]["status"] == "incomplete"


def test_store_is_a_bounded_lru():
    s = ResponseStore(2)
    for rid in ("a", "b"):
        s.put({"id": rid}, [])
    assert s.get("a") is not None  # a is now the most recent
    s.put({"id": "c"}, [])
    assert s.get("b") is None and s.get("a") is not None and s.get("c") is not None and len(s) == 2
    assert s.delete("a") and not s.delete("a") and len(s) == 1
    off = ResponseStore(0)
    off.put({"id": "a"}, [])
    assert off.get("a") is None and len(off) == 0
    with pytest.raises(ValueError):
        ResponseStore(-1)


# ---- through a real server --------------------------------------------------------------------------

STORE_SIZE = 6


@pytest.fixture(scope="module")
def server(llm_fp32):
    with served_engine(llm_fp32.engine, KEY, tool_call_parser="llama3_json",
                       responses_store_size=STORE_SIZE) as http:
        yield http
    engine = llm_fp32.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def _check(r: Response) -> Response:
    """The response as the official types validate it (strictly, not the client's lenient parse)."""
    Response.model_validate(r.model_dump(exclude_unset=True, by_alias=True))
    assert r.id.startswith("resp_") and r.object == "response"
    return r


def _tokens(server, messages: list[dict], tools: list[dict] | None = None) -> int:
    body = {"messages": messages, **({"tools": tools} if tools else {})}
    r = server.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["count"]


CHAT = [{"role": "user", "content": "Say hello in French."}]


@pytest.mark.slow
def test_create_equals_a_greedy_chat_completion(server, client):
    r = _check(client.responses.create(model=server.model, input=CHAT, instructions="You are terse.",
                                       max_output_tokens=8, temperature=0, metadata={"k": "v"}))
    chat = client.chat.completions.create(model=server.model, max_tokens=8, temperature=0,
                                          messages=[{"role": "system", "content": "You are terse."}, *CHAT])
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert [o.type for o in r.output] == ["message"]
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    cut = chat.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if cut else "completed")
    assert (r.incomplete_details.reason if cut else r.incomplete_details) == ("max_output_tokens" if cut else None)
    assert (r.instructions, r.max_output_tokens, r.temperature, r.metadata) == ("You are terse.", 8, 0.0, {"k": "v"})
    assert r.tool_choice == "auto" and r.tools == [] and r.parallel_tool_calls and r.text.format.type == "text"


@pytest.mark.slow
def test_stream_events_in_order_joining_to_the_text(server, client):
    kw = dict(model=server.model, input="Name a color.", max_output_tokens=6, temperature=0)
    plain = _check(client.responses.create(**kw))
    events = list(client.responses.create(stream=True, **kw))
    for e in events:
        EVENTS.validate_python(e.model_dump(exclude_unset=True, by_alias=True))
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * len(deltas) + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = _check(events[-1].response)
    assert "".join(deltas) == events[-4].text == final.output_text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens and final.status == plain.status
    assert client.responses.retrieve(final.id).output_text == final.output_text  # a streamed one is stored too
    with client.responses.stream(**kw) as s:  # the client's stream helper gets its final response
        assert s.get_final_response().output_text == plain.output_text


def _idle(server) -> bool:
    engine = server.app.state.engine
    return engine.call_soon(lambda: not engine.engine.has_unfinished_requests()).result(30)


def _aborted(server) -> float:
    return metric(server.get("/metrics").text, "vllm:request_success_total", finished_reason="abort") or 0.0


@pytest.mark.slow
def test_a_stream_dropped_midway_aborts_its_request(server):
    import time

    before = _aborted(server)
    body = {"model": server.model, "input": "Write a long story.", "max_output_tokens": 1500, "stream": True}
    with server.stream("POST", "/v1/responses", json=body) as r:
        for line in r.iter_lines():
            if "response.output_text.delta" in line:
                break
    deadline = time.monotonic() + 60
    while not _idle(server):
        assert time.monotonic() < deadline, "the dropped stream's request kept running"
        time.sleep(0.05)
    assert _aborted(server) == before + 1  # ended by the abort, not by running to its end


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_round_trip(server, client, stream):
    # llama3_json reads {"name", "parameters"}: a JSON schema forces the model to write exactly that call
    forced = {"format": {"type": "json_schema", "name": "call", "schema": {
        "type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": PARIS},
        "required": ["name", "parameters"], "additionalProperties": False}}}
    kw = dict(model=server.model, input="What is the weather in Paris?", tools=[WEATHER], temperature=0,
              max_output_tokens=40, text=forced)
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        for e in events:
            EVENTS.validate_python(e.model_dump(exclude_unset=True, by_alias=True))
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert json.loads(args) == {"city": "Paris"}
        assert [e.item.type for e in events if e.type == "response.output_item.added"] == ["function_call"]
        r = _check(events[-1].response)
    else:
        r = _check(client.responses.create(**kw))
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert (call.name, json.loads(call.arguments), call.status) == ("get_weather", {"city": "Paris"}, "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert r.tools[0].name == "get_weather"
    # the result goes back as a function_call_output: the prompt is the chat with the call and the tool message
    r2 = _check(client.responses.create(model=server.model, tools=[WEATHER], max_output_tokens=2, temperature=0,
                                        input=[{"role": "user", "content": "What is the weather in Paris?"}, *r.output,
                                               {"type": "function_call_output", "call_id": call.call_id,
                                                "output": "sunny, 21 C"}]))
    chat = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    assert r2.usage.input_tokens == _tokens(server, chat, tools)
    assert r2.usage.input_tokens != _tokens(server, chat[:1] + chat[2:], tools)  # negative control: no call


@pytest.mark.slow
def test_a_named_tool_choice_forces_the_call(server, client):
    tool = {**WEATHER, "parameters": PARIS}
    r = _check(client.responses.create(model=server.model, input="Weather?", tools=[tool], max_output_tokens=30,
                                       tool_choice={"type": "function", "name": "get_weather"}))
    assert [(o.type, o.name, json.loads(o.arguments)) for o in r.output] == [("function_call", "get_weather",
                                                                               {"city": "Paris"})]
    assert r.tool_choice.name == "get_weather"


@pytest.mark.slow
def test_previous_response_id_continues_the_conversation(server, client):
    r1 = _check(client.responses.create(model=server.model, input="My name is Ann.", instructions="Be brief.",
                                        max_output_tokens=4, temperature=0))
    r2 = _check(client.responses.create(model=server.model, input="What is my name?", previous_response_id=r1.id,
                                        max_output_tokens=2, temperature=0))
    assert r2.previous_response_id == r1.id
    # the stored input and output come first; the earlier instructions do not carry over (as OpenAI does)
    want = [{"role": "user", "content": "My name is Ann."}, {"role": "assistant", "content": r1.output_text},
            {"role": "user", "content": "What is my name?"}]
    assert r2.usage.input_tokens == _tokens(server, want) > r1.usage.input_tokens
    # a third turn chains through both
    r3 = _check(client.responses.create(model=server.model, input="Thanks.", previous_response_id=r2.id,
                                        max_output_tokens=1, temperature=0))
    want += [{"role": "assistant", "content": r2.output_text}, {"role": "user", "content": "Thanks."}]
    assert r3.usage.input_tokens == _tokens(server, want)


@pytest.mark.slow
def test_get_and_delete_a_stored_response(server, client):
    r = _check(client.responses.create(model=server.model, input="Hi", max_output_tokens=2, temperature=0))
    got = _check(client.responses.retrieve(r.id))
    assert got.model_dump() == r.model_dump()
    assert client.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    # store false: answered, never kept
    r = _check(client.responses.create(model=server.model, input="Hi", max_output_tokens=1, store=False))
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=server.model, input="Hi", previous_response_id=r.id)
    assert (e.value.body["param"], e.value.body["code"]) == ("previous_response_id", "previous_response_not_found")


@pytest.mark.slow
def test_the_store_keeps_the_last_n_least_recently_used_out(server, client):
    ids = [client.responses.create(model=server.model, input="Hi", max_output_tokens=1).id
           for _ in range(STORE_SIZE)]
    client.responses.retrieve(ids[0])  # now the most recent
    ids.append(client.responses.create(model=server.model, input="Hi", max_output_tokens=1).id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])  # the least recently used went
    for rid in [ids[0], *ids[2:]]:
        client.responses.retrieve(rid)
    assert len(server.app.state.serving.responses_store) == STORE_SIZE


@pytest.mark.slow
def test_storing_off_refuses_previous_response_id(server):
    serving = server.app.state.serving
    kept, serving._responses_store = serving._responses_store, ResponseStore(0)
    try:
        r = server.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 1})
        assert r.status_code == 200 and server.get(f"/v1/responses/{r.json()['id']}").status_code == 404
        r = server.post("/v1/responses", json={"input": "Hi", "previous_response_id": "resp_x"})
        assert r.status_code == 400 and "storing is off" in r.json()["error"]["message"]
    finally:
        serving._responses_store = kept


@pytest.mark.slow
@pytest.mark.parametrize("body,status,param", [
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "bad name!"}]}, 400, "tools"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": "x"}]}, 400, "tools"),
    ({"input": "Hi", "tool_choice": {"type": "file_search"}}, 400, "tool_choice"),
    ({"input": "Hi", "tool_choice": {"type": "function", "name": "g"}, "tools": [WEATHER]}, 400, "tool_choice"),
    ({"input": "Hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": []}, 400, "input"),
    ({}, 400, "input"),
    ({"input": "Hi", "max_output_tokens": 5000}, 400, "max_output_tokens"),
    ({"input": "hello " * 2100}, 400, "input"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text"),
    ({"input": "Hi", "background": True}, 400, "background"),
    ({"input": "Hi", "model": "gpt-5"}, 404, "model"),
])
def test_bad_requests(server, body, status, param):
    r = server.post("/v1/responses", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    if param == "max_output_tokens":
        assert "max_output_tokens" in err["message"] and "max_tokens" not in err["message"].replace(
            "max_output_tokens", "")


@pytest.mark.slow
def test_api_key_is_required(server):
    import httpx

    assert httpx.post(server.url + "/v1/responses", json={"input": "Hi"}).status_code == 401
    assert httpx.get(server.url + "/v1/responses/resp_x").status_code == 401
