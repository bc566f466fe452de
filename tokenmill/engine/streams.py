"""What the AsyncEngine (async_engine.py) hands its callers and takes from them: a request's stream of
outputs, the errors an add raises, the snapshot and observer interfaces, and the commands that cross from
the callers' threads to the engine thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tokenmill.core.step_planner import Forecast
from tokenmill.engine.messages import StepStats
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop has died; no request can be served any more."""


class EngineDrainingError(RuntimeError):
    """The engine is shutting down and admits no new requests."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound (max_waiting_requests)."""


class SLOShedError(RuntimeError):
    """The request's predicted time to first token misses its SLO: come back after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state as of the last step or command batch (written by the engine thread only)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_open_streams: int = 0
    busy_seconds: float = 0.0  # the engine core's time in steps since it started
    forecast: Forecast | None = None  # with a latency target: the load TTFT is predicted from
    time: float = 0.0  # time.perf_counter when taken
    num_waiting_for_kv: int = 0  # disaggregation: consumer requests whose KV is arriving
    num_kv_held: int = 0  # producer requests whose blocks wait for a consumer


class EngineObserver(Protocol):
    """Receives what the engine thread sees; called on the engine thread, so keep it quick. An observer
    may also have ``on_admission(outcome)``: a request refused at admission ("ttft_slo", "queue_full")
    or admitted under --slo-policy queue although predicted late ("predicted_miss"); SLO decisions are
    told on the caller's thread."""

    def on_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None: ...

    def on_request_finished(self, output: RequestOutput, now: float) -> None: ...

    def on_step(self, stats: StepStats) -> None: ...


class Aborts(Protocol):
    """What a stream needs of its engine (the AsyncEngine): to abort its request."""

    def abort(self, request_id: str) -> None: ...


class RequestStream:
    """The outputs of one request, as an async iterator of cumulative RequestOutputs.

    Iteration ends after the finished output. Leaving early (``aclose``/``abort``, or the
    consumer going away) aborts the request; aborting a finished request does nothing.
    """

    def __init__(self, request_id: str, engine: Aborts, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.finished = False  # the finished output was consumed, or an error ended the stream
        self._closed = False

    # -- called on the event loop (posted by the engine thread) --
    def _put(self, out: RequestOutput) -> None:
        self._latest = out  # cumulative: the newest output holds everything the older ones did
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self._event.set()

    # -- consumer side --
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._latest is not None:
                out, self._latest = self._latest, None
                if out.finished:
                    self.finished = True
                return out
            if self._error is not None:
                self.finished = True
                raise self._error
            if self.finished or self._closed:
                raise StopAsyncIteration
            self._event.clear()
            await self._event.wait()

    def abort(self) -> None:
        """Abort the request unless it already finished. Thread-safe, idempotent, non-blocking."""
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self._engine.abort(self.request_id)
        # wake a consumer waiting in __anext__, so it ends now
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._event.set()
        else:
            try:
                self._loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:  # the loop is closed
                pass

    async def aclose(self) -> None:
        self.abort()

    def __del__(self) -> None:  # safety net: a forgotten stream must not keep its request running
        try:
            if not self.finished and not self._closed:
                self._engine.abort(self.request_id)
        except Exception:
            pass


@dataclass
class AddCommand:
    prompt: Any
    params: SamplingParams
    request_id: str
    priority: int
    add_special_tokens: bool
    arrival_time: float | None
    stream: RequestStream
    future: concurrent.futures.Future
    slo_tpot_ms: float | None = None
    admitted: list | None = None  # its entry in AsyncEngine._admitted, where SLO admission counted it
    kv_transfer_params: dict | None = None  # prefill/decode disaggregation (LLMEngine.add_request)
    cache_salt: str | None = None  # its own prefix-cache salt (LLMEngine.add_request)
    lora_request: Any = None  # its adapter, a lora.request.LoRARequest (LLMEngine.add_request)


@dataclass
class AbortCommand:
    request_id: str


@dataclass
class CallCommand:
    fn: Callable[[], Any]
    future: concurrent.futures.Future
