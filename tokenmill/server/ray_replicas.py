"""``tokenmill serve --data-parallel-size N --data-parallel-backend ray``: N replicas as Ray actors on a Ray
cluster's nodes, the router (server/router.py) on this machine in front of them.

Ray places the replicas: a placement group of one bundle per replica (``num_cpus``, and ``num_gpus`` on a GPU),
spread over the nodes where it can. Each replica is a ``ReplicaServer`` actor in its bundle that owns one
``tokenmill serve`` process (the same flags, server/data_parallel.py's ``replica_argv``) listening on its node's
address, on a port picked on that node before the actor starts. So when the actor dies (a crash, ``ray.kill``
with restarts left, its server exiting), Ray restarts it in the same bundle, on the same node, and it serves
at the same URL again: the router marks it down meanwhile (its failure and /health logic) and its poll brings
it back. The server process gets SIGTERM from the kernel when its actor's process dies however it dies, and
the actors die with the driver that made them (Ray's ownership), so nothing outlives the command.

Python, on a cluster already joined (``ray.init(...)``; ``start`` joins RAY_ADDRESS's or a local one if not)::

    replicas = RayReplicas(["--max-model-len", "4096"], 2, num_cpus=4)
    urls = replicas.start()          # once every replica answers /health
    ...                              # tokenmill router --replica URL ... or Router(replicas=urls)
    replicas.shutdown()
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from tokenmill.server.data_parallel import (STARTUP_TIMEOUT_S, _exit_cleanly, check_data_parallel, kv_share,
                                            replica_argv, serve_router, start_replica, stop_replicas)

if TYPE_CHECKING:
    from collections.abc import Sequence

logger = logging.getLogger("tokenmill.server")
NAMESPACE = "tokenmill"  # the actors' Ray namespace: ray.get_actor(name, namespace="tokenmill") finds them


def import_ray():  # noqa: ANN201 -- the ray module, an optional dependency
    try:
        import ray
    except ImportError as e:
        raise ImportError("--data-parallel-backend ray needs Ray: pip install 'tokenmill[ray]'") from e
    return ray


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _node_port() -> tuple[str, int]:
    """(This node's address as Ray knows it, a free port on it): run in a replica's bundle before its actor."""
    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


def _wait_port_free(host: str, port: int, timeout: float) -> None:
    """Until nothing listens on ``port`` (a restarted actor: its last server may still be draining)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT does not count
            try:
                s.bind((host, port))
                return
            except OSError:
                time.sleep(0.5)


class ReplicaServer:
    """One replica, as a Ray actor (``ray.remote(ReplicaServer)``): a ``tokenmill serve`` process it owns on its
    node's address. When that process exits on its own the actor ends too, so Ray restarts both."""

    def __init__(self, argv: Sequence[str], port: int, env: dict[str, str], log_level: str = "WARNING",
                 port_wait_s: float = 60.0) -> None:
        import ray

        self.host = ray.util.get_node_ip_address()
        self.url = _url(self.host, port)
        self.stopping = False
        self.starting = False  # wait_ready is watching: a server that exits is its to report
        _wait_port_free(self.host, port, port_wait_s)
        cmd = [sys.executable, "-m", "tokenmill.cli", "--log-level", log_level, "serve", *argv, "--host", self.host,
               "--port", str(port)]
        # started on the actor's main thread, which lives as long as its process: the parent-death signal is
        # tied to the thread that forked the child
        self.proc = start_replica(cmd, {**os.environ, **env})
        threading.Thread(target=self._watch, name="tokenmill-replica-watch", daemon=True).start()

    def _watch(self) -> None:
        code = self.proc.wait()
        if not (self.stopping or self.starting):
            logger.error("replica %s exited with status %s: ending its actor, for Ray to restart it", self.url, code)
            os._exit(1)

    def info(self) -> tuple[str, int]:
        """(URL, the server's pid)."""
        return self.url, self.proc.pid

    def wait_ready(self, timeout: float) -> str:
        import httpx

        self.starting = True
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:  # (the actor stays: the caller stops the lot)
                raise RuntimeError(f"replica {self.url} exited with status {self.proc.returncode} before it was ready")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    self.starting = False
                    if self.proc.poll() is not None:  # exited just now: the watcher let it be
                        os._exit(1)
                    return self.url
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica {self.url} not ready after {timeout:.0f} s")
            time.sleep(0.2)

    def drain(self) -> None:
        """SIGTERM: the server drains its in-flight requests and exits (the actor stays, for ``stop``)."""
        self.stopping = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, grace: float) -> None:
        self.stopping = True
        stop_replicas([self.proc], grace)


class RayReplicas:
    """``num_replicas`` ``tokenmill serve`` replicas with the flags ``serve_argv`` (no --host/--port/
    --kv-cache-memory: set here), placed by Ray. ``kv_cache_memory``: a fraction of free memory is divided
    among the replicas Ray put on the same node; a size is each one's. ``env``: set in each server's
    environment (on its node; the rest of its environment is its Ray worker's). ``max_restarts``: how often
    Ray restarts a dead replica (-1: always). ``strategy``: the placement group's (SPREAD: on distinct nodes
    where Ray can; PACK; STRICT_SPREAD)."""

    def __init__(self, serve_argv: Sequence[str], num_replicas: int, *, num_cpus: float = 1.0, num_gpus: float = 0.0,
                 kv_cache_memory: str = "0.1", env: dict[str, str] | None = None, max_restarts: int = 3,
                 name: str = "tokenmill", strategy: str = "SPREAD", log_level: str = "WARNING",
                 drain_timeout: float = 30.0) -> None:
        if num_replicas < 1:
            raise ValueError(f"the number of replicas must be at least 1, not {num_replicas}")
        if num_cpus <= 0:
            raise ValueError(f"--ray-num-cpus-per-replica must be positive, not {num_cpus}")
        self.argv, self.n = list(serve_argv), num_replicas
        self.bundle = {"CPU": float(num_cpus), **({"GPU": float(num_gpus)} if num_gpus else {})}
        self.kv_cache_memory, self.env, self.max_restarts = kv_cache_memory, dict(env or {}), max_restarts
        self.name, self.strategy, self.log_level, self.drain_timeout = name, strategy, log_level, drain_timeout
        self.actors: list = []
        self.urls: list[str] = []
        self.pids: list[int] = []  # each replica's server as last seen (a new one after a restart)
        self.dead: set[int] = set()  # replicas Ray gave up on (restarts spent)
        self.pg = None
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None

    def actor_name(self, i: int) -> str:
        return f"{self.name}-replica-{i}"

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> list[str]:
        """Place the replicas, start their servers and wait until each answers /health: their URLs. Raises
        RuntimeError (the replicas started so far stopped) if Ray cannot place them or one fails to start."""
        ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init()
        deadline = time.monotonic() + timeout
        try:
            self.pg = placement_group([dict(self.bundle)] * self.n, strategy=self.strategy, name=self.name)
            ready, _ = ray.wait([self.pg.ready()], timeout=10)
            if not ready:  # Ray waits for room (an autoscaler may add nodes): say what for
                logger.warning("waiting for Ray to place %d replicas of %s; the cluster has %s", self.n, self.bundle,
                               ray.available_resources())
                ready, _ = ray.wait([self.pg.ready()], timeout=max(1.0, deadline - time.monotonic()))
                if not ready:
                    raise RuntimeError(f"Ray could not place {self.n} replicas of {self.bundle} (the cluster has "
                                       f"{ray.cluster_resources()})")

            def where(i: int) -> PlacementGroupSchedulingStrategy:
                return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)

            probe = ray.remote(_node_port)

            def node_port(i: int):  # noqa: ANN202 -- a Ray object ref
                return probe.options(num_cpus=self.bundle["CPU"], scheduling_strategy=where(i)).remote()

            found = ray.get([node_port(i) for i in range(self.n)])
            while len(set(found)) < len(found):  # two replicas on one node got the same free port: pick again
                i = next(i for i, f in enumerate(found) if f in found[:i])
                found[i] = ray.get(node_port(i))
            per_node = Counter(host for host, _ in found)
            actor = ray.remote(ReplicaServer)
            for i, (host, port) in enumerate(found):
                argv = [*self.argv, "--kv-cache-memory", kv_share(self.kv_cache_memory, per_node[host])]
                self.actors.append(actor.options(
                    name=self.actor_name(i), namespace=NAMESPACE, max_restarts=self.max_restarts,
                    num_cpus=self.bundle["CPU"], num_gpus=self.bundle.get("GPU", 0), scheduling_strategy=where(i),
                ).remote(argv, port, self.env, self.log_level, self.drain_timeout + 30))
            logger.info("starting %d replicas on Ray: %s", self.n, ", ".join(_url(h, p) for h, p in found))
            left = max(1.0, deadline - time.monotonic())
            self.urls = ray.get([a.wait_ready.remote(left) for a in self.actors], timeout=left + 30)
            self.pids = [pid for _, pid in ray.get([a.info.remote() for a in self.actors])]
        except (ray.exceptions.RayError, RuntimeError) as e:
            self.shutdown(10)
            cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None else e
            raise RuntimeError(f"the Ray replicas did not start: {cause}") from e
        self._monitor = threading.Thread(target=self._watch, name="tokenmill-ray-monitor", daemon=True)
        self._monitor.start()
        return self.urls

    def _watch(self, interval: float = 2.0) -> None:
        """Note the replicas Ray restarted (logged) and those it gave up on (``dead``)."""
        ray = import_ray()
        actors = list(self.actors)  # (shutdown empties the list)
        while not self._stop.wait(interval):
            refs = {actors[i].info.remote(): i for i in range(self.n) if i not in self.dead}
            if not refs:
                return
            done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=5)
            for ref in done:
                i = refs[ref]
                try:
                    pid = ray.get(ref)[1]
                except ray.exceptions.ActorDiedError:
                    if not self._stop.is_set():
                        logger.error("replica %s died and Ray will not restart it", self.urls[i])
                        self.dead.add(i)
                    continue
                except ray.exceptions.RayActorError:  # restarting
                    continue
                if pid != self.pids[i]:
                    logger.warning("replica %s was restarted by Ray", self.urls[i])
                    self.pids[i] = pid

    def all_dead(self) -> bool:
        return len(self.dead) == self.n

    def drain(self) -> None:
        """Each server drains its in-flight requests and exits (not waited for)."""
        for a in self.actors:
            a.drain.remote()

    def shutdown(self, grace: float = 40.0) -> None:
        """Stop the servers (SIGTERM, SIGKILL after ``grace`` seconds), kill the actors, free their placement."""
        ray = import_ray()
        from ray.util.placement_group import remove_placement_group

        self._stop.set()
        actors, self.actors = self.actors, []
        if actors:
            ray.wait([a.stop.remote(grace) for a in actors], num_returns=len(actors), timeout=grace + 5)
        for a in actors:
            ray.kill(a)  # no restart; its server, if still there, gets SIGTERM from the kernel
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    def __enter__(self) -> RayReplicas:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def replica_env(api_key: str | None) -> dict[str, str]:
    """What the driver's environment gives each replica's server: tokenmill's own settings, the API key (by
    environment, never a command line), OMP_NUM_THREADS if set here (else each gets its reserved CPUs)."""
    env = {k: v for k, v in os.environ.items() if k.startswith("TOKENMILL_") or k == "OMP_NUM_THREADS"}
    if api_key:
        env["TOKENMILL_API_KEY"] = api_key
    return env


def run_ray_data_parallel(a: argparse.Namespace) -> int:
    api_key = check_data_parallel(a)
    try:
        ray = import_ray()
    except ImportError as e:
        raise ValueError(str(e)) from None  # (the command line's "tokenmill: error: ...")
    env = replica_env(api_key)
    on_gpu = str(getattr(a, "device", "cpu")).startswith("cuda")
    if not on_gpu and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, int(a.ray_num_cpus_per_replica)))
    gpus = a.tensor_parallel_size * a.pipeline_parallel_size if on_gpu else 0
    replicas = RayReplicas(replica_argv(a), a.data_parallel_size, num_cpus=a.ray_num_cpus_per_replica,
                           num_gpus=gpus, kv_cache_memory=a.kv_cache_memory, env=env, name=f"tokenmill-{a.port}",
                           log_level=a.log_level, drain_timeout=a.drain_timeout)
    # SIGTERM while the replicas load: a clean exit through the finally below
    previous = signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        try:
            urls = replicas.start()
        except RuntimeError as e:
            logger.error("%s", e)
            return 1
        signal.signal(signal.SIGTERM, previous)
        status = 0

        def all_dead() -> bool:
            nonlocal status
            if replicas.all_dead():
                logger.error("every replica has died: stopping")
                status = 1
            return status != 0

        serve_router(a, urls, api_key, replicas.drain, all_dead)
        return status
    finally:
        signal.signal(signal.SIGTERM, previous)
        replicas.shutdown(a.drain_timeout + 10)
        ray.shutdown()
