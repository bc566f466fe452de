"""``--step-log``: every engine step as one JSON line (when it started, how long it took, what it computed),
and the reading back that ``tokenmill profile --from-step-log`` fits a cost model to.

A step's own duration is not what serving pays for it: between two steps the engine core also sends the
outputs to the front end and takes in new requests, and on a machine whose cores the front end and the
clients share, a step runs slower the more tokens they are streaming. What a simulator must charge is a
step's *cycle*: from its start to the start of the step after it, when the engine went straight on.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.perf.step_cost import StepShape
from tokenmill.engine.messages import StepStats

if TYPE_CHECKING:
    from tokenmill.engine.messages import CoreInfo
    from tokenmill.outputs import RequestOutput

SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(StepShape))


class StepLog:
    """An engine observer writing each step that computed something as a JSON line, after a first line
    naming the engine (what a profile fitted to the steps records of it)."""

    def __init__(self, path: str | Path, info: CoreInfo) -> None:
        self._file = open(path, "w", buffering=1)  # noqa: SIM115 -- open while the server runs
        self._file.write(json.dumps({"engine": engine_meta(info)}) + "\n")

    def on_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        pass

    def on_request_finished(self, output: RequestOutput, now: float) -> None:
        pass

    def on_step(self, stats: StepStats) -> None:  # on the engine thread, which is also the only writer
        if stats.shape is None or self._file.closed:
            return
        self._file.write(json.dumps({"start": stats.start_time, "duration": stats.duration,
                                     "running": stats.num_running, "waiting": stats.num_waiting,
                                     **dataclasses.asdict(stats.shape)}) + "\n")

    def close(self) -> None:
        self._file.close()


def engine_meta(info: CoreInfo) -> dict:
    """What a calibrated profile says of the engine it timed (both `tokenmill profile`s write it)."""
    return {"model": info.model_name, "quantization": info.quantization, "kv_bytes_per_token": info.kv_bytes_per_token,
            "kv_cache_bytes": info.num_blocks * info.block_size * info.kv_bytes_per_token}


def read_step_log(path: str | Path) -> tuple[dict, list[dict]]:
    """(the engine's header, the steps). A last line cut short (a server killed while writing) is dropped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read the step log {path} ({e})") from None
    try:
        head = json.loads(lines[0])["engine"] if lines else None
    except (json.JSONDecodeError, KeyError, TypeError):
        head = None
    if not isinstance(head, dict):
        raise ValueError(f"{path} is not a step log written by `tokenmill serve --step-log` (no engine header line)")
    records = []
    for i, line in enumerate(lines[1:], 1):
        try:
            rec = json.loads(line)
            StepShape(**{k: int(rec[k]) for k in SHAPE_FIELDS})
            float(rec["start"]), float(rec["duration"]), int(rec["running"]), int(rec["waiting"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            if i == len(lines) - 1 and isinstance(e, json.JSONDecodeError):
                break
            raise ValueError(f"{path}, line {i + 1}: not a step written by `tokenmill serve --step-log` ({e})") from None
        records.append(rec)
    return head, records


# A gap between two steps this many times the median gap is not the loop's overhead but a pause (a restarted
# engine core, requests held up by a KV transfer with nothing else to run): the step before it is charged as
# one that left the engine idle.
PAUSE_GAPS = 10


def step_cycles(records: list[dict]) -> tuple[list[StepShape], list[float]]:
    """(shape, cycle seconds) per logged step. A step after which work remained (running or waiting) was
    followed at once by the next: its cycle is the time to the next step's start. A step that left the
    engine idle, the last one, and one followed by a pause (a gap over PAUSE_GAPS times the median gap)
    get their duration plus the median gap."""
    records = sorted(records, key=lambda r: r["start"])
    gaps: list[float | None] = []
    for rec, nxt in zip(records, records[1:] + [None]):
        busy = rec["running"] + rec["waiting"] > 0 and nxt is not None
        gaps.append(max(nxt["start"] - rec["start"] - rec["duration"], 0.0) if busy else None)
    median = statistics.median([g for g in gaps if g is not None] or [0.0])
    shapes = [StepShape(**{k: r[k] for k in SHAPE_FIELDS}) for r in records]
    cycles = [r["duration"] + (g if g is not None and g <= PAUSE_GAPS * max(median, 1e-4) else median)
              for r, g in zip(records, gaps)]
    return shapes, cycles
