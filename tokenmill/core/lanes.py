"""Pipeline parallelism's steps in flight, as the scheduler sees them (vLLM's virtual engines).

The engine runs several steps at once (engine/core.py): a request in a step not yet applied is in flight, so it
is neither scheduled again nor preempted until then. The running requests are spread over ``n`` lanes (one per
step in flight), balanced as they are admitted, and consecutive steps take consecutive lanes, so each step has
its share. With one lane (no steps in flight) every method here is a no-op or says yes."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.request import Request


class Lanes:
    def __init__(self, n: int = 1) -> None:
        self.n = n
        self._next = 0  # the lane the next step takes
        self._of: dict[str, int] = {}  # request id -> its lane
        self.in_flight: set[str] = set()  # requests in a step not yet applied
        self._finish_later: set[str] = set()  # ended while in flight: told to the runner once applied

    def take(self, running: list[Request]) -> int:
        """The lane this step takes: the next in turn, topped up from the other lanes' requests not in flight
        where the lanes drifted apart as requests ended; if it has nothing to run, the next lane in turn
        that has (waiting requests join whichever lane runs)."""
        n, lane = self.n, self._next
        if n > 1:
            self._balance(running, lane)
            free = {self._of.get(r.request_id, 0) for r in running if r.request_id not in self.in_flight}
            if lane not in free:
                lane = next((x % n for x in range(lane + 1, lane + n) if x % n in free), lane)
        self._next = (lane + 1) % n
        return lane

    def _balance(self, running: list[Request], lane: int) -> None:
        """Move requests not in flight from lanes above their share (running / lanes) into ``lane`` below it."""
        size = [0] * self.n
        for r in running:
            size[self._of.get(r.request_id, 0)] += 1
        share = len(running) // self.n
        for r in reversed(running):
            if size[lane] >= share:
                return
            other = self._of.get(r.request_id, 0)
            if other != lane and size[other] > share and r.request_id not in self.in_flight:
                self._of[r.request_id] = lane
                size[other] -= 1
                size[lane] += 1

    def skips(self, request_id: str, lane: int) -> bool:
        """Whether a step on ``lane`` passes this running request by: its step is in flight, or it is another
        lane's."""
        return self.n > 1 and (request_id in self.in_flight or self._of.get(request_id, 0) != lane)

    def room(self, running: list[Request], num_waiting: int, lane: int) -> float:
        """How many more requests ``lane`` may take: its share of the running and waiting ones, less those
        it holds."""
        if self.n == 1:
            return math.inf
        cap = -(-(len(running) + num_waiting) // self.n)
        return cap - sum(1 for r in running if self._of.get(r.request_id, 0) == lane)

    def join(self, request_id: str, lane: int) -> None:
        if self.n > 1:
            self._of[request_id] = lane

    def leave(self, request_id: str) -> None:
        self._of.pop(request_id, None)

    def launched(self, request_id: str) -> None:
        if self.n > 1:
            self.in_flight.add(request_id)

    def finish(self, request_id: str) -> bool:
        """A request ended: False while its step is in flight (the runner samples it first, and hears once the
        step is applied: ``landed``), else True: tell the runner now."""
        if request_id in self.in_flight:
            self._finish_later.add(request_id)
            return False
        return True

    def landed(self, request_id: str) -> bool:
        """The request's step was applied: no longer in flight; True if it ended meanwhile (tell the runner)."""
        if request_id not in self.in_flight:
            return False
        self.in_flight.discard(request_id)
        if request_id in self._finish_later:
            self._finish_later.discard(request_id)
            return True
        return False

    def pop_victim(self, running: list[Request], i: int) -> Request | None:
        """The request to preempt for running[i]: the last after it not in flight, else running[i] itself
        if nothing after it is in flight (taken out of running); None while requests after it are in
        flight (their steps will free or grow their blocks: running[i] waits rather than lose its KV)."""
        for j in range(len(running) - 1, i - 1, -1):
            if running[j].request_id not in self.in_flight:
                return None if j == i < len(running) - 1 else running.pop(j)
        return None
