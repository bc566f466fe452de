"""What agents rely on in a chat answer (issue 47): --reasoning-parser (qwen3, deepseek_r1) splitting the thinking
into reasoning_content, --chat-template replacing the model's template, and the tool-call parsers beside hermes
(mistral, pythonic, qwen3_xml). The parsers are tested on strings, streamed deltas split at every position
included; one real server (the default model) checks the whole path with a custom template and an output
forced by a regex, streamed and not."""

from __future__ import annotations

import argparse
import json
import re

import httpx
import openai
import pytest

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server.app import ServerConfig, build_app
from tokenmill.server.args import add_server_args
from tokenmill.server.chat_template import load_chat_template
from tokenmill.server.reasoning import REASONING_PARSERS, reasoning_for
from tokenmill.server.run import BackgroundServer
from tokenmill.server.tool_parsers import (
    TOOL_CALL_PARSERS,
    StreamingToolParser,
    parse_mistral,
    parse_pythonic,
    parse_qwen3_xml,
    parse_tool_calls,
)

MODEL = "smollm2-135m-instruct"


def _splits(text: str):
    """The text as deltas: cut in two at every position, and one character at a time."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text) or [""]


# ---- reasoning ---------------------------------------------------------------------------------------------

QWEN3 = [  # (output, reasoning_content, content)
    ("<think>abc</think>Hello", "abc", "Hello"),
    ("<think>\nabc\n</think>\n\nHello", "\nabc\n", "\n\nHello"),
    ("  <think>a<b</think>c", "a<b", "c"),
    ("<think>abc", "abc", None),  # cut off while thinking: still reasoning
    ("<think></think>Hi", "", "Hi"),
    ("Hello", None, "Hello"),  # no thinking: all content
    ("Hi <think>x</think> there", None, "Hi <think>x</think> there"),  # only an opening <think> starts it
    ("<thin", None, "<thin"),
    ("", None, ""),
]
DEEPSEEK_R1 = [
    ("abc</think>Hello", "abc", "Hello"),  # the <think> was in the prompt
    ("<think>abc</think>Hello", "abc", "Hello"),
    ("abc", "abc", None),
    ("</think>Hi", "", "Hi"),
    ("a</thinkx</think>b", "a</thinkx", "b"),
]


@pytest.mark.parametrize("parser,output,reasoning,content",
                         [("qwen3", *c) for c in QWEN3] + [("deepseek_r1", *c) for c in DEEPSEEK_R1])
def test_reasoning_split_whole_and_streamed_at_every_position(parser, output, reasoning, content):
    r = reasoning_for(parser, None, constrained=False)
    assert r.split(output) == (reasoning, content)
    for pieces in _splits(output):
        s = r.stream()
        got_r = got_c = ""
        for i, piece in enumerate(pieces):
            dr, dc = s.feed(piece, i == len(pieces) - 1)
            got_r += dr
            got_c += dc
        assert (got_r, got_c) == (reasoning or "", content or ""), pieces


def test_reasoning_stream_holds_back_only_a_tags_beginning():
    s = reasoning_for("qwen3", None, constrained=False).stream()
    assert s.feed("<thi", False) == ("", "")  # may be <think>
    assert s.feed("nk>abc</th", False) == ("abc", "")  # may be </think>
    assert s.feed("ink>Hel", False) == ("", "Hel")
    assert s.feed("lo", True) == ("", "lo")
    s = reasoning_for("qwen3", None, constrained=False).stream()
    assert s.feed("Hel", False) == ("", "Hel")  # cannot be <think>: content at once


def test_reasoning_per_request():
    assert reasoning_for(None, None, False) is None
    assert reasoning_for("qwen3", {"enable_thinking": False}, False) is None  # the template closed the thinking
    assert reasoning_for("qwen3", {"enable_thinking": True}, False) is not None
    assert reasoning_for("deepseek_r1", None, False).starts_inside
    # a constrained output starts where the constraint does: the opening tag must be in it
    assert not reasoning_for("deepseek_r1", None, True).starts_inside
    assert reasoning_for("deepseek_r1", None, True).split('{"a": 1}') == (None, '{"a": 1}')


def test_unknown_parsers_are_refused_at_startup_naming_the_choices():
    with pytest.raises(ValueError, match="qwen3, deepseek_r1.*'nope'"):
        ServerConfig(reasoning_parser="nope")
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic, qwen3_xml"):
        ServerConfig(tool_call_parser="nope")
    p = argparse.ArgumentParser()
    add_server_args(p)
    a = p.parse_args(["--reasoning-parser", "deepseek_r1", "--tool-call-parser", "qwen3_xml"])
    assert (a.reasoning_parser, a.tool_call_parser) == ("deepseek_r1", "qwen3_xml")
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}
    with pytest.raises(SystemExit):
        p.parse_args(["--reasoning-parser", "nope"])


# ---- --chat-template ---------------------------------------------------------------------------------------

CUSTOM_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\nCUSTOM {{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_template_from_a_file_or_inline_and_the_startup_errors(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(CUSTOM_TEMPLATE)
    assert load_chat_template(str(f)) == CUSTOM_TEMPLATE
    assert load_chat_template("{{ messages[0].content }}\\n") == "{{ messages[0].content }}\n"  # vLLM's escapes
    with pytest.raises(ValueError, match="looks like a file path.*cannot be read"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(ValueError, match="does not parse as a Jinja template.*endfor"):
        load_chat_template(str(bad))
    with pytest.raises(ValueError, match="does not parse"):
        ServerConfig(chat_template="{{ oops }")
    with pytest.raises(ValueError, match="cannot be read"):
        ServerConfig(chat_template=str(tmp_path / "missing.jinja"))
    assert ServerConfig(chat_template=str(f)).chat_template_text == CUSTOM_TEMPLATE


# ---- tool-call parsers -------------------------------------------------------------------------------------

WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "hot": {"type": "boolean"}, "temp": {"type": "number"},
                                     "opts": {"type": "object"}, "zip": {"type": "string"}}}}}]

MISTRAL = [  # (output, content, [(name, arguments)])
    ('[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]', None,
     [("f", {"x": 1}), ("g", {})]),
    ('Let me check. [TOOL_CALLS] [{"name": "f", "arguments": "{\\"x\\": 2}"}]', "Let me check.", [("f", {"x": 2})]),
    ('[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{"y": [1, 2]}', None, [("f", {"x": 1}), ("g", {"y": [1, 2]})]),
    ("no calls here", "no calls here", []),
    ('[TOOL_CALLS][{"name": "f", "arguments": {"x": ', '[TOOL_CALLS][{"name": "f", "arguments": {"x": ', []),
    ('[TOOL_CALLS][{"arguments": {}}]', '[TOOL_CALLS][{"arguments": {}}]', []),  # no name
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}]</s>', None, [("f", {})]),  # skip_special_tokens false
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}] x [TOOL_CALLS]g[ARGS]{}', '[TOOL_CALLS][{"name": "f", '
     '"arguments": {}}] x [TOOL_CALLS]g[ARGS]{}', []),  # text between calls: not calls
]
PYTHONIC = [
    ('[get_weather(city="Paris"), f(x=1)]', None, [("get_weather", {"city": "Paris"}), ("f", {"x": 1})]),
    ("[f(a=[1, 2.5, -3], b={'k': None}, c=True, d=(1, 2))]", None,
     [("f", {"a": [1, 2.5, -3], "b": {"k": None}, "c": True, "d": [1, 2]})]),
    ("<|python_start|>[weather.get()]<|python_end|>", None, [("weather.get", {})]),
    ("[f(1)]", "[f(1)]", []),  # positional: no names to give it
    ('[f(x=open("/etc/passwd"))]', '[f(x=open("/etc/passwd"))]', []),  # not a literal: nothing is evaluated
    ("[f(x=__import__('os').system('true'))]", "[f(x=__import__('os').system('true'))]", []),
    ("[f(x={1, 2})]", "[f(x={1, 2})]", []),  # a set has no JSON
    ("[1, 2]", "[1, 2]", []),
    ("[]", "[]", []),
    ("The list is [f(x=1)]", "The list is [f(x=1)]", []),
    ("[f(x=1", "[f(x=1", []),
]
QWEN3_XML = [
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
     "<parameter=hot>\ntrue\n</parameter>\n<parameter=temp>\n21.5\n</parameter>\n<parameter=opts>\n{\"a\": [1]}\n"
     "</parameter>\n<parameter=zip>\n75001\n</parameter>\n</function>\n</tool_call>", None,
     [("get_weather", {"city": "Paris", "days": 3, "hot": True, "temp": 21.5, "opts": {"a": [1]}, "zip": "75001"})]),
    ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork\n</parameter>\n</function>\n"
     "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>", "Checking.",
     [("get_weather", {"city": "New\nYork"}), ("get_time", {})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=unknown>\n3\n</parameter>\n<parameter=days>\nnull\n</parameter>"
     "\n</function>\n</tool_call>", None, [("get_weather", {"unknown": "3", "days": None})]),  # undeclared: a string
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>",
     None, [("get_weather", {"days": "three"})]),  # not a number: as written; EOS before the tag closed
    ("plain text", "plain text", []),
    ("<tool_call>no function</tool_call>", "<tool_call>no function</tool_call>", []),
]


@pytest.mark.parametrize("parser,text,content,calls", [("mistral", *c) for c in MISTRAL] +
                         [("pythonic", *c) for c in PYTHONIC] + [("qwen3_xml", *c) for c in QWEN3_XML])
def test_tool_call_parsers(parser, text, content, calls):
    got_content, got = parse_tool_calls(parser, text, WEATHER_TOOLS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got)


def test_mistral_ids_are_nine_letters_and_digits():
    _, calls = parse_mistral('[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[CALL_ID]abcDEF123[ARGS]{}')
    assert all(re.fullmatch("[A-Za-z0-9]{9}", c.id) for c in calls) and calls[1].id == "abcDEF123"


def test_the_parsers_are_registered():
    assert TOOL_CALL_PARSERS == ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml")
    assert parse_pythonic("[f()]")[1][0].arguments == "{}"
    assert parse_qwen3_xml("<tool_call><function=f></function></tool_call>")[1][0].name == "f"


STREAM_SAMPLES = [  # (parser, text): content before the calls and two calls
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {"y": "]"}}]'),
    ("mistral", 'Sure. [TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{"y": "["}'),
    ("pythonic", '[get_weather(city="Paris"), f(x=1)]'),
    ("pythonic", "Not [a call"),
    ("qwen3_xml", "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
     "</tool_call>\n<tool_call>\n<function=f>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"),
    ("qwen3_xml", "No <tool_ calls <tool here"),
    ("hermes", 'Sure.<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": '
               '{"y": 1}}</tool_call>'),
]


@pytest.mark.parametrize("parser,text", STREAM_SAMPLES)
def test_streaming_parsers_agree_with_the_whole_text_at_every_split(parser, text):
    content, calls = parse_tool_calls(parser, text, WEATHER_TOOLS)
    want = [(c.name, json.loads(c.arguments)) for c in calls]
    for pieces in _splits(text):
        p = StreamingToolParser(parser, WEATHER_TOOLS)
        out, got = "", []
        for i, piece in enumerate(pieces):
            c, new = p.feed(piece, i == len(pieces) - 1)
            out += c
            got += new
        assert [(c.name, json.loads(c.arguments)) for c in got] == want, pieces
        if want:
            assert out.strip() == (content or "").strip(), pieces
        else:
            assert out == text, pieces


@pytest.mark.parametrize("parser,text", [STREAM_SAMPLES[i] for i in (1, 4, 6)])
def test_streaming_sends_each_call_once_it_is_complete(parser, text):
    """Like hermes, the tag parsers send a call before the output ends: the first of two goes out as soon as it
    is whole, the content before the tag as it comes, and never a piece of the tag. (Mistral's JSON-list form
    sends its calls when the list closes.)"""
    p = StreamingToolParser(parser, WEATHER_TOOLS)
    out, first_at, got = "", None, []
    for i, ch in enumerate(text):
        c, new = p.feed(ch, False)
        out += c
        got += new
        if new and first_at is None:
            first_at = i
    assert first_at is not None and first_at < len(text) - 20
    assert out.strip() == "Sure." and "<" not in out and "[" not in out
    got += p.feed("", True)[1]
    assert len(got) == 2


# ---- through a real server ---------------------------------------------------------------------------------

THINK_THEN_HELLO = "<think>abc</think>Hello"


@pytest.fixture(scope="module")
def server(llm_fp32, tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "custom.jinja"
    template.write_text(CUSTOM_TEMPLATE)
    ae = AsyncEngine(llm_fp32.engine, max_waiting_requests=64, log_interval=None)
    srv = BackgroundServer(build_app(ae, ServerConfig(reasoning_parser="qwen3", chat_template=str(template)))).start()
    yield srv
    srv.stop(60)
    engine = llm_fp32.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _forced(text: str) -> dict:
    return {"structured_outputs": {"regex": re.escape(text)}}


def _stream(client, **kw) -> tuple[str | None, str, list, str]:
    """(joined reasoning_content or None if none came, joined content, tool calls, finish_reason)."""
    reasoning, content, calls, finish = None, "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        ch = chunk.choices[0]
        r = getattr(ch.delta, "reasoning_content", None)
        if r:
            reasoning = (reasoning or "") + r
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    return reasoning, content, [(n, json.loads(a)) for n, a in calls.values()], finish


def test_server_renders_chats_and_tokenize_with_the_custom_template(server, llm_fp32):
    msgs = [{"role": "user", "content": "Hi"}]
    want = CUSTOM_TEMPLATE.replace("{% for m in messages %}", "").split("{% endfor %}")[0]
    want = want.replace("{{ m.role }}", "user").replace("{{ m.content }}", "Hi") + "<|im_start|>assistant\n"
    r = httpx.post(server.url + "/tokenize", json={"messages": msgs}, timeout=60).json()
    assert r["tokens"] == llm_fp32.tokenizer.encode(want, add_special_tokens=False)
    # negative control: the model's own template renders something else
    own = llm_fp32.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    assert "CUSTOM" not in own and r["tokens"] != llm_fp32.tokenizer.encode(own, add_special_tokens=False)


@pytest.mark.parametrize("stream", [False, True])
def test_server_splits_reasoning_from_content(client, stream):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=40, temperature=0,
              extra_body=_forced(THINK_THEN_HELLO))
    if stream:
        assert _stream(client, **kw)[:2] == ("abc", "Hello")
    else:
        msg = client.chat.completions.create(**kw).choices[0].message
        assert (msg.reasoning_content, msg.content) == ("abc", "Hello")
    # enable_thinking false: the same text is all content (qwen3 parses no reasoning then)
    kw["extra_body"] = {**_forced(THINK_THEN_HELLO), "chat_template_kwargs": {"enable_thinking": False}}
    if stream:
        assert _stream(client, **kw)[:2] == (None, THINK_THEN_HELLO)
    else:
        msg = client.chat.completions.create(**kw).choices[0].message
        assert (msg.reasoning_content, msg.content) == (None, THINK_THEN_HELLO)


@pytest.mark.parametrize("stream", [False, True])
def test_server_reads_tool_calls_from_the_content_only(client, stream):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], max_tokens=60, temperature=0,
              tools=[tool], tool_choice="auto")
    for text, reasoning, calls in [(f"<think>ok</think>{call}", "ok", [("get_weather", {"city": "Paris"})]),
                                   (f"<think>{call}</think>Done", call, [])]:  # a call while thinking is no call
        kw["extra_body"] = _forced(text)
        if stream:
            got_r, got_c, got_calls, finish = _stream(client, **kw)
        else:
            ch = client.chat.completions.create(**kw).choices[0]
            got_r, got_c, finish = ch.message.reasoning_content, ch.message.content or "", ch.finish_reason
            got_calls = [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls or []]
        assert (got_r, got_calls) == (reasoning, calls)
        assert (got_c, finish) == (("", "tool_calls") if calls else ("Done", "stop"))
