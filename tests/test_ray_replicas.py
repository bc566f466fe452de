"""``tokenmill serve --data-parallel-backend ray``: replicas as Ray actors on a local Ray cluster (one node; a
real multi-node cluster is not tested here), the prefix router in front: prefix affinity, an actor killed and
restarted by Ray at the same URL, a replica that cannot start, and a shutdown that leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.helpers import free_port, metric, wait_healthy

ray = pytest.importorskip("ray")

SYSTEM = ("You are the harbour master's assistant in a small fishing town. You answer questions about tides, "
          "berths, fuel, weather warnings and fees in one short sentence, politely, without guessing. ") * 3
SERVE_FLAGS = ["--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--itl-target-ms", "0", "--no-dashboard",
               "--request-timelines", "0", "--uvicorn-log-level", "warning", "--disable-log-requests",
               "--disable-log-stats", "--api-key", "sesame"]
AUTH = {"Authorization": "Bearer sesame"}  # the router's key, which the replicas get by environment


def _wait_for(fn, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not fn():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_replicas_get_the_serve_flags_but_the_ray_ones_and_their_environment(monkeypatch):
    from tokenmill.cli import build_parser
    from tokenmill.server.data_parallel import replica_argv
    from tokenmill.server.ray_replicas import RayReplicas, replica_env

    a = build_parser().parse_args(["serve", "-dp", "3", "-dpb", "ray", "--ray-num-cpus-per-replica", "2",
                                   "--max-n", "4"])
    assert (a.data_parallel_backend, a.ray_num_cpus_per_replica) == ("ray", 2.0)
    assert replica_argv(a) == ["--max-n", "4"]
    monkeypatch.setenv("TOKENMILL_ACTIVATIONS", "int8")
    monkeypatch.setenv("SECRET_OF_THE_DRIVER", "x")
    env = replica_env("k")
    assert env["TOKENMILL_ACTIVATIONS"] == "int8" and env["TOKENMILL_API_KEY"] == "k"
    assert "SECRET_OF_THE_DRIVER" not in env
    with pytest.raises(ValueError, match="must be positive"):
        RayReplicas([], 2, num_cpus=0)
    with pytest.raises(ValueError, match="at least 1"):
        RayReplicas([], 0)


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of 2 CPUs: room for two replicas of one CPU each."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _cpus_free() -> bool:
    return ray.available_resources().get("CPU", 0) == 2


def test_a_replica_that_cannot_start_fails_the_start_and_leaves_no_actor(cluster):
    from tokenmill.server.ray_replicas import NAMESPACE, RayReplicas

    # the model missing on its node: what a node without the model's files does
    replicas = RayReplicas(["/nowhere/model.gguf"], 1, name="tokenmill-broken", max_restarts=0)
    with pytest.raises(RuntimeError, match="did not start: replica .* exited with status"):
        replicas.start(timeout=120)
    _wait_for(lambda: _gone(replicas.actor_name(0), NAMESPACE))
    _wait_for(_cpus_free)  # the placement group is freed


def _gone(name: str, namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return True
    return False


def _server_pid(actor) -> int | None:  # noqa: ANN001 -- a Ray actor handle
    try:
        return ray.get(actor.info.remote(), timeout=30)[1]
    except ray.exceptions.RayActorError:  # restarting
        return None


def _chat(url: str, system: str, question: str) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, headers=AUTH, json={
        "model": "smollm2-135m-instruct", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    return r.json()


def _ok(url: str, replica: str) -> float:
    text = httpx.get(url + "/metrics", headers=AUTH).text
    return metric(text, "tokenmill:router_requests_total", instance=replica, outcome="ok")


@pytest.mark.slow
def test_ray_replicas_route_by_prefix_survive_a_killed_actor_and_stop_with_the_command(cluster, tmp_path):
    from tokenmill.server.ray_replicas import NAMESPACE

    port = free_port()
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 -- Ray relays the replicas' logs: a pipe could fill
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--data-parallel-size", "2",
                             "--data-parallel-backend", "ray", "--port", str(port), *SERVE_FLAGS],
                            stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "RAY_ADDRESS": cluster})
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, proc, timeout=300)
        except AssertionError:
            log.seek(0)
            raise AssertionError(log.read()[-5000:]) from None
        actors = [ray.get_actor(f"tokenmill-{port}-replica-{i}", namespace=NAMESPACE) for i in range(2)]
        info = dict(ray.get([a.info.remote() for a in actors]))  # url -> its server's pid
        by_url = dict(zip(info, actors, strict=True))
        assert not any(u.startswith("http://127.") for u in info)  # on the node's address, for other nodes
        assert {httpx.get(u + "/v1/models").status_code for u in info} == {401}  # the key reached them

        # the prefix router: a shared system prompt stays on one replica, whose cache holds it
        first = _chat(url, SYSTEM, "When is high tide?")
        second = _chat(url, SYSTEM, "How much is a berth for a night?")
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
        holder, other = sorted(info, key=lambda u: _ok(url, u), reverse=True)
        assert (_ok(url, holder), _ok(url, other)) == (2, 0)
        # negative control: the other replica never saw the prefix
        assert _chat(other, SYSTEM, "How much is a berth for a night?")["usage"]["prompt_tokens_details"][
            "cached_tokens"] == 0

        # Ray kills the holder's actor: its server goes with it, later requests go to the other replica
        old = psutil.Process(info[holder])
        ray.kill(by_url[holder], no_restart=False)
        old.wait(30)  # psutil.TimeoutExpired if the server outlived its actor
        for q in ("Is there fuel at the pier?", "Any weather warnings?"):
            _chat(url, SYSTEM, q)
        assert _ok(url, other) == 2
        # Ray restarts the actor in its placement, on the same node and port: the router's poll brings it back
        _wait_for(lambda: metric(httpx.get(url + "/metrics", headers=AUTH).text, "tokenmill:router_instance_up",
                                 instance=holder) == 1, timeout=120)
        again, pid = ray.get(by_url[holder].info.remote())
        assert again == holder and pid != old.pid
        assert _chat(holder, SYSTEM, "Where do I pay?")["usage"]["completion_tokens"] == 4

        # a server that exits on its own (its engine died, say) takes its actor with it, for Ray to restart both
        actor_pid = ray.get(by_url[other].__ray_call__.remote(lambda self: os.getpid()))
        psutil.Process(info[other]).kill()
        psutil.Process(actor_pid).wait(30)
        _wait_for(lambda: _server_pid(by_url[other]) not in (None, info[other]), timeout=120)
        _wait_for(lambda: metric(httpx.get(url + "/metrics", headers=AUTH).text, "tokenmill:router_instance_up",
                                 instance=other) == 1, timeout=120)
        assert _chat(other, SYSTEM, "Where do I pay?")["usage"]["completion_tokens"] == 4

        servers = [psutil.Process(pid) for _, pid in ray.get([a.info.remote() for a in actors])]
        everyone = servers + [c for s in servers for c in s.children(recursive=True)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        gone, alive = psutil.wait_procs(everyone, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
        for i in range(2):
            _wait_for(lambda i=i: _gone(f"tokenmill-{port}-replica-{i}", NAMESPACE))
        _wait_for(_cpus_free)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()
