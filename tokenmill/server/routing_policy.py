"""Which replica a request goes to: round robin, least loaded, or the one most likely to hold its prefix.

The prefix policy is SGLang's cache-aware router. The router has no tokenizer, so it matches characters:
an approximate radix tree over the prompts' text (completions) or the chat messages as the router sees
them (role and content of each, tools first), every node labelled with the replicas it was routed to and
when. A request goes to the replica whose routed prompts share the longest prefix with it, if that
match covers more than ``cache_threshold`` of the prompt, else to the replica with the least text in the
tree (the most room in its cache). Both give way to load: where the busiest and the idlest replica
differ by more than ``balance_abs_threshold`` requests and by a factor above ``balance_rel_threshold``,
the least loaded one takes it. Each replica's share of the tree is bounded (``max_tree_size``
characters); past it, its least recently routed leaves go first, as the replica's own LRU cache would.

Characters, not token ids, so the match is approximate at the edges (a token may straddle the matched
prefix's end) but needs no tokenizer and matches what the replicas' block hashes share: a common text
prefix is a common token prefix up to the last token or so.
"""

from __future__ import annotations

import heapq
import itertools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

POLICIES = ("prefix", "least-loaded", "round-robin")


def _common_prefix(a: str, b: str, start: int) -> int:
    """The length of the common prefix of ``a`` and ``b[start:]`` (slice comparisons: C speed)."""
    n = min(len(a), len(b) - start)
    if b.startswith(a[:n], start):
        return n
    lo, hi = 0, n  # a[:lo] matches, a[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if b.startswith(a[:mid], start):
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("text", "parent", "children", "tenants")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text
        self.parent = parent
        self.children: dict[str, _Node] = {}  # by first character
        self.tenants: dict[str, int] = {}  # replica -> when it was last routed text through here


class PrefixTree:
    """A radix tree over characters shared by all replicas ("tenants"). A tenant's nodes form a subtree
    from the root (inserting labels the whole path; eviction takes leaves first), so the deepest node
    carrying a tenant ends its match."""

    def __init__(self, max_chars: int = 1 << 24) -> None:
        self.root = _Node("", None)
        self.max_chars = max_chars  # per tenant
        self.sizes: dict[str, int] = {}
        self._clock = itertools.count(1)

    def match(self, text: str) -> dict[str, int]:
        """Per tenant, how many leading characters of ``text`` its routed prompts share (absent: none)."""
        node, i, matched = self.root, 0, {}
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            k = _common_prefix(child.text, text, i)
            for t in child.tenants:
                matched[t] = i + k
            if k < len(child.text):
                break
            node, i = child, i + k
        return matched

    def insert(self, text: str, tenant: str) -> None:
        now = next(self._clock)
        node, i = self.root, 0
        node.tenants[tenant] = now
        self.sizes.setdefault(tenant, 0)
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                child = node.children[text[i]] = _Node(text[i:], node)
                k = len(child.text)
            else:
                k = _common_prefix(child.text, text, i)
                if k < len(child.text):
                    child = self._split(child, k)
            if tenant not in child.tenants:
                self.sizes[tenant] += len(child.text)
            child.tenants[tenant] = now
            node, i = child, i + k
        if self.sizes[tenant] > self.max_chars:
            self.evict(tenant, int(self.max_chars * 0.9))  # to a low-water mark: a full walk is not per insert

    @staticmethod
    def _split(node: _Node, k: int) -> _Node:
        """Cut ``node``'s text after ``k`` characters; the new upper node (same tenants) is returned."""
        upper = _Node(node.text[:k], node.parent)
        upper.tenants = dict(node.tenants)
        node.parent.children[upper.text[0]] = upper
        node.text, node.parent = node.text[k:], upper
        upper.children[node.text[0]] = node
        return upper

    def _nodes(self, tenant: str) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(c for c in n.children.values() if tenant in c.tenants)
        return out

    def _drop(self, node: _Node, tenant: str) -> None:
        del node.tenants[tenant]
        self.sizes[tenant] -= len(node.text)
        if not node.tenants:  # nobody's: its children (subsets of its tenants) are gone already
            del node.parent.children[node.text[0]]

    def evict(self, tenant: str, target: int) -> None:
        """Drop ``tenant``'s least recently routed leaves until its text is at most ``target`` characters."""
        def is_leaf(n: _Node) -> bool:
            return n is not self.root and not any(tenant in c.tenants for c in n.children.values())

        heap = [(n.tenants[tenant], id(n), n) for n in self._nodes(tenant) if is_leaf(n)]
        heapq.heapify(heap)
        while self.sizes[tenant] > target and heap:
            _, _, n = heapq.heappop(heap)
            self._drop(n, tenant)
            if is_leaf(n.parent) and tenant in n.parent.tenants:
                heapq.heappush(heap, (n.parent.tenants[tenant], id(n.parent), n.parent))

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything routed to ``tenant`` (a replica that went away lost its cache)."""
        if tenant not in self.root.tenants:
            return
        for n in reversed(self._nodes(tenant)):  # children before their parents
            if n is self.root:
                del n.tenants[tenant]
            else:
                self._drop(n, tenant)
        del self.sizes[tenant]


@dataclass
class RoutingConfig:
    """``tokenmill router``'s policy flags (SGLang's names and meanings; defaults as its router's)."""
    policy: str = "prefix"
    cache_threshold: float = 0.5
    balance_abs_threshold: float = 32
    balance_rel_threshold: float = 1.0001
    max_tree_size: int = 1 << 24  # characters per replica

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"--cache-threshold must be within [0, 1], not {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("--balance-abs-threshold must be >= 0 and --balance-rel-threshold >= 1")
        if self.max_tree_size < 1:
            raise ValueError(f"--max-tree-size must be a positive number of characters, not {self.max_tree_size}")


@dataclass
class Choice:
    target: str
    reason: str  # prefix_match | smallest_tree | load_imbalance | least_loaded | round_robin
    matched: int  # characters of the prompt the tree matched on the target


class Balancer:
    """Chooses among replicas by a RoutingConfig. The tree is kept under every policy, so the router
    reports how much of each prompt the replica it went to had seen, whatever chose it."""

    def __init__(self, replicas: Sequence[str], config: RoutingConfig | None = None) -> None:
        self.order = list(replicas)
        self.config = config or RoutingConfig()
        self.tree = PrefixTree(self.config.max_tree_size)
        self._next = 0  # round robin's position in ``order``

    def _rotate(self, candidates: Sequence[str]) -> list[str]:
        """The candidates in round-robin order from the current turn, which then advances past the first."""
        n = len(self.order)
        ranked = [self.order[(self._next + k) % n] for k in range(n)]
        ranked = [u for u in ranked if u in candidates]
        self._next = (self.order.index(ranked[0]) + 1) % n
        return ranked

    def choose(self, candidates: Sequence[str], loads: Mapping[str, float], key: str) -> Choice:
        """The replica for a request whose routing key is ``key``, among ``candidates`` (the live ones not
        tried yet), given each one's load (requests in flight and queued)."""
        if not candidates:
            raise ValueError("no replica to choose from")
        cfg = self.config
        matched = self.tree.match(key) if key else {}
        turn = {u: i for i, u in enumerate(self._rotate(candidates))}  # ties: in turn
        if cfg.policy == "round-robin":
            target = min(candidates, key=turn.__getitem__)
            return Choice(target, "round_robin", matched.get(target, 0))
        by_load = min(candidates, key=lambda u: (loads.get(u, 0.0), turn[u]))
        if cfg.policy == "least-loaded":
            return Choice(by_load, "least_loaded", matched.get(by_load, 0))
        busiest, idlest = max(loads.get(u, 0.0) for u in candidates), loads.get(by_load, 0.0)
        if busiest - idlest > cfg.balance_abs_threshold and busiest > idlest * cfg.balance_rel_threshold:
            return Choice(by_load, "load_imbalance", matched.get(by_load, 0))
        best = min(candidates, key=lambda u: (-matched.get(u, 0), loads.get(u, 0.0), turn[u]))
        if key and matched.get(best, 0) / len(key) > cfg.cache_threshold:
            return Choice(best, "prefix_match", matched[best])
        roomy = min(candidates, key=lambda u: (self.tree.sizes.get(u, 0), loads.get(u, 0.0), turn[u]))
        return Choice(roomy, "smallest_tree", matched.get(roomy, 0))

    def routed(self, key: str, target: str) -> None:
        """``target`` took a request: the tree learns its prompt."""
        if key:
            self.tree.insert(key, target)

    def forget(self, target: str) -> None:
        self.tree.remove_tenant(target)


# ---- what a request is matched on ---------------------------------------------------------

_TOKEN_BASE = 0x10000  # token ids as characters beyond the BMP's text, one each (ids up to ~1M)


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text, in order
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else json.dumps(content, sort_keys=True)


def _prompt_text(prompt: object) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return "".join(chr(_TOKEN_BASE + t) for t in prompt if 0 <= t < 0x10FFFF - _TOKEN_BASE)
        return _prompt_text(prompt[0])  # a batch goes where its first prompt does
    return ""


def routing_key(body: dict) -> str:
    """The text a request is matched on: the completion prompt (token ids as one character each; a batch
    by its first prompt), or the chat's tools then each message's role and content. A ``cache_salt``
    comes first, since the replicas share no cached block across salts."""
    if "messages" in body:
        parts = [json.dumps(body["tools"], sort_keys=True)] if body.get("tools") else []
        for m in body["messages"] if isinstance(body["messages"], list) else ():
            if isinstance(m, dict):
                parts.append(f"<{m.get('role', '')}>{_text(m.get('content'))}")
        text = "\n".join(parts)
    else:
        text = _prompt_text(body.get("prompt"))
    salt = body.get("cache_salt")
    return f"{salt}\x00{text}" if isinstance(salt, str) and salt else text
