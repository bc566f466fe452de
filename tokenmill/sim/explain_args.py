"""``tokenmill explain``'s flags, apart from sim/explain.py so that ``tokenmill --help`` imports nothing heavy."""

from __future__ import annotations

import argparse

WHAT_IF_FLAGS = ("--max-num-batched-tokens", "--max-num-seqs", "--[no-]enable-chunked-prefill",
                 "--scheduling-policy", "--itl-target-ms", "--slo-ttft-ms", "--slo-tpot-ms", "--kv-blocks",
                 "--speculative-method", "--num-speculative-tokens", "--speculative-acceptance-rate",
                 "--speculative-draft-cost")


def add_explain_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--request", required=True, metavar="ID", help="the request's id (the response's \"id\")")
    p.add_argument("--what-if", default=None, metavar="FLAGS",
                   help=f"replay also with these settings changed, one quoted string: {', '.join(WHAT_IF_FLAGS)} "
                        "(e.g. --what-if \"--max-num-batched-tokens 512 --max-num-seqs 16\")")
    p.add_argument("--api-key", default=None, help="the server's API key (default: $TOKENMILL_API_KEY)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")


def what_if_parser() -> argparse.ArgumentParser:
    w = argparse.ArgumentParser(prog="--what-if", add_help=False, exit_on_error=False)
    w.add_argument("--max-num-batched-tokens", type=int)
    w.add_argument("--max-num-seqs", type=int)
    w.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    w.add_argument("--scheduling-policy", choices=["fcfs", "priority"])
    w.add_argument("--itl-target-ms", type=float)
    w.add_argument("--slo-ttft-ms", type=float)
    w.add_argument("--slo-tpot-ms", type=float)
    w.add_argument("--kv-blocks", type=int)
    w.add_argument("--speculative-method", choices=["ngram", "draft", "off"])
    w.add_argument("--num-speculative-tokens", type=int)
    w.add_argument("--speculative-acceptance-rate", type=float)  # per draft; default: measured, else 0.8
    w.add_argument("--speculative-draft-cost", type=float)  # a draft pass over a target step of the same shape
    return w
