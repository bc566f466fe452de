"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from tokenmill.outputs import RequestOutput
from tokenmill.server.protocol import CompletionRequest, bad_request
from tokenmill.server.responses import SSEResponse, _sse, json_response
from tokenmill.server.serving import _Prepared, _split_prompts, _usage, check_cache_salt, truncate_prompt
from tokenmill.server.streaming import _abort_all, _chunk_builder, _collect, _DeltaTracker, _merge, error_event
from tokenmill.server.structured import structured_outputs

logger = logging.getLogger("tokenmill.server")


class CompletionsMixin:
    """The completions endpoint; mixed into OpenAIServing."""

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        self.check_serving()
        model = self.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        prompts = _split_prompts(req.prompt)
        if len(prompts) > self.config.max_prompts:
            raise bad_request(f"{len(prompts)} prompts given; at most {self.config.max_prompts} per request",
                              "prompt")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        structured, structured_param = structured_outputs(req)
        # echo with logprobs: the prompt's own logprobs come first (computed in the prefill)
        echo_lps = bool(req.echo) and req.logprobs is not None
        params = self.sampling_params(req, max_tokens=max_tokens, max_tokens_param="max_tokens",
                                      logprobs=req.logprobs, logprobs_param="logprobs", structured=structured,
                                      prompt_logprobs=max(req.logprobs, req.prompt_logprobs or 0) if echo_lps
                                      else None)
        ids_list, texts = [], []
        for p in prompts:
            if isinstance(p, str):
                if not p:
                    raise bad_request("prompt must not be empty", "prompt")
                try:
                    ids = await asyncio.to_thread(self.tokenizer.encode, p, req.add_special_tokens is not False)
                except Exception as e:  # noqa: BLE001 - this prompt's failure is this request's alone
                    raise bad_request(f"the prompt could not be tokenized: {type(e).__name__}: {e}", "prompt") from None
                if not ids:
                    raise bad_request("prompt has no tokens", "prompt")
                texts.append(p)
            else:
                if not p:
                    raise bad_request("prompt token list must not be empty", "prompt")
                bad = [t for t in p if not 0 <= t < self.vocab_size]
                if bad:
                    raise bad_request(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                                      "prompt")
                ids = list(p)
                texts.append(self.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else "")
            kept = truncate_prompt(ids, req.truncate_prompt_tokens)
            if len(kept) < len(ids) and req.echo:  # echo what the model saw
                texts[-1] = self.tokenizer.decode(kept, skip_special_tokens=False)
            ids = kept
            self.check_context(ids, max_tokens, "prompt", "max_tokens")
            ids_list.append(ids)
        prep = _Prepared(ids_list, texts, params, "max_tokens", "prompt", structured_param=structured_param,
                         kv_transfer_params=req.kv_transfer_params, cache_salt=check_cache_salt(req.cache_salt))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        await self.start(prep, request_id, req.priority or 0, arrival, req.slo_ttft_ms, req.slo_tpot_ms,
                         stream=bool(req.stream), headers=raw.headers)
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(self._completion_events(prep, request_id, created, model, bool(req.echo),
                                                       include_usage), lambda: _abort_all(prep.streams))
        finals = await _collect(prep.streams, raw)
        return json_response({**self._completion_body(prep, finals, request_id, created, model, bool(req.echo)),
                              **self.kv_transfer_response(prep, request_id)})

    def _completion_body(self, prep: _Prepared, finals: list[RequestOutput], request_id: str, created: int,
                         model: str, echo: bool) -> dict:
        choices, completion_tokens = [], 0
        n = prep.params.n
        for pi, out in enumerate(finals):
            prefix = prep.prompt_texts[pi] if echo else ""
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                lp = None
                if c.logprobs is not None:
                    lp = self._completion_logprobs(c.token_ids, c.logprobs, len(prefix))
                    if echo and out.prompt_logprobs is not None:
                        lp = self._echo_logprobs(prep.prompt_ids[pi], out.prompt_logprobs, lp)
                choice = {"index": pi * n + c.index, "text": prefix + c.text, "logprobs": lp,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if prep.params.prompt_logprobs is not None and out.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._vllm_prompt_logprobs(out.prompt_logprobs)
                choices.append(choice)
        prompt_tokens = sum(len(ids) for ids in prep.prompt_ids)
        cached = sum(out.num_cached_tokens for out in finals)
        return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": _usage(prompt_tokens, completion_tokens, cached)}

    async def _completion_events(self, prep: _Prepared, request_id: str, created: int, model: str, echo: bool,
                                 include_usage: bool) -> AsyncIterator[str]:
        n = prep.params.n
        track = _DeltaTracker()
        chunk = _chunk_builder(request_id, "text_completion", created, model, include_usage)

        merged = _merge(prep.streams)
        echo_lps = echo and prep.params.logprobs is not None
        echoed: set[int] = set()
        cached: dict[int, int] = {}  # per prompt: its prompt tokens found in the prefix cache
        try:
            if echo and not echo_lps:
                for pi, text in enumerate(prep.prompt_texts):
                    yield chunk([{"index": pi * n + i, "text": text, "logprobs": None, "finish_reason": None}
                                 for i in range(n)])
            async for pi, out in merged:
                cached[pi] = out.num_cached_tokens
                if echo_lps and pi not in echoed and out.prompt_logprobs is not None:
                    # the prompt's logprobs come with its first output: echo it then
                    echoed.add(pi)
                    empty = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                    lp = self._echo_logprobs(prep.prompt_ids[pi], out.prompt_logprobs, empty)
                    yield chunk([{"index": pi * n + i, "text": prep.prompt_texts[pi], "logprobs": lp,
                                  "finish_reason": None} for i in range(n)])
                for c in out.outputs:
                    idx = pi * n + c.index
                    d = track.delta(idx, c)
                    if d is None:
                        continue
                    delta, new_ids, start, tstart = d
                    lp = None
                    if c.logprobs is not None:
                        lp = self._completion_logprobs(new_ids, c.logprobs[tstart:], start)
                    choice = {"index": idx, "text": delta, "logprobs": lp, "finish_reason": None}
                    if c.finished:
                        choice["finish_reason"] = c.finish_reason
                        choice["stop_reason"] = c.stop_reason
                    yield chunk([choice])
            if include_usage:
                prompt_tokens = sum(len(ids) for ids in prep.prompt_ids)
                yield _sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": _usage(prompt_tokens, track.completion_tokens,
                                                           sum(cached.values()))})
        except Exception as e:  # noqa: BLE001 - headers are sent: report in the stream
            yield error_event(e, request_id)
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"
