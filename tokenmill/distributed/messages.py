"""What the driver (rank 0) sends the other ranks, and how: each step's forward pass or Stop, as plain data in
msgpack (never pickle). Under tensor parallelism every rank takes every step together, so a message is a
broadcast; pipeline stages may still be busy with earlier steps, so there it goes point to point."""

from __future__ import annotations

import datetime
import os
import time

import msgspec
import torch
import torch.distributed as dist

from tokenmill.config import EngineConfig
from tokenmill.distributed.group import TPGroup

STOP_WAIT_S = 10.0  # how long a stop waits for busy pipeline stages to take it


class Forward(msgspec.Struct, tag="fwd", array_like=True):
    scheduled: list[tuple[list[int], int, list[int]]]  # (token ids, start position, block table)
    logits_rows: list[int]


class Stop(msgspec.Struct, tag="stop", array_like=True):
    pass


encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(Forward | Stop)


def new_group(config: EngineConfig, store, rank: int, device: torch.device) -> TPGroup:
    """This rank's group of all the ranks; under pipeline parallelism with T > 1, also its stage's
    tensor-parallel group (``.tensor``: ranks stage x T .. stage x T + T - 1, on their own store prefix)."""
    par = config.parallel
    t, p = par.tensor_parallel_size, par.pipeline_parallel_size
    group = TPGroup(store, rank, par.world_size, device, par.enable_expert_parallel, p > 1, par.all2all_backend)
    if p > 1:
        group.stage, group.num_stages = rank // t, p
        if t > 1:
            group.tensor = TPGroup(dist.PrefixStore(f"stage{group.stage}/", store), rank % t, t, device,
                                   par.enable_expert_parallel, False, par.all2all_backend)
        group.warm_up()  # (every rank makes its group at startup: the pairs open before the first step)
    return group


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:r on GPUs (one per rank), the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def worker_threads(t: int) -> int:
    """Torch threads for each of the T processes: the cores shared out ($TOKENMILL_TP_THREADS overrides)."""
    forced = os.environ.get("TOKENMILL_TP_THREADS")
    return int(forced) if forced else max(1, (os.cpu_count() or 1) // t)


def post_message(group: TPGroup, data: bytes) -> list:
    """The driver's message to every worker: a broadcast where the ranks take every step together
    (tensor parallelism), point to point where they may still be busy with earlier steps (pipeline
    stages; returns the sends in flight, to keep until they complete)."""
    if not group.pipeline:
        group.broadcast_bytes(data)
        return []
    group.message_seq += 1
    return group.send_message(data, list(range(1, group.size)), group.message_seq)


def receive_message(group: TPGroup) -> Forward | Stop:
    """A worker's next message from the driver (post_message's other side)."""
    if not group.pipeline:
        return decoder.decode(group.broadcast_bytes(None))
    group.message_seq += 1
    return decoder.decode(group.recv_message(group.message_seq))


def send_stop(group: TPGroup) -> None:
    """Stop every worker (stages finish their passes first); a rank already gone is no error."""
    try:
        deadline = time.monotonic() + STOP_WAIT_S
        for work, _ in post_message(group, encoder.encode(Stop())):
            work.wait(datetime.timedelta(seconds=max(0.1, deadline - time.monotonic())))
    except RuntimeError:
        pass
