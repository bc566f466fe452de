"""The engine core in its own process (``--engine-core-process``), as vLLM runs it.

Why: in one process the HTTP server, tokenization, detokenization and SSE share the step loop's GIL,
and a crash anywhere takes everything down. Here the core (scheduler + model runner, engine/core.py)
busy-loops in a process of its own; the API server's process keeps the front end (engine/llm_engine.py).

Wire: two ZeroMQ PUSH/PULL pipes over IPC sockets in a private temporary folder, msgpack via msgspec
(engine/messages.py), never pickle. The core applies every queued command before each step, blocks
on its input only when it has nothing to run, and sends one CoreStep per step.

Failure: the core reports an exception it dies of as CoreFailed before it exits; if it vanishes
(SIGKILL, OOM killer) the client notices the process is gone within POLL_S. The core dies with its
parent: a watchdog thread exits it once its parent process is gone (a SIGKILLed server leaves no
orphan holding the model's memory).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
import traceback
from typing import TYPE_CHECKING

import msgspec
import zmq

from tokenmill.config import EngineConfig
from tokenmill.engine.messages import (
    AbortRequests,
    CheckInvariants,
    CoreFailed,
    CoreInfo,
    CoreOutput,
    CoreReady,
    CoreState,
    CoreStep,
    EngineCoreRequest,
    ReportRequests,
    Shutdown,
    from_core_decoder,
    from_core_encoder,
    plain_info,
    to_core_decoder,
    to_core_encoder,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from tokenmill.engine.core import EngineCore
    from tokenmill.engine.messages import FromCore, ToCore

logger = logging.getLogger("tokenmill")
POLL_S = 0.1  # how often a waiting client looks whether the core process is still there
WATCHDOG_S = 0.2  # how often the core looks whether its parent is still there
SEND_TIMEOUT_MS = 2000  # a send to a core that takes none fails after this
UNIX_PATH_MAX = 100  # sun_path holds 108 bytes on Linux, 104 on macOS


class EngineCoreDiedError(RuntimeError):
    """The engine core process died (an exception in its loop, or it was killed)."""


class CoreProcessClient:
    """Starts the engine core process and speaks to it; one thread at a time (the engine thread)."""

    def __init__(self, config: EngineConfig, startup_timeout: float = 900.0) -> None:
        self.startup_timeout = startup_timeout
        self._dir = tempfile.mkdtemp(prefix="tokenmill-core-")
        self._ctx = zmq.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._from_core = self._ctx.socket(zmq.PULL)
        for s in (self._to_core, self._from_core):
            s.setsockopt(zmq.LINGER, 0)
        # No bound on queued messages (a burst of adds must not block the engine thread); a send
        # with no core to take it (dead) times out instead of blocking forever.
        self._to_core.setsockopt(zmq.SNDHWM, 0)
        self._to_core.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self._from_core.setsockopt(zmq.RCVHWM, 0)
        in_addr, out_addr = _bind(self._to_core, f"{self._dir}/in"), _bind(self._from_core, f"{self._dir}/out")
        self._lock = threading.Lock()  # sends may come from another thread (shutdown)
        self.info: CoreInfo | None = None
        self.ready_state: CoreState | None = None
        self._closed = False
        # spawn, not fork: the parent may hold threads (uvicorn, torch's pools) a fork would copy broken
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="tokenmill-engine-core", daemon=True,
            args=(to_core_encoder.encode(config), in_addr, out_addr, os.getpid(), logging.getLogger("tokenmill").level))
        self.process.start()

    def wait_ready(self) -> CoreInfo:
        """Wait for the core to load its model; raise what it failed with if it could not."""
        deadline = time.monotonic() + self.startup_timeout
        while self.info is None:
            msg = self._recv(POLL_S)
            if isinstance(msg, CoreReady):
                self.info, self.ready_state = msg.info, msg.state
                logger.info("engine core process %d is ready", msg.pid)
            elif isinstance(msg, CoreFailed):
                self.shutdown()
                raise (ValueError if msg.error_type == "ValueError" else RuntimeError)(msg.message)
            elif time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"the engine core did not start within {self.startup_timeout:.0f} s")
        return self.info

    # ---- commands --------------------------------------------------------------------

    def add(self, msg: EngineCoreRequest) -> None:
        self._send(msg)

    def abort(self, msg: AbortRequests) -> None:
        self._send(msg)

    def check_invariants(self) -> None:
        self._send(CheckInvariants())

    def report_requests(self) -> None:
        self._send(ReportRequests())

    def _send(self, msg: ToCore) -> None:
        with self._lock:
            if self._closed:
                return
            if not self.process.is_alive():  # a send to a dead core would wait out SEND_TIMEOUT_MS
                self.check_alive()
            try:
                self._to_core.send(to_core_encoder.encode(msg), copy=False)
            except zmq.Again:
                self.check_alive()
                raise EngineCoreDiedError("the engine core takes no messages") from None

    # ---- outputs ---------------------------------------------------------------------

    def step(self, timeout: float = POLL_S) -> list[CoreStep]:
        """Every CoreStep that arrived: waits up to ``timeout`` s for the first, takes the rest that
        are already there. [] if none came. Raises EngineCoreDiedError if the core is gone."""
        first = self._recv(timeout)
        if first is None:
            return []
        steps = [first]
        while (msg := self._recv(0)) is not None:
            steps.append(msg)
        for m in steps:
            if isinstance(m, CoreFailed):
                raise EngineCoreDiedError(f"the engine core died: {m.error_type}: {m.message}")
        return [m for m in steps if isinstance(m, CoreStep)]

    def _recv(self, timeout: float) -> FromCore | None:
        if self._from_core.poll(int(timeout * 1000)):
            return from_core_decoder.decode(self._from_core.recv(copy=False).buffer)
        if timeout and not self.process.is_alive():
            self.check_alive()
        return None

    def check_alive(self) -> None:
        """Raise EngineCoreDiedError if the core process is gone."""
        if self._closed or self.process.is_alive():
            return
        if self._from_core.poll(0):  # its last words: why it died
            msg = from_core_decoder.decode(self._from_core.recv())
            if isinstance(msg, CoreFailed):
                raise EngineCoreDiedError(f"the engine core died: {msg.error_type}: {msg.message}")
        raise EngineCoreDiedError(f"the engine core process {self.process.pid} exited with code "
                                  f"{self.process.exitcode} (killed, or out of memory?)")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to exit, kill it if it does not, and remove the sockets. Safe to call twice."""
        if self._closed:
            return
        try:
            if self.process.is_alive():
                self._send(Shutdown())
        except (zmq.ZMQError, EngineCoreDiedError):
            pass
        with self._lock:
            self._closed = True
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __del__(self) -> None:
        try:
            self.shutdown(1.0)
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


def _bind(sock: zmq.Socket, path: str) -> str:
    """An IPC socket at ``path``; loopback TCP where the path is too long for a Unix socket (a deep $TMPDIR)."""
    if len(path) <= UNIX_PATH_MAX:
        sock.bind(f"ipc://{path}")
        return f"ipc://{path}"
    return f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


# ---- the core process ---------------------------------------------------------------


def _watch_parent(parent_pid: int, in_addr: str) -> None:
    """Exit this process once its parent is gone (SIGKILLed, crashed): no orphan keeps the model, and the
    sockets' folder, which the parent had no chance to remove, goes too."""
    while os.getppid() == parent_pid:
        time.sleep(WATCHDOG_S)
    if in_addr.startswith("ipc://"):
        shutil.rmtree(os.path.dirname(in_addr.removeprefix("ipc://")), ignore_errors=True)
    os._exit(0)


def run_engine_core(config_bytes: bytes, in_addr: str, out_addr: str, parent_pid: int, log_level: int) -> None:
    """The engine core process's main: load, then loop until Shutdown or death."""
    # Ctrl-C and SIGTERM reach the whole process group; the server drains on them and then stops this
    # process with Shutdown (or its watchdog does), so the core must outlive the signal, not die mid-drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid, in_addr), name="parent-watchdog", daemon=True).start()
    logging.basicConfig(format="%(asctime)s %(levelname)s [engine core] %(name)s: %(message)s")
    logging.getLogger("tokenmill").setLevel(log_level or logging.WARNING)
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.setsockopt(zmq.RCVHWM, 0)
    outbox.setsockopt(zmq.SNDHWM, 0)
    inbox.connect(in_addr)
    outbox.connect(out_addr)
    send = lambda msg: outbox.send(from_core_encoder.encode(msg), copy=False)  # noqa: E731
    try:
        from tokenmill.engine.builder import build_core

        # This process is daemonic (it dies with the front end), and multiprocessing refuses children to
        # a daemonic process; its tensor-parallel workers are stopped by it, or exit by their own parent
        # watchdog when it dies (distributed/executor.py), so nothing is left behind.
        multiprocessing.current_process().daemon = False
        core = build_core(msgspec.msgpack.decode(config_bytes, type=EngineConfig))
        send(CoreReady(plain_info(core.info), os.getpid(), core.state()))
        gc.collect()
        gc.freeze()  # the model's and the pool's objects stay: collections under load skip them
        try:
            _loop(core, inbox, send)
        finally:
            core.shutdown()  # its tensor-parallel workers, if any
    except BaseException as e:  # noqa: BLE001 - report whatever kills the core, then exit
        logging.getLogger("tokenmill").error("the engine core died: %r", e, exc_info=e)
        send(CoreFailed(type(e).__name__, str(e) or repr(e), traceback.format_exc()))
        outbox.close(linger=2000)  # let the last words leave before the process ends
        ctx.term()
        os._exit(1)
    outbox.close(linger=1000)
    inbox.close(linger=0)
    ctx.term()


def _loop(core: EngineCore, inbox: zmq.Socket, send: Callable[[FromCore], object]) -> None:
    while True:
        # Every queued command goes in before the next step; with nothing to run, wait for one.
        changed = False
        block = not core.has_unfinished()
        while inbox.poll(None if block else 0):
            msg = to_core_decoder.decode(inbox.recv(copy=False).buffer)
            block = False
            if isinstance(msg, Shutdown):
                return
            changed = True
            if isinstance(msg, EngineCoreRequest):
                try:
                    core.add(msg)
                except ValueError as e:  # the front end checks first; should it miss something, say so
                    rejected = CoreOutput(msg.request_id, status="abort", finished_time=time.perf_counter(),
                                          error=str(e))
                    send(CoreStep([rejected], None, core.state()))
            elif isinstance(msg, AbortRequests):
                core.abort(msg)
            elif isinstance(msg, CheckInvariants):
                state = core.state()
                state.invariants_checked, state.invariant_error = True, core.check_invariants()
                send(CoreStep([], None, state))
                changed = False
            elif isinstance(msg, ReportRequests):
                state = core.state()
                state.requests = core.request_progress()
                send(CoreStep([], None, state))
                changed = False
        if core.has_unfinished():
            step = core.step()
            if step.outputs or step.stats is not None or changed:  # not a bare poll for KV transfers
                send(step)
        elif changed:
            send(CoreStep([], None, core.state()))
