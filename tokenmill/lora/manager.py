"""The engine core's adapters, managed like KV blocks: loaded adapters kept in host memory (``--max-cpu-loras``,
least recently used out first, never one a request still holds), and the ones a step runs in slots of the model's
working set (``--max-loras``, vLLM's GPU slots; least recently used out first). The scheduler admits no request
whose adapter would need a slot more than ``--max-loras`` hold (core/scheduler.py).

The model definition is not touched: ``LoRAManager`` wraps each decoder layer's qkv_proj, o_proj, gate_up_proj
and down_proj in a LoRALinear (layer.py) for the steps that have rows with an adapter, and puts the plain
projections back for the steps that have none, so those keep the fused layer kernels (which read the raw
weights: LlamaForCausalLM._fused_layers, DecoderLayer.fused_halves; a wrapped projection is not a
QuantizedLinear, so they run op by op while it is in place, and the two paths give the same bits)."""

from __future__ import annotations

import collections
import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.layers.kernels import cpu_kernels
from tokenmill.lora.adapter import LoRAError, projection_shapes, read_adapter
from tokenmill.lora.layer import LoRALinear, LoRAStep
from tokenmill.lora.request import LoRARequest, LoRAStats

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tokenmill.config import LoRAConfig, ModelConfig
    from tokenmill.lora.adapter import AdapterWeights

logger = logging.getLogger("tokenmill")


class LoRAManager:
    def __init__(self, model, model_config: ModelConfig, config: LoRAConfig, device: torch.device) -> None:
        """Wraps ``model``'s projections (a LlamaForCausalLM on one rank; anything else is refused)."""
        if getattr(model, "tp", None) is not None or getattr(model, "layer_range", (0, 0))[0] != 0 or \
                model_config.num_layers != len(getattr(model, "layers", ())):
            raise ValueError("--enable-lora runs on one rank: it is not built for --tensor-parallel-size or "
                             "--pipeline-parallel-size above 1 yet")
        if not all(hasattr(layer, "self_attn") and hasattr(layer.self_attn, "qkv_proj") for layer in model.layers):
            raise ValueError(f"--enable-lora applies to decoder models; this {model_config.architecture} model has no "
                             "q/k/v projections to adapt")
        self.model, self.model_config, self.config, self.device = model, model_config, config, device
        self.step_state = LoRAStep()
        ops = cpu_kernels() if device.type == "cpu" else None
        shapes = projection_shapes(model_config)
        # (parent module, attribute, layer, projection, wrapper)
        self.wrappers: list[tuple[object, str, int, str, LoRALinear]] = []
        for i, layer in enumerate(model.layers):
            places = [(layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj")]
            if not getattr(layer, "moe", False):
                places += [(layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")]
            for parent, attr in places:
                fan_in, outs = shapes[attr]
                self.wrappers.append((parent, attr, i, attr, LoRALinear(getattr(parent, attr), fan_in, outs,
                                                                        self.step_state, ops, config.max_loras)))
        self.host: collections.OrderedDict[int, AdapterWeights] = collections.OrderedDict()  # id -> weights, LRU
        self.users: dict[str, int] = {}  # request id -> the adapter id it holds
        self.pins: collections.Counter[int] = collections.Counter()
        self.slots: list[int | None] = [None] * config.max_loras  # slot -> adapter id
        self.slot_lru: collections.OrderedDict[int, int] = collections.OrderedDict()  # adapter id -> slot, LRU first
        self.installed: frozenset[int] = frozenset()  # wrappers in place (indexes into self.wrappers)
        self.holding: frozenset[int] = frozenset()  # wrappers that hold weights in some slot
        self.stats = LoRAStats(max_loras=config.max_loras)

    # ---- requests (the engine core) ------------------------------------------------------

    def acquire(self, request_id: str, lora: LoRARequest) -> str:
        """Hold ``lora`` for a request, loading it into host memory if it is not there (LoRAError if it cannot
        run); the adapter's digest, which keys its requests' prefix-cache blocks."""
        weights = self._load(lora)
        self.users[request_id] = lora.lora_int_id
        self.pins[lora.lora_int_id] += 1
        self._trim_host()  # (after the pin: never the adapter just loaded)
        return weights.digest

    def release(self, request_id: str) -> None:
        """A request ended (the scheduler's finish hook): its adapter may leave host memory."""
        lora_id = self.users.pop(request_id, None)
        if lora_id is not None:
            self.pins[lora_id] -= 1
            if self.pins[lora_id] <= 0:
                del self.pins[lora_id]
            self._trim_host()

    def _load(self, lora: LoRARequest) -> AdapterWeights:
        if not isinstance(lora, LoRARequest):
            raise LoRAError(f"lora_request must be a LoRARequest, got {type(lora).__name__}", "lora_request")
        weights = self.host.get(lora.lora_int_id)
        if weights is not None:
            if weights.path != str(Path(lora.lora_path).expanduser()):
                raise LoRAError(f"lora_int_id {lora.lora_int_id} is already loaded from {weights.path} (adapter "
                                f"{weights.name!r}); give {lora.lora_path} another id", "lora_request")
            self.host.move_to_end(lora.lora_int_id)
            return weights
        weights = read_adapter(lora.lora_path, self.model_config, self.config.max_lora_rank, lora.lora_name)
        self.host[lora.lora_int_id] = weights
        self.stats.host_loads += 1
        logger.info("LoRA adapter %r loaded from %s (rank %d, %.1f MiB)", lora.lora_name, weights.path,
                    weights.rank, weights.nbytes / 2**20)
        return weights

    def _trim_host(self) -> None:
        """Down to --max-cpu-loras, least recently used first; adapters that requests hold or that sit in a slot
        stay (--max-cpu-loras >= --max-loras: the slots' adapters always fit)."""
        for lora_id in list(self.host):
            if len(self.host) <= self.config.cpu_loras:
                break
            if lora_id not in self.pins and lora_id not in self.slot_lru:
                del self.host[lora_id]
                self.stats.host_evictions += 1

    # ---- a step (the model runner) -------------------------------------------------------

    @staticmethod
    def order_rows(order: list, num_decodes: int, states: dict) -> list:
        """The step's requests (decodes first) with the decodes, and the rest, grouped by adapter: each adapter's
        rows then come in at most two runs, which the wrapped projections take as slices."""
        def key(s) -> int:
            lora = states[s.request_id].lora
            return 0 if lora is None else lora.lora_int_id

        return sorted(order[:num_decodes], key=key) + sorted(order[num_decodes:], key=key)

    @contextlib.contextmanager
    def step(self, rows: list[tuple[LoRARequest | None, int]]) -> Iterator[None]:
        """Run the forward pass inside this with each request's adapter (or None) and number of rows, in the
        batch's row order."""
        used = {lora.lora_int_id for lora, _ in rows if lora is not None}
        if not used:
            self._install(False)
            yield
            return
        slot_of = self._activate(used)
        self._install(True)
        per_row = np.repeat([slot_of[lora.lora_int_id] if lora is not None else -1 for lora, _ in rows],
                            [n for _, n in rows])
        groups = []
        for slot in sorted(set(slot_of.values())):
            idx = np.flatnonzero(per_row == slot)
            starts = np.flatnonzero(np.diff(idx, prepend=-2) != 1)  # the runs of consecutive rows
            runs = [(int(idx[a]), int(idx[b - 1]) + 1) for a, b in zip(starts, [*starts[1:], len(idx)])]
            groups.append((slot, runs, None if len(runs) == 1 else torch.from_numpy(idx).to(self.device)))
        self.step_state.groups = groups
        try:
            yield
        finally:
            self.step_state.groups = []

    @torch.inference_mode()
    def _activate(self, used: set[int]) -> dict[int, int]:
        """Every adapter of the step in a slot (loading the missing ones, evicting the least recently used ones
        the step does not use); adapter id -> slot."""
        if len(used) > self.config.max_loras:
            raise RuntimeError(f"a step with {len(used)} adapters, over --max-loras {self.config.max_loras} (the "
                               "scheduler admits no more)")
        missing = [i for i in sorted(used) if i not in self.slot_lru]
        for i in used & set(self.slot_lru):
            self.slot_lru.move_to_end(i)
        if missing:
            for i in missing:
                if i not in self.host:
                    raise RuntimeError(f"LoRA adapter id {i} runs in a step but is not loaded (no request holds it)")
            for i in missing:
                slot = next((s for s, held in enumerate(self.slots) if held is None), None)
                if slot is None:
                    victim = next(v for v in self.slot_lru if v not in used)
                    slot = self.slot_lru.pop(victim)
                    self.stats.slot_evictions += 1
                self.slots[slot] = i
                self.slot_lru[i] = slot
                self._write(slot, i)
                self.stats.slot_loads += 1
            self.holding = frozenset(k for k, (*_, w) in enumerate(self.wrappers)
                                     if any(s is not None for s in w.slots))
            self._trim_host()
        return {i: self.slot_lru[i] for i in used}

    def _write(self, slot: int, lora_id: int) -> None:
        weights = self.host[lora_id]
        for _, _, layer, module, w in self.wrappers:
            w.write(slot, weights.modules.get((layer, module)), self.device)

    def _install(self, on: bool) -> None:
        """The wrappers holding an adapter's weights in place (on), or every plain projection back (off); the
        model's fused kernels' cached arguments are dropped so that they see the change."""
        want = self.holding if on else frozenset()
        if want == self.installed:
            return
        for k, (parent, attr, *_, w) in enumerate(self.wrappers):
            setattr(parent, attr, w if k in want else w.base)
        self.installed = want
        self.model.set_layer_fusion(self.model.layers[0].fuse)  # (keeps the setting; resets the cached halves)

    def lora_stats(self, running, waiting) -> LoRAStats:
        """The step's LoRAStats from the scheduler's running and waiting requests."""
        def count(reqs) -> dict[str, int]:
            return dict(collections.Counter(r.lora_request.lora_name for r in reqs if r.lora_request is not None))

        s = self.stats
        return LoRAStats(count(running), count(waiting), s.max_loras, s.host_loads, s.slot_loads,
                         s.host_evictions, s.slot_evictions)


def lora_salt(digest: str, cache_salt: str | None) -> str:
    """A request's prefix-cache salt with its adapter's identity in it: requests with different adapters (or one
    with and one without) never share a KV block, the same adapter (the same files) shares as usual."""
    return f"lora:{digest}" + ("" if cache_salt is None else f"\0{cache_salt}")
