"""A model's tokenizer alone, no weights and no torch (what an API-server process needs), from whatever names
the model: here, above both the tokenizer and the model registry."""

from __future__ import annotations

from tokenmill.models.gguf_reader import open_gguf
from tokenmill.models.registry import ModelSource, resolve_model
from tokenmill.tokenizer import Tokenizer


def load_tokenizer(model: str | ModelSource) -> Tokenizer:
    """``model``: a built-in alias, a .gguf file, a Hugging Face folder, or a resolved ModelSource."""
    src = resolve_model(model) if isinstance(model, str) else model
    if src.format == "gguf":
        return Tokenizer.from_gguf(open_gguf(src.path))
    return Tokenizer.from_hf_folder(src.path)
