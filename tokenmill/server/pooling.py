"""POST /v1/embeddings, /v1/score and /v1/rerank (OpenAI's, vLLM's and Jina/Cohere's shapes) over pooling
requests (pooling_params.py): a model served with --task embed gives embeddings, and scores as their cosine
similarity; one served with --task score (a cross-encoder, a decoder reranker) scores each pair as one prompt."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from tokenmill.engine.tasks import pair_prompt, pooling_params, score_pairs
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.protocol import _Request, bad_request
from tokenmill.server.responses import json_response
from tokenmill.server.serving import _Prepared, truncate_prompt
from tokenmill.server.streaming import _collect

if TYPE_CHECKING:
    from fastapi import Request
    from fastapi.responses import Response

    from tokenmill.outputs import RequestOutput


class EmbeddingRequest(_Request):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # vLLM: keep the input's last N tokens
    normalize: bool | None = None  # vLLM: default the model's (sentence-transformers' Normalize module)
    add_special_tokens: bool = True
    priority: int = 0


class ScoreRequest(_Request):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    priority: int = 0


class RerankDocument(_Request):
    text: str


class RerankRequest(_Request):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(None, ge=0)  # 0 or none: every document
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    priority: int = 0


class PoolingMixin:
    """The pooling endpoints; mixed into OpenAIServing."""

    async def embeddings(self, req: EmbeddingRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        self.check_serving(None)
        model = self.check_model(req.model)
        inputs = _split_inputs(req.input)
        ids_list = [await self._pooling_ids(x, req.add_special_tokens, req.truncate_prompt_tokens, "input")
                    for x in inputs]
        params = self._pooling_params("embed", dimensions=req.dimensions, normalize=req.normalize)
        outs = await self._pool(ids_list, [params] * len(ids_list), "embd", raw, req.priority, arrival)
        data = [{"object": "embedding", "index": i,
                 "embedding": _base64(o.pooled) if req.encoding_format == "base64" else o.pooled}
                for i, o in enumerate(outs)]
        n = sum(len(ids) for ids in ids_list)
        return json_response({"object": "list", "data": data, "model": model,
                              "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def score(self, req: ScoreRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        self.check_serving(None)
        model = self.check_model(req.model)
        try:
            pairs = score_pairs(req.text_1, req.text_2)
        except ValueError as e:
            raise bad_request(str(e), "text_2") from None
        scores, n = await self._scores(pairs, req.truncate_prompt_tokens, raw, req.priority, arrival)
        return json_response({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                              "model": model, "data": [{"index": i, "object": "score", "score": s}
                                                       for i, s in enumerate(scores)],
                              "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def rerank(self, req: RerankRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        self.check_serving(None)
        model = self.check_model(req.model)
        if not req.documents:
            raise bad_request("documents must not be empty", "documents")
        docs = [d if isinstance(d, str) else d.text for d in req.documents]
        scores, n = await self._scores([(req.query, d) for d in docs], req.truncate_prompt_tokens, raw,
                                       req.priority, arrival)
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[: req.top_n or None]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": docs[i]}} if req.return_documents else {})} for i in order]
        return json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": n},
                              "results": results})

    # ---- shared ------------------------------------------------------------------------

    def _pooling_params(self, want: str, **kw) -> SamplingParams:
        info = self.engine.engine.info
        try:
            return SamplingParams(pooling=pooling_params(info.served, info.model_config.hidden_size, want, **kw))
        except ValueError as e:
            raise bad_request(str(e), getattr(e, "param", None)) from None

    async def _pooling_ids(self, x: str | list[int], add_special: bool, keep: int | None, param: str) -> list[int]:
        if isinstance(x, str):
            if not x:
                raise bad_request(f"{param} must not contain empty strings", param)
            ids = await asyncio.to_thread(self.tokenizer.encode, x, add_special)
        else:
            bad = [t for t in x if not 0 <= t < self.vocab_size]
            if not x or bad:
                raise bad_request(f"{param}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
                                  if bad else f"{param} must not contain empty token lists", param)
            ids = list(x)
        return self._fit(truncate_prompt(ids, keep), param)

    def _fit(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise bad_request(f"{param} has no tokens", param)
        if len(ids) > self.max_model_len:
            raise bad_request(f"{param} has {len(ids)} tokens but this model's context is {self.max_model_len}; "
                              "shorten it or set truncate_prompt_tokens", param, "context_length_exceeded")
        return ids

    async def _scores(self, pairs: list[tuple[str, str]], keep: int | None, raw: Request, priority: int,
                      arrival: float) -> tuple[list[float], int]:
        """Each pair's score and the prompt tokens they took: cosine similarity of embeddings (task embed), or
        the pair as one prompt through the model's classifier or yes/no tokens (task score)."""
        if any(not a or not b for a, b in pairs):
            raise bad_request("texts to score must not be empty", "text_2")
        if self.engine.engine.info.served.task == "embed":
            ids = [await self._pooling_ids(t, True, keep, "text_1" if i % 2 == 0 else "text_2")
                   for pair in pairs for i, t in enumerate(pair)]
            params = self._pooling_params("embed", normalize=True)
            outs = await self._pool(ids, [params] * len(ids), "score", raw, priority, arrival)
            vecs = [o.pooled for o in outs]
            return ([math.fsum(a * b for a, b in zip(vecs[2 * i], vecs[2 * i + 1])) for i in range(len(pairs))],
                    sum(map(len, ids)))
        prompts, params = [], []
        for a, b in pairs:
            ids, split = await asyncio.to_thread(pair_prompt, self.tokenizer, a, b)
            prompts.append(self._fit(truncate_prompt(ids, keep), "text_2"))
            cut = len(ids) - len(prompts[-1])
            split = None if split is None else max(split - cut, 0)
            params.append(self._pooling_params("score", token_type_split=split))
        outs = await self._pool(prompts, params, "score", raw, priority, arrival)
        return [o.pooled[0] for o in outs], sum(map(len, prompts))

    async def _pool(self, ids_list: list[list[int]], params: list[SamplingParams], kind: str, raw: Request,
                    priority: int, arrival: float) -> list[RequestOutput]:
        """Run the pooling requests (one per prompt, each with its own parameters); their final outputs."""
        if len(ids_list) > self.config.max_prompts * 8:
            raise bad_request(f"{len(ids_list)} inputs given; at most {self.config.max_prompts * 8} per request",
                              "input")
        request_id = f"{kind}-{uuid.uuid4().hex}"
        preps = [_Prepared([ids], [""], p, "max_tokens", "input") for ids, p in zip(ids_list, params)]
        started = []
        try:
            for i, prep in enumerate(preps):
                await self.start(prep, f"{request_id}-{i}", priority, arrival)
                started.append(prep)
        except BaseException:
            for prep in started:
                for st in prep.streams:
                    st.abort()
            raise
        return await _collect([st for prep in preps for st in prep.streams], raw)


def _split_inputs(x: Any) -> list[str | list[int]]:
    if isinstance(x, str):
        return [x]
    if not x:
        raise bad_request("input must not be empty", "input")
    return [x] if isinstance(x[0], int) else list(x)


def _base64(vec: list[float]) -> str:
    """OpenAI's base64 encoding: the float32 values, little-endian."""
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
