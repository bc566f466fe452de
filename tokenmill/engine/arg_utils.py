"""Engine and sampling flags, and the configs they build: the one place every command
(generate, chat, serve, bench offline, eval, profile) takes them from. No heavy imports: the CLI
builds its parser with this before anything loads."""

from __future__ import annotations

import argparse

from tokenmill.config import ATTENTION_BACKEND_CHOICES, QUANTIZATION_CHOICES
from tokenmill.models.registry import DEFAULT_MODEL


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"built-in alias, .gguf file, Hugging Face model folder or hub id org/name (default: {DEFAULT_MODEL})")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype; auto: float32 on a CPU where tokenmill's kernels build (every mode batch "
                        "invariant there), bfloat16 on GPUs and on CPUs with AVX512-BF16/AMX but no kernels, else "
                        "float32")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (default: cpu)")
    g.add_argument("--quantization", default="auto", choices=list(QUANTIZATION_CHOICES),
                   help="weights: auto (default: gguf for a GGUF file whose layers are Q4_0/Q4_1/Q8_0, on the CPU "
                        "in float32 with the kernels built; else none); none (float); int8 (per output channel); "
                        "int4 (groups of 32, scale and zero point); gguf (keep a GGUF file's own Q4_0/Q4_1/Q8_0 "
                        "blocks). Quantized layers run integer CPU kernels")
    g.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKEND_CHOICES),
                   help="paged attention: auto (default: cpu where the CPU kernels run the model, else torch); cpu "
                        "(the kernels' paged_attention reading the blocks in place, batch invariant, and whole "
                        "fused attention layers); torch (gathered blocks and scaled_dot_product_attention, CPU or "
                        "GPU); flex (torch's FlexAttention over the pool in place: a mask per step from the block "
                        "tables; compiled kernels on GPUs, torch's slow reference code on a CPU)")
    g.add_argument("--activation-precision", default=None, choices=["int16", "int8"],
                   help="the CPU kernels' activations, quantized per token and block of 32: int16 (default, or "
                        "TOKENMILL_ACTIVATIONS; within 1e-4 of float activations) or int8 (llama.cpp's 127 steps: "
                        "about twice the prefill and batched speed on AVX2 for K-quant and Q4_0/Q4_1 files, at "
                        "about 97%% top-1 agreement; BENCHMARKS.md). Either is batch invariant")
    g.add_argument("--max-model-len", type=int, default=None, help="context length to serve (default: the model's)")
    g.add_argument("--kv-cache-memory", default="0.1",
                   help="KV cache size: bytes (2GiB, 512MB) or a fraction of free memory (0.1 = 10%%; default)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                   help="KV cache storage: auto (the model dtype, default); int8 or fp8 (e4m3) with a float32 scale "
                        "per token and head: about 3.8x the tokens of a float32 cache in the same memory")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (power of two, default 16)")
    g.add_argument("--kv-offload-size", type=float, default=None,
                   help="a second KV tier on local disk, of this many GiB: prefix-cache blocks evicted from the pool "
                        "are written there and read back on a hit instead of computed (same output bits); it "
                        "outlives a restart (default: off; CPU, one rank)")
    g.add_argument("--kv-offload-path", default=None,
                   help="the KV tier's directory (default: tokenmill/kv under the user's cache directory); a "
                        "subdirectory keyed by the model's files and KV layout, so no other model reads it")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests running in one step (default 256)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step, prefill and decode together (default 256 with chunked "
                        "prefill, 8192 without; raise it on a GPU); with a latency target (--itl-target-ms, "
                        "--slo-tpot-ms) the budget adapts to it under this cap (default 2048)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts across steps under the token budget, running decodes first "
                        "(default on; --no-enable-chunked-prefill runs each prompt whole)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of a prompt prefix already computed (shared system prompts, "
                        "multi-turn chats); default on, as in vLLM: on the CPU kernels a request's outputs are the "
                        "same bits with or without a cache hit; --no-enable-prefix-caching turns it off")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: arrival order (default); priority: lower request priority runs first, "
                        "ties by arrival, and the lowest-priority running request is preempted first")
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                   help="what a preempted request loses: recompute drops its KV and computes it again "
                        "(default); swap (GPU only) copies its KV blocks to host memory and back when it resumes")
    g.add_argument("--starvation-timeout", type=float, default=30.0,
                   help="priority policy: seconds a request may wait before it is promoted ahead of all "
                        "others (default 30)")
    g.add_argument("--seed", type=int, default=0, help="engine random seed (default 0)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="tensor parallelism: split every layer over this many processes on this machine (gloo on "
                        "the CPU, NCCL on GPUs); heads and the MLP width must divide by it (default 1)")
    g.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "external_launcher"],
                   help="how tensor-parallel ranks start: mp, worker processes started by tokenmill (default); "
                        "external_launcher, every rank started by torchrun with the same command (env:// "
                        "rendezvous, one machine or several): rank 0 runs it, the others serve its forward passes")
    g.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="pipeline parallelism: split the layers into this many stages, one process each, with "
                        "several steps in flight across them (default 1)")
    g.add_argument("--pipeline-batches-in-flight", type=int, default=0,
                   help="steps (batches of different requests) in flight across the pipeline stages at once, so "
                        "that every stage has work (default: the pipeline size; 1 runs one step at a time)")
    g.add_argument("--pipeline-micro-batches", type=int, default=0,
                   help="micro-batches each step is cut into under pipeline parallelism (whole requests; default "
                        "1); more shrink a step's bubble (P - 1) / (m + P - 1) but re-read each stage's weights")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="mixture-of-experts models under --tensor-parallel-size: each rank holds whole experts "
                        "(the experts must divide by the size) instead of a slice of every expert")
    g.add_argument("--all2all-backend", default="allreduce", choices=["allreduce", "alltoall"],
                   help="expert parallelism's dispatch and combine: allreduce, every rank routes every token to "
                        "its own experts and one all-reduce sums the layer (default); alltoall, each rank routes "
                        "its share of the tokens and all-to-alls send them to their experts' ranks and back")
    g.add_argument("--task", default="auto", choices=["auto", "generate", "embed", "score"],
                   help="what the model serves: generate (completions, chat); embed (/v1/embeddings, and /v1/score "
                        "as cosine similarity); score (/v1/score, /v1/rerank with a cross-encoder or a decoder "
                        "reranker); auto (default): embed for a model whose files declare a pooling "
                        "(sentence-transformers modules, GGUF pooling_type), score for a sequence classifier, "
                        "else generate")
    g.add_argument("--classifier-from-token", default=None, type=lambda v: tuple(v.split(",")),
                   help="with --task score on a generative model (the Qwen3-Reranker shape): the 'no' and 'yes' "
                        "words, e.g. no,yes; a pair's score is P(yes) of the two at the prompt's last token")
    add_speculative_args(g)
    add_lora_args(g)
    add_latency_args(p)


def add_lora_args(g: argparse._ArgumentGroup) -> None:
    """Multi-LoRA serving (tokenmill/lora/; serve's --lora-modules names the adapters)."""
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT folders or GGUF LoRA files) on the attention and MLP projections, "
                        "chosen per request (a request's model field; LoRARequest offline); one step mixes requests "
                        "with different adapters and none, each with its alone-bits")
    g.add_argument("--max-loras", type=int, default=1,
                   help="adapters one step may run, each in a slot of the model's working set (default 1); a "
                        "request whose adapter would need one more waits, and the least recently used slot is "
                        "reloaded")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted (default 16)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded in host memory, least recently used out first (default: --max-loras)")


def add_kv_transfer_args(p: argparse.ArgumentParser) -> None:
    """serve's disaggregation flags (engine_kwargs takes them where the command has them)."""
    g = p.add_argument_group("prefill/decode disaggregation (with `tokenmill router` in front)")
    g.add_argument("--kv-role", default=None, choices=["producer", "consumer"],
                   help="producer: a prefill instance, which holds each prefilled request's KV blocks until a "
                        "consumer pulls them; consumer: a decode instance, which pulls a request's prompt KV from "
                        "the producer its router names, then decodes it (default: neither, colocated serving)")
    g.add_argument("--kv-transport", default="tcp", choices=["tcp", "torch"],
                   help="how KV blocks travel: tcp, length-prefixed frames of raw tensor bytes (default); torch, "
                        "torch.distributed point to point on a gloo pair per connection. Both sides must agree")
    g.add_argument("--kv-host", default="127.0.0.1",
                   help="producer: the address consumers pull KV from (default 127.0.0.1, this machine only)")
    g.add_argument("--kv-port", type=int, default=0,
                   help="producer: the port consumers pull KV from (default 0: a free one; the producer's "
                        "responses name it)")
    g.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                   help="seconds a producer holds a request's blocks for a consumer, and a consumer waits on a "
                        "producer, before giving up: the blocks go back to the pool (default 30)")
    g.add_argument("--kv-load-failure-policy", default="recompute", choices=["recompute", "fail"],
                   help="consumer: a pull that fails (producer gone, blocks expired) computes the prompt here "
                        "(recompute, default) or ends the request aborted (fail)")


def add_speculative_args(g: argparse.ArgumentParser | argparse._ArgumentGroup, engine: bool = True) -> None:
    """The speculative-decoding flags: serve's, and (engine=False: what the draft model and the method are)
    simulate's, which runs the same scheduler with a modelled acceptance."""
    g.add_argument("--speculative-method", default=None, choices=["ngram", "draft"],
                   help="speculative decoding (default off): ngram drafts tokens by prompt lookup over each "
                        "request's own tokens, draft by a smaller model (--speculative-model); the target "
                        "verifies them in the same step, keeping its distribution exactly (greedy outputs are "
                        "unchanged)")
    g.add_argument("--speculative-model", default=None,
                   help="the draft model (implies --speculative-method draft): a name as --model takes it, a "
                        ".gguf file or a Hugging Face folder with the target's tokenizer; e.g. the target with "
                        "--quantization none and the same file as drafter serves float outputs at close to "
                        "quantized speed")
    g.add_argument("--num-speculative-tokens", type=int, default=3,
                   help="most draft tokens per request and step (default 3)")
    if not engine:
        return
    g.add_argument("--speculative-quantization", default="auto", choices=list(QUANTIZATION_CHOICES),
                   help="the draft model's weights, as --quantization (default auto)")
    g.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram: shortest suffix to match (default 2)")
    g.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: longest suffix to match (default 4)")


def add_latency_args(p: argparse.ArgumentParser, step_cost_profile: bool = True) -> None:
    """The latency targets and SLOs (core/step_planner.py): serve's, and simulate's, which runs the same planner."""
    g = p.add_argument_group("latency targets and SLOs")
    g.add_argument("--itl-target-ms", type=float, default=None,
                   help="inter-token latency each step is planned to meet: a step takes the running decodes plus "
                        "the largest prefill chunk whose predicted time fits (Sarathi-Serve's rule), so long "
                        "prompts never stall the decodes past it (serve: default 100, off on a --kv-role producer; "
                        "other commands: off, the fixed --max-num-batched-tokens; 0 turns it off; simulate: off "
                        "unless given)")
    g.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="time-to-first-token SLO: a request whose predicted TTFT misses it is answered at once "
                        "with 503 and Retry-After (--slo-policy shed), never admitted to make everyone late; a "
                        "request's own slo_ttft_ms field overrides it")
    g.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="time-per-output-token SLO: steps are planned to meet it (instead of --itl-target-ms) and "
                        "the running batch is held at the size whose predicted step meets it; a request's own "
                        "slo_tpot_ms field can tighten it while it runs")
    g.add_argument("--slo-policy", default="shed", choices=["shed", "queue"],
                   help="a request that cannot meet its TTFT SLO: shed (default: 503 + Retry-After within "
                        "milliseconds) or queue (admit it anyway, counted in tokenmill:slo_predicted_misses_total)")
    if step_cost_profile:
        g.add_argument("--step-cost-profile", default=None, metavar="FILE.json",
                       help="the step-cost model the targets plan with, from `tokenmill profile` (default: about "
                            "1.5 s of steps timed at startup)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--generation-config", default="auto",
                   help="where the sampling defaults come from: auto (default) = the model's "
                        "generation_config.json where it ships one (a Hugging Face folder), else tokenmill's "
                        "(temperature 0.8, top-k 40, top-p 0.95, min-p 0.05: llama.cpp's); vllm = tokenmill's "
                        "only; a folder = its generation_config.json. Flags below win over both")
    g.add_argument("--max-tokens", type=int, default=None, help="most tokens to generate (default 256, or the "
                                                                     "generation config's max_new_tokens)")
    g.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy; default 0.8 or the generation config's")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]; default 0.95")
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0 = off); default 40")
    g.add_argument("--min-p", type=float, default=None,
                   help="drop tokens below min_p x the top probability; default 0.05")
    g.add_argument("--repetition-penalty", type=float, default=None, help="default 1.0 (off)")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed-sampling", dest="sampling_seed", type=int, default=None,
                   help="per-request sampling seed (same seed, same output)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    g.add_argument("-n", type=int, default=1, help="completions per prompt")
    g.add_argument("--logprobs", type=int, default=None, help="also return the top-N logprobs per token")


def _itl_target_ms(a: argparse.Namespace) -> float | None:
    """--itl-target-ms, or the command's default (serve's); a prefill instance (--kv-role producer) runs no
    decodes, so it has none by default."""
    if a.itl_target_ms is not None:
        return a.itl_target_ms or None
    return None if getattr(a, "kv_role", None) == "producer" else getattr(a, "serve_itl_target_ms", None)


def engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(model=a.model, dtype=a.dtype, device=a.device, quantization=a.quantization,
                activation_precision=a.activation_precision, attention_backend=a.attention_backend,
                max_model_len=a.max_model_len,
                kv_cache_memory=a.kv_cache_memory, kv_cache_dtype=a.kv_cache_dtype, block_size=a.block_size, max_num_seqs=a.max_num_seqs,
                kv_offload_size=a.kv_offload_size, kv_offload_path=a.kv_offload_path,
                max_num_batched_tokens=a.max_num_batched_tokens, enable_chunked_prefill=a.enable_chunked_prefill,
                enable_prefix_caching=a.enable_prefix_caching, scheduling_policy=a.scheduling_policy,
                preemption_mode=a.preemption_mode, starvation_timeout=a.starvation_timeout, seed=a.seed,
                speculative_method=a.speculative_method, num_speculative_tokens=a.num_speculative_tokens,
                prompt_lookup_min=a.prompt_lookup_min, prompt_lookup_max=a.prompt_lookup_max,
                speculative_model=a.speculative_model, speculative_quantization=a.speculative_quantization,
                itl_target_ms=_itl_target_ms(a), slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms,
                slo_policy=a.slo_policy, step_cost_profile=a.step_cost_profile,
                measure_roofline=getattr(a, "measure_roofline", False),
                tensor_parallel_size=a.tensor_parallel_size, pipeline_parallel_size=a.pipeline_parallel_size,
                pipeline_micro_batches=a.pipeline_micro_batches,
                pipeline_batches_in_flight=a.pipeline_batches_in_flight, all2all_backend=a.all2all_backend,
                distributed_executor_backend=a.distributed_executor_backend,
                enable_expert_parallel=a.enable_expert_parallel,
                task=getattr(a, "task", "auto"), classifier_from_token=getattr(a, "classifier_from_token", None),
                **{k: getattr(a, k) for k in LORA_FLAGS if hasattr(a, k)},
                **{k: getattr(a, k) for k in KV_TRANSFER_FLAGS if hasattr(a, k)})


LORA_FLAGS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
KV_TRANSFER_FLAGS = ("kv_role", "kv_transport", "kv_host", "kv_port", "kv_transfer_timeout", "kv_load_failure_policy")


def sampling_params(a: argparse.Namespace, model_path=None):
    """The command's SamplingParams: its flags over the --generation-config defaults for model_path."""
    from tokenmill.generation_config import sampling_defaults
    from tokenmill.sampling_params import SamplingParams

    d = sampling_defaults(a.generation_config, model_path)
    pick = {k: getattr(a, k) if getattr(a, k) is not None else d[k]
            for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")}
    return SamplingParams(
        n=a.n, presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty, seed=a.sampling_seed,
        stop=a.stop, ignore_eos=a.ignore_eos, logprobs=a.logprobs, **pick,
    )
