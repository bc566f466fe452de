"""Tokenizer layer: text <-> token ids, chat templates and streaming detokenization.

Built on the Rust `tokenizers` library and jinja2 only (no `transformers`, no `sentencepiece`). A tokenizer
comes from one of:

- a GGUF file's `tokenizer.ggml.*` metadata, of either vocabulary type llama.cpp writes for the models we
  run: `gpt2` (byte-level BPE: Llama 3, Qwen2, SmolLM) or `llama` (SentencePiece BPE with byte fallback:
  Llama 2, Mistral 7B v0.1, TinyLlama). Other types (`bert`, `t5`, `rwkv`, ...) are refused by name.
- a Hugging Face folder's `tokenizer.json`, or, where a folder has none, its SentencePiece `tokenizer.model`
  (read with a few lines of protobuf decoding, so `sentencepiece` is not needed).

Both SentencePiece routes build the same `tokenizers` object transformers does (its GGUF converter and
its LlamaTokenizer): BPE merges recovered from the vocabulary, `▁` for spaces with one prepended at the
start, `<0x..>` byte tokens for characters outside the vocabulary, and the matching decoder; the tests
check token-for-token agreement with transformers.
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    import gguf

# Tokens that end a turn or a document in common chat formats; they stop generation when special.
_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>", "<|end|>",
               "<end_of_turn>", "<|return|>")

# GGUF `tokenizer.ggml.pre` names whose split regex differs from GPT-2's, as transformers maps them.
# Anything else (including "smollm") gets GPT-2's ByteLevel regex, as transformers does.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
               "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
               "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}

# Token types, the same numbers in llama.cpp's token_type and SentencePiece's model proto.
_CONTROL, _USER_DEFINED = 3, 4
_GGUF_VOCABS = "'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE) and 'bert' (WordPiece)"


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable char table, which byte-level BPE vocabularies are spelled in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


_BYTE_CHARS = _byte_alphabet()
_BYTE_ALPHABET = frozenset(_BYTE_CHARS.values())


def _gguf_field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _token_str(value: Any) -> str | None:
    # tokenizer_config.json spells special tokens as strings or as serialized AddedToken dicts.
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """A model's tokenizer: `hf` does the work, this adds special-token ids and chat templates."""

    def __init__(self, hf: HFTokenizer, *, bos_token_id: int | None, eos_token_id: int | None,
                 chat_template: str | None, extra_stop_ids: Sequence[int] = ()) -> None:
        self.hf = hf
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        special = {t.content: i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        stops = {i for i in (eos_token_id, *extra_stop_ids) if i is not None}
        stops |= {special[t] for t in _END_TOKENS if t in special}
        self.stop_token_ids: frozenset[int] = frozenset(stops)
        self._template: jinja2.Template | None = None

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """Rebuild the tokenizer a GGUF describes, making the same choices as transformers' converter."""
        kind = _gguf_field(reader, "tokenizer.ggml.model")
        tokens: list[str] = _gguf_field(reader, "tokenizer.ggml.tokens")
        types: list[int] = _gguf_field(reader, "tokenizer.ggml.token_type") or []
        bos_id = _gguf_field(reader, "tokenizer.ggml.bos_token_id")
        eos_id = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
        if kind == "gpt2":
            hf = _byte_level_bpe(reader, tokens, types)
        elif kind == "bert":  # (its template is BERT's, set there: no add-BOS/EOS flags apply)
            hf = _wordpiece(tokens, types, _gguf_field(reader, "tokenizer.ggml.cls_token_id", bos_id),
                            _gguf_field(reader, "tokenizer.ggml.seperator_token_id", eos_id))
            return cls(hf, bos_token_id=bos_id, eos_token_id=eos_id, chat_template=None)
        elif kind == "llama":
            scores = _gguf_field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
            hf = _sentencepiece_bpe(tokens, types, scores)
            specials = [bos_id, eos_id, _gguf_field(reader, "tokenizer.ggml.unknown_token_id"),
                        _gguf_field(reader, "tokenizer.ggml.padding_token_id")]
            _add_named_specials(hf, [tokens[i] for i in specials if i is not None])
        else:
            raise ValueError(f"GGUF tokenizer type {kind!r} is not supported (supported: {_GGUF_VOCABS})")

        # llama.cpp (and transformers) add BOS to a SentencePiece vocabulary unless the file says otherwise.
        add_bos = bool(_gguf_field(reader, "tokenizer.ggml.add_bos_token", kind == "llama")) and bos_id is not None
        add_eos = bool(_gguf_field(reader, "tokenizer.ggml.add_eos_token", False)) and eos_id is not None
        hf.post_processor = _template_processor(tokens[bos_id] if add_bos else None, bos_id,
                                                tokens[eos_id] if add_eos else None, eos_id)
        eot_id = _gguf_field(reader, "tokenizer.ggml.eot_token_id")  # llama.cpp's explicit end-of-turn
        return cls(hf, bos_token_id=bos_id, eos_token_id=eos_id,
                   chat_template=_gguf_field(reader, "tokenizer.chat_template"),
                   extra_stop_ids=[eot_id] if eot_id is not None else [])

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, or else tokenizer.model (+ tokenizer_config.json, chat_template.jinja,
        generation_config.json)."""
        path = Path(path)
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        spm_ids: dict[str, int] = {}  # a tokenizer.model's own special ids, the last fallback
        if (path / "tokenizer.json").is_file():
            hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
        elif (path / "tokenizer.model").is_file():
            hf, spm_ids = _hf_from_sentencepiece_model(path / "tokenizer.model", config)
        else:
            raise ValueError(f"{path} has neither tokenizer.json nor a SentencePiece tokenizer.model")

        template = config.get("chat_template")
        if isinstance(template, list):  # older format: a list of named templates
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default", next(iter(named.values()), None))
        if (path / "chat_template.jinja").is_file():  # newer format; wins, as in transformers
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")

        def token_id(key: str) -> int | None:  # tokenizer_config.json, else generation_config.json, else the model
            token = _token_str(config.get(key))
            found = hf.token_to_id(token) if token else None
            fallback = generation.get(f"{key}_id", spm_ids.get(key))
            return found if found is not None else (fallback[0] if isinstance(fallback, list) else fallback)

        gen_eos = generation.get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        return cls(hf, bos_token_id=token_id("bos_token"), eos_token_id=token_id("eos_token"),
                   chat_template=template, extra_stop_ids=gen_eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; `add_special_tokens` adds BOS/EOS only where the model asks for them."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render a conversation to prompt text with the model's jinja template, as transformers does."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a raw prompt instead of chat messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of dicts like {'role': 'user', 'content': 'hi'}")
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str):
                raise ValueError(f"message {i} has no string 'role': {m!r}")
            if not isinstance(m.get("content"), (str, list, type(None))):
                raise ValueError(f"message {i} 'content' must be a string, a list of parts or None: {m!r}")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        bos, eos = (self.hf.id_to_token(i) if i is not None else "" for i in (self.bos_token_id, self.eos_token_id))
        variables = {"tools": None, "documents": None, "bos_token": bos or "", "eos_token": eos or "", **kwargs}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **variables)
        except jinja2.TemplateError as e:  # includes the template's own raise_exception(...)
            raise ValueError(f"chat template rejected the messages: {e}") from e
        except (TypeError, AttributeError, KeyError, IndexError) as e:  # a template tripping over odd values
            raise ValueError(f"chat template could not render the messages ({type(e).__name__}: {e})") from e

    def with_chat_template(self, chat_template: str) -> Tokenizer:
        """This tokenizer rendering chats with another template (a server's --chat-template)."""
        other = copy.copy(self)
        other.chat_template, other._template = chat_template, compile_chat_template(chat_template)
        return other

    def detokenizer(self, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns generated ids into text deltas that never end inside a multi-byte character.

    `tokenizers`' DecodeStream holds tokens back while the decoded tail is an incomplete UTF-8
    character (U+FFFD); we only add `flush` for whatever is still held at the end of a stream.
    """

    _CONTEXT = 8  # prompt tokens kept as left context, enough for decoders that look back (e.g. leading space)

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids)[-self._CONTEXT:]
        # A prompt ending inside a character would make DecodeStream re-emit the context; drop that tail.
        while self._ids and tokenizer.decode(self._ids, skip_special_tokens).endswith("\ufffd"):
            self._ids.pop()
        self._done = len(self._ids)  # ids before this index are already in `text` (or are the prompt)
        self._stream = DecodeStream(ids=list(self._ids), skip_special_tokens=skip_special_tokens)
        self.text = ""

    def step(self, token_id: int) -> str:
        """Add one generated token; return the new text ("" while a character is still incomplete)."""
        self._ids.append(token_id)
        delta = self._stream.step(self._tokenizer.hf, token_id)
        if delta is None:
            return ""
        self._done = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """End of stream: return the held-back tail, even if it decodes to a replacement char."""
        if self._done == len(self._ids):
            return ""
        # Decode with some left context, so decoders that strip a leading space see the same text as `step`.
        context, held = self._ids[max(0, self._done - self._CONTEXT):self._done], self._ids[self._done:]
        head, full = (self._tokenizer.decode(ids, self._skip) for ids in (context, context + held))
        delta = full[len(head):] if full.startswith(head) else self._tokenizer.decode(held, self._skip)
        self._done = len(self._ids)
        self.text += delta
        return delta


def _byte_level_bpe(reader: gguf.GGUFReader, tokens: list[str], types: list[int]) -> HFTokenizer:
    """A GGUF `gpt2` vocabulary: byte-level BPE with the file's merges and split regex."""
    merges = [tuple(m.split(" ", 1)) for m in _gguf_field(reader, "tokenizer.ggml.merges", [])]
    # A few files store tokens as raw text instead of in the byte alphabet; respell those.
    alphabet = _BYTE_ALPHABET
    vocab = {t if set(t) <= alphabet else "".join(_BYTE_CHARS[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    hf = HFTokenizer(models.BPE(vocab, merges, dropout=None, continuing_subword_prefix="",
                                end_of_word_suffix="", fuse_unk=False))
    split = _PRE_SPLITS.get(_gguf_field(reader, "tokenizer.ggml.pre"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    hf.pre_tokenizer = byte_level if split is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    hf.decoder = decoders.ByteLevel()
    # Control tokens must match whole and be skippable; a "control" token outside the byte alphabet is
    # a llama.cpp mislabel and would grow the vocab, so skip it. User-defined tokens match whole too.
    hf.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
                           if ty == _CONTROL and set(t) <= alphabet])
    hf.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
                   if ty == _USER_DEFINED and t in vocab])
    return hf


def _sentencepiece_bpe(tokens: list[str], types: list[int], scores: list[float] | None, *,
                       add_prefix_space: bool = True, legacy: bool = False) -> HFTokenizer:
    """A SentencePiece BPE vocabulary (`▁` for spaces, `<0x..>` byte tokens) as transformers' LlamaTokenizer
    builds it. Merges are ranked by `scores` (a GGUF's), or by token id where None (a tokenizer.model)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _merges(vocab, None if scores is None else dict(zip(tokens, scores)))
    hf = HFTokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True, dropout=None))
    # "first": only the start of the text gets a `▁`, not the text after a special token; `legacy`
    # (an older transformers behaviour some tokenizer_config.json files still ask for) prefixes each piece.
    scheme = ("always" if legacy else "first") if add_prefix_space else "never"
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    # Strip the one space the prepended `▁` decodes to.
    hf.decoder = decoders.Sequence(steps + [decoders.Strip(content=" ", left=1)] if add_prefix_space else steps)
    # Control tokens match whole and are skippable; user-defined ones match whole but stay in decoded text.
    hf.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
                           if ty == _CONTROL])
    hf.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
                   if ty == _USER_DEFINED])
    return hf


def _add_named_specials(hf: HFTokenizer, names: Sequence[str | None]) -> None:
    """bos/eos/unk/pad become special tokens too (e.g. `<unk>`, which is not a control token), as in
    transformers; ones already added keep their flags."""
    added = {t.content for t in hf.get_added_tokens_decoder().values()}
    hf.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in names if t and t not in added])


def _merges(vocab: dict[str, int], scores: dict[str, float] | None) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies, best first: every split of a token into two tokens,
    ranked by the whole token's score (higher first), or by its id (lower first) without scores. This is
    transformers' generate_merges, down to how ties are broken, so both build the same tokenizer."""
    ranks = vocab if scores is None else scores
    merges = []
    for token, rank in ranks.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        merges += [(left, right, rank) for left, right in sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]]))]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=scores is not None)
    return [(left, right) for left, right, _ in merges]


# tokenizer_config.json keys of the special tokens, with their field number and default in SentencePiece's
# TrainerSpec (-1: none).
_SPM_SPECIALS = {"bos_token": (41, 1), "eos_token": (42, 2), "unk_token": (40, 0), "pad_token": (43, -1)}


def _hf_from_sentencepiece_model(path: Path, config: dict) -> tuple[HFTokenizer, dict[str, int]]:
    """A tokenizer.model as transformers' LlamaTokenizer loads it (with tokenizer_config.json's settings),
    and the model's own special-token ids."""
    pieces, trainer = _read_sentencepiece_model(path)
    model_type = trainer.get(3, 1)  # TrainerSpec.model_type, unigram unless set
    if model_type != 2:
        kind = {1: "unigram", 3: "word", 4: "char"}.get(model_type, f"type {model_type}")
        raise ValueError(f"{path} is a {kind} SentencePiece model; only BPE ones (Llama 2, Mistral) are "
                         "supported: use a folder with a tokenizer.json instead")
    tokens, types = [p[0] for p in pieces], [p[2] for p in pieces]
    own_ids = {key: i for key, (field, default) in _SPM_SPECIALS.items()
               if 0 <= (i := _int32(trainer.get(field, default))) < len(tokens)}
    names = {key: _token_str(config.get(key)) or (tokens[own_ids[key]] if key in own_ids else None)
             for key in _SPM_SPECIALS}

    hf = _sentencepiece_bpe(tokens, types, None, add_prefix_space=config.get("add_prefix_space") is not False,
                            legacy=bool(config.get("legacy", False)))
    # Tokens tokenizer_config.json declares (e.g. a <pad> past the model's vocabulary), in id order.
    declared = config.get("added_tokens_decoder") or {}
    for _, t in sorted((int(i), t) for i, t in declared.items() if isinstance(t, dict) and t.get("content")):
        special = bool(t.get("special", False))
        hf.add_tokens([AddedToken(t["content"], special=special, normalized=t.get("normalized", not special),
                                  lstrip=t.get("lstrip", False), rstrip=t.get("rstrip", False),
                                  single_word=t.get("single_word", False))])
    _add_named_specials(hf, list(names.values()))

    # BOS as the model was trained (transformers 5 assumes no BOS when the flag is absent; 4 and llama.cpp add it).
    bos, eos = names["bos_token"], names["eos_token"]
    add_bos = bool(config.get("add_bos_token", True)) and bos is not None
    add_eos = bool(config.get("add_eos_token", False)) and eos is not None
    hf.post_processor = _template_processor(bos if add_bos else None, hf.token_to_id(bos) if bos else None,
                                            eos if add_eos else None, hf.token_to_id(eos) if eos else None)
    return hf, own_ids


def _read_sentencepiece_model(path: Path) -> tuple[list[tuple[str, float, int]], dict[int, Any]]:
    """(piece, score, type) for each token, and the TrainerSpec's fields by number, from a tokenizer.model.

    A handful of protobuf fields is all we need, so we decode the wire format here rather than require
    `sentencepiece` + `protobuf` (whose processor API alone does not expose token types or the model type).
    ModelProto: 1 pieces (1 piece, 2 score, 3 type), 2 trainer_spec. See sentencepiece_model.proto.
    """
    try:
        pieces, trainer = [], {}
        for field, value in _protobuf_fields(path.read_bytes()):
            if field == 1:
                piece = dict(_protobuf_fields(value))
                score = struct.unpack("<f", piece[2])[0] if 2 in piece else 0.0
                pieces.append((piece.get(1, b"").decode("utf-8"), score, piece.get(3, 1)))
            elif field == 2:
                trainer = dict(_protobuf_fields(value))
    except (ValueError, TypeError, AttributeError, struct.error) as e:  # fields of the wrong kind, bad UTF-8
        raise ValueError(f"{path} is not a SentencePiece model ({e})") from None
    if not pieces:
        raise ValueError(f"{path} is not a SentencePiece model (no vocabulary in it)")
    return pieces, trainer


def _protobuf_fields(data: bytes) -> Iterator[tuple[int, Any]]:
    """(field number, value) for each field of one protobuf message: an int for varints, else raw bytes."""
    def varint(i: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            byte = data[i]  # IndexError on truncated data
            value |= (byte & 0x7F) << shift
            i, shift = i + 1, shift + 7
            if byte < 0x80:
                return value, i

    i = 0
    try:
        while i < len(data):
            key, i = varint(i)
            wire = key & 7
            if wire == 0:
                value, i = varint(i)
            elif wire in (1, 2, 5):  # 64-bit, length-delimited, 32-bit
                size, i = varint(i) if wire == 2 else (8 if wire == 1 else 4, i)
                value, i = data[i:i + size], i + size
            else:
                raise ValueError(f"unexpected protobuf wire type {wire}")
            if i > len(data):
                raise ValueError("truncated protobuf data")
            yield key >> 3, value
    except IndexError:
        raise ValueError("truncated protobuf data") from None


def _int32(value: int) -> int:
    """A protobuf int32 read as an unsigned varint (negative numbers are sent as 64-bit two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _wordpiece(tokens: list[str], types: list[int], cls_id: int, sep_id: int) -> HFTokenizer:
    """BERT's WordPiece from a GGUF: llama.cpp's converter writes a word's first piece with a leading U+2581 and
    a continuation without its ``##``; control tokens ([CLS], [SEP], ...) as they are. It lowercases, as
    llama.cpp's WordPiece tokenizer does."""
    from tokenizers import normalizers

    control = 3
    vocab = {(t if ty == control else t[1:] if t.startswith("\u2581") else "##" + t): i
             for i, (t, ty) in enumerate(zip(tokens, types or [1] * len(tokens)))}
    unk = next((t for t in ("[UNK]", "<unk>") if t in vocab), None)
    hf = HFTokenizer(models.WordPiece(vocab, unk_token=unk or "[UNK]"))
    hf.normalizer = normalizers.BertNormalizer(lowercase=True)
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf.decoder = decoders.WordPiece()
    hf.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(tokens, types or ()) if ty == control])
    cls, sep = tokens[cls_id], tokens[sep_id]
    hf.post_processor = processors.TemplateProcessing(single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
                                                      special_tokens=[(cls, cls_id), (sep, sep_id)])
    return hf


def _template_processor(bos: str | None, bos_id: int | None, eos: str | None,
                        eos_id: int | None) -> processors.TemplateProcessing:
    """BOS/EOS around each sequence, as transformers sets up from add_bos_token / add_eos_token."""
    def wrap(seq: str) -> str:
        return " ".join(t for t in (bos and f"{bos}:{seq[-1]}", seq, eos and f"{eos}:{seq[-1]}") if t)

    return processors.TemplateProcessing(single=wrap("$A:0"), pair=f"{wrap('$A:0')} {wrap('$B:1')}",
                                         special_tokens=[(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t])


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (used for assistant masks) and render its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes and ascii-escapes, which changes the prompt text.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    # Chat templates come from model files, i.e. untrusted: render them sandboxed.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the model's chat template does not parse: {e}") from e
