"""``tokenmill simulate``'s flags (sim/cli.py runs them)."""

from __future__ import annotations

import argparse


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    from tokenmill.bench.args import add_dataset_args
    from tokenmill.engine.arg_utils import add_latency_args, add_speculative_args
    from tokenmill.sim.spec import DEFAULT_ACCEPTANCE

    g = p.add_argument_group("model and hardware")
    g.add_argument("--model", default="smollm2-135m-instruct",
                   help="a model name, a .gguf, a Hugging Face folder or a config.json alone (no weights needed)")
    g.add_argument("--hardware", default=None,
                   help="roofline on a hardware profile: a100, h100, h200, l4 (datasheet peaks), a100-fitted, h100-fitted, "
                        "h200-fitted (efficiencies and overheads fitted to published measurements: BENCHMARKS.md), or a "
                        "JSON profile file with HardwareProfile's fields")
    g.add_argument("--profile", default=None, metavar="FILE.json",
                   help="a calibrated cost model of this machine, written by `tokenmill profile` (instead of "
                        "--hardware)")
    g.add_argument("--weight-dtype", default="bf16", help="roofline: weight bytes (bf16, fp8, int8, int4; default bf16)")
    g.add_argument("--kv-dtype", default="bf16", help="roofline: KV cache element (bf16, fp8, int8; default bf16)")
    g.add_argument("--compute-dtype", default="bf16",
                   help="roofline: the matmuls' dtype, whose peak FLOP/s the compute time takes (bf16, fp16, fp8 or "
                        "int8 where the hardware has it, fp32; default bf16; fp8: W8A8 as TensorRT-LLM and vLLM run "
                        "fp8 checkpoints)")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="roofline: devices per replica (default 1)")
    g.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="roofline: pipeline stages per replica, each of --tensor-parallel-size devices (default 1)")
    g.add_argument("--pipeline-batches-in-flight", type=int, default=0,
                   help="roofline: steps in flight across the stages, as the engine's flag (default: the stages; "
                        "1: one step at a time)")
    g.add_argument("--pipeline-micro-batches", type=int, default=1,
                   help="roofline: micro-batches each step is cut into across the stages (default 1)")
    g.add_argument("--step-time-scale", type=float, default=1.0,
                   help="multiply every step time by this: a loaded server's observed/predicted ratio "
                        "(its tokenmill:step_time_ratio gauge) carries a profile over to serving (default 1)")
    g.add_argument("--request-overhead-ms", type=float, nargs="+", default=[0.0], metavar="MS",
                   help="the front end's time for each request outside the engine's steps (HTTP, tokenizing, "
                        "the first token back to the client), added to its TTFT and E2EL: FIXED [PER_1K] ms, "
                        "PER_1K a thousand prompt tokens; about 5 ms fixed on a 2-vCPU server, idle "
                        "(benchmarks/simulator_validation.py measures it; default 0)")
    g.add_argument("--front-end-shares-cpu", action="store_true",
                   help="the front end runs on the engine's own cores (a CPU server, as `tokenmill profile` "
                        "measures): a request's --request-overhead-ms also slows the step running when it "
                        "reaches the scheduler")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV pool bytes (e.g. 40GiB); default: 90%% of the device memory less the weights "
                        "(--hardware), or what the profile's engine had (--profile)")
    g = p.add_argument_group("scheduling (the engine's flags)")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="default 256 (CPU) / 8192 (GPU)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    add_latency_args(p, step_cost_profile=False)  # the server's own planner and admission
    g = p.add_argument_group(
        "speculative decoding", "serve's flags (a --speculative-model may also be a config.json alone); the "
        "scheduler's off rule, KV reservation and budget run as in the engine, the acceptance is modelled")
    add_speculative_args(g, engine=False)  # serve's definitions of the method, draft model and draft count
    g.add_argument("--speculative-acceptance-rate", "--spec-acceptance-rate", type=float, default=None,
                   metavar="A", help="probability that a draft is accepted, each independently until the first "
                                     "rejection: a step of k drafts gives (1 - A^(k+1)) / (1 - A) tokens on average "
                                     f"(default {DEFAULT_ACCEPTANCE:g}: n-gram drafts on recurring text, "
                                     "BENCHMARKS.md)")
    g.add_argument("--speculative-weight-dtype", default=None,
                   help="the draft model's weight bytes, as --weight-dtype (default: --weight-dtype); with "
                        "--profile the ratio of the two prices a draft pass")
    g = p.add_argument_group(
        "prefill/decode disaggregation", "prompts computed on producer instances, their KV shipped over the "
        "network, decoded on other instances; each instance is one replica of the configuration above "
        "(its devices, KV pool and scheduling flags)")
    g.add_argument("--disaggregated", default=None, metavar="P:D",
                   help="P prefill (producer) and D decode instances, e.g. 1:1 or 2:1, driven as the router "
                        "drives them: a request is prefilled on the least loaded producer, which holds its KV; "
                        "it queues at the least loaded decode instance until that has room, which then pulls "
                        "the KV of its prompt but the last token (recomputed there) over the KV link; TTFT = "
                        "prefill queue + prefill + decode queue + transfer + first step (default: one instance "
                        "does both)")
    g.add_argument("--kv-link-gbps", type=float, default=None, metavar="GBPS",
                   help="the network between instances, Gb/s per device and direction, e.g. 400 (InfiniBand "
                        "NDR) or 100 (Ethernet); a tensor or pipeline parallel instance ships its shards over "
                        "all its devices' links (default: --hardware's NIC, e.g. h100: 400; needed with "
                        "--profile)")
    g.add_argument("--kv-link-latency-us", type=float, default=None, metavar="US",
                   help="microseconds added to each transfer (default: --hardware's, 5)")
    g = p.add_argument_group("load and SLOs")
    g.add_argument("--request-rate", type=float, default=None,
                   help="simulate this rate only; without it, --slo searches for the highest rate meeting them")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1 = Poisson)")
    g.add_argument("--duration", type=float, default=60.0,
                   help="seconds of arrivals simulated at each rate: rate x duration requests (at least "
                        "--num-prompts; the workload's requests are cycled, each with fresh random tokens where "
                        "it has none of its own), so an overload shows as a queue that keeps growing (default 60)")
    g.add_argument("--time-scale", type=float, default=1.0, help="trace: stretch its recorded clock")
    g.add_argument("--slo", "--goodput", dest="slo", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs in ms, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el)")
    g.add_argument("--slo-percentile", type=float, default=99.0, help="percentile that must meet them (default 99)")
    g.add_argument("--think-time", type=float, default=30.0,
                   help="seconds a user waits between a reply and their next request: users = rate x (think time "
                        "+ mean latency) (default 30)")
    g.add_argument("--compare", default=None, metavar="FLAGS",
                   help="a second configuration: these flags over the first's, e.g. \"--hardware l4 "
                        "--tensor-parallel-size 2\"; both are reported side by side")
    g.add_argument("--plot", default=None, metavar="DIR", help="plots of the (best) run: latency CDFs, tokens in flight")
    g.add_argument("--save-result", default=None, metavar="FILE.json",
                   help="write the (best) run as `tokenmill bench serve --save-result` writes a measured one "
                        "(vLLM's flat layout: the metrics at the top level, every request's timings beside), so "
                        "the scripts that read bench results read a simulation too; with --compare, FILE's "
                        "stem gets -A and -B")
    g.add_argument("--tokenizer", default=None, help="tokenizer that builds the prompts (default: --model's, or "
                                                      "the embedded model's for a config alone)")
    add_dataset_args(p)
