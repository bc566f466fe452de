"""Default sampling parameters for `tokenmill generate` and `tokenmill chat` (vLLM's --generation-config).

- ``auto`` (default): the model's own ``generation_config.json`` where it ships one (a Hugging Face
  folder), over tokenmill's defaults; a GGUF file ships none, so it gets tokenmill's defaults.
- ``vllm``: tokenmill's defaults only, whatever the model ships (the name vLLM gives this choice).
- a folder: the ``generation_config.json`` in that folder, over tokenmill's defaults.

tokenmill's defaults are llama.cpp's sampler defaults (temperature 0.8, top-k 40, top-p 0.95, min-p
0.05): a model as small as the embedded one drifts or repeats itself greedy and rambles at
temperature 1. Flags given on the command line win over both; ``--temperature 0`` is greedy.
"""

from __future__ import annotations

import json
from pathlib import Path

DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0,
            "max_tokens": 256}

# generation_config.json key -> SamplingParams field
_HF_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def _from_file(path: Path) -> dict:
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix it or pass --generation-config vllm") from None
    out = {field: cfg[key] for key, field in _HF_KEYS.items() if cfg.get(key) is not None}
    if cfg.get("do_sample") is False:  # transformers then decodes greedily, whatever temperature says
        out["temperature"] = 0.0
    return out


def sampling_defaults(generation_config: str, model_path: Path | None) -> dict:
    """The default SamplingParams fields for this model and --generation-config value."""
    if generation_config == "vllm":
        return dict(DEFAULTS)
    if generation_config == "auto":
        folder = model_path if model_path is not None and model_path.is_dir() else None
        if folder is None or not (folder / "generation_config.json").is_file():
            return dict(DEFAULTS)
        return {**DEFAULTS, **_from_file(folder / "generation_config.json")}
    folder = Path(generation_config)
    if not (folder / "generation_config.json").is_file():
        raise ValueError(f"--generation-config {generation_config!r}: expected auto, vllm or a folder holding "
                         "generation_config.json")
    return {**DEFAULTS, **_from_file(folder / "generation_config.json")}
