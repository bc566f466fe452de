"""Pipeline parallelism (``--pipeline-parallel-size P``): the decoder layers split into P contiguous
stages, one process each (or T tensor-parallel processes each, with ``--tensor-parallel-size T``), with
several steps in flight so that every stage has work.

Stage s holds layers ``stage_layers(L, s, P)`` and the KV cache of those layers only; every stage keeps
the embedding, final norm and head (stage 0 embeds, the last stage computes logits; a tied head is the
embedding, so both ends need it). Global rank = stage x T + tensor-parallel rank; rank 0 (stage 0) is
the driver, which schedules and samples.

Steps in flight (``--pipeline-batches-in-flight``, default P; vLLM's virtual engines / batch queue): rank 0
runs stage 0 of a step, sends its hidden states on and returns at once (PendingLogits), so the engine can
schedule the next step, of other requests, while the later stages work on the first (engine/core.py; the
scheduler spreads the running requests over P lanes, one per step in flight, and never schedules or
preempts a request whose step is in flight). With equal stages and P steps in flight no stage waits in
the steady state. Each stage runs the steps in the order rank 0 launched them, so a block freed by an
abort while its step is in flight is written by a later step only after it.

Within a step, its requests may also be cut into m micro-batches (``--pipeline-micro-batches``, default
1; whole requests, balanced by tokens) run GPipe-style: stage 0 sends micro-batch 1 on and starts
micro-batch 2 while stage 1 works on the first. One step alone takes m + P - 1 stage turns of which each
stage is busy m: its bubble is (P - 1) / (m + P - 1).

Transport: point-to-point send/recv (gloo on the CPU, NCCL on GPUs), raw tensors of a known shape,
counted in bytes (TPGroup.send_bytes): hidden states forward on the compute group, logits and expert
counts back to rank 0 on a group of their own (TPGroup.back), so that each direction's messages between
two ranks are matched in the order they were posted, as NCCL matches them; gloo also matches their tags
(pass and micro-batch: forward_tag). The driver's step messages go point to point too, on the control
group (executor.post_message), since a stage may still be busy with earlier steps.
"""

from __future__ import annotations

import dataclasses
import re
import time

import torch

from tokenmill.config import ModelConfig


def stage_layers(num_layers: int, stage: int, p: int, head: float = 0.0) -> tuple[int, int]:
    """[first, last) of the layers stage ``stage`` of ``p`` holds: contiguous, every stage at least one,
    balanced so that each stage's layers (the last stage's plus the output head, worth ``head`` layers)
    come to about the same; with head 0, sizes differ by at most 1."""
    total = num_layers + head
    bounds = [0]
    for s in range(1, p):
        bounds.append(min(max(int(s * total // p), bounds[-1] + 1), num_layers - (p - s)))
    bounds.append(num_layers)
    return bounds[stage], bounds[stage + 1]


def head_layers(cfg: ModelConfig) -> float:
    """The output head's weights in decoder layers' worth, what a decode step reads of each (the last
    stage runs the head, so it gets fewer layers: SmolLM2-135M's 49,152 x 576 head is 8 of its layers)."""
    d = cfg.hidden_size
    attn = d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    width = (cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size
             if cfg.num_experts else cfg.intermediate_size)
    return cfg.vocab_size * d / (attn + 3 * d * width)


def model_stage_layers(cfg: ModelConfig, stage: int, p: int) -> tuple[int, int]:
    """The layers of a model's stage, balanced with its head on the last stage."""
    return stage_layers(cfg.num_layers, stage, p, head_layers(cfg))


def check_pipeline_parallel(cfg: ModelConfig, p: int) -> None:
    if p > cfg.num_layers:
        raise ValueError(f"--pipeline-parallel-size {p} exceeds the model's {cfg.num_layers} layers: each stage "
                         f"needs at least one; use --pipeline-parallel-size {cfg.num_layers} or fewer")


def stage_config(cfg: ModelConfig, first: int, last: int) -> ModelConfig:
    """The config of a stage holding layers [first, last): its layer count and per-layer settings."""
    return dataclasses.replace(cfg, num_layers=last - first,
                               layer_windows=cfg.layer_windows[first:last] if cfg.layer_windows else (),
                               no_rope_layers=cfg.no_rope_layers[first:last],
                               dense_layers=tuple(i - first for i in cfg.dense_layers if first <= i < last))


_LAYER = re.compile(r"^((?:model\.)?layers\.)(\d+)\.")


def stage_name(name: str, first: int, last: int) -> str | None:
    """A checkpoint tensor's name in a stage holding layers [first, last) (layers renumbered from 0), or
    None for another stage's layer."""
    m = _LAYER.match(name)
    if m is None:
        return name
    i = int(m.group(2))
    if not first <= i < last:
        return None
    return f"{m.group(1)}{i - first}.{name[m.end():]}"


def micro_batches(order: list, m: int) -> list[list]:
    """``order`` (decodes first) cut into at most m contiguous groups of whole requests, each with about
    1/m of the tokens; every group keeps the decodes-first layout."""
    total = sum(len(s.token_ids) for s in order)
    m = max(1, min(m, len(order)))
    groups: list[list] = [[]]
    done = 0
    for i, s in enumerate(order):
        left = len(order) - i  # requests still to place, counting s
        if groups[-1] and len(groups) < m and (done >= total * len(groups) / m or left <= m - len(groups)):
            groups.append([])
        groups[-1].append(s)
        done += len(s.token_ids)
    return groups


def bubble_fraction(p: int, m: int) -> float:
    """The share of a step each stage idles with m equal micro-batches over p equal stages."""
    return (p - 1) / (m + p - 1)


class PendingLogits:
    """Rank 0's side of a forward pass in flight through the stages: its sends, the logits rows the last
    stage will send back and (mixture of experts) each later stage's routed-token counts. wait() returns
    the logits once they are all in."""

    def __init__(self, group, out: torch.Tensor, recvs: list, sends: list, counts: list) -> None:
        self.group, self.out, self.recvs, self.sends, self.counts = group, out, recvs, sends, counts

    def wait(self) -> torch.Tensor:
        t = time.perf_counter()
        for work, index, part in self.recvs:
            work.wait()
            self.out[index] = part
        for work, stage, counts in self.counts:
            work.wait()
            new = counts.tolist()
            acc = self.group.stage_expert_counts.setdefault(stage, [[0] * len(new[0]) for _ in new])
            for row, add in zip(acc, new):
                row[:] = [a + b for a, b in zip(row, add)]
        for work, _ in self.sends:
            work.wait()
        self.group.recv_wait_s += time.perf_counter() - t
        return self.out


EXPERT_COUNTS = 1023  # forward_tag's micro-batch slot for a stage's per-expert counts


def later_stages_expert_tokens(model, group) -> list[list[int]]:
    """Rank 0: the later stages' routed tokens per layer and expert since the last call, in layer order
    after stage 0's ([] for a dense layer, as LlamaForCausalLM.take_expert_tokens gives them), restarted."""
    whole, out = model.whole_cfg, []
    for s in range(1, group.num_stages):
        first, last = model_stage_layers(whole, s, group.num_stages)
        counts = group.stage_expert_counts.pop(s, None) or [[0] * whole.num_experts for _ in range(last - first)]
        out += [row if whole.is_moe_layer(first + i) else [] for i, row in enumerate(counts)]
    return out


def forward_tag(seq: int, micro_batch: int) -> int:
    """The point-to-point tag of forward pass ``seq``'s micro-batch: unique among the passes in flight."""
    return (seq % 2**16) * 1024 + micro_batch % 1024


def pipelined_forward(runner, group, order: list, logits_rows: list[int], m: int) -> PendingLogits | None:
    """This stage's part of one forward pass (every rank calls it with the same ``order``, passes in the
    same sequence). Rank 0 runs its stage and returns at once with the pass in flight (PendingLogits: the
    logits for ``logits_rows`` of the flat batch arrive later), so that the engine can schedule and start
    the next step meanwhile; the other stages return None once their part is sent."""
    model, stage, p = runner.model, group.stage, group.num_stages
    t = group.size // p  # tensor-parallel ranks a stage: each sends to its counterpart in the next stage
    seq = group.forward_seq = group.forward_seq + 1
    plan, off = [], 0
    for mb in micro_batches(order, m):
        n = sum(len(s.token_ids) for s in mb)
        rows = [(j, r - off) for j, r in enumerate(logits_rows) if off <= r < off + n]
        plan.append((mb, n, rows))
        off += n
    # (the activations' dtype is the norms': a quantized embedding's .weight would dequantize the table)
    hidden, dtype, dev = model.cfg.hidden_size, model.norm.weight.dtype, runner.device
    recvs, counts = [], []
    experts = model.cfg.num_experts
    if group.rank == 0:  # posted first: the last stage's sends complete whatever rank 0 is doing then (in
        # the order each stage sends them: its logits, then its expert counts)
        vocab = model.cfg.vocab_size
        out = torch.empty(len(logits_rows), vocab, dtype=torch.float32, device=dev)
        for k, (_, _, rows) in enumerate(plan):
            if rows:
                part = torch.empty(len(rows), vocab, dtype=torch.float32, device=dev)
                index = torch.tensor([j for j, _ in rows], dtype=torch.long, device=dev)
                recvs.append((group.irecv_back(part, (p - 1) * t, forward_tag(seq, k)), index, part))
        for s in range(1, p) if experts else ():  # each later stage's routed tokens (/metrics: every layer's)
            first, last = model_stage_layers(model.whole_cfg, s, p)
            buf = torch.empty(last - first, experts, dtype=torch.long, device=dev)
            counts.append((group.irecv_back(buf, s * t, forward_tag(seq, EXPERT_COUNTS)), s, buf))
    else:
        # this stage's sends of the previous pass: done once the next stage took them (it runs in order)
        for work, _ in group.pending_sends:
            work.wait()
    sends = []  # (work, tensor): sends in flight, their buffers kept alive until they complete
    for k, (mb, n, rows) in enumerate(plan):
        input_ids, positions, meta = runner.inputs(mb)
        if stage == 0:
            x = model.embed(input_ids)
        else:
            x = group.recv(torch.empty(n, hidden, dtype=dtype, device=dev), group.rank - t, forward_tag(seq, k))
        x = model.run_layers(x, positions, runner.kv_caches, meta)
        if stage < p - 1:
            sends.append((group.send(x, group.rank + t, forward_tag(seq, k)), x))
        elif rows:  # the last stage (never stage 0: p > 1); its ranks gather the vocabulary, the first sends
            logits = model.compute_logits(x, torch.tensor([r for _, r in rows], dtype=torch.long, device=dev))
            if group.rank == (p - 1) * t:
                sends.append((group.send(logits, 0, forward_tag(seq, k), back=True), logits))
    if group.rank == 0:
        return PendingLogits(group, out, recvs, sends, counts)
    if experts and group.rank % t == 0:  # (a stage's tensor-parallel ranks all count every token)
        c = model.expert_counts().to(dev)
        sends.append((group.send(c, 0, forward_tag(seq, EXPERT_COUNTS), back=True), c))
    group.pending_sends = sends
    return None
