"""One interface to the engine core wherever it runs (vLLM's EngineCoreClient). InprocClient calls an EngineCore
in this process; MPClient speaks to one in a process of its own (engine/core_process.py). LLMEngine holds one
and never asks which: the differences (what "now" means for the core's state, whether its parts can be looked
at, whether it can die apart from this process and be restarted) live here."""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenmill.engine.core_process import CoreProcessClient
from tokenmill.engine.messages import AbortRequests, CoreState, CoreStep
from tokenmill.structured_output import GrammarCompiler
from tokenmill.models.tokenizer_loader import load_tokenizer

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine.messages import EngineCoreRequest
    from tokenmill.engine.messages import CoreInfo
    from tokenmill.tokenizer import Tokenizer

# what tests, benchmarks and tools look at inside an engine core in this process (LLMEngine.scheduler, ...)
INSPECTABLE_PARTS = ("scheduler", "kv_cache", "runner", "device", "dtype", "startup")


class CoreClient(ABC):
    """The engine core as the front end sees it: sequences in (already validated), CoreSteps out."""

    config: EngineConfig
    info: CoreInfo
    tokenizer: Tokenizer
    grammars: GrammarCompiler  # the front end's grammar compiler (the input processor's)
    core: Any  # the EngineCore in this process, or the handle on the core's process (its .process)

    def __init__(self) -> None:
        self.progress: dict[str, tuple[str, int]] = {}  # a core process's last request_progress() answer

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, msg: AbortRequests) -> None: ...

    @abstractmethod
    def get_output(self) -> list[CoreStep]:
        """The steps the core finished since the last call (in this process: one step, run now)."""

    @abstractmethod
    def state(self) -> CoreState:
        """The core's counts: now in this process, as of its last message from another."""

    @property
    def num_unreported_adds(self) -> int:
        """Sequences sent since the last state (a core process's waiting count lags by them)."""
        return 0

    @abstractmethod
    def has_unfinished(self) -> bool:
        """Whether the core has work the front end's sequences do not show: requests, or KV transfers to
        see through (a core process reports the transfers it holds)."""

    @abstractmethod
    def request_progress(self) -> dict[str, tuple[str, int]]:
        """request id -> (RequestStatus value, tokens whose KV is computed); from a core process, its answer
        to the last call (each call asks again)."""

    @abstractmethod
    def check_invariants(self, on_step: Callable[[CoreStep], None], timeout: float) -> None:
        """Check the KV cache's invariants (AssertionError if one fails); ``on_step`` applies the steps
        that arrive before a core process answers."""

    @property
    @abstractmethod
    def pid(self) -> int: ...

    def parts(self) -> dict[str, Any]:
        """The in-process core's INSPECTABLE_PARTS; none from another process."""
        return {}

    def local_core(self, what: str) -> EngineCore:
        raise RuntimeError(f"{what} needs the engine core in this process; build the engine without "
                           "--engine-core-process")

    def check_alive(self) -> None:
        """Raise if the core has died (only a process of its own can die apart from this one)."""

    def restarted(self) -> CoreClient:
        """A fresh core in place of a dead one, same config."""
        raise RuntimeError("only an engine core in its own process can be restarted (--engine-core-process)")

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(CoreClient):
    """An EngineCore in this process, called directly."""

    def __init__(self, core: EngineCore) -> None:
        super().__init__()
        self.core, self.config, self.info, self.tokenizer = core, core.config, core.info, core.tokenizer
        self.grammars = core.grammars  # one vocabulary table for the front end and the runner's matchers

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add(request)

    def abort_requests(self, msg: AbortRequests) -> None:
        self.core.abort(msg)

    def get_output(self) -> list[CoreStep]:
        return [self.core.step()]

    def state(self) -> CoreState:
        return self.core.state()

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def request_progress(self) -> dict[str, tuple[str, int]]:
        return {rid: (status, computed) for rid, status, computed in self.core.request_progress()}

    def check_invariants(self, on_step: Callable[[CoreStep], None], timeout: float) -> None:
        self.core.kv_cache.check_invariants()

    @property
    def pid(self) -> int:
        return os.getpid()

    def parts(self) -> dict[str, Any]:
        return {name: getattr(self.core, name) for name in INSPECTABLE_PARTS}

    def local_core(self, what: str) -> EngineCore:
        return self.core

    def shutdown(self) -> None:
        if hasattr(self.core, "shutdown"):
            self.core.shutdown()


class MPClient(CoreClient):
    """An engine core in a process of its own, spoken to over ZeroMQ (vLLM's SyncMPClient). The core's state
    here is what its last message said."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None) -> None:
        super().__init__()
        self.config = config
        self.core = CoreProcessClient(config)
        try:
            # the tokenizer loads here while the core loads the model in its own process
            self.tokenizer = load_tokenizer(config.model) if tokenizer is None else tokenizer
            self.info = self.core.wait_ready()
        except BaseException:
            self.core.shutdown()
            raise
        self.grammars = GrammarCompiler(self.tokenizer, self.info.model_config.vocab_size)
        self._state = self.core.ready_state or CoreState(num_free_blocks=self.info.num_blocks)
        self._added_since_state = 0

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add(request)
        self._added_since_state += 1

    def abort_requests(self, msg: AbortRequests) -> None:
        self.core.abort(msg)

    def get_output(self) -> list[CoreStep]:
        steps = self.core.step()
        for step in steps:
            self._state, self._added_since_state = step.state, 0
            if step.state.requests is not None:
                self.progress = {rid: (status, computed) for rid, status, computed in step.state.requests}
        return steps

    def state(self) -> CoreState:
        return self._state

    @property
    def num_unreported_adds(self) -> int:
        return self._added_since_state

    def has_unfinished(self) -> bool:
        return self._state.num_kv_held > 0

    def request_progress(self) -> dict[str, tuple[str, int]]:
        self.core.report_requests()
        return self.progress

    def check_invariants(self, on_step: Callable[[CoreStep], None], timeout: float) -> None:
        self.core.check_invariants()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            answer = None
            for step in self.get_output():
                on_step(step)  # every step that came, the answer's included
                if step.state.invariants_checked:
                    answer = step.state
            if answer is not None:
                assert answer.invariant_error is None, answer.invariant_error
                return
        raise TimeoutError("the engine core did not answer the invariant check")

    @property
    def pid(self) -> int:
        return self.core.process.pid

    def check_alive(self) -> None:
        self.core.check_alive()

    def restarted(self) -> MPClient:
        self.core.shutdown()
        return MPClient(self.config, self.tokenizer)

    def shutdown(self) -> None:
        self.core.shutdown()


def make_client(config: EngineConfig, core_process: bool) -> CoreClient:
    """The core for ``config``: in a process of its own, or built here."""
    if core_process:
        return MPClient(config)
    # imported here: it loads torch, which a front end whose core runs elsewhere never needs
    from tokenmill.engine.builder import build_core

    return InprocClient(build_core(config))
