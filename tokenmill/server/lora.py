"""LoRA adapters on the server, as vLLM serves them: ``--lora-modules NAME=PATH`` at startup and
``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter`` at run time (behind the API key, as every route
but /health), each adapter listed in ``/v1/models`` with its base as ``parent`` and chosen by a request's
``model`` field; and the adapters on /metrics (vLLM's ``vllm:lora_requests_info``, tokenmill's loads and
evictions).

An adapter's files are checked here when it is registered (in numpy: this process may have no torch), so a bad
one is a 400 (404 where the path does not exist) and never reaches the engine; the engine core loads it when a
request first names it and keeps it by its id (tokenmill/lora/manager.py)."""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import json
import time
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import Counter, Gauge
from pydantic import BaseModel

from tokenmill.lora.adapter import LoRAError, read_adapter
from tokenmill.lora.request import LoRARequest
from tokenmill.server.protocol import OpenAIError, bad_request

if TYPE_CHECKING:
    from collections.abc import Sequence

    from prometheus_client import CollectorRegistry

    from tokenmill.engine.messages import CoreInfo, StepStats

# the adapter the request's ``model`` field named (ServingBase.check_model sets it, ServingBase.start reads it): each
# HTTP request runs in a task of its own, so the value never crosses to another request
REQUEST_LORA: contextvars.ContextVar[LoRARequest | None] = contextvars.ContextVar("request_lora", default=None)


def parse_lora_modules(specs: Sequence[str]) -> list[tuple[str, str]]:
    """--lora-modules as vLLM takes them: NAME=PATH, or JSON {"name", "path"}."""
    out = []
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                d = json.loads(spec)
                out.append((str(d["name"]), str(d["path"])))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules {spec!r}: a JSON module needs \"name\" and \"path\" ({e})") from None
            continue
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH (or JSON with name and path), got {spec!r}")
        out.append((name, path))
    return out


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class LoRAModels:
    """The adapters this server serves, by name (vLLM's OpenAIServingModels' share of LoRA)."""

    def __init__(self, info: CoreInfo | None, base_names: Sequence[str],
                 modules: Sequence[tuple[str, str]] = ()) -> None:
        self.info, self.base_names = info, list(base_names)
        self.enabled = info is not None and info.config.lora.enable_lora
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self.created = int(time.time())
        if modules and not self.enabled:
            raise ValueError("--lora-modules needs --enable-lora")
        for name, path in modules:  # at startup: a bad adapter stops the server with what is wrong
            self.add(name, path)

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def add(self, name: str, path: str) -> LoRARequest:
        """Check the adapter's files against the model and register it (LoRAError, OpenAIError if not)."""
        if not self.enabled:
            raise bad_request("LoRA adapters are not enabled on this server: start it with --enable-lora",
                              "lora_name")
        if not name or not path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
        if name in self.adapters or name in self.base_names:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        lora = self.info.config.lora
        read_adapter(path, self.info.model_config, lora.max_lora_rank, name)  # (raises LoRAError)
        request = LoRARequest(name, next(self._ids), path, self.base_names[0])
        self.adapters[name] = request
        return request

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "not_found")
        del self.adapters[name]  # requests running with it finish; the engine drops it from memory in its turn

    def cards(self, max_model_len: int) -> list[dict]:
        return [{"id": r.lora_name, "object": "model", "created": self.created, "owned_by": "tokenmill",
                 "root": r.lora_path, "parent": r.base_model_name, "max_model_len": max_model_len}
                for r in self.adapters.values()]


def add_lora_routes(app: FastAPI, loras: LoRAModels) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies and plain-text answers)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        try:
            await asyncio.to_thread(loras.add, body.lora_name, body.lora_path)
        except LoRAError as e:
            missing = "does not exist" in str(e)  # vLLM: an adapter it cannot find is a 404
            raise OpenAIError(404 if missing else 400, str(e), "lora_path", "not_found" if missing else None) \
                from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        loras.remove(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


class LoRAMetrics:
    """An engine observer: vLLM's ``vllm:lora_requests_info`` (labels: the adapters running and waiting, comma
    separated, and max_lora; the value the time of the step it describes) and ``tokenmill:lora_loads_total`` /
    ``tokenmill:lora_evictions_total`` by tier: ``host`` (loaded from files into memory, --max-cpu-loras) and
    ``slot`` (into the step's working set, --max-loras)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                          ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=registry)
        self.loads = Counter("tokenmill:lora_loads", "LoRA adapters loaded: from their files into host memory "
                             "(tier host) or into the slots a step runs (tier slot).", ["model_name", "tier"],
                             registry=registry)
        self.evictions = Counter("tokenmill:lora_evictions", "LoRA adapters evicted, least recently used first: "
                                 "from host memory (tier host, --max-cpu-loras) or from a slot (tier slot, "
                                 "--max-loras).", ["model_name", "tier"], registry=registry)
        self.model_name = model_name
        self._seen = (0, 0, 0, 0)

    def on_step(self, stats: StepStats) -> None:
        s = stats.lora
        if s is None:
            return
        self.info.clear()  # one sample: the adapters as of the last step
        self.info.labels(str(s.max_loras), ",".join(sorted(s.waiting)), ",".join(sorted(s.running))).set(time.time())
        now = (s.host_loads, s.slot_loads, s.host_evictions, s.slot_evictions)
        for value, seen, counter, tier in zip(now, self._seen, (self.loads, self.loads, self.evictions,
                                                                 self.evictions), ("host", "slot", "host", "slot")):
            if value > seen:
                counter.labels(self.model_name, tier).inc(value - seen)
        self._seen = now

    def on_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        pass

    def on_request_finished(self, output, now: float) -> None:  # noqa: ANN001 -- a RequestOutput
        pass
