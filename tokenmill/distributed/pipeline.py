"""Pipeline parallelism (``--pipeline-parallel-size P``): the decoder layers split into P contiguous
stages, one process each, with several micro-batches of a step in flight so that stages overlap.

Stage s holds layers ``stage_layers(L, s, P)`` and the KV cache of those layers only; every stage keeps
the embedding, final norm and head (stage 0 embeds, the last stage computes logits; a tied head is the
embedding, so both ends need it). A step's requests are cut into m micro-batches (whole requests,
balanced by tokens; ``--pipeline-micro-batches``, default P) and run GPipe-style: stage 0 embeds and runs
micro-batch 1, sends its hidden states to stage 1 and goes on with micro-batch 2 while stage 1 works on
the first, and so on; the last stage sends each micro-batch's logits rows back to rank 0, which samples.
With equal stages a step takes m + P - 1 stage-times of which each stage is busy m: the bubble is
(P - 1) / (m + P - 1). (vLLM overlaps steps instead, one scheduler per in-flight batch, which also hides
the end of each step; not built here: a request's next step needs its sampled token.)

Transport: point-to-point send/recv on the parallel group's compute group (gloo on the CPU, NCCL on
GPUs), raw tensors of a known shape, counted in bytes (TPGroup.send_bytes).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from tokenmill.config import ModelConfig


def stage_layers(num_layers: int, stage: int, p: int) -> tuple[int, int]:
    """[first, last) of the layers stage ``stage`` of ``p`` holds (contiguous, sizes differ by at most 1)."""
    return stage * num_layers // p, (stage + 1) * num_layers // p


def check_pipeline_parallel(cfg: ModelConfig, p: int) -> None:
    if p > cfg.num_layers:
        raise ValueError(f"--pipeline-parallel-size {p} exceeds the model's {cfg.num_layers} layers: each stage "
                         f"needs at least one; use --pipeline-parallel-size {cfg.num_layers} or fewer")


def stage_config(cfg: ModelConfig, first: int, last: int) -> ModelConfig:
    """The config of a stage holding layers [first, last): its layer count and per-layer settings."""
    return dataclasses.replace(cfg, num_layers=last - first,
                               layer_windows=cfg.layer_windows[first:last] if cfg.layer_windows else (),
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


def pipelined_forward(runner, group, order: list, logits_rows: list[int], m: int) -> torch.Tensor | None:
    """This stage's part of one forward pass (every rank calls it with the same ``order``); rank 0 gets
    the logits for ``logits_rows`` of the flat batch, the other stages None."""
    model, rank, p = runner.model, group.rank, group.size
    plan, off = [], 0
    for mb in micro_batches(order, m):
        n = sum(len(s.token_ids) for s in mb)
        rows = [(j, r - off) for j, r in enumerate(logits_rows) if off <= r < off + n]
        plan.append((mb, n, rows))
        off += n
    # (the activations' dtype is the norms': a quantized embedding's .weight would dequantize the table)
    hidden, dtype, dev = model.cfg.hidden_size, model.norm.weight.dtype, runner.device
    pending = []  # (work, tensor): sends in flight, their buffers kept alive until they complete
    for tag, (mb, n, rows) in enumerate(plan):
        input_ids, positions, meta = runner._inputs(mb)
        if rank == 0:
            x = model.embed(input_ids)
        else:
            x = group.recv(torch.empty(n, hidden, dtype=dtype, device=dev), rank - 1, tag)
        x = model.run_layers(x, positions, runner.kv_caches, meta)
        if rank < p - 1:
            pending.append((group.send(x, rank + 1, tag), x))
        elif rows:  # the last stage (never rank 0: p > 1)
            logits = model.compute_logits(x, torch.tensor([r for _, r in rows], dtype=torch.long, device=dev))
            pending.append((group.send(logits, 0, tag), logits))
    out = None
    if rank == 0:
        vocab = model.cfg.vocab_size
        out = torch.empty(len(logits_rows), vocab, dtype=torch.float32, device=dev)
        for tag, (_, _, rows) in enumerate(plan):
            if rows:
                part = group.recv(torch.empty(len(rows), vocab, dtype=torch.float32, device=dev), p - 1, tag)
                out[torch.tensor([j for j, _ in rows], dtype=torch.long, device=dev)] = part
    for work, _ in pending:
        work.wait()
    return out
