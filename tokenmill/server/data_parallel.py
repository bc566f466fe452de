"""``tokenmill serve --data-parallel-size N``: N replicas of the model on this machine behind the router.

Each replica is a ``tokenmill serve`` process of its own with the same flags on a free loopback port; the
KV cache's share of memory (a fraction in ``--kv-cache-memory``) and, on the CPU, the cores are divided
among them. Once every replica answers /health, the router (server/router.py, ``--router-policy``, prefix
by default) serves on the user's --host/--port in this process. SIGTERM/SIGINT drain the replicas and stop
the router; the replicas get SIGTERM from the kernel if this process dies any other way (Linux), so none
is left behind. A replica that dies is routed around; when every replica has died the router exits with
status 1, for a supervisor to restart the whole.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

logger = logging.getLogger("tokenmill.server")
STARTUP_TIMEOUT_S = 900.0
# the router's own flags, or set per replica
# (the API key goes by environment, not on a command line anyone on the machine can read)
_NOT_PASSED = {"host", "port", "data_parallel_size", "data_parallel_backend", "ray_num_cpus_per_replica",
               "router_policy", "kv_cache_memory", "api_key", "help"}


def _serve_parser() -> argparse.ArgumentParser:
    from tokenmill.engine.arg_utils import add_engine_args, add_kv_transfer_args
    from tokenmill.server.args import add_server_args

    p = argparse.ArgumentParser(add_help=False)
    add_server_args(p)
    add_engine_args(p)
    add_kv_transfer_args(p)
    return p


def replica_argv(a: argparse.Namespace) -> list[str]:
    """The ``serve`` flags of ``a`` that differ from their defaults, as a command line (but host, port, the
    data-parallel flags, the KV cache's size and the API key, which each replica gets from the parent)."""
    argv: list[str] = []
    for action in _serve_parser()._actions:
        value = getattr(a, action.dest, action.default)
        if action.dest in _NOT_PASSED or value == action.default or value is None:
            continue
        if not action.option_strings:  # the positional MODEL
            argv.append(str(value))
            continue
        flag = action.option_strings[0] if isinstance(action, argparse.BooleanOptionalAction) else \
            max(action.option_strings, key=len)
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            argv.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for v in value:
                argv += [flag, str(v)]
        elif action.nargs in ("+", "*") or isinstance(action.nargs, int):
            argv += [flag, *map(str, value)]
        elif isinstance(value, (tuple, list)):  # a type that splits its one argument (a,b -> tuple)
            argv += [flag, ",".join(map(str, value))]
        else:
            argv += [flag, str(value)]
    return argv


def kv_share(kv_cache_memory: str, n: int) -> str:
    """Each replica's --kv-cache-memory: a fraction of free memory divided by n; a size stays each one's."""
    try:
        return f"{float(kv_cache_memory) / n:.6g}"
    except ValueError:
        return kv_cache_memory


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (held together while picked, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGTERM this process when its parent dies, however it dies (PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def start_replica(cmd: Sequence[str], env: dict | None = None) -> subprocess.Popen:
    """A child process that gets SIGTERM when this one dies (where the OS offers that: Linux)."""
    parent = os.getpid()

    def setup() -> None:  # pragma: no cover - in the child
        _die_with_parent()
        if os.getppid() != parent:  # the parent died before the line above took effect
            os._exit(1)

    return subprocess.Popen(list(cmd), env=env, preexec_fn=setup if sys.platform.startswith("linux") else None)


def stop_replicas(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM (each drains its requests), then SIGKILL whatever is left after ``grace`` seconds."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("replica %d did not stop within %.0f s: killing it", p.pid, grace)
            p.kill()
            p.wait()


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _wait_ready(urls: Sequence[str], procs: Sequence[subprocess.Popen]) -> None:
    import httpx

    pending = dict(zip(urls, procs, strict=True))
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while pending:
        for url, p in list(pending.items()):
            if p.poll() is not None:
                raise RuntimeError(f"replica {url} exited with status {p.returncode} before it was ready")
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    del pending[url]
                    logger.info("replica %s is ready", url)
            except httpx.TransportError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"replicas {', '.join(pending)} not ready after {STARTUP_TIMEOUT_S:.0f} s")
        time.sleep(0.2)


def check_data_parallel(a: argparse.Namespace) -> str | None:
    """Refuse what replicas cannot do (each backend alike); the API key the replicas and the router take."""
    n = a.data_parallel_size
    if n < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, not {n}")
    if getattr(a, "kv_role", None):
        raise ValueError("--data-parallel-size with --kv-role: start prefill and decode instances apiece and put "
                         "`tokenmill router --prefill ... --decode ...` in front")
    if getattr(a, "step_log", None):
        raise ValueError("--step-log writes one engine's steps: run it on one replica (no --data-parallel-size)")
    return a.api_key or os.environ.get("TOKENMILL_API_KEY") or None


def serve_router(a: argparse.Namespace, urls: Sequence[str], api_key: str | None, on_signal: Callable[[], None],
                 should_stop: Callable[[], bool]) -> None:
    """The router (``--router-policy``) over ``urls`` on --host/--port, in the foreground until SIGTERM/SIGINT
    (``on_signal`` first: the replicas drain while it relays their last streams) or ``should_stop``."""
    from tokenmill.server.router import Router
    from tokenmill.server.router_serving import router_server, run_server_until_signal
    from tokenmill.server.routing_policy import RoutingConfig

    router = Router(api_key=api_key, replicas=urls, routing=RoutingConfig(a.router_policy))
    server = router_server(router, a.host, a.port, api_key, a.uvicorn_log_level, grace=a.drain_timeout + 5,
                           on_signal=on_signal, should_stop=should_stop)
    logger.info("router on %s:%d: %s policy over %d replicas", a.host, a.port, a.router_policy, len(urls))
    run_server_until_signal(server)


def run_data_parallel(a: argparse.Namespace) -> int:
    api_key = check_data_parallel(a)
    n = a.data_parallel_size
    env = dict(os.environ)
    if api_key:
        env["TOKENMILL_API_KEY"] = api_key
    if str(getattr(a, "device", "cpu")).startswith("cpu") and "OMP_NUM_THREADS" not in env:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        env["OMP_NUM_THREADS"] = str(max(1, cores // n))  # the cores shared out, not each replica on all
    argv = [*replica_argv(a), "--kv-cache-memory", kv_share(a.kv_cache_memory, n), "--host", "127.0.0.1"]
    urls, procs = [], []
    # SIGTERM while the replicas load: a clean exit through the finally below
    previous = signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        for port in free_ports(n):
            cmd = [sys.executable, "-m", "tokenmill.cli", "--log-level", a.log_level, "serve", *argv, "--port",
                   str(port)]
            urls.append(f"http://127.0.0.1:{port}")
            procs.append(start_replica(cmd, env))
        logger.info("starting %d replicas: %s", n, ", ".join(urls))
        try:
            _wait_ready(urls, procs)
        except RuntimeError as e:
            logger.error("%s", e)
            return 1
        signal.signal(signal.SIGTERM, previous)
        gone: set[int] = set()
        status = 0

        def all_gone() -> bool:
            nonlocal status
            for url, p in zip(urls, procs, strict=True):
                if p.pid not in gone and p.poll() is not None:
                    gone.add(p.pid)
                    logger.error("replica %s exited with status %s: routing around it", url, p.returncode)
            if len(gone) == len(procs):
                logger.error("every replica has exited: stopping")
                status = 1
            return status != 0

        def drain() -> None:  # the replicas drain their in-flight requests while the router relays them
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)

        serve_router(a, urls, api_key, drain, all_gone)
        return status
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_replicas(procs, a.drain_timeout + 10)
