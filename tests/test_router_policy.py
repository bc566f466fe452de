"""The router's replica choice without any server: the prefix tree, the policies, the routing key, and the
command lines ``tokenmill serve --data-parallel-size`` gives its replicas."""

from __future__ import annotations

import random

import pytest

from tokenmill.server.routing_policy import Balancer, PrefixTree, RoutingConfig, routing_key

A, B, C = "http://a", "http://b", "http://c"
SYSTEM = "You are a meticulous assistant for the harbour office. " * 8


def _check(tree: PrefixTree) -> None:
    """Each tenant's size is the text of the nodes it labels, and its nodes hang from the root."""
    sizes: dict[str, int] = {}
    stack = [tree.root]
    while stack:
        n = stack.pop()
        for t in n.tenants:
            sizes[t] = sizes.get(t, 0) + len(n.text)
        for c in n.children.values():
            assert c.parent is n and c.text and set(c.tenants) <= set(n.tenants) and c.tenants
            stack.append(c)
    assert sizes == {t: s for t, s in tree.sizes.items()}


def test_the_tree_matches_the_longest_routed_prefix_per_replica():
    tree = PrefixTree()
    tree.insert(SYSTEM + "What time is high tide?", A)
    tree.insert(SYSTEM + "Is berth 4 free?", B)
    tree.insert("Something else entirely", B)
    _check(tree)
    m = tree.match(SYSTEM + "What time is low tide?")
    assert m[A] == len(SYSTEM + "What time is ") and m[B] == len(SYSTEM)
    assert tree.match("Something else") == {B: len("Something else")}
    assert tree.match("nothing shared") == {}
    assert tree.sizes[A] == len(SYSTEM + "What time is high tide?")
    assert tree.sizes[B] == len(SYSTEM + "Is berth 4 free?") + len("Something else entirely")
    # token-id prompts are one character per id, so a shared id prefix matches like text
    tree.insert(routing_key({"prompt": [1, 2, 3, 4, 5]}), C)
    assert tree.match(routing_key({"prompt": [1, 2, 3, 9]}))[C] == 3


def test_the_tree_evicts_least_recently_routed_leaves_first_and_forgets_a_replica():
    tree = PrefixTree(max_chars=1000)
    old, new = SYSTEM[:300] + "old question", SYSTEM[:300] + "new question"
    tree.insert(old, A)
    tree.insert("x" * 200, A)
    tree.insert(new, A)  # the newest
    tree.insert(old, B)
    assert tree.sizes[A] < 1000
    tree.insert("y" * 500, A)  # over the bound: down to 900 characters, the oldest leaves first
    _check(tree)
    assert tree.sizes[A] <= 900
    m = tree.match(new)
    assert m[A] == len(new) and tree.match("y" * 500)[A] == 500  # the recent ones stay
    assert A not in tree.match("x" * 200) and tree.match(old)[A] == 300  # the old leaves went, not their shared prefix
    assert tree.match(old)[B] == len(old)  # another replica's share is untouched
    tree.remove_tenant(A)
    _check(tree)
    assert A not in tree.sizes and tree.match(new) == {B: 300}
    tree.remove_tenant(A)  # twice is harmless


def test_the_tree_stays_consistent_under_random_inserts_and_evictions():
    rng = random.Random(0)
    tree = PrefixTree(max_chars=3000)
    stems = ["".join(rng.choice("abc") for _ in range(40)) for _ in range(6)]
    for i in range(400):
        text = rng.choice(stems) + "".join(rng.choice("abcd") for _ in range(rng.randrange(1, 80)))
        tenant = rng.choice([A, B, C])
        tree.insert(text, tenant)
        assert tree.match(text)[tenant] == len(text)  # what was just routed is matched whole
        assert tree.sizes[tenant] <= 3000
        if i % 97 == 0:
            tree.remove_tenant(rng.choice([A, B, C]))
    _check(tree)


def test_the_longest_prefix_wins_else_the_roomiest_replica():
    bal = Balancer([A, B, C])
    loads = {A: 0, B: 0, C: 0}
    first = bal.choose([A, B, C], loads, SYSTEM + "q1")
    assert first.reason == "smallest_tree" and first.matched == 0
    bal.routed(SYSTEM + "q1", first.target)
    again = bal.choose([A, B, C], {**loads, first.target: 5}, SYSTEM + "q2")  # busier, still balanced enough
    assert again.target == first.target and again.reason == "prefix_match" and again.matched == len(SYSTEM) + 1
    # a different prompt goes to a replica with nothing routed to it yet, not the one holding SYSTEM
    other = bal.choose([A, B, C], loads, "Translate to French: good morning")
    assert other.reason == "smallest_tree" and other.target != first.target
    # a match under --cache-threshold counts for nothing
    short = Balancer([A, B], RoutingConfig(cache_threshold=0.9))
    short.routed(SYSTEM, A)
    short.routed("z" * 10, B)  # B holds less text
    pick = short.choose([A, B], {A: 0, B: 0}, SYSTEM[:200] + "q" * 100)
    assert pick.target == B and pick.reason == "smallest_tree"
    # only the candidates count: where A failed, its match does not draw the request back
    assert bal.choose([B, C], loads, SYSTEM + "q3").target in (B, C)


def test_the_imbalance_bound_switches_to_the_least_loaded():
    bal = Balancer([A, B], RoutingConfig(balance_abs_threshold=4, balance_rel_threshold=1.5))
    bal.routed(SYSTEM, A)
    assert bal.choose([A, B], {A: 4, B: 0}, SYSTEM + "q").target == A  # a difference of 4 is within the bound
    c = bal.choose([A, B], {A: 5, B: 0}, SYSTEM + "q")
    assert (c.target, c.reason, c.matched) == (B, "load_imbalance", 0)
    assert bal.choose([A, B], {A: 15, B: 10}, SYSTEM + "q").target == A  # 5 apart, but not 1.5 x: balanced
    assert bal.choose([A, B], {A: 16, B: 10}, SYSTEM + "q").target == B


def test_round_robin_cycles_and_least_loaded_takes_the_idlest():
    rr = Balancer([A, B, C], RoutingConfig(policy="round-robin"))
    rr.routed(SYSTEM, A)
    picks = [rr.choose([A, B, C], {A: 0, B: 9, C: 0}, SYSTEM).target for _ in range(6)]
    assert picks == [A, B, C, A, B, C]  # neither load nor prefix matter
    assert [rr.choose([A, C], {}, "").target for _ in range(4)] == [A, C, A, C]  # B down: skipped
    ll = Balancer([A, B, C], RoutingConfig(policy="least-loaded"))
    ll.routed(SYSTEM, A)
    c = ll.choose([A, B, C], {A: 3, B: 1, C: 2}, SYSTEM)
    assert (c.target, c.reason) == (B, "least_loaded")
    assert {ll.choose([A, B, C], {A: 1, B: 1, C: 1}, "").target for _ in range(3)} == {A, B, C}  # ties in turn


def test_the_routing_key_and_bad_flags():
    chat = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]}
    parts = {"messages": [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                          {"role": "user", "content": "hi"}]}
    assert routing_key(chat) == routing_key(parts) and SYSTEM in routing_key(chat)
    longer = {"messages": [*chat["messages"], {"role": "assistant", "content": "hello"}]}
    assert routing_key(longer).startswith(routing_key(chat))  # a conversation extends its own key
    tools = routing_key({**chat, "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert tools != routing_key(chat)
    # different salts share nothing on the replicas, so nothing in the tree either
    assert not routing_key({**chat, "cache_salt": "s1"}).startswith(routing_key({**chat, "cache_salt": "s2"})[:3])
    assert routing_key({"prompt": ["first", "second"]}) == "first"
    assert routing_key({"prompt": 7}) == routing_key({}) == ""
    for bad, msg in ((dict(policy="random"), "--policy"), (dict(cache_threshold=1.5), "--cache-threshold"),
                     (dict(balance_rel_threshold=0.5), "--balance-rel-threshold"), (dict(max_tree_size=0), "tree")):
        with pytest.raises(ValueError, match=msg):
            RoutingConfig(**bad)


def test_the_router_refuses_mixed_or_missing_instances():
    from tokenmill.server.router import Router

    with pytest.raises(ValueError, match="cannot be combined"):
        Router([A], [B], replicas=[C])
    with pytest.raises(ValueError, match="--replica URLs, or at least one --prefill"):
        Router()
    with pytest.raises(ValueError, match="given twice"):
        Router(replicas=[A, A + "/"])
    r = Router(replicas=[A, B], routing=RoutingConfig(policy="round-robin"))
    a, b = r.replicas
    b.up = False  # a down replica only when nothing else is left
    assert r.pick_replica(set(), "")[0] is a and r.pick_replica({a}, "")[0] is b and r.pick_replica({a, b}, "") is None


def test_replicas_get_the_parents_serve_flags():
    from tokenmill.cli import build_parser
    from tokenmill.server.data_parallel import kv_share, replica_argv

    def serve(*argv):
        return build_parser().parse_args(["serve", *argv])

    a = serve("model.gguf", "--port", "9000", "--data-parallel-size", "2", "--router-policy", "round-robin",
              "--no-engine-core-process", "--served-model-name", "x", "--served-model-name", "y", "--max-n", "4",
              "--itl-target-ms", "0", "--disable-log-stats", "--kv-cache-memory", "0.3", "--api-key", "k",
              "--classifier-from-token", "no,yes")
    argv = replica_argv(a)
    assert "--port" not in argv and "--data-parallel-size" not in argv and "--kv-cache-memory" not in argv
    assert "k" not in argv  # the API key goes by environment
    again = serve(*argv)
    for k, v in vars(a).items():
        if k not in ("port", "data_parallel_size", "router_policy", "kv_cache_memory", "api_key", "func"):
            assert getattr(again, k) == v, k
    assert replica_argv(serve()) == []
    assert kv_share("0.3", 2) == "0.15" and kv_share("2GiB", 2) == "2GiB"
