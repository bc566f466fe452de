"""Logprobs in the OpenAI shapes: per token text and bytes, completions' and chat's layouts, and prompt
logprobs (echo, and vLLM's prompt_logprobs field)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.tokenizer import Tokenizer


class _TokenText:
    """Token id -> (text, utf-8 bytes), cached."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        try:
            from tokenmill.tokenizer import _BYTE_CHARS  # byte-level BPE alphabet, to recover exact bytes

            self._unbyte = {c: b for b, c in _BYTE_CHARS.items()}
        except ImportError:  # pragma: no cover
            self._unbyte = {}

    def __call__(self, tid: int) -> tuple[str, list[int]]:
        hit = self._cache.get(tid)
        if hit is None:
            text = self.tokenizer.decode([tid], skip_special_tokens=False)
            raw = None
            if "\ufffd" in text:  # a piece of a multi-byte character: give its real bytes
                try:
                    piece = self.tokenizer.hf.id_to_token(tid)
                    if piece and all(ch in self._unbyte for ch in piece):
                        raw = [self._unbyte[ch] for ch in piece]
                except Exception:  # noqa: BLE001
                    raw = None
            hit = (text, raw if raw is not None else list(text.encode("utf-8")))
            if len(self._cache) < 200_000:
                self._cache[tid] = hit
        return hit


def _lp(x: float | None) -> float:
    return -9999.0 if x is None or not math.isfinite(x) else float(x)


class LogprobsMixin:
    """Formats logprobs; the endpoints mix it in."""

    def _completion_logprobs(self, token_ids: list[int], lps: list[dict[int, float]], offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, d in zip(token_ids, lps):
            text, _ = self.token_text(tid)
            tokens.append(text)
            token_lps.append(_lp(d.get(tid)))
            tops.append({self.token_text(t)[0]: _lp(v) for t, v in sorted(d.items(), key=lambda kv: -kv[1])})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _echo_logprobs(self, prompt_ids: list[int], prompt_lps: list, completion: dict) -> dict:
        """OpenAI's echo with logprobs: the prompt tokens first (the first with no logprob), then the
        completion's."""
        first = self.token_text(prompt_ids[0])[0]
        rest = self._completion_logprobs(prompt_ids[1:], prompt_lps[1:], len(first))
        prompt = {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
                  "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}
        return {k: prompt[k] + completion[k] for k in prompt}

    def _vllm_prompt_logprobs(self, prompt_lps: list) -> list:
        """vLLM's prompt_logprobs field: None, then {token id: {logprob, rank, decoded_token}} per token."""
        out = []
        for d in prompt_lps:
            if d is None:
                out.append(None)
                continue
            ranked = sorted(d.items(), key=lambda kv: -kv[1])
            out.append({str(t): {"logprob": _lp(v), "rank": r + 1, "decoded_token": self.token_text(t)[0]}
                        for r, (t, v) in enumerate(ranked)})
        return out

    def _chat_logprobs(self, token_ids: list[int], lps: list[dict[int, float]], top_n: int | None) -> list[dict]:
        content = []
        for tid, d in zip(token_ids, lps):
            text, raw = self.token_text(tid)
            top = []
            for t, v in sorted(d.items(), key=lambda kv: -kv[1])[: top_n or 0]:
                ttext, traw = self.token_text(t)
                top.append({"token": ttext, "logprob": _lp(v), "bytes": traw})
            content.append({"token": text, "logprob": _lp(d.get(tid)), "bytes": raw, "top_logprobs": top})
        return content
