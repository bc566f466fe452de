"""Tokenizer layer: parity with transformers for the default GGUF, chat templates, streaming decode."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.tokenizer import Tokenizer

TEXTS = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see, won't we?",
    "  leading spaces and trailing spaces   ",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\n\nafter three newlines\n",
    "\r\nwindows\r\nline endings",
    "     ",
    "\n",
    "def f(x):\n    if x > 1:\n        return x * 2\n    return None\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }  // C++",
    "3.14159 42 1000000 -7 1e-9 0x1F 2024-01-31 12:30",
    "日本語のテキストと中文文本",
    "한국어 문장입니다.",
    "Emoji: 👋🏽 👨‍👩‍👧‍👦 🇫🇷 🚀✨",
    "Accents: café naïve résumé Straße Ångström",
    "RTL: مرحبا بالعالم שלום עולם",
    "Math: ∑ x² ≤ ∞, √2 ≈ 1.414, α β γ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> in the middle",
    "<file_sep><filename>main.py",
    "Mixed: Hello, 世界! 🌍 ¿Qué tal? Привет.",
    "URL https://example.com/path?q=1&r=two#frag and email a.b@c.org",
    "x" * 300,
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Write a haiku about 🌸."},
        {"role": "assistant", "content": "Petals drift and fall\nsoftly on the quiet pond"},
        {"role": "user", "content": "Another one, in 日本語 please."},
    ],
]


@pytest.fixture(scope="module")
def model_path():
    from tokenmill.models.registry import resolve_model

    return resolve_model("smollm2-135m-instruct").path


@pytest.fixture(scope="module")
def tok(model_path) -> Tokenizer:
    import gguf

    return Tokenizer.from_gguf(gguf.GGUFReader(model_path))


@pytest.fixture(scope="module")
def ref(model_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)


# --- parity with transformers on the real GGUF --------------------------------------------------


@pytest.mark.slow
def test_metadata(tok: Tokenizer, ref) -> None:
    assert tok.vocab_size == 49152 == len(ref)
    assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id) == (1, 2)
    assert tok.stop_token_ids == {0, 2}  # <|im_end|> (eos) and <|endoftext|>
    assert tok.chat_template == ref.chat_template


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_matches_transformers(tok: Tokenizer, ref, text: str) -> None:
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


@pytest.mark.slow
def test_bytes_missing_from_vocab_match_transformers(tok: Tokenizer, ref) -> None:
    # SmolLM2's vocab has no token for bytes 0x04 0x06 0x13 0x14 0x16 0x1d 0xc0 0xc1 0xf1 0xf2 0xf5-0xff;
    # BPE without an unk token drops them, so these cannot round-trip -- same as transformers.
    for text in ["a\x04b", "\U00040000", "x\x1dy\U00080001z"]:
        assert tok.encode(text) == ref.encode(text)
        assert tok.decode(tok.encode(text)) == ref.decode(ref.encode(text)) != text


@pytest.mark.slow
def test_special_tokens_stay_whole_and_no_bos(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>") == [1]  # add_bos_token is False in this GGUF
    assert tok.decode(tok.encode("a<|im_end|>b")) == "ab"  # special tokens skipped by default


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(tok: Tokenizer, ref, messages: list[dict]) -> None:
    for gen in (True, False):
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert tok.apply_chat_template(messages, add_generation_prompt=gen) == expected


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["not a list", [{"content": "no role"}], ["hi"],
                                 [{"role": "user", "content": 3}]])
def test_malformed_messages(tok: Tokenizer, bad: Any) -> None:
    with pytest.raises(ValueError, match="message"):
        tok.apply_chat_template(bad)


# --- incremental detokenizer --------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] = (), skip: bool = True) -> tuple[list[str], str]:
    detok = tok.detokenizer(prompt, skip_special_tokens=skip)
    deltas = [detok.step(i) for i in ids]
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


@pytest.mark.slow
@pytest.mark.parametrize("text", [t for t in TEXTS if any(ord(c) > 127 for c in t)] + ["a<|im_end|>b 👍"])
def test_detokenizer_never_splits_chars(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    for skip in (True, False):
        deltas, tail = _stream(tok, ids, skip=skip)
        assert not any("\ufffd" in d for d in deltas)
        assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)
        assert tail == ""  # the stream ended on a whole character


@pytest.mark.slow
def test_detokenizer_prompt_context_and_flush(tok: Tokenizer) -> None:
    prompt, gen = tok.encode("Say hi:"), tok.encode(" 你好 🎉")
    deltas, tail = _stream(tok, gen, prompt)
    assert "".join(deltas) == " 你好 🎉" and tail == ""
    # Generation cut off inside a 4-byte emoji: nothing broken mid-stream, flush returns the leftovers.
    cut = gen[:-1]
    deltas, tail = _stream(tok, cut, prompt)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) + tail == tok.decode(cut) and "\ufffd" in tail


# Only characters the vocab can spell (see test_bytes_missing_from_vocab_match_transformers).
_SPELLABLE = st.characters(max_codepoint=0x3FFFF, blacklist_categories=("Cs",),
                           blacklist_characters="\ufffd\x04\x06\x13\x14\x16\x1d")


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=_SPELLABLE, max_size=40))
def test_detokenizer_random_unicode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    deltas, tail = _stream(tok, ids, skip=False)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=False) == text


# --- Hugging Face folder ------------------------------------------------------------------------


@pytest.mark.slow
def test_from_hf_folder_round_trip(tok: Tokenizer, tmp_path) -> None:
    tok.hf.save(str(tmp_path / "tokenizer.json"))
    config = {"chat_template": tok.chat_template, "bos_token": "<|im_start|>",
              "eos_token": {"content": "<|im_end|>", "special": True}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = Tokenizer.from_hf_folder(tmp_path)
    assert (loaded.vocab_size, loaded.bos_token_id, loaded.eos_token_id) == (tok.vocab_size, 1, 2)
    assert loaded.stop_token_ids == tok.stop_token_ids
    for text in TEXTS:
        assert loaded.encode(text) == tok.encode(text)
    for messages in CONVERSATIONS:
        assert loaded.apply_chat_template(messages) == tok.apply_chat_template(messages)
    # chat_template.jinja, when present, wins over tokenizer_config.json's template
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert Tokenizer.from_hf_folder(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"


def test_from_hf_folder_without_tokenizer_json(tmp_path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)


# --- small synthetic GGUFs: fast checks of the other metadata paths -----------------------------


@dataclass
class _Field:
    value: Any

    def contents(self) -> Any:
        return self.value


class _FakeReader:
    def __init__(self, **meta: Any) -> None:
        self.fields = {f"tokenizer.{k}": _Field(v) for k, v in meta.items()}


def _tiny_gguf(**extra: Any) -> _FakeReader:
    tokens = ["<s>", "</s>", "<|eot_id|>", "<think>", "h", "i", "Ġ", "hi", "Ġhi"]
    meta = {"ggml.model": "gpt2", "ggml.pre": "llama-bpe", "ggml.tokens": tokens,
            "ggml.token_type": [3, 3, 3, 4, 1, 1, 1, 1, 1], "ggml.merges": ["h i", "Ġ hi"],
            "ggml.bos_token_id": 0, "ggml.eos_token_id": 1}
    meta.update(extra)
    return _FakeReader(**meta)


def test_gguf_add_bos_and_added_tokens() -> None:
    tok = Tokenizer.from_gguf(_tiny_gguf(**{"ggml.add_bos_token": True}))
    assert tok.encode("hi hi") == [0, 7, 8]
    assert tok.encode("hi hi", add_special_tokens=False) == [7, 8]
    assert tok.encode("<think>hi<|eot_id|>", add_special_tokens=False) == [3, 7, 2]
    assert tok.decode([0, 3, 7, 2]) == "<think>hi"  # user-defined tokens are not special
    assert tok.stop_token_ids == {1, 2}
    assert Tokenizer.from_gguf(_tiny_gguf()).encode("hi") == [7]  # no add_bos_token: no BOS


def test_no_chat_template_is_a_clear_error() -> None:
    tok = Tokenizer.from_gguf(_tiny_gguf())
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_features_and_errors() -> None:
    template = ("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
                "{{ bos_token }}{{ messages | tojson }}{% if tools is not none %}T{% endif %}{{ extra }}")
    tok = Tokenizer.from_gguf(_tiny_gguf(chat_template=template))
    out = tok.apply_chat_template([{"role": "user", "content": "é<b>"}], extra="!")
    assert out == '<s>[{"role": "user", "content": "é<b>"}]!'
    with pytest.raises(ValueError, match="first must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_unsupported_gguf_vocab_type() -> None:
    with pytest.raises(ValueError, match="'t5' is not supported"):
        Tokenizer.from_gguf(_tiny_gguf(**{"ggml.model": "t5"}))


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 49151), max_size=30), st.lists(st.integers(0, 49151), max_size=5))
def test_detokenizer_arbitrary_ids(tok: Tokenizer, ids: list[int], prompt: list[int]) -> None:
    # A model can emit any ids, even invalid UTF-8; the stream must still add up to a plain decode.
    deltas, tail = _stream(tok, ids, prompt)
    assert "".join(deltas) + tail == tok.decode(ids)


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=40))
def test_encode_random_text_matches_transformers(tok: Tokenizer, ref, text: str) -> None:
    text = text.encode("utf-8", "replace").decode("utf-8")  # drop lone surrogates
    assert tok.encode(text) == ref.encode(text)
