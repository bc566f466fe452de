"""SentencePiece vocabularies (Llama 2, Mistral 7B v0.1, TinyLlama): a GGUF's `llama` tokenizer and a Hugging
Face folder's tokenizer.model, each checked token for token against transformers loading the same files.

The tests train their own tiny SentencePiece BPE model (byte fallback on) on text they generate, so nothing
is downloaded.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import gguf
import pytest

from tokenmill.tokenizer import Tokenizer, _read_sentencepiece_model

spm = pytest.importorskip("sentencepiece")
transformers = pytest.importorskip("transformers")

USER_DEFINED = "<tool>"  # a user-defined piece: always one token, never skipped
TEXTS = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see, won't we?",
    " one leading space",
    "   leading spaces and trailing spaces   ",
    "double  spaces   between    words",
    "a  x  y  z  ok",  # "▁▁x" or "▁x": the merge order of the "▁▁" piece decides
    "     ",
    " ",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\n\nafter three newlines\n",
    "\r\nwindows\r\nline endings",
    "\n",
    "def f(x):\n    if x > 1:\n        return x * 2\n    return None\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }  // C++",
    "3.14159 42 1000000 -7 1e-9 0x1F 2024-01-31 12:30",
    "0123456789 9876543210",
    "日本語のテキストと中文文本",
    "한국어 문장입니다.",
    "Emoji: 👋🏽 👨‍👩‍👧‍👦 🇫🇷 🚀✨",
    "Accents: café naïve résumé Straße Ångström",
    "Mixed: Hello, 世界! 🌍 ¿Qué tal? Привет.",
    "<s>already a bos</s> then text",
    "text with </s> in the middle",
    "a<unk>b",
    f"call {USER_DEFINED}the tool{USER_DEFINED} now",
    f"{USER_DEFINED}",
    "<0x41> is spelled like a byte token",
    "▁ is the space marker",
    "URL https://example.com/path?q=1&r=two#frag and email a.b@c.org",
    "x" * 200,
]


# --- a tiny SentencePiece model and the files built from it ---------------------------------------------


def _corpus(words: int = 4000, seed: int = 0) -> list[str]:
    """A few thousand words of English, numbers, code and non-ASCII text, the same every run."""
    english = [
        "the", "of", "and", "to", "in", "is", "that", "it", "was", "for", "on", "are", "with", "as", "his", "they",
        "be", "at", "one", "have", "this", "from", "or", "had", "by", "word", "but", "what", "some", "we", "can",
        "out", "other", "were", "all", "there", "when", "up", "use", "your", "how", "said", "an", "each", "she",
        "which", "do", "their", "time", "if", "will", "way", "about", "many", "then", "them", "write", "would",
        "like", "so", "these", "her", "long", "make", "thing", "see", "him", "two", "has", "look", "more", "day",
        "could", "go", "come", "did", "number", "sound", "no", "most", "people", "my", "over", "know", "water",
        "than", "call", "first", "who", "may", "down", "side", "been", "now", "find", "any", "new", "work", "part",
        "take", "get", "place", "made", "live",
    ]
    accented = ["café", "naïve", "résumé", "Straße", "Ångström", "façade", "jalapeño", "crème", "brûlée", "smörgåsbord"]
    cjk = ["日本語", "中文", "東京", "한국어", "你好", "世界"]
    code = ["def f(x):\n    return x * 2", "for (int i = 0; i < n; ++i) { sum += a[i]; }", "if x > 1:\n\treturn None",
            "print('hello, world')", "x = [1, 2, 3]  # list"]
    rng = random.Random(seed)
    lines, line = [], []
    for _ in range(words):
        r = rng.random()
        word = (rng.choice(english) if r < 0.80 else str(rng.randint(0, 10 ** rng.randint(1, 6))) if r < 0.87
                else rng.choice(accented) if r < 0.92 else rng.choice(cjk) if r < 0.95 else rng.choice(code))
        line.append(word.capitalize() if rng.random() < 0.1 else word)
        if rng.random() < 0.08:
            lines.append(" ".join(line) + rng.choice(".!?,"))
            line = []
    return lines


def _train(model_type: str = "bpe", vocab_size: int = 400) -> bytes:
    """A tokenizer.model laid out like Llama 2's: <unk> <s> </s>, 256 byte pieces, then merges."""
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_writer=out, model_type=model_type, vocab_size=vocab_size,
        byte_fallback=True, split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, character_coverage=0.995, user_defined_symbols=[USER_DEFINED],
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
    return out.getvalue()


@pytest.fixture(scope="module")
def spm_model() -> bytes:
    """The trained model with Llama 2's quirk: whitespace pieces ("▁▁") scored -1e9, out of id order. Merges
    ranked by score (a GGUF) or by id (a tokenizer.model) then differ, and transformers ranks each its way."""
    pb2 = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")  # needs protobuf
    proto = pb2.ModelProto.FromString(_train())
    spaces = [p for p in proto.pieces if len(p.piece) > 1 and set(p.piece) == {"▁"}]
    assert spaces
    for piece in spaces:
        piece.score = -1e9
    return proto.SerializeToString()


def _vocab(model: bytes) -> tuple[list[str], list[float], list[int]]:
    """tokens, scores and llama.cpp token types (1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte)."""
    sp = spm.SentencePieceProcessor(model_proto=model)
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
             else 4 if t == USER_DEFINED else 1 for i, t in enumerate(tokens)]
    return tokens, [sp.get_score(i) for i in range(len(tokens))], types


def _write_gguf(path: Path, model: bytes, kind: str = "llama", **flags: bool) -> Path:
    """A vocabulary-only GGUF as llama.cpp's converter writes one (transformers needs no tensors for it)."""
    tokens, scores, types = _vocab(model)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(kind)
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if "add_bos" in flags:
        w.add_add_bos_token(flags["add_bos"])
    if "add_eos" in flags:
        w.add_add_eos_token(flags["add_eos"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# tokenizer_config.json as Llama 2 / Mistral / TinyLlama folders have it.
LLAMA_CONFIG = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False, "legacy": False,
                "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
                "clean_up_tokenization_spaces": False,
                "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                                  "single_word": False, "special": True}
                                         for i, t in enumerate(["<unk>", "<s>", "</s>"])}}


def _write_folder(path: Path, model: bytes, config: dict | None = LLAMA_CONFIG) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.model").write_bytes(model)
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def gguf_pair(spm_model, tmp_path_factory):
    """(tokenmill's, transformers') tokenizer of one GGUF that states add_bos_token, as llama.cpp writes it."""
    path = _write_gguf(tmp_path_factory.mktemp("gguf") / "spm.gguf", spm_model, add_bos=True, add_eos=False)
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return Tokenizer.from_gguf(gguf.GGUFReader(path)), ref


@pytest.fixture(scope="module")
def folder_pair(spm_model, tmp_path_factory):
    """(tokenmill's, transformers') tokenizer of a folder with only tokenizer.model + tokenizer_config.json."""
    path = _write_folder(tmp_path_factory.mktemp("folder"), spm_model)
    return Tokenizer.from_hf_folder(path), transformers.AutoTokenizer.from_pretrained(str(path))


def _assert_same(tok: Tokenizer, ref, text: str) -> None:
    for add in (True, False):
        assert tok.encode(text, add_special_tokens=add) == ref.encode(text, add_special_tokens=add), (text, add)
    ids = ref.encode(text)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (text, skip)


# --- parity with transformers ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_matches_transformers(gguf_pair, text: str) -> None:
    _assert_same(*gguf_pair, text)


@pytest.mark.parametrize("text", TEXTS)
def test_folder_matches_transformers(folder_pair, text: str) -> None:
    _assert_same(*folder_pair, text)


def test_the_vocabulary_is_exercised(gguf_pair) -> None:
    # Guards the tests above: they must see merges, byte fallback, BOS, and special/user-defined tokens.
    tok, _ = gguf_pair
    assert tok.vocab_size == 400 and (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.stop_token_ids == {2}
    ids = tok.encode("the water 🚀")
    pieces = [tok.hf.id_to_token(i) for i in ids]
    assert ids[0] == 1 and "▁the" in pieces and ["<0xF0>", "<0x9F>", "<0x9A>", "<0x80>"] == pieces[-4:]
    assert tok.encode(f"x{USER_DEFINED}</s>", add_special_tokens=False)[-2:] == [tok.hf.token_to_id(USER_DEFINED), 2]
    assert tok.decode(tok.encode(f"a{USER_DEFINED}</s><unk>b")) == f"a{USER_DEFINED}b"  # specials skipped
    text = "Hello  world\n 日本 🚀 <0x41>"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text  # round trip (no leading space)


@pytest.mark.parametrize("flags", [{}, {"add_bos": False}, {"add_eos": True}, {"add_bos": False, "add_eos": True}])
def test_gguf_bos_eos_flags(spm_model, tmp_path, flags: dict) -> None:
    # No flag in the file: llama.cpp and transformers both add BOS to a SentencePiece vocabulary.
    path = _write_gguf(tmp_path / "spm.gguf", spm_model, **flags)
    tok, ref = Tokenizer.from_gguf(gguf.GGUFReader(path)), transformers.AutoTokenizer.from_pretrained(
        str(tmp_path), gguf_file=path.name)
    ids = tok.encode("hello world")
    assert ids == ref.encode("hello world")
    assert (ids[0] == 1) == flags.get("add_bos", True) and (ids[-1] == 2) == flags.get("add_eos", False)


@pytest.mark.parametrize("change", [{"legacy": True}, {"add_prefix_space": False}, {"add_eos_token": True},
                                   {"add_bos_token": False, "bos_token": "</s>"},
                                   {"pad_token": "<pad>", "added_tokens_decoder": {
                                       "400": {"content": "<pad>", "special": True},
                                       "3": {"content": USER_DEFINED, "special": True}}}])
def test_folder_config_settings_match_transformers(spm_model, tmp_path, change: dict) -> None:
    path = _write_folder(tmp_path, spm_model, {**LLAMA_CONFIG, **change})
    tok, ref = Tokenizer.from_hf_folder(path), transformers.AutoTokenizer.from_pretrained(str(path))
    assert tok.vocab_size == len(ref)
    for text in TEXTS:
        _assert_same(tok, ref, text)


def test_folder_special_ids(spm_model, tmp_path) -> None:
    tok = Tokenizer.from_hf_folder(_write_folder(tmp_path / "a", spm_model, {**LLAMA_CONFIG, "eos_token": "<unk>"}))
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 0)
    # Without tokenizer_config.json: generation_config.json's ids, else the model's own.
    bare = _write_folder(tmp_path / "b", spm_model, None)
    tok = Tokenizer.from_hf_folder(bare)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    (bare / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tok = Tokenizer.from_hf_folder(bare)
    assert tok.eos_token_id == 0 and tok.stop_token_ids == {0, 2}
    assert tok.encode("hi")[0] == 1  # BOS by default, as the model was trained


def test_tokenizer_json_wins_over_tokenizer_model(spm_model, tmp_path) -> None:
    from tiny_models import VOCAB_SIZE, write_tokenizer_files

    write_tokenizer_files(_write_folder(tmp_path, spm_model))
    assert Tokenizer.from_hf_folder(tmp_path).vocab_size == VOCAB_SIZE != 400


def test_reading_tokenizer_model_agrees_with_sentencepiece(spm_model, tmp_path) -> None:
    (tmp_path / "tokenizer.model").write_bytes(spm_model)
    pieces, trainer = _read_sentencepiece_model(tmp_path / "tokenizer.model")
    tokens, scores, types = _vocab(spm_model)
    assert [p[0] for p in pieces] == tokens and [p[1] for p in pieces] == scores and [p[2] for p in pieces] == types
    assert trainer[3] == 2 and trainer.get(43) == (1 << 64) - 1  # BPE; pad_id -1 as a 64-bit varint


# --- streaming decode ------------------------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] = (), skip: bool = True) -> tuple[list[str], str]:
    detok = tok.detokenizer(prompt, skip_special_tokens=skip)
    deltas = [detok.step(i) for i in ids]
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_matches_whole_decode(gguf_pair, text: str) -> None:
    tok, _ = gguf_pair
    ids = tok.encode(text)
    for skip in (True, False):
        deltas, tail = _stream(tok, ids, skip=skip)
        assert not any("\ufffd" in d for d in deltas)
        assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip) and tail == ""
    # After a prompt the text continues it, so a leading `▁` is a space (a whole decode strips it).
    prompt, gen = tok.encode("Say hi:"), tok.encode(text, add_special_tokens=False)
    deltas, tail = _stream(tok, gen, prompt)
    assert "".join(deltas) + tail == tok.decode(prompt + gen)[len(tok.decode(prompt)):]


def test_detokenizer_held_bytes_and_flush(gguf_pair) -> None:
    tok, _ = gguf_pair
    prompt, gen = tok.encode("Say hi:"), tok.encode(" the 🚀", add_special_tokens=False)
    deltas, tail = _stream(tok, gen, prompt)
    assert deltas[-4:] == ["", "", "", "🚀"] and "".join(deltas) == " the 🚀" and tail == ""
    deltas, tail = _stream(tok, gen[:-1], prompt)  # cut inside the emoji's four byte tokens
    assert "".join(deltas) == " the " and "\ufffd" in tail


# --- bad input -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["t5", "rwkv", "ugm"])
def test_unsupported_gguf_vocabulary_type(spm_model, tmp_path, kind: str) -> None:
    path = _write_gguf(tmp_path / "x.gguf", spm_model, kind=kind)
    with pytest.raises(ValueError, match=rf"'{kind}' is not supported.*'gpt2'.*'llama'"):
        Tokenizer.from_gguf(gguf.GGUFReader(path))


def test_unigram_tokenizer_model_is_refused(tmp_path) -> None:
    _write_folder(tmp_path, _train("unigram", vocab_size=400))
    with pytest.raises(ValueError, match="unigram SentencePiece model; only BPE"):
        Tokenizer.from_hf_folder(tmp_path)


@pytest.mark.parametrize("content", [b"", b"not a protobuf at all\n", b"IQ== 0\nIg== 1\n"])
def test_broken_tokenizer_model(tmp_path, content: bytes) -> None:
    (tmp_path / "tokenizer.model").write_bytes(content)
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        Tokenizer.from_hf_folder(tmp_path)


def test_truncated_tokenizer_model(spm_model, tmp_path) -> None:
    (tmp_path / "tokenizer.model").write_bytes(spm_model[: len(spm_model) // 2])
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        Tokenizer.from_hf_folder(tmp_path)
