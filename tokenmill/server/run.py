"""Running the server: uvicorn with a drain on SIGTERM and an exit on engine death, a background server for
tests, and ``tokenmill serve``."""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server.app import OpenAIServing, build_app
from tokenmill.server.lora import parse_lora_modules
from tokenmill.server.router_serving import run_server_until_signal
from tokenmill.server.serving import ServerConfig

if TYPE_CHECKING:
    import argparse
    from types import FrameType

    from tokenmill.engine.llm_engine import LLMEngine

logger = logging.getLogger("tokenmill.server")


ENGINE_DEATH_GRACE_S = 1.0
MAX_RESTARTS_PER_MINUTE = 3  # --restart-engine-core: more than this is a crash loop; give up  # --exit-on-engine-death: how long the error responses get to leave


class Server(uvicorn.Server):
    """uvicorn.Server that drains on SIGTERM/SIGINT.

    At the first signal admission stops (new requests and /health answer 503) and in-flight
    requests get ``drain_timeout`` seconds to finish; whatever is left is then aborted (its
    streams end with finish_reason "abort" and ``data: [DONE]``), and uvicorn shuts down. A
    second signal skips the wait.
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app
        self._drainer: threading.Thread | None = None
        self._engine_dead_since: float | None = None
        self._restarts: list[float] = []  # when the engine core was restarted (--restart-engine-core)
        self._restarting: threading.Thread | None = None

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's 0.1 s tick: also exit a while after the engine died, where the config asks for it
        (the in-flight requests have had their errors by then; a supervisor restarts the server)."""
        serving: OpenAIServing | None = getattr(self._app.state, "serving", None)  # None: another app
        if serving is not None and serving.engine.error is not None and self._restart(serving):
            return await super().on_tick(counter)
        if serving is not None and serving.config.exit_on_engine_death and serving.engine.error is not None:
            now = time.monotonic()
            if self._engine_dead_since is None:
                self._engine_dead_since = now
                logger.error("the engine died (%r): exiting in %.1f s", serving.engine.error, ENGINE_DEATH_GRACE_S)
            elif now - self._engine_dead_since >= ENGINE_DEATH_GRACE_S:
                return True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        serving: OpenAIServing = self._app.state.serving
        serving.draining = True
        serving.engine.stop_accepting()
        if self._drainer is None and not self.should_exit:
            logger.info("got signal %s: draining, up to %.1f s for %d in-flight requests", sig,
                        serving.config.drain_timeout, serving.engine.num_unfinished)
            self._drainer = threading.Thread(target=self._drain, args=(sig, frame), name="tokenmill-drain",
                                             daemon=True)
            self._drainer.start()
        else:
            super().handle_exit(sig, frame)

    def _drain(self, sig: int, frame: FrameType | None) -> None:
        serving: OpenAIServing = self._app.state.serving
        engine = serving.engine
        deadline = time.monotonic() + serving.config.drain_timeout
        while engine.is_running and engine.num_unfinished and time.monotonic() < deadline and not self.should_exit:
            time.sleep(0.05)
        if engine.is_running and engine.num_unfinished:
            logger.warning("drain timeout: aborting %d in-flight requests", engine.num_unfinished)
            engine.abort_all()
            end = time.monotonic() + 2.0  # let the streams send their last chunk
            while engine.is_running and engine.num_unfinished and time.monotonic() < end:
                time.sleep(0.05)
        super().handle_exit(sig, frame)

    def _restart(self, serving: OpenAIServing) -> bool:
        """--restart-engine-core: start a fresh core on a thread (once per death); False when restarting is
        off or has given up (3 restarts within a minute: a crash loop), so the exit rule applies."""
        if not serving.config.restart_engine_core:
            return False
        if self._restarting is not None and self._restarting.is_alive():
            return True
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < 60]
        if len(self._restarts) >= MAX_RESTARTS_PER_MINUTE:
            return False
        self._restarts.append(now)
        logger.error("the engine died (%r): starting a fresh engine core", serving.engine.error)
        llm_engine = serving.engine.engine

        def restart() -> None:
            try:
                serving.engine.restart(llm_engine.restart_core)
                logger.info("the engine core restarted")
            except Exception:  # noqa: BLE001 - the next tick tries again, or gives up
                logger.exception("the engine core did not restart")

        self._restarting = threading.Thread(target=restart, name="tokenmill-restart", daemon=True)
        self._restarting.start()
        return True


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
                access_log: bool = True) -> Server:
    # Our drain already finished or aborted everything; uvicorn's own grace is a short backstop.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=5)
    return Server(config, app)


class BackgroundServer:
    """The server on a thread of this process (tests, notebooks). ``port=0`` picks a free port."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self.app = app
        self.server = make_server(app, host, port, log_level=log_level, access_log=False)
        self.thread = threading.Thread(target=self.server.run, name="tokenmill-http", daemon=True)
        self.host = host

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def signal_exit(self) -> None:
        """What SIGTERM does to a server on the main thread: start draining and exit."""
        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def serve(engine: AsyncEngine, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, *,
          log_level: str = "info", access_log: bool = True) -> int:
    """Run the server in the foreground until SIGTERM/SIGINT, then drain and return 0."""
    app = build_app(engine, config)
    server = make_server(app, host, port, log_level=log_level, access_log=access_log)
    # What startup allocated lives as long as the server: out of the collector's sight, a full collection
    # under load does not walk it (vLLM does the same), so a shed request's 503 is not held up by one.
    gc.collect()
    gc.freeze()
    run_server_until_signal(server)
    return 0 if engine.error is None else 1


def configure_logging(a: argparse.Namespace) -> None:
    if a.log_level.upper() == "WARNING":  # the CLI default: a server should say what it does
        logging.getLogger("tokenmill").setLevel(logging.INFO)
    if a.disable_log_requests:
        logging.getLogger("tokenmill.requests").setLevel(logging.WARNING)
    if a.disable_log_stats:
        logging.getLogger("tokenmill.stats").setLevel(logging.WARNING)


def config_from_args(a: argparse.Namespace) -> ServerConfig:
    """ServerConfig from ``tokenmill serve`` flags; the API key falls back to $TOKENMILL_API_KEY."""
    api_key = a.api_key or os.environ.get("TOKENMILL_API_KEY") or None
    return ServerConfig(served_model_names=a.served_model_name or (), api_key=api_key, max_n=a.max_n,
                        max_logprobs=a.max_logprobs, max_prompts=a.max_prompts,
                        max_request_bytes=a.max_request_bytes, request_body_timeout=a.request_body_timeout,
                        drain_timeout=a.drain_timeout,
                        tool_call_parser=a.tool_call_parser, reasoning_parser=a.reasoning_parser,
                        chat_template=a.chat_template, exit_on_engine_death=a.exit_on_engine_death,
                        restart_engine_core=a.restart_engine_core, dashboard=a.dashboard,
                        request_timelines=a.request_timelines, otlp_traces_endpoint=a.otlp_traces_endpoint,
                        live_replay_interval=a.live_replay_interval,
                        responses_store_size=a.responses_store_size,
                        lora_modules=parse_lora_modules(getattr(a, "lora_modules", None) or ()))


def serve_args(llm_engine: LLMEngine, a: argparse.Namespace) -> int:
    """Serve an already built LLMEngine (or one with its interface) with ``tokenmill serve`` flags."""
    configure_logging(a)
    config = config_from_args(a)
    engine = AsyncEngine(llm_engine, max_waiting_requests=a.max_waiting_requests,
                         log_interval=0 if a.disable_log_stats else a.log_stats_interval,
                         log_requests=not a.disable_log_requests)
    step_log = None
    if getattr(a, "step_log", None):
        from tokenmill.engine.step_log import StepLog

        step_log = StepLog(a.step_log, llm_engine.info)
        engine.observers.append(step_log)
    if a.host not in ("127.0.0.1", "localhost", "::1") and not config.api_key:
        logger.warning("listening on %s without --api-key: anyone who can reach it can use it", a.host)
    try:
        return serve(engine, config, a.host, a.port, log_level=a.uvicorn_log_level,
                     access_log=not a.disable_access_log)
    finally:
        if step_log is not None:
            step_log.close()


def run_from_args(a: argparse.Namespace) -> int:
    """``tokenmill serve``: load the model (in the engine core's own process unless
    --no-engine-core-process), then serve it."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.arg_utils import engine_kwargs
    from tokenmill.engine.llm_engine import LLMEngine

    configure_logging(a)
    if getattr(a, "data_parallel_backend", "mp") == "ray":  # replicas as Ray actors: server/ray_replicas.py
        from tokenmill.server.ray_replicas import run_ray_data_parallel

        return run_ray_data_parallel(a)
    if getattr(a, "data_parallel_size", 1) != 1:  # N replicas behind the router: server/data_parallel.py
        from tokenmill.server.data_parallel import run_data_parallel

        return run_data_parallel(a)
    kwargs = engine_kwargs(a)
    if getattr(a, "model_arg", None):
        kwargs["model"] = a.model_arg
    config_from_args(a)  # flag errors before the slow model load
    if getattr(a, "step_log", None):
        try:
            open(a.step_log, "w").close()  # noqa: SIM115 -- a path that cannot be written fails now, not later
        except OSError as e:
            raise ValueError(f"--step-log {a.step_log}: cannot write it ({e.strerror})") from None
    if a.restart_engine_core and not a.engine_core_process:
        raise ValueError("--restart-engine-core restarts an engine core process: drop --no-engine-core-process")
    llm_engine = LLMEngine(EngineConfig.from_kwargs(**kwargs), core_process=a.engine_core_process)
    try:
        return serve_args(llm_engine, a)
    finally:
        llm_engine.shutdown()
