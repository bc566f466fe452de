"""``tokenmill eval perplexity``: perplexity of a text file under any engine configuration.

The file is tokenized whole (no special tokens), cut to its first ``num_tokens`` tokens and split
into non-overlapping windows of ``context_len`` tokens; in each window every token after the first
``context_len // 2`` is scored given all the tokens before it in the window, as llama.cpp's
llama-perplexity does (so every scored token has at least half a window of context). Perplexity is
exp(mean negative log-likelihood) over the scored tokens. The same file, ``num_tokens`` and
``context_len`` give the same tokens for any configuration, so figures compare directly.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float
    scored_tokens: int
    windows: int
    context_len: int
    seconds: float


def windows_of(ids: list[int], context_len: int) -> list[list[int]]:
    n = len(ids) // context_len
    return [ids[i * context_len:(i + 1) * context_len] for i in range(n)]


def perplexity(engine, text: str, num_tokens: int = 16384, context_len: int = 512,
               progress: bool = True) -> PerplexityResult:
    if context_len < 4:
        raise ValueError(f"--context-len must be at least 4, got {context_len}")
    if context_len > engine.max_model_len:
        raise ValueError(f"--context-len {context_len} exceeds the model's context ({engine.max_model_len})")
    ids = engine.tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    wins = windows_of(ids, context_len)
    if not wins:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one --context-len window ({context_len}); "
                         "give a longer file or a smaller --context-len")
    first = context_len // 2  # scored positions: first .. context_len - 1
    nll, count = 0.0, 0
    start = time.perf_counter()
    for w in tqdm(wins, desc="perplexity", unit="window", disable=not progress):
        lp = engine.score(w)  # lp[i] = log p(w[i + 1] | w[: i + 1])
        scored = lp[first - 1:]
        nll -= float(scored.double().sum())
        count += scored.numel()
    mean = nll / count
    return PerplexityResult(math.exp(mean), mean, count, len(wins), context_len, time.perf_counter() - start)


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", required=True, metavar="FILE", help="a plain-text file, e.g. tinyshakespeare.txt")
    p.add_argument("--num-tokens", type=int, default=16384,
                   help="use the file's first N tokens (default 16384)")
    p.add_argument("--context-len", type=int, default=512,
                   help="window length; the second half of each window is scored (default 512)")
    p.add_argument("--output-json", default=None, metavar="FILE", help="also write the result as JSON")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def cmd_perplexity(a: argparse.Namespace) -> int:
    import torch  # here, not at the top: `tokenmill --help` builds this parser and must not load torch

    from tokenmill.engine.arg_utils import engine_kwargs
    from tokenmill.engine.llm import LLM

    path = Path(a.dataset)
    if not path.is_file():
        raise ValueError(f"--dataset {a.dataset!r} is not a file; give a plain-text file")
    if a.num_tokens < 4:
        raise ValueError(f"--num-tokens must be at least 4, got {a.num_tokens}")
    llm = LLM(**engine_kwargs(a))
    with torch.inference_mode():
        r = perplexity(llm.engine, path.read_text(encoding="utf-8", errors="replace"), a.num_tokens,
                       a.context_len, progress=not a.no_progress)
    print(f"perplexity {r.perplexity:.4f} over {r.scored_tokens} tokens ({r.windows} windows of {r.context_len}; "
          f"quantization {llm.engine.quantization}, kv-cache-dtype {a.kv_cache_dtype}, "
          f"{r.seconds:.1f} s)")
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(asdict(r) | {"dataset": str(path), "model": a.model,
                                                                 "quantization": llm.engine.quantization,
                                                                 "kv_cache_dtype": a.kv_cache_dtype}, indent=1))
        print(f"saved {a.output_json}", file=sys.stderr)
    return 0
