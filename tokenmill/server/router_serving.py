"""Running ``tokenmill router`` (server/router.py) in the foreground: the command, and the uvicorn server it and
``tokenmill serve --data-parallel-size`` (server/data_parallel.py) run it on."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import TYPE_CHECKING

import uvicorn

from tokenmill.server.router import Router, build_router_app
from tokenmill.server.routing_policy import RoutingConfig

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

logger = logging.getLogger("tokenmill.router")


class RouterServer(uvicorn.Server):
    """uvicorn with two hooks: ``on_signal`` when SIGTERM/SIGINT arrives (before uvicorn's graceful shutdown),
    ``should_stop`` checked every tick (true: shut down)."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> None:
        super().__init__(config)
        self.on_signal, self.should_stop = on_signal, should_stop

    def handle_exit(self, sig: int, frame: object) -> None:
        if self.on_signal is not None:
            self.on_signal()
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.should_stop is not None and counter % 5 == 0 and self.should_stop():
            return True
        return await super().on_tick(counter)


def router_server(router: Router, host: str, port: int, api_key: str | None, log_level: str = "warning",
                  grace: float = 30.0, **hooks: Callable) -> RouterServer:
    from tokenmill.server.middleware import AuthMiddleware

    app = build_router_app(router)
    if api_key:
        app.add_middleware(AuthMiddleware, api_key=api_key)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=grace)
    return RouterServer(config, **hooks)


def run_server_until_signal(server: uvicorn.Server) -> None:
    """Run in the foreground; SIGTERM/SIGINT shut it down gracefully and return (uvicorn re-raises the signal
    once it is done: a clean return here, so the caller's cleanup runs). Off the main thread (tests) no
    handler can be installed: it just runs."""
    def done(signum: int, frame: object) -> None:
        raise SystemExit(0)

    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, done) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        server.run()
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_router(a: argparse.Namespace) -> int:
    """``tokenmill router``: serve until SIGTERM/SIGINT."""
    logging.getLogger("tokenmill").setLevel(logging.INFO)
    api_key = a.api_key or os.environ.get("TOKENMILL_API_KEY") or None
    routing = RoutingConfig(a.policy, a.cache_threshold, a.balance_abs_threshold, a.balance_rel_threshold,
                            a.max_tree_size)
    router = Router(a.prefill or (), a.decode or (), api_key, a.poll_interval, a.timeout, replicas=a.replica or (),
                    routing=routing)
    if router.replicas:
        logger.info("router on %s:%d: %s policy over replicas %s", a.host, a.port, routing.policy,
                    ", ".join(i.url for i in router.replicas))
    else:
        logger.info("router on %s:%d: prefill %s, decode %s", a.host, a.port, ", ".join(a.prefill),
                    ", ".join(a.decode))
    run_server_until_signal(router_server(router, a.host, a.port, api_key, a.uvicorn_log_level))
    return 0
