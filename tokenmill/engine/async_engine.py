"""AsyncEngine: an LLMEngine stepping continuously on its own thread, fed from asyncio.

Only the engine thread touches the LLMEngine. Callers (the HTTP server's event loop) send it
commands through a FIFO queue -- add, abort, or "run this function between two steps" -- and it
applies them all before every step, so an abort frees the request's KV blocks before the next
step starts. Each request gets a :class:`RequestStream`; the engine thread posts that request's
outputs to it with ``loop.call_soon_threadsafe``. Outputs are cumulative (full text and token ids
so far), so a stream keeps only the newest one: a slow consumer costs O(1) memory and never
holds up the batch.

Validation errors of ``add_request`` (ValueError), a full waiting queue (:class:`QueueFullError`),
a draining engine (:class:`EngineDrainingError`) and a dead engine (:class:`EngineDeadError`) are
raised to the awaiting caller. If the loop crashes, the exception is recorded, every open stream
fails with :class:`EngineDeadError` and ``healthy`` turns False.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from tokenmill.core.assembly import make_admission
from tokenmill.engine.admission import AdmissionGate
from tokenmill.engine.observers import Observers
from tokenmill.engine.streams import (AbortCommand, AddCommand, CallCommand, EngineDeadError, EngineDrainingError,
                                      EngineObserver, EngineSnapshot, QueueFullError, RequestStream, SLOShedError)
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.lora.request import LoRARequest

logger = logging.getLogger("tokenmill.async_engine")
IDLE_CHECK_S = 0.25  # while idle, how often the loop looks whether an engine core process is still alive


class AsyncEngine:
    """Runs ``engine`` (an LLMEngine, or anything with its interface) on a background thread.

    ``max_waiting_requests`` bounds the scheduler's waiting queue (in sequences; a request with
    n=4 counts 4); an add beyond it raises QueueFullError. ``log_interval`` seconds between
    periodic stats lines while busy (0 or None: never). ``observers`` get token counts and
    finished requests (see EngineObserver), e.g. the Prometheus metrics.
    """

    def __init__(self, engine: Any, *, max_waiting_requests: int | None = None, log_interval: float | None = 10.0,
                 log_requests: bool = True, observers: Sequence[EngineObserver] = ()) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0 or None, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.observers = Observers(observers)
        if log_interval or log_requests:
            from tokenmill.engine.stat_logger import LoggingStatLogger

            self.observers.append(LoggingStatLogger(lambda: self.snapshot, engine, log_interval, log_requests))
        self.error: BaseException | None = None  # why the loop died
        self.snapshot = EngineSnapshot()
        # SLO admission on the caller's thread (engine/admission.py); its state is guarded by _cmd_lock
        sched = getattr(getattr(engine, "config", None), "scheduler", None)
        admission = make_admission(sched) if sched is not None else None
        self.admission = AdmissionGate(admission, self.observers.admission) if admission is not None else None
        self._commands: deque = deque()
        # guards _commands with _dead / _accepting / _stop; reentrant because RequestStream.__del__
        # (run by the garbage collector at any allocation) may call abort() while it is held
        self._cmd_lock = threading.RLock()
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._dead = False
        self._accepting = True
        self._stop = False
        self._thread: threading.Thread | None = None
        self._num_steps = 0
    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> AsyncEngine:
        if self._thread is None:
            self._update_snapshot()
            self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
            self._thread.start()
        return self

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        """False once the loop has died (or was never started)."""
        return not self._dead and self.is_running

    @property
    def accepting(self) -> bool:
        return self._accepting and not self._dead

    def stop_accepting(self) -> None:
        """Start draining: new adds raise EngineDrainingError; running requests continue."""
        with self._cmd_lock:
            self._accepting = False

    @property
    def num_unfinished(self) -> int:
        """Requests with an open stream (admitted and not yet finished or aborted)."""
        return self.snapshot.num_open_streams

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop admitting, abort everything still running (streams end with finish_reason
        "abort"), stop the thread. Safe to call twice or on a dead engine."""
        self.stop_accepting()
        with self._cmd_lock:
            self._stop = True
        self._wakeup.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    async def drain(self, timeout: float) -> bool:
        """Stop admitting and wait up to ``timeout`` s for in-flight requests; True if all finished."""
        self.stop_accepting()
        deadline = time.monotonic() + timeout
        while self.is_running and self.snapshot.num_open_streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.snapshot.num_open_streams

    # ---- caller side (any thread with a running event loop) --------------------------------

    async def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                          priority: int = 0, add_special_tokens: bool = True,
                          arrival_time: float | None = None, slo_ttft_ms: float | None = None,
                          slo_tpot_ms: float | None = None, kv_transfer_params: dict | None = None,
                          cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it.

        Raises ValueError (invalid or can never fit), QueueFullError, SLOShedError, EngineDrainingError
        or EngineDeadError. ``arrival_time`` (time.perf_counter) is when the request really arrived,
        e.g. when its HTTP request was received; the latency metrics count from it. ``slo_ttft_ms`` and
        ``slo_tpot_ms`` are the request's own SLOs, over the engine's; ``cache_salt`` its own prefix-cache salt;
        ``lora_request`` its adapter.
        """
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, self, loop)
        future: concurrent.futures.Future = concurrent.futures.Future()
        admission = self.admission
        num_tokens = 0
        if admission is not None and admission.wants_tokens(slo_ttft_ms):
            ids = prompt if isinstance(prompt, list) else self.engine.tokenize_prompt(prompt, add_special_tokens)
            num_tokens = len(ids)
        with self._cmd_lock:
            if self._dead:
                stream.finished = True
                raise EngineDeadError(f"the engine loop has died: {self.error!r}")
            if not self._accepting or self._stop:
                stream.finished = True
                raise EngineDrainingError("the server is shutting down and admits no new requests")
            admitted = None
            if num_tokens:
                try:
                    admitted = admission.admit(self.snapshot, num_tokens, params.n if isinstance(params, SamplingParams)
                                               else 1, priority, slo_ttft_ms, request_id)
                except SLOShedError:
                    stream.finished = True
                    raise
            self._commands.append(AddCommand(prompt, params, request_id, priority, add_special_tokens,
                                       arrival_time, stream, future, slo_tpot_ms, admitted, kv_transfer_params,
                                       cache_salt, lora_request))
        self._wakeup.set()
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add: applied after it, in order
            stream.finished = True
            raise
        except BaseException:
            stream.finished = True
            raise
        return stream

    def _forget_admission(self, entry: list | None) -> None:
        if entry is not None:
            with self._cmd_lock:
                self.admission.forget(entry)

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       priority: int = 0, add_special_tokens: bool = True) -> AsyncIterator[RequestOutput]:
        """``async for out in engine.generate(...)``: outputs until finished; aborts if the consumer leaves."""
        stream = await self.add_request(prompt, params, request_id, priority, add_special_tokens)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, non-blocking); its blocks are free before the next step."""
        with self._cmd_lock:
            if self._dead or not self.is_running:
                return  # nothing runs any more: nothing to abort
            self._commands.append(AbortCommand(request_id))
        self._wakeup.set()

    def abort_all(self) -> concurrent.futures.Future:
        """Abort every open request (their streams end with finish_reason "abort")."""
        return self.call_soon(lambda: [self._apply_abort(rid) for rid in list(self._streams)])

    def call_soon(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine thread between two steps; a Future of its result.

        The way to look at engine state consistently from another thread (tests, debugging).
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cmd_lock:
            if self._dead or not self.is_running:
                future.set_exception(EngineDeadError("the engine loop is not running"))
                return future
            self._commands.append(CallCommand(fn, future))
        self._wakeup.set()
        return future

    # ---- engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._wakeup.clear()
                self._apply_commands()
                if self._stop:
                    break
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    now = time.perf_counter()
                    self._num_steps += 1
                    self._dispatch(outputs, now)
                    self._after_step()
                else:
                    self._update_snapshot()
                    self._wakeup.wait(IDLE_CHECK_S)
                    engine.check_alive()
            self._abort_all("engine shut down")
        except BaseException as e:  # noqa: BLE001 - anything that kills the loop is reported
            self._die(e)
        finally:
            self._update_snapshot()
            try:
                engine.shutdown()  # an engine core process goes with the loop that fed it
            except Exception:  # noqa: BLE001
                logger.exception("could not stop the engine core")

    def _apply_commands(self) -> None:
        while True:
            with self._cmd_lock:
                if not self._commands:
                    return
                cmd = self._commands.popleft()
            if isinstance(cmd, AddCommand):
                self._apply_add(cmd)
            elif isinstance(cmd, AbortCommand):
                self._apply_abort(cmd.request_id)
            else:
                if cmd.future.set_running_or_notify_cancel():
                    try:
                        cmd.future.set_result(cmd.fn())
                    except BaseException as e:  # noqa: BLE001
                        cmd.future.set_exception(e)

    def _apply_add(self, cmd: AddCommand) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            self._forget_admission(cmd.admitted)
            return
        engine = self.engine
        try:
            limit = self.max_waiting_requests
            n = cmd.params.n if isinstance(cmd.params, SamplingParams) else 1
            if limit is not None and engine.num_waiting + n > limit:
                self.observers.admission("queue_full")
                raise QueueFullError(
                    f"the server is overloaded: {engine.num_waiting} sequences are waiting and the "
                    f"limit is {limit} (--max-waiting-requests); retry later")
            # The command waited for the step in flight; latencies count from the real arrival.
            # the optional arguments only where given (engines with the plain signature take the rest)
            extra = {k: v for k, v in (("slo_tpot_ms", cmd.slo_tpot_ms), ("kv_transfer_params", cmd.kv_transfer_params),
                                       ("cache_salt", cmd.cache_salt), ("lora_request", cmd.lora_request)) if v}
            rid = engine.add_request(cmd.prompt, cmd.params, cmd.request_id, cmd.priority, cmd.add_special_tokens,
                                     arrival_time=cmd.arrival_time, **extra)
        except Exception as e:  # noqa: BLE001 - ValueError is the caller's fault; others are reported too
            self._forget_admission(cmd.admitted)
            cmd.future.set_exception(e)
            return
        if cmd.admitted is not None:
            with self._cmd_lock:
                self.admission.added(cmd.admitted, getattr(engine, "num_sent", 0))
        self._streams[rid] = cmd.stream
        self.observers.track(rid, cmd.params.n if isinstance(cmd.params, SamplingParams) else 1)
        self.observers.added(rid, cmd.arrival_time if cmd.arrival_time is not None else time.perf_counter())
        cmd.future.set_result(rid)

    def _apply_abort(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        now = time.perf_counter()
        if out is not None:
            self.observers.output(out, now)
        stream = self._streams.pop(request_id, None)
        self.observers.forget(request_id)
        if out is not None and stream is not None:
            self._update_snapshot()  # before the consumer hears of it: what it reads next is current
            self._post(stream, stream._put, out)

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        # Metrics and the snapshot first, outputs last: a client that got its answer sees them current.
        posts = []
        for out in outputs:
            self.observers.output(out, now)
            if out.finished:
                stream = self._streams.pop(out.request_id, None)
                self.observers.forget(out.request_id)
            else:
                stream = self._streams.get(out.request_id)
            if stream is not None:
                posts.append((stream, out))
        self._update_snapshot()
        for stream, out in posts:
            self._post(stream, stream._put, out)

    def _after_step(self) -> None:
        for stats in self.engine.last_step_stats:
            self.observers.step(stats)

    def _update_snapshot(self) -> None:
        engine = self.engine
        try:
            state, num_blocks = engine.state, engine.info.num_blocks
            forecast = getattr(state, "forecast", None)
            added = getattr(state, "num_added", 0)
            with self._cmd_lock:  # admissions the core has added are in this forecast; the rest are pending
                self.snapshot = EngineSnapshot(
                    state.num_running, state.num_waiting, 1.0 - state.num_free_blocks / num_blocks,
                    state.num_free_blocks, num_blocks, state.num_preemptions, self._num_steps, len(self._streams),
                    state.busy_seconds, forecast, time.perf_counter(), getattr(state, "num_waiting_for_kv", 0),
                    getattr(state, "num_kv_held", 0))
                if self.admission is not None:
                    self.admission.seen(added)
        except Exception:  # noqa: BLE001 - a broken engine must not break reporting
            logger.exception("could not read engine state")

    @staticmethod
    def _post(stream: RequestStream, fn: Callable, arg: Any) -> None:
        try:
            stream._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            pass

    def _abort_all(self, why: str) -> None:
        for rid in list(self._streams):
            try:
                self._apply_abort(rid)
            except Exception:  # noqa: BLE001
                logger.exception("aborting %s on %s failed", rid, why)
        with self._cmd_lock:
            pending, self._commands = list(self._commands), deque()
        err = EngineDrainingError("the server is shutting down")
        for cmd in pending:
            if isinstance(cmd, (AddCommand, CallCommand)) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(err)
        with self._cmd_lock:  # anything that raced in after the thread stopped is refused by add_request
            self._accepting = False

    def restart(self, rebuild: Callable[[], Any]) -> None:
        """After the loop died: ``rebuild()`` the engine (a fresh core process) and step again. Blocks
        while it rebuilds; meanwhile the engine counts as dead (adds fail, /health 503)."""
        if self._thread is not None:
            self._thread.join(30)
        rebuild()
        self._streams.clear()
        self.observers.clear_tracked()
        self._num_steps = 0
        with self._cmd_lock:
            self._commands.clear()
            if self.admission is not None:
                self.admission.pending.clear()  # a fresh core counts its adds from 0
            self._stop = False
            self._accepting = True
            self._thread = None
            self.error = None
            self._dead = False
        self.start()

    def _die(self, exc: BaseException) -> None:
        logger.error("the engine loop died: %r", exc, exc_info=exc)
        self.error = exc
        with self._cmd_lock:
            self._dead = True
            pending, self._commands = list(self._commands), deque()
        dead = EngineDeadError(f"the engine loop died: {exc!r}")
        dead.__cause__ = exc
        for cmd in pending:
            if isinstance(cmd, (AddCommand, CallCommand)) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(dead)
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            self._post(stream, stream._fail, dead)
        # Best effort: free what the dead requests held, so the KV accounting stays readable.
        for rid in self.observers.tracked():
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                pass
        self.observers.clear_tracked()
