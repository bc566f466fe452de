"""Benchmark workloads: lists of SampleRequest, built with the target model's tokenizer.

Datasets (``--dataset``):
- ``random``: random vocabulary tokens turned into text; input/output lengths drawn uniformly from
  ``[len * (1 - range_ratio), len * (1 + range_ratio)]`` as vLLM's random dataset does. With
  ``long_input_every`` N, every N-th request's prompt is ``long_input_len`` tokens instead: long
  prompts arriving among short ones, the case chunked prefill exists for.
- ``shared-prefix``: one (or ``num_prefixes``) long common system prompt plus a short unique question,
  the case prefix caching exists for.
- ``text``: windows cut at random line starts of a plain-text file (e.g. tinyshakespeare.txt).
- ``trace``: the request lengths and arrival times of a production trace (trace.py).
- ``sharegpt``: the first user turn of ShareGPT-format conversations; the output length is the
  length of the first reply unless ``output_len`` is given.

A prompt's text is made so that re-tokenizing it gives the asked number of tokens: decode the ids,
re-encode, trim or extend, repeat (``PromptMaker.fit``). ``prompt_len`` is always the re-encoded
length (without special tokens), so it is what the server will see, give or take a BOS token.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenmill.bench.args import DATASETS
from tokenmill.tokenizer import Tokenizer

DEFAULT_INPUT_LEN = 128
DEFAULT_OUTPUT_LEN = 128


@dataclass
class SampleRequest:
    prompt: str  # the whole prompt text (completions endpoint)
    prompt_len: int  # tokens of `prompt` by the benchmark's tokenizer, special tokens excluded
    output_len: int  # max_tokens to ask for
    system: str | None = None  # shared-prefix: the common head of `prompt`; a system message on chat
    arrival_s: float | None = None  # trace: recorded arrival, seconds after the trace's first request
    prompt_ids: list[int] | None = None  # the tokens of `prompt` (offline benchmark)

    def messages(self) -> list[dict]:
        """The prompt as chat messages: one user message, or system prefix + user question."""
        if self.system is None:
            return [{"role": "user", "content": self.prompt}]
        return [{"role": "system", "content": self.system},
                {"role": "user", "content": self.prompt[len(self.system):]}]


@dataclass
class DatasetSpec:
    """What ``--dataset`` and its flags ask for; see ``tokenmill bench serve --help``."""

    name: str = "random"
    path: str | None = None
    num_prompts: int = 100
    input_len: int | None = None  # default DEFAULT_INPUT_LEN
    output_len: int | None = None  # default DEFAULT_OUTPUT_LEN (sharegpt: the reply's length)
    range_ratio: float = 0.0
    prefix_len: int = 1000
    question_len: int = 32
    num_prefixes: int = 1
    trace_start: int = 0
    trace_max_input_len: int | None = None
    trace_max_output_len: int | None = None
    trace_length_scale: float = 1.0
    seed: int = 0
    long_input_len: int = 2048
    long_input_every: int = 0  # 0: no long prompts

    def check(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"unknown dataset {self.name!r}; choose one of {', '.join(DATASETS)}")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be at least 1, got {self.num_prompts}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        for flag, v in (("--input-len", self.input_len), ("--output-len", self.output_len),
                        ("--prefix-len", self.prefix_len), ("--question-len", self.question_len),
                        ("--num-prefixes", self.num_prefixes), ("--long-input-len", self.long_input_len)):
            if v is not None and v < 1:
                raise ValueError(f"{flag} must be at least 1, got {v}")
        if self.long_input_every < 0:
            raise ValueError(f"--long-input-every must be 0 (off) or a positive N, got {self.long_input_every}")
        if self.long_input_every and self.name != "random":
            raise ValueError("--long-input-every applies to --dataset random only")
        if self.name in ("text", "trace", "sharegpt"):
            if not self.path:
                raise ValueError(f"--dataset {self.name} needs --dataset-path FILE ("
                                 + {"text": "a plain-text file, e.g. tinyshakespeare.txt",
                                    "trace": "a CSV with TIMESTAMP,ContextTokens,GeneratedTokens columns, "
                                             "e.g. AzureLLMInferenceTrace_conv.csv",
                                    "sharegpt": "a ShareGPT-format JSON list of conversations"}[self.name] + ")")
            if not Path(self.path).is_file():
                raise ValueError(f"--dataset-path {self.path!r} is not a file; give the path of an existing file")


class PromptMaker:
    """Makes prompt texts of exact token lengths for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        special = set(tokenizer.hf.get_added_tokens_decoder())
        candidates = [i for i in range(tokenizer.vocab_size) if i not in special]
        texts = tokenizer.hf.decode_batch([[i] for i in candidates], skip_special_tokens=False)
        # Whole, printable tokens only: partial UTF-8 bytes and control characters re-tokenize unpredictably.
        self.ids = np.array([i for i, s in zip(candidates, texts) if s.strip() and "\ufffd" not in s
                             and s.isprintable()], dtype=np.int64)
        if len(self.ids) < 100:
            raise ValueError("the tokenizer has too few printable tokens to build random prompts")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def random_ids(self, n: int, rng: np.random.Generator) -> list[int]:
        return self.ids[rng.integers(0, len(self.ids), n)].tolist()

    def fit(self, ids: list[int], n: int, more: Callable[[int, int], list[int]]) -> tuple[str, list[int]]:
        """(text, its tokens) with len(tokens) == n where reachable: start from ``ids``, decode, re-encode,
        trim to n or extend with ``more(start, k)`` (k tokens to follow the first ``start``), and repeat
        until stable (off by a token or two at worst)."""
        ids = list(ids[:n])
        if len(ids) < n:
            ids += more(len(ids), n - len(ids))
        text, enc = "", []
        for _ in range(10):
            text = self.tok.decode(ids, skip_special_tokens=False)
            enc = self.encode(text)
            if len(enc) == n:
                break
            ids = enc[:n] if len(enc) > n else enc + more(len(enc), n - len(enc))
        return text, enc

    def random_text(self, n: int, rng: np.random.Generator) -> tuple[str, list[int]]:
        return self.fit(self.random_ids(n, rng), n, lambda start, k: self.random_ids(k, rng))


def _lengths(length: int, ratio: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """n lengths uniform in [floor(length*(1-ratio)), ceil(length*(1+ratio))], at least 1 (vLLM's rule)."""
    low = max(1, int(math.floor(length * (1 - ratio))))
    high = max(low, int(math.ceil(length * (1 + ratio))))
    return rng.integers(low, high + 1, n)


def random_requests(maker: PromptMaker, n: int, input_len: int, output_len: int, range_ratio: float,
                    rng: np.random.Generator, long_len: int = 0, long_every: int = 0) -> list[SampleRequest]:
    ins, outs = _lengths(input_len, range_ratio, n, rng), _lengths(output_len, range_ratio, n, rng)
    if long_every:
        ins[long_every - 1::long_every] = long_len
    reqs = []
    for i_len, o_len in zip(ins, outs):
        text, ids = maker.random_text(int(i_len), rng)
        reqs.append(SampleRequest(text, len(ids), int(o_len), prompt_ids=ids))
    return reqs


def shared_prefix_requests(maker: PromptMaker, n: int, prefix_len: int, question_len: int, output_len: int,
                           num_prefixes: int, range_ratio: float, rng: np.random.Generator) -> list[SampleRequest]:
    """Request i gets prefix i % num_prefixes (``prefix_len`` tokens ending in a newline) + its own question.

    The newline ends a pre-tokenizer word, so the prompt's tokens start with exactly the prefix's tokens.
    """
    prefixes = []
    for _ in range(num_prefixes):
        head, _ = maker.random_text(max(1, prefix_len - 1), rng)
        prefixes.append(head.rstrip() + "\n")
    outs = _lengths(output_len, range_ratio, n, rng)
    reqs = []
    for i in range(n):
        q, _ = maker.random_text(question_len, rng)
        q = q.lstrip() or "?"
        prompt = prefixes[i % num_prefixes] + q
        ids = maker.encode(prompt)
        reqs.append(SampleRequest(prompt, len(ids), int(outs[i]), system=prefixes[i % num_prefixes], prompt_ids=ids))
    return reqs


def text_requests(maker: PromptMaker, path: str, n: int, input_len: int, output_len: int, range_ratio: float,
                  rng: np.random.Generator) -> list[SampleRequest]:
    """Windows of the file starting at random line starts, cut to the drawn token length."""
    corpus = Path(path).read_text(encoding="utf-8", errors="replace")
    if len(corpus.strip()) < 16:
        raise ValueError(f"{path} holds almost no text; give a plain-text file with some content")
    ins, outs = _lengths(input_len, range_ratio, n, rng), _lengths(output_len, range_ratio, n, rng)
    reqs = []
    for i_len, o_len in zip(ins, outs):
        i_len = int(i_len)
        nl = corpus.find("\n", int(rng.integers(0, len(corpus))))
        start = nl + 1 if 0 <= nl < len(corpus) - 1 else 0
        chars = 8 * i_len + 64
        while True:
            window = corpus[start:start + chars]
            while len(window) < chars:  # wrap around a short file
                window += "\n" + corpus[:chars - len(window)]
            ids = maker.encode(window)
            if len(ids) >= i_len + 16:
                break
            chars *= 2
        text, enc = maker.fit(ids, i_len, lambda at, k, window_ids=ids: window_ids[at:at + k])
        reqs.append(SampleRequest(text, len(enc), int(o_len), prompt_ids=enc))
    return reqs


def trace_requests(maker: PromptMaker, spec: DatasetSpec, rng: np.random.Generator) -> list[SampleRequest]:
    from tokenmill.bench.trace import load_trace, scale_lengths

    rows = load_trace(spec.path, start=spec.trace_start, num=spec.num_prompts)
    rows = scale_lengths(rows, spec.trace_length_scale, spec.trace_max_input_len, spec.trace_max_output_len)
    reqs = []
    for r in rows:
        text, ids = maker.random_text(r.input_len, rng)
        reqs.append(SampleRequest(text, len(ids), r.output_len, arrival_s=r.arrival_s, prompt_ids=ids))
    return reqs


def _first_exchange(conv: object) -> tuple[str, str] | None:
    """(first user turn, the reply after it) of a ShareGPT conversation, or None."""
    if not isinstance(conv, list):
        return None
    for i, turn in enumerate(conv[:-1]):
        if isinstance(turn, dict) and turn.get("from", turn.get("role")) in ("human", "user"):
            reply = conv[i + 1]
            if isinstance(reply, dict) and isinstance(turn.get("value"), str) and isinstance(reply.get("value"), str):
                return turn["value"], reply["value"]
            return None
    return None


def sharegpt_requests(maker: PromptMaker, path: str, n: int, output_len: int | None,
                      rng: np.random.Generator) -> list[SampleRequest]:
    """vLLM's ShareGPT sampling: shuffle, take the first user turn as the prompt and the reply's length as
    the output length; skip prompts or replies under 4 tokens, prompts over 1024 and pairs over 2048."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); give a ShareGPT-format JSON list of "
                         '{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}') from None
    if not isinstance(data, list):
        raise ValueError(f"{path} must hold a JSON list of conversations (ShareGPT format)")
    reqs = []
    for k in rng.permutation(len(data)):
        item = data[int(k)]
        conv = item.get("conversations", item.get("conversation")) if isinstance(item, dict) else None
        pair = _first_exchange(conv)
        if pair is None:
            continue
        ids = maker.encode(pair[0])
        out = output_len if output_len is not None else len(maker.encode(pair[1]))
        if len(ids) < 4 or (output_len is None and out < 4) or len(ids) > 1024 or len(ids) + out > 2048:
            continue
        reqs.append(SampleRequest(pair[0], len(ids), out, prompt_ids=ids))
        if len(reqs) == n:
            break
    if not reqs:
        raise ValueError(f"{path} has no usable conversation (a user turn followed by a reply, 4-1024 prompt "
                         "tokens); check the file's format")
    return reqs


def sample_requests(spec: DatasetSpec, tokenizer: Tokenizer | PromptMaker) -> list[SampleRequest]:
    """The workload ``spec`` describes; deterministic for a given seed and tokenizer."""
    spec.check()
    maker = tokenizer if isinstance(tokenizer, PromptMaker) else PromptMaker(tokenizer)
    rng = np.random.default_rng(spec.seed)
    in_len = spec.input_len or DEFAULT_INPUT_LEN
    out_len = spec.output_len or DEFAULT_OUTPUT_LEN
    if spec.name == "random":
        return random_requests(maker, spec.num_prompts, in_len, out_len, spec.range_ratio, rng,
                               spec.long_input_len, spec.long_input_every)
    if spec.name == "shared-prefix":
        return shared_prefix_requests(maker, spec.num_prompts, spec.prefix_len, spec.question_len, out_len,
                                      spec.num_prefixes, spec.range_ratio, rng)
    if spec.name == "text":
        return text_requests(maker, spec.path, spec.num_prompts, in_len, out_len, spec.range_ratio, rng)
    if spec.name == "trace":
        return trace_requests(maker, spec, rng)
    return sharegpt_requests(maker, spec.path, spec.num_prompts, spec.output_len, rng)


def dataset_spec(a: argparse.Namespace) -> DatasetSpec:
    """The workload the flags of bench/args.py's add_dataset_args describe."""
    return DatasetSpec(a.dataset, a.dataset_path, a.num_prompts, a.input_len, a.output_len, a.range_ratio,
                       a.prefix_len, a.question_len, a.num_prefixes, a.trace_start, a.trace_max_input_len,
                       a.trace_max_output_len, a.trace_length_scale, a.seed, a.long_input_len, a.long_input_every)
