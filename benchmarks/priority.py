"""Priority scheduling and its starvation guard, measured: what `--scheduling-policy priority` buys
the urgent requests and what it costs the others.

The workload, the same for every configuration: a saturating, closed-loop stream of urgent requests
(priority 0; the client keeps --backlog of them waiting at all times, so the engine is never idle of
urgent work) and, one second in, a few background requests (priority 10). The engine admits at most
--max-num-seqs at once, so admission order decides who waits. The stream runs for --duration seconds,
then stops; the engine drains.

Configurations, one after the other on one engine each, in one run:
- fcfs                     arrival order; priority is ignored
- priority, no guard       urgent first; the background requests wait for the stream to end
- priority, guard T        urgent first, but a request waiting over T seconds is promoted

    python benchmarks/priority.py                                  # defaults: 30 s, guard 8 s
    python benchmarks/priority.py --duration 20 --guard 5 --json results/priority.json

Prints, per configuration: the urgent requests' queueing delay (arrival to first scheduled) p50 and
p99, their count, and each background request's end-to-end latency (arrival to finish).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def run(label: str, engine_kwargs: dict, a: argparse.Namespace) -> dict:
    engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs))
    rng = random.Random(a.seed)
    vocab = engine.model_config.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(a.input_len)]

    params = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0)
    urgent: dict[str, object] = {}
    background: dict[str, object] = {}
    finished: dict[str, object] = {}
    engine.add_request(prompt(), params)  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    start = time.perf_counter()
    n = 0
    while True:
        now = time.perf_counter() - start
        if now < a.duration:
            waiting_urgent = sum(1 for r in engine.scheduler.waiting if r.priority == 0)
            for _ in range(a.backlog - waiting_urgent):
                rid = f"u{n}"
                n += 1
                engine.add_request(prompt(), params, request_id=rid, priority=0)
                urgent[rid] = None
            if now >= 1.0 and not background:
                for i in range(a.background):
                    rid = f"bg{i}"
                    engine.add_request(prompt(), params, request_id=rid, priority=10)
                    background[rid] = None
        elif not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.metrics[0]
    queue = [finished[r].queue_time for r in urgent if r in finished]
    bg = {r: finished[r].e2e_latency for r in background}
    result = {
        "label": label,
        "urgent_finished": len(queue),
        "urgent_queue_p50_s": statistics.median(queue),
        "urgent_queue_p99_s": percentile(queue, 99),
        "background_latency_s": bg,
        "background_max_s": max(bg.values()),
    }
    print(f"{label:24s} urgent: {len(queue):4d} done, queueing p50 {result['urgent_queue_p50_s']:6.2f} s, "
          f"p99 {result['urgent_queue_p99_s']:6.2f} s | background latency (s): "
          + " ".join(f"{v:6.1f}" for v in bg.values()), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", default="none", help="engine --quantization (default none)")
    ap.add_argument("--max-num-seqs", type=int, default=4, help="sequences admitted at once (default 4)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds the urgent stream runs (default 30)")
    ap.add_argument("--guard", type=float, default=8.0, help="starvation timeout of the guarded run, s (default 8)")
    ap.add_argument("--backlog", type=int, default=8, help="urgent requests kept waiting (default 8)")
    ap.add_argument("--background", type=int, default=4, help="background requests (default 4)")
    ap.add_argument("--input-len", type=int, default=32, help="prompt tokens (default 32)")
    ap.add_argument("--output-len", type=int, default=16, help="generated tokens, EOS ignored (default 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here as JSON")
    a = ap.parse_args()
    base = dict(model=a.model, quantization=a.quantization, max_num_seqs=a.max_num_seqs)
    configs = [
        ("fcfs", dict(base, scheduling_policy="fcfs")),
        ("priority, no guard", dict(base, scheduling_policy="priority", starvation_timeout=None)),
        (f"priority, guard {a.guard:g} s", dict(base, scheduling_policy="priority", starvation_timeout=a.guard)),
    ]
    results = [run(label, kw, a) for label, kw in configs]
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
