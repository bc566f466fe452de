"""What the engine thread tells its observers (engine/streams.py ``EngineObserver``: the Prometheus metrics, the
stat logger, the step log): token counts as requests' outputs grow, finished requests, steps, admission
outcomes. An observer that raises is logged, never allowed to stop the engine."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from tokenmill.engine.messages import StepStats
    from tokenmill.engine.streams import EngineObserver
    from tokenmill.outputs import RequestOutput

logger = logging.getLogger("tokenmill")


def notify(fn: Callable, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - an observer bug must not kill the engine
        logger.exception("engine observer %r failed", fn)


class Observers(list):
    """The engine's observers (a list: the server adds and removes its own), told through the methods below."""

    def __init__(self, observers: Iterable[EngineObserver] = ()) -> None:
        super().__init__(observers)
        self._seen: dict[str, list[int]] = {}  # request id -> output tokens told so far, per child sequence

    def track(self, request_id: str, num_sequences: int) -> None:
        self._seen[request_id] = [0] * num_sequences

    def forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)

    def tracked(self) -> list[str]:
        return list(self._seen)

    def clear_tracked(self) -> None:
        self._seen.clear()

    def added(self, request_id: str, arrival: float) -> None:
        """A request the engine took (observers with ``on_request_added``: request timelines)."""
        for obs in self:
            fn = getattr(obs, "on_request_added", None)
            if fn is not None:
                notify(fn, request_id, arrival)

    def output(self, out: RequestOutput, now: float) -> None:
        """A request's output: the prompt tokens of each sequence that produced its first token, the tokens
        new since its last output; and the request, if it finished. Observers with ``on_request_output`` get
        the output itself."""
        seen = self._seen.get(out.request_id)
        if seen is None:
            seen = self._seen[out.request_id] = [0] * len(out.outputs)
        prompt = gen = 0
        for c in out.outputs:
            if c.index >= len(seen):
                seen.extend([0] * (c.index + 1 - len(seen)))
            n = len(c.token_ids)
            if n > seen[c.index]:
                if seen[c.index] == 0:
                    prompt += len(out.prompt_token_ids)  # this sequence's prefill is done
                gen += n - seen[c.index]
                seen[c.index] = n
        for obs in self:
            notify(obs.on_tokens, prompt, gen)
            fn = getattr(obs, "on_request_output", None)
            if fn is not None:
                notify(fn, out, now)
        if out.finished:
            for obs in self:
                notify(obs.on_request_finished, out, now)

    def step(self, stats: StepStats) -> None:
        for obs in self:
            notify(obs.on_step, stats)

    def admission(self, outcome: str) -> None:
        for obs in self:
            fn = getattr(obs, "on_admission", None)
            if fn is not None:
                notify(fn, outcome)
