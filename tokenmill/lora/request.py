"""What a request says about its adapter (vLLM's LoRARequest), and what a step reports about adapters. Plain data:
the front end, the engine core's messages and the scheduler read it; nothing here imports torch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs with: ``lora_name`` (what /v1/models lists and a request's ``model`` field
    names), ``lora_int_id`` (unique per adapter, >= 1: the engine keeps adapters by it) and ``lora_path`` (a PEFT
    adapter folder, or a llama.cpp GGUF LoRA file)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs a lora_path (a PEFT folder or a GGUF file)")


@dataclass
class LoRAStats:
    """Adapters as of one step: the requests running and waiting with each adapter (by name), and counts since the
    engine started of adapters loaded from files into host memory and into the step's slots, and evicted from
    each (--max-cpu-loras, --max-loras)."""

    running: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    max_loras: int = 0
    host_loads: int = 0
    slot_loads: int = 0
    host_evictions: int = 0
    slot_evictions: int = 0
