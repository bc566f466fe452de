"""Whether a request could ever run on this engine: its context, its KV blocks, its step budget. The front end
asks before it sends a request to the engine core (wherever that runs); the scheduler asks again at add."""

from __future__ import annotations

from tokenmill.config import SchedulerConfig
from tokenmill.sampling_params import InvalidParameter


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int, num_blocks: int, block_size: int,
               config: SchedulerConfig) -> None:
    """Raise ValueError if a request of this size could never run (the front end asks before it sends
    a request to the engine core, wherever that runs)."""
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise InvalidParameter(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds the "
            f"model's context length of {max_model_len} tokens; shorten the prompt or lower max_tokens",
            "max_tokens")
    need = -(-total // block_size)
    if need > num_blocks:
        raise InvalidParameter(
            f"this request needs {need} KV blocks ({total} tokens) but the whole KV cache has "
            f"{num_blocks}; raise --kv-cache-memory or lower max_tokens", "max_tokens")
    if not config.enable_chunked_prefill and total > config.max_num_batched_tokens:
        raise InvalidParameter(
            f"prompt + max_tokens ({total} tokens) exceeds max_num_batched_tokens "
            f"({config.max_num_batched_tokens}) and chunked prefill is off; raise "
            "--max-num-batched-tokens or pass --enable-chunked-prefill", "max_tokens")
