"""What ``tokenmill router`` says on its /metrics: its own counters, and each instance's state as it
balances on it (server/router.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenmill.server.metrics import TTFT_BUCKETS

if TYPE_CHECKING:
    from collections.abc import Callable


@dataclass(eq=False)
class Instance:
    url: str
    role: str  # "prefill" | "decode" | "replica"
    inflight: int = 0  # this router's requests on it now
    load: float = 0.0  # running + waiting (+ waiting for KV) at its last /metrics poll
    kv_usage: float = 0.0
    up: bool = True
    kv_recv_seconds: float = 0.0  # a consumer's KV pulls so far, at its last poll: their time and number
    kv_recv_count: float = 0.0
    prefix_cache_hits: float = 0.0  # its own prefix cache's counters (tokens), at its last poll
    prefix_cache_queries: float = 0.0


class RouterMetrics:
    def __init__(self, instances: list[Instance], tree_size: Callable[[str], float]) -> None:
        reg = self.registry = CollectorRegistry()
        self.requests = Counter("tokenmill:router_requests", "Legs sent to each instance, by outcome (ok, "
                                "client_error, failed: retried elsewhere).", ["role", "instance", "outcome"],
                                registry=reg)
        self.retries = Counter("tokenmill:router_retries", "Legs retried on another instance after one failed.",
                               ["role"], registry=reg)
        self.stream_failures = Counter("tokenmill:router_stream_failures", "Streams cut off by their instance "
                                       "failing after the first event was relayed (the client got an error event).",
                                       ["role", "instance"], registry=reg)
        self.prefill_s = Histogram("tokenmill:router_prefill_seconds", "Prefill leg: from the client's request to "
                                   "the producer's answer (queueing and prefill on the producer).", buckets=TTFT_BUCKETS,
                                   registry=reg)
        self.decode_first_s = Histogram("tokenmill:router_decode_first_byte_seconds", "Decode leg: from sending it "
                                        "to the consumer's first streamed event (KV transfer, the prompt's last "
                                        "token and queueing on the consumer; unstreamed: the whole answer).",
                                        buckets=TTFT_BUCKETS, registry=reg)
        self.ttft_s = Histogram("tokenmill:router_time_to_first_token_seconds", "Streaming requests: from the "
                                "client's request to the first content event relayed.", buckets=TTFT_BUCKETS,
                                registry=reg)
        # replicas: how much of each routed prompt the router's tree had already sent to the replica it chose
        # (matched / prompt characters is the router's prefix-hit rate per replica)
        self.prompt_chars = Counter("tokenmill:router_prompt_chars", "Characters of the routing keys (prompts, "
                                    "chat messages) sent to each replica.", ["instance"], registry=reg)
        self.matched_chars = Counter("tokenmill:router_prefix_match_chars", "Of those, the leading characters the "
                                     "router's prefix tree had routed to the same replica before.", ["instance"],
                                     registry=reg)
        self.decisions = Counter("tokenmill:router_routing_decisions", "Replica choices by the rule that made them: "
                                 "prefix_match, smallest_tree, load_imbalance, least_loaded, round_robin.",
                                 ["reason"], registry=reg)
        up = Gauge("tokenmill:router_instance_up", "1 if the instance answered its last poll or leg.",
                   ["role", "instance"], registry=reg)
        load = Gauge("tokenmill:router_instance_load", "The instance's load as the router balances on it: its "
                     "router requests in flight plus its running and waiting requests at the last poll.",
                     ["role", "instance"], registry=reg)
        # the consumers' KV pulls, summed at the last poll: with the two histograms above, TTFT's split into
        # prefill, transfer and first decode (`tokenmill bench serve` reports it)
        decode = [i for i in instances if i.role == "decode"]
        Gauge("tokenmill:router_kv_transfer_time_seconds", "The decode instances' KV pulls: seconds in all, as "
              "their /metrics said at the last poll.", registry=reg).set_function(
            lambda: sum(i.kv_recv_seconds for i in decode))
        Gauge("tokenmill:router_kv_transfers", "The decode instances' KV pulls: how many, at the last poll.",
              registry=reg).set_function(lambda: sum(i.kv_recv_count for i in decode))
        for inst in instances:
            up.labels(inst.role, inst.url).set_function(lambda i=inst: float(i.up))
            load.labels(inst.role, inst.url).set_function(lambda i=inst: i.inflight + i.load)
        replicas = [i for i in instances if i.role == "replica"]
        if replicas:
            tree = Gauge("tokenmill:router_tree_chars", "Characters of the router's prefix tree routed to each "
                         "replica (bounded by --max-tree-size).", ["instance"], registry=reg)
            hits = Gauge("tokenmill:router_instance_prefix_cache_hits", "The replica's own "
                         "vllm:prefix_cache_hits_total (tokens) at the last poll.", ["instance"], registry=reg)
            queries = Gauge("tokenmill:router_instance_prefix_cache_queries", "The replica's own "
                            "vllm:prefix_cache_queries_total (tokens) at the last poll.", ["instance"], registry=reg)
            for inst in replicas:
                tree.labels(inst.url).set_function(lambda u=inst.url: tree_size(u))
                hits.labels(inst.url).set_function(lambda i=inst: i.prefix_cache_hits)
                queries.labels(inst.url).set_function(lambda i=inst: i.prefix_cache_queries)
                for reason in ("ok", "client_error", "failed"):
                    self.requests.labels("replica", inst.url, reason)
                self.prompt_chars.labels(inst.url)
                self.matched_chars.labels(inst.url)
