"""Command line: tokenmill generate | chat | serve | bench serve | bench offline | eval perplexity."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TYPE_CHECKING

from tokenmill.engine.arg_utils import (add_engine_args, add_kv_transfer_args, add_sampling_args, engine_kwargs,
                                       sampling_params)

if TYPE_CHECKING:
    from collections.abc import Callable

SERVE_ITL_TARGET_MS = 100.0


def cmd_generate(a: argparse.Namespace) -> int:
    from tokenmill.engine.llm import LLM

    llm = LLM(**engine_kwargs(a))
    try:
        return _generate(llm, a)
    finally:
        llm.shutdown()  # (a KV tier, --kv-offload-size, keeps the pool's cached blocks for the next run)


def _generate(llm, a: argparse.Namespace) -> int:
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
    try:
        return _chat(llm, a)
    finally:
        llm.shutdown()


def _chat(llm, a: argparse.Namespace) -> int:
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
    from tokenmill.server.run import run_from_args

    return run_from_args(a)


def _lazy(module: str, name: str):
    """A command that imports its module only when it runs (torch and the server load slowly)."""
    def run(a: argparse.Namespace) -> int:
        import importlib

        return getattr(importlib.import_module(module), name)(a)
    return run


def _command(sub: argparse._SubParsersAction, name: str, summary: str, description: str,
             add_args: Callable[[argparse.ArgumentParser], None], module: str, func: str) -> None:
    """A subcommand whose flags ``add_args`` declares and whose ``module.func`` is imported when it runs."""
    p = sub.add_parser(name, help=summary, description=description)
    add_args(p)
    p.set_defaults(func=_lazy(module, func))


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
    add_kv_transfer_args(s)
    # a server plans steps to an inter-token latency; offline commands keep the throughput budget. Only a
    # server reports its use of the machine's roofline (/metrics), so only it measures one at startup.
    s.set_defaults(func=cmd_serve, serve_itl_target_ms=SERVE_ITL_TARGET_MS, measure_roofline=True)

    from tokenmill.server.args import add_router_args

    r = sub.add_parser("router", help="one OpenAI endpoint in front of replicas (routed by prompt prefix or load) "
                       "or of prefill/decode instances",
                       description="With --replica: send each request to the replica most likely to hold its "
                                   "prompt's prefix (--policy prefix), the least loaded or the next in turn. With "
                                   "--prefill and --decode: send each request's prefill to a `tokenmill serve "
                                   "--kv-role producer` instance and its decode, with the KV pulled from the producer, to a `--kv-role consumer` "
                                   "instance; the client sees one ordinary (streaming) response. Balances each leg by "
                                   "load (/metrics), retries a leg on another instance when one fails. /metrics has "
                                   "the router's own counters and the prefill / decode split of TTFT.")
    add_router_args(r)
    r.set_defaults(func=_lazy("tokenmill.server.router_serving", "run_router"))

    b = sub.add_parser("bench", help="serving benchmark against any OpenAI-compatible server, or offline throughput")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    from tokenmill.bench.args import add_offline_args, add_serve_args

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

    from tokenmill.sim.args import add_simulate_args

    sm = sub.add_parser("simulate", help="how many users given hardware supports: the real scheduler against a "
                                         "cost model",
                        description="Simulate serving a workload with the real scheduler and KV cache, each step's "
                                    "time predicted by a roofline of --hardware or a calibrated --profile of this "
                                    "machine. With --slo, find the highest request rate meeting them; report users, "
                                    "batch sizes, KV memory and where the time goes.")
    add_simulate_args(sm)
    sm.set_defaults(func=_lazy("tokenmill.sim.cli", "cmd_simulate"))
    from tokenmill.sim.explain_args import add_explain_args

    _command(sub, "explain", "why a served request took its time, and what other settings would have given",
             "Read a request's window of traffic from a running tokenmill server and replay it through the "
             "simulator with the server's live-fitted cost model: as served, and with --what-if settings. Its "
             "causes are at GET /v1/requests/ID/timeline.", add_explain_args, "tokenmill.sim.explain", "cmd_explain")
    pr = sub.add_parser("profile", help="measure this machine's step times and fit the simulator's cost model",
                        description="Time real engine steps over a grid (decode batches x contexts, prefill chunks, "
                                    "mixed) and write the fitted cost model for `tokenmill simulate --profile`.")
    pr.add_argument("--output", default="profile.json", help="where to write the model (default profile.json)")
    pr.add_argument("--quick", action="store_true", help="a smaller grid")
    pr.add_argument("--from-step-log", nargs="+", default=None, metavar="FILE.jsonl",
                    help="fit to the steps a server ran (`tokenmill serve --step-log`) instead of timing a grid: each "
                         "step charged its cycle (start to the next step's start), so the model carries the "
                         "serving's own overheads and contention; no model is loaded, and the engine flags "
                         "and --quick do not apply (the log's first line names its engine)")
    add_engine_args(pr)
    pr.set_defaults(func=_lazy("tokenmill.sim.profile", "cmd_profile"))
    from tokenmill.models.inspect import add_inspect_args

    _command(sub, "inspect", "what a .gguf file or model folder is, from its headers",
             "Describe a model without loading its weights: family, size, tensor types, context length, tokenizer "
             "and chat template, and the --quantization mode tokenmill would run it in on this machine.",
             add_inspect_args, "tokenmill.models.inspect", "cmd_inspect")
    from tokenmill.monitor.args import add_top_args

    _command(sub, "top", "live terminal view of a running server (tokenmill's or vLLM's /metrics)",
             "Read a server's /metrics every --interval seconds and show requests running and waiting, KV-cache "
             "use, tokens/s, TTFT and ITL percentiles (from the histograms' deltas) and, from tokenmill, device busy "
             "and roofline use. Works with any server exporting vLLM's metric names. Ctrl-C quits.",
             add_top_args, "tokenmill.monitor.top", "cmd_top")
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
