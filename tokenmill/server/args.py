"""Flags of ``tokenmill serve`` (no heavy imports: the CLI builds its parser with this)."""

from __future__ import annotations

import argparse

from tokenmill.server.reasoning import REASONING_PARSERS
from tokenmill.server.tool_parsers import TOOL_CALL_PARSERS


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="model to serve; same as --model (default: the embedded SmolLM2)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1, this machine only; 0.0.0.0 exposes it to the network)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, /metrics included "
                        "(a Prometheus scrape job sends it as its bearer token) (default: the TOKENMILL_API_KEY "
                        "environment variable; unset = no auth)")
    g.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                   help="model name clients must send (repeatable; the first is reported; default: the model's "
                        "name, e.g. smollm2-135m-instruct)")
    g.add_argument("--engine-core-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine core (scheduler + model) in its own process behind ZeroMQ, as vLLM does, "
                        "so HTTP, tokenization and streaming do not share its GIL and a crash of either side is "
                        "contained (default on; --no-engine-core-process runs it on a thread of the server's "
                        "process)")
    g.add_argument("--exit-on-engine-death", action=argparse.BooleanOptionalAction, default=True,
                   help="when the engine dies (an exception in a step, the core process killed): fail every "
                        "in-flight request, answer /health 503, and exit with status 1 after a second, for a "
                        "supervisor to restart (default on; --no-exit-on-engine-death keeps serving 503s)")
    g.add_argument("--restart-engine-core", action="store_true",
                   help="when the engine core process dies, fail its in-flight requests, start a fresh one and "
                        "keep serving (/health answers 503 while it loads) instead of exiting; after 3 restarts "
                        "within a minute the server gives up and exits. Needs --engine-core-process")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="serve N replicas of the model on this machine, each its own server process on a free "
                        "loopback port with these flags (the KV cache's share of memory, --kv-cache-memory as a "
                        "fraction, divided among them; the CPU's cores too), behind a router on --host/--port "
                        "that sends each request to the replica most likely to hold its prompt's prefix "
                        "(default 1: no router)")
    g.add_argument("--router-policy", default="prefix", choices=["prefix", "least-loaded", "round-robin"],
                   help="with --data-parallel-size: how the router picks a replica (default prefix; `tokenmill "
                        "router --help` explains each)")
    g.add_argument("--data-parallel-backend", "-dpb", default="mp", choices=["mp", "ray"],
                   help="where the --data-parallel-size replicas run: mp, processes on this machine (default); ray, "
                        "Ray actors placed on the Ray cluster's nodes (RAY_ADDRESS, or the cluster `ray start` "
                        "began on this machine, else a local one), each owning one server on its node's address, "
                        "the router here (pip install 'tokenmill[ray]')")
    g.add_argument("--ray-num-cpus-per-replica", type=float, default=1.0, metavar="N",
                   help="with --data-parallel-backend ray: the CPUs Ray reserves for each replica, and on the CPU "
                        "its threads (default 1)")
    g.add_argument("--max-waiting-requests", type=int, default=256,
                   help="bound on sequences waiting for the scheduler; beyond it requests get 503 (default 256)")
    g.add_argument("--max-n", type=int, default=8, help="largest n (completions per prompt) a request may ask "
                   "for (default 8)")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="largest logprobs / top_logprobs a request may ask for (default and maximum 20)")
    g.add_argument("--max-prompts", type=int, default=32,
                   help="most prompts in one batched /v1/completions request (default 32)")
    g.add_argument("--max-request-bytes", type=int, default=1 << 20,
                   help="largest request body in bytes; bigger ones get 413 (default 1048576 = 1 MiB)")
    g.add_argument("--request-body-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive, each part of it; a slower one gets 408 and "
                        "its connection closed, so slow clients cannot hold the server's connections (default 30)")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: stop admitting, give in-flight requests this many seconds to finish, "
                        "then abort them and exit (default 30)")
    g.add_argument("--tool-call-parser", default="hermes", choices=list(TOOL_CALL_PARSERS),
                   help="how tool_choice auto finds tool calls in the output: hermes (<tool_call>{...}</tool_call>: "
                        "Hermes, Qwen2.5, SmolLM2; default), llama3_json ({\"name\", \"parameters\"} objects), "
                        "mistral ([TOOL_CALLS] and a JSON list, or name[ARGS]{...}), pythonic ([f(x=1), g(y=\"z\")]: "
                        "Llama 3.2/4) or qwen3_xml (Qwen3-Coder's <tool_call><function=...><parameter=...>). "
                        "Only the content is searched, never the reasoning. tool_choice required or a named "
                        "function constrains the output instead")
    g.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                   help="send the model's thinking (between <think> and </think>) as reasoning_content, apart from "
                        "content: qwen3 (where the output opens with <think>; none with chat_template_kwargs "
                        "{\"enable_thinking\": false}) or deepseek_r1 (the output starts inside the thinking: all "
                        "up to </think> is reasoning). Default: none, the thinking stays in content")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template, as a file or the template itself, used instead of the model's for "
                        "/v1/chat/completions and /tokenize (default: the model's)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility: tool_choice auto is always on when a request has tools")
    g.add_argument("--dashboard", action=argparse.BooleanOptionalAction, default=True,
                   help="serve a live dashboard at /dashboard (charts of the last ten minutes: requests, KV cache, "
                        "TTFT/ITL percentiles, tokens/s, device busy and roofline use; the in-flight requests), "
                        "fed by the metrics read once a second; same auth as the API, a browser sends the key as "
                        "the Basic auth password (default on; --no-dashboard turns both off)")
    g.add_argument("--request-timelines", type=int, default=1000, metavar="N",
                   help="keep each request's timeline (every step it took part in with the step's whole batch, "
                        "preemptions and why, when its tokens went out) and the blame for its TTFT and slow "
                        "inter-token gaps, for the in-flight requests and the last N finished ones: "
                        "GET /v1/requests/{id}/timeline (the response's id; same auth as the API). Default 1000; "
                        "0 turns it off")
    g.add_argument("--live-replay-interval", type=float, default=60.0, metavar="SECONDS",
                   help="every this many seconds, replay the last 200 finished requests' arrivals and lengths "
                        "through the simulator with the step-cost model fitted on the served steps, and publish "
                        "its mean TTFT and TPOT beside the measured ones (tokenmill:replay_*_seconds on /metrics "
                        "and the dashboard): the simulator checking itself live. Needs request timelines. "
                        "Default 60; 0 turns it off")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export a trace per request to this OpenTelemetry collector over OTLP/HTTP (protobuf), e.g. "
                        "http://localhost:4318/v1/traces (a base address gets /v1/traces added): a root llm_request "
                        "span with vLLM's gen_ai.* attributes, a child of the caller's trace when the HTTP request "
                        "carries traceparent, and child spans for the queue, each prefill chunk, the decode, each "
                        "preemption and each KV transfer. Needs request timelines and pip install "
                        "'tokenmill[tracing]'")
    g.add_argument("--responses-store-size", type=int, default=1000, metavar="N",
                   help="keep the last N finished /v1/responses responses (least recently used out first) for "
                        "previous_response_id and GET/DELETE /v1/responses/{id}; a request with store false is not "
                        "kept. Default 1000; 0 turns storing off")
    g.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served from startup (with --enable-lora), each NAME=PATH (a PEFT adapter folder "
                        "or a llama.cpp GGUF LoRA file; or JSON {\"name\", \"path\"}): listed in /v1/models with the "
                        "base as parent, and a request whose model field names one runs with it. More load and "
                        "unload at run time through POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    g.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between throughput / queue / KV-usage log lines while busy (default 10; 0 = off)")
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic stats lines")
    g.add_argument("--step-log", default=None, metavar="FILE.jsonl",
                   help="write every engine step (start, duration, the tokens and context it computed) to this file "
                        "as JSON lines: what `tokenmill profile --from-step-log` fits the simulator's cost model to")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per finished request (id, tokens, TTFT, TPOT, finish reason)")
    g.add_argument("--disable-access-log", action="store_true", help="no uvicorn access log line per HTTP request")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log level (default info)")


def add_router_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``tokenmill router`` (server/router.py)."""
    p.add_argument("--replica", action="extend", nargs="+", default=None, metavar="URL",
                   help="plain replicas (`tokenmill serve` instances) to route whole requests to, e.g. "
                        "http://127.0.0.1:8101 (repeatable); or use --prefill and --decode")
    p.add_argument("--policy", default="prefix", choices=["prefix", "least-loaded", "round-robin"],
                   help="how a replica is chosen: prefix (default: the one the request's prompt prefix was sent to "
                        "before, by an approximate radix tree over the prompts' characters, unless the load is "
                        "imbalanced), least-loaded (fewest requests in flight and queued) or round-robin")
    p.add_argument("--cache-threshold", type=float, default=0.5,
                   help="prefix policy: the share of a prompt a replica's match must exceed for the request to go "
                        "there; below it, to the replica with the least text routed to it (default 0.5)")
    p.add_argument("--balance-abs-threshold", type=float, default=32,
                   help="prefix policy: the load is imbalanced (and the least loaded replica takes the request) "
                        "where the busiest and the idlest replica differ by more than this many requests ... "
                        "(default 32)")
    p.add_argument("--balance-rel-threshold", type=float, default=1.0001,
                   help="... and the busiest has more than this many times the idlest's load (default 1.0001)")
    p.add_argument("--max-tree-size", type=int, default=1 << 24,
                   help="prefix policy: characters of routed prompts remembered per replica; past it the least "
                        "recently routed ones are forgotten (default 16777216)")
    p.add_argument("--prefill", nargs="+", default=None, metavar="URL",
                   help="prefill instances (`tokenmill serve --kv-role producer`), e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", nargs="+", default=None, metavar="URL",
                   help="decode instances (`tokenmill serve --kv-role consumer`)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--api-key", default=None,
                   help="require this bearer key from clients and send it to the instances (default: "
                        "$TOKENMILL_API_KEY; unset = no auth)")
    p.add_argument("--poll-interval", type=float, default=1.0,
                   help="seconds between reads of every instance's /metrics for balancing (default 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a leg may take (default 600)")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
