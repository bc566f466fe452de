"""Command line: tokenmill generate | chat | serve | bench serve | bench offline | eval perplexity."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from tokenmill.config import QUANTIZATION_CHOICES
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
    g.add_argument("--max-model-len", type=int, default=None, help="context length to serve (default: the model's)")
    g.add_argument("--kv-cache-memory", default="0.1",
                   help="KV cache size: bytes (2GiB, 512MB) or a fraction of free memory (0.1 = 10%%; default)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                   help="KV cache storage: auto (the model dtype, default); int8 or fp8 (e4m3) with a float32 scale "
                        "per token and head: about 3.8x the tokens of a float32 cache in the same memory")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (power of two, default 16)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests running in one step (default 256)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step, prefill and decode together (default 256 with chunked "
                        "prefill, 8192 without; raise it on a GPU)")
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
    g.add_argument("--speculative-quantization", default="auto", choices=list(QUANTIZATION_CHOICES),
                   help="the draft model's weights, as --quantization (default auto)")
    g.add_argument("--num-speculative-tokens", type=int, default=3,
                   help="most draft tokens per request and step (default 3)")
    g.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram: shortest suffix to match (default 2)")
    g.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: longest suffix to match (default 4)")


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


def engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(model=a.model, dtype=a.dtype, device=a.device, quantization=a.quantization, max_model_len=a.max_model_len,
                kv_cache_memory=a.kv_cache_memory, kv_cache_dtype=a.kv_cache_dtype, block_size=a.block_size, max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.max_num_batched_tokens, enable_chunked_prefill=a.enable_chunked_prefill,
                enable_prefix_caching=a.enable_prefix_caching, scheduling_policy=a.scheduling_policy,
                preemption_mode=a.preemption_mode, starvation_timeout=a.starvation_timeout, seed=a.seed,
                speculative_method=a.speculative_method, num_speculative_tokens=a.num_speculative_tokens,
                prompt_lookup_min=a.prompt_lookup_min, prompt_lookup_max=a.prompt_lookup_max,
                speculative_model=a.speculative_model, speculative_quantization=a.speculative_quantization)


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


def cmd_generate(a: argparse.Namespace) -> int:
    from tokenmill.engine.llm import LLM

    llm = LLM(**engine_kwargs(a))
    params = sampling_params(a, llm.engine.model_path)
    if a.raw:
        outs = llm.generate(a.prompts, params, use_tqdm=not a.no_progress)
    else:
        convs = [[{"role": "user", "content": p}] for p in a.prompts]
        outs = llm.chat(convs, params, use_tqdm=not a.no_progress)
    for out in outs:
        for c in out.outputs:
            if a.json:
                m = out.metrics[c.index]
                print(json.dumps({"prompt": out.prompt, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                                  "finish_reason": c.finish_reason, "ttft_s": m.ttft, "tpot_s": m.tpot,
                                  "e2e_s": m.e2e_latency}))
            else:
                print(c.text)
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    from tokenmill.engine.llm import LLM

    llm = LLM(**engine_kwargs(a))
    params = sampling_params(a, llm.engine.model_path)
    engine = llm.engine
    messages = [{"role": "system", "content": a.system}] if a.system else []
    print("tokenmill chat: type a message, Ctrl-D or /exit to quit, /reset to start over.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if a.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        try:
            rid = engine.add_request(prompt, params, add_special_tokens=False)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        shown = 0
        text = ""
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    text = out.outputs[0].text
                    print(text[shown:], end="", flush=True)  # stream as the tokens come
                    shown = len(text)
        except KeyboardInterrupt:
            engine.abort_request(rid)
        print()
        messages.append({"role": "assistant", "content": text})


def cmd_serve(a: argparse.Namespace) -> int:
    from tokenmill.server.app import run_from_args

    return run_from_args(a)


def _lazy(module: str, name: str):
    """A command that imports its module only when it runs (torch and the server load slowly)."""
    def run(a: argparse.Namespace) -> int:
        import importlib

        return getattr(importlib.import_module(module), name)(a)
    return run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill", description="tokenmill: LLM inference with a paged KV cache "
                                "and continuous batching")
    p.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate completions for prompts, batched",
                       description="Generate for each PROMPT. Prompts are wrapped in the model's chat template "
                                   "as a user message unless --raw is given.")
    g.add_argument("prompts", nargs="+", metavar="PROMPT")
    g.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON line per completion with timings")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat that streams tokens as they come")
    c.add_argument("--system", default=None, help="system message")
    add_engine_args(c)
    add_sampling_args(c)
    c.set_defaults(func=cmd_chat)

    from tokenmill.server.args import add_server_args

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, /metrics)",
                       description="Serve MODEL over an OpenAI-compatible HTTP API: POST /v1/completions, "
                                   "POST /v1/chat/completions, GET /v1/models, /health, /metrics (Prometheus, "
                                   "vLLM metric names), /version. Binds 127.0.0.1 unless --host says otherwise.")
    add_server_args(s)
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="serving benchmark against any OpenAI-compatible server, or offline throughput")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    from tokenmill.bench.offline import add_offline_args
    from tokenmill.bench.serve import add_serve_args

    bs = bsub.add_parser("serve", help="TTFT, TPOT, ITL, E2EL, throughput and goodput of a running server",
                         description="Send a workload to an OpenAI-compatible server (tokenmill, vLLM, llama.cpp's "
                                     "llama-server) on an arrival schedule, streaming, and report vLLM's serving "
                                     "metrics; --sweep finds the highest load meeting --goodput SLOs, --compare runs "
                                     "a second server alternately and prints both side by side.")
    add_serve_args(bs)
    bs.set_defaults(func=_lazy("tokenmill.bench.serve", "cmd_bench_serve"))
    bo = bsub.add_parser("offline", help="engine-only throughput through LLM.generate (no HTTP)")
    add_offline_args(bo)
    add_engine_args(bo)
    bo.set_defaults(func=_lazy("tokenmill.bench.offline", "cmd_bench_offline"))

    e = sub.add_parser("eval", help="model quality under an engine configuration")
    esub = e.add_subparsers(dest="eval_command", required=True)
    from tokenmill.eval import add_eval_args

    ep = esub.add_parser("perplexity", help="perplexity of a text file (compare quantizations on the same tokens)",
                         description="Perplexity over the first --num-tokens tokens of a text file, in windows of "
                                     "--context-len whose second halves are scored (llama-perplexity's method).")
    add_eval_args(ep)
    add_engine_args(ep)
    ep.set_defaults(func=_lazy("tokenmill.eval", "cmd_perplexity"))

    from tokenmill.sim.cli import add_simulate_args

    sm = sub.add_parser("simulate", help="how many users given hardware supports: the real scheduler against a "
                                         "cost model",
                        description="Simulate serving a workload with the real scheduler and KV cache, each step's "
                                    "time predicted by a roofline of --hardware or a calibrated --profile of this "
                                    "machine. With --slo, find the highest request rate meeting them; report users, "
                                    "batch sizes, KV memory and where the time goes.")
    add_simulate_args(sm)
    sm.set_defaults(func=_lazy("tokenmill.sim.cli", "cmd_simulate"))
    pr = sub.add_parser("profile", help="measure this machine's step times and fit the simulator's cost model",
                        description="Time real engine steps over a grid (decode batches x contexts, prefill chunks, "
                                    "mixed) and write the fitted cost model for `tokenmill simulate --profile`.")
    pr.add_argument("--output", default="profile.json", help="where to write the model (default profile.json)")
    pr.add_argument("--quick", action="store_true", help="a smaller grid")
    add_engine_args(pr)
    pr.set_defaults(func=_lazy("tokenmill.sim.profile", "cmd_profile"))
    return p





def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:  # bad input of any kind: say what, not a traceback
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
