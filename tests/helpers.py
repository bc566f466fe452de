"""Test helpers that reach into the engine on purpose."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tokenmill.core.sched_output import ForwardRow
from tokenmill.layers.kernels import cpu_kernels, kernels_expected, unavailable_reason

# Kernel tests skip only where the kernels cannot exist (not x86 with AVX2, or no compiler); where they
# should, a failed build runs the tests and fails them.
needs_kernels = pytest.mark.skipif(cpu_kernels() is None and not kernels_expected(),
                                   reason=f"CPU kernels unavailable: {unavailable_reason()}")

PRECISIONS = ("int16", "int8")  # the kernels' activations (TOKENMILL_ACTIVATIONS)


@contextlib.contextmanager
def activations(name: str):
    """The kernels' activation precision set to ``name`` for the block, as it was after."""
    ops = cpu_kernels()
    before = ops.activation_precision("")
    ops.activation_precision(name)
    try:
        yield
    finally:
        ops.activation_precision(before)


@torch.inference_mode()
def prefill_logits(engine, token_ids: list[int]) -> torch.Tensor:
    """Logits [T, V] at every position, computed through the engine's paged KV cache with the inputs a
    scheduled step gets (one prefill chunk)."""
    kv = engine.kv_cache
    table = kv.allocate_slots("__probe__", len(token_ids))
    assert table is not None
    try:
        ids, pos, meta = engine.runner.inputs([ForwardRow(list(token_ids), 0, table)])
        return engine.runner.model(ids, pos, engine.runner.kv_caches, meta, pos)
    finally:
        kv.free("__probe__")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc, timeout: float = 120.0) -> None:  # noqa: ANN001 -- a subprocess.Popen
    """Wait until a server process answers /health 200; fail with its output if it exits first."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else f"exited with {proc.returncode}"
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)


def metric(text: str, name: str, **labels) -> float | None:
    """The sum of a /metrics page's samples called ``name`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    found = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                found = (found or 0.0) + s.value
    return found


def step_until_done(engine) -> dict:  # noqa: ANN001 -- an LLMEngine
    """Step an engine until nothing is unfinished; each finished request's last output, by id."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@contextlib.contextmanager
def served_engine(engine, api_key: str, **config):  # noqa: ANN001 -- an LLMEngine
    """The real server over ``engine`` on loopback (build_app with ServerConfig(api_key, dashboard off,
    **config)), as an httpx client with the key, the model's name (``.model``), the app (``.app``) and the
    server's address (``.url``)."""
    import httpx

    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.server.app import build_app
    from tokenmill.server.run import BackgroundServer
    from tokenmill.server.serving import ServerConfig

    ae = AsyncEngine(engine, max_waiting_requests=64, log_interval=None, log_requests=False)
    app = build_app(ae, ServerConfig(api_key=api_key, dashboard=False, **config))
    srv = BackgroundServer(app).start()
    try:
        with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=300) as http:
            http.model = http.get("/v1/models").json()["data"][0]["id"]
            http.app, http.url = app, srv.url
            yield http
    finally:
        srv.stop(60)
