"""Shared fixtures. The real default model loads once per test session."""

from __future__ import annotations

import pytest
import torch

from tokenmill.models.registry import DEFAULT_MODEL, resolve_model


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one torch thread in this process and in each parallel worker it starts (thread
    hand-offs cost more than the math, badly so on shared cores). Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import os

    n, env = torch.get_num_threads(), os.environ.get("TOKENMILL_TP_THREADS")
    torch.set_num_threads(1)
    os.environ["TOKENMILL_TP_THREADS"] = "1"
    yield
    torch.set_num_threads(n)
    if env is None:
        os.environ.pop("TOKENMILL_TP_THREADS", None)
    else:
        os.environ["TOKENMILL_TP_THREADS"] = env


@pytest.fixture(scope="session")
def gguf_path():
    return resolve_model(DEFAULT_MODEL).path


@pytest.fixture(scope="session")
def llm_fp32():
    """The default model with float32 weights (the GGUF dequantized), the precision the reference
    comparisons need (the default, --quantization auto, would keep the file's int4/int8 blocks). The server
    tests serve it, so it measures the roofline as `serve` does."""
    from tokenmill import LLM

    return LLM(DEFAULT_MODEL, dtype="float32", quantization="none", kv_cache_memory="256MiB", max_model_len=2048,
               measure_roofline=True)


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    """Hugging Face transformers' own loading of the same GGUF: the reference."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture()
def llm(llm_fp32):
    """The shared engine, checked to be idle with every KV block free after each test."""
    yield llm_fp32
    engine = llm_fp32.engine
    assert not engine.has_unfinished_requests(), "a test left requests in the engine"
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks, "KV blocks leaked"


@pytest.fixture(scope="session")
def llm_default():
    """The default model in the configuration a user gets with no flags (--quantization auto: the GGUF's
    own blocks on the integer kernels where they build)."""
    from tokenmill import LLM

    return LLM(DEFAULT_MODEL, kv_cache_memory="256MiB", max_model_len=2048)
