"""LLM: the offline API. Queue many prompts, step the engine until all finish."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.tasks import pair_prompt, pooling_params, score_pairs
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """Offline batched generation, e.g. ``LLM().generate(["Hello"], SamplingParams(max_tokens=32))``.

    Engine options (keywords, the CLI flags' names with underscores): dtype ("auto", "float32",
    "bfloat16", "float16"), device, max_model_len, kv_cache_memory (bytes like "2GiB" or a fraction
    of free memory), block_size, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill,
    enable_prefix_caching, scheduling_policy ("fcfs" | "priority"), preemption_mode, starvation_timeout,
    seed. See ``tokenmill generate --help``.
    """

    def __init__(self, model: str = "smollm2-135m-instruct", **engine_options) -> None:
        config = EngineConfig.from_kwargs(model=model, **engine_options)
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's other processes (an engine-core process, tensor-parallel workers), if any."""
        self.engine.shutdown()

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = True, add_special_tokens: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in input order. ``lora_request``: the
        adapter every prompt runs with, or one per prompt (None: the base model; needs ``enable_lora=True``).

        Every request is validated before any is queued, so one bad prompt or parameter queues nothing.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        # every request validated (once) before any is queued
        processed = [self.engine.input_processor.process(p, sp, add_special_tokens=add_special_tokens,
                                                         lora_request=lr)
                     for p, sp, lr in zip(prompts, params, loras)]
        ids = []
        try:
            for request in processed:
                ids.append(self.engine.add_processed(request))
        except ValueError:  # the core refused one after all: take back the others
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
                   for c in conversations]
        # The template already holds any BOS token.
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, add_special_tokens=False,
                             lora_request=lora_request)

    def embed(self, prompts: Prompt | Sequence[Prompt], dimensions: int | None = None,
              normalize: bool | None = None, use_tqdm: bool = True) -> list[list[float]]:
        """Each prompt's embedding (a model served with task embed: its pooling, normalised unless
        ``normalize`` is False; the first ``dimensions`` values of a Matryoshka model)."""
        info = self.engine.info
        params = SamplingParams(pooling=pooling_params(info.served, info.model_config.hidden_size, "embed",
                                                       dimensions, normalize))
        return [out.pooled for out in self.generate(prompts, params, use_tqdm=use_tqdm)]

    def score(self, first: str | Sequence[str], second: str | Sequence[str], use_tqdm: bool = True) -> list[float]:
        """Relevance scores of text pairs (one first text against many seconds, or pairwise lists): a
        cross-encoder's or decoder reranker's (task score), or the embeddings' cosine similarity (task embed)."""
        pairs = score_pairs(first, second)
        info = self.engine.info
        if info.served.task == "embed":
            vecs = self.embed([t for pair in pairs for t in pair], normalize=True, use_tqdm=use_tqdm)
            return [sum(a * b for a, b in zip(vecs[2 * i], vecs[2 * i + 1])) for i in range(len(pairs))]
        prompts, params = [], []
        for a, b in pairs:
            ids, split = pair_prompt(self.tokenizer, a, b)
            prompts.append(ids)
            params.append(SamplingParams(pooling=pooling_params(info.served, info.model_config.hidden_size, "score",
                                                                token_type_split=split)))
        outs = self.generate(prompts, params, use_tqdm=use_tqdm, add_special_tokens=False)
        return [out.pooled[0] for out in outs]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
        return [done[i] for i in ids]
