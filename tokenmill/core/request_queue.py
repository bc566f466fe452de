"""Scheduling policies: the order of the waiting queue, and who is preempted first.

- ``fcfs``: arrival order; a preempted request goes back to the front; the most recently
  admitted running request is the preemption victim.
- ``priority``: lower ``priority`` value first, ties by arrival; the victim is the running
  request with the highest (priority, arrival). A starvation guard promotes any request that
  has waited longer than ``starvation_timeout`` seconds ahead of everything else and shields it
  from preemption, so a steady stream of urgent work cannot hold it back forever.

Pure Python, no tensors: the scheduler and the simulator share it.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterator

from tokenmill.request import Request


class FCFSQueue:
    """Waiting requests in arrival order."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def add_preempted(self, req: Request) -> None:
        self._q.appendleft(req)  # it was admitted before anything still waiting

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def promote_starved(self, now: float) -> None:
        """FCFS cannot starve a request: nothing to do."""

    def order_running(self, running: list[Request]) -> None:
        """Running requests keep admission order."""

    def __getitem__(self, i: int) -> Request:
        return self._q[i]

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Waiting requests ordered by (promoted first, priority, arrival)."""

    def __init__(self, starvation_timeout: float | None) -> None:
        self.starvation_timeout = starvation_timeout
        self._keys: list[tuple] = []
        self._reqs: list[Request] = []
        self._seq = itertools.count()  # breaks exact ties: stable, and never compares requests

    def key(self, req: Request) -> tuple:
        return (not req.promoted, req.priority, req.timings.arrival)

    def add(self, req: Request) -> None:
        k = (*self.key(req), next(self._seq))
        i = bisect.bisect(self._keys, k)
        self._keys.insert(i, k)
        self._reqs.insert(i, req)

    add_preempted = add  # its original key puts it back where it belongs

    def pop(self) -> Request:
        self._keys.pop(0)
        return self._reqs.pop(0)

    def remove(self, req: Request) -> None:
        i = next(i for i, r in enumerate(self._reqs) if r is req)
        del self._keys[i], self._reqs[i]

    def promote_starved(self, now: float) -> None:
        if self.starvation_timeout is None:
            return
        starved = [r for r in self._reqs if not r.promoted and now - r.timings.arrival > self.starvation_timeout]
        for r in starved:
            self.remove(r)
            r.promoted = True
            self.add(r)

    def order_running(self, running: list[Request]) -> None:
        # Most urgent first, so a tight token budget goes to them (stable sort keeps admission order on ties).
        running.sort(key=self.key)

    def __getitem__(self, i: int) -> Request:
        return self._reqs[i]

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._reqs)


def make_queue(policy: str, starvation_timeout: float | None) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue(starvation_timeout)
    raise ValueError(f"unknown scheduling policy {policy!r}: use fcfs or priority")
