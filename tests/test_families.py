"""Model families beyond Llama/Qwen2: Qwen3 (q/k norms), Mistral (sliding window), Gemma 2 (sandwich norms,
GELU, embedding scale, soft caps, alternating window), Phi-3 (fused checkpoint tensors), Gemma 3 (Gemma 2's
extras with q/k norms, five local layers to a global one, two RoPE bases), Phi-3.5/Phi-4-mini (partial RoPE,
longrope), Llama with YaRN and dynamic NTK RoPE, and SmolLM3 (no RoPE on every fourth layer).

Each is a tiny random model built with transformers' own classes (tiny_models.py), saved as a Hugging
Face folder and, where the family has GGUF metadata, written as a GGUF file the way llama.cpp's
converter lays it out; tokenmill's logits at every position and its greedy tokens are compared with
transformers' on the same weights. The prompt (36 tokens) is longer than the 8-token windows, so a
model that ignored the window would fail; the guards below check that each feature matters.
"""

from __future__ import annotations

import copy
import json
import shutil

import gguf
import pytest
import torch
from helpers import prefill_logits
from test_loaders import N_GEN, TOL, check_against, engine_greedy, make_llm, rel_err

import tiny_models as tm

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

T = gguf.GGMLQuantizationType
TEXT = "The quick brown fox, hello world! Once upon a time 1, 2, 3"

# Phi-4-mini's shape: RoPE over 3/4 of each head, longrope factors (original context 32 here, shorter than the
# prompt, so the long ones apply), no sliding window
PHI4_ROPE = {"rope_type": "longrope", "partial_rotary_factor": 0.75, "rope_theta": 10000.0,
             "short_factor": [1.0 + 0.05 * i for i in range(6)], "long_factor": [1.0 + 0.5 * i for i in range(6)]}
# case -> (architecture, random_hf_model overrides); a case not listed is its own architecture with its defaults
VARIANTS = {
    "phi4-mini": ("phi3", {"rope_parameters": PHI4_ROPE, "original_max_position_embeddings": 32,
                           "sliding_window": None, "eos_token_id": 2}),
    "llama-yarn": ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                 "original_max_position_embeddings": 16},
                             "max_position_embeddings": 64}),
    "llama-dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
}
# dynamic NTK's base is fixed by max_model_len: at the original context (256) it is the plain base, which is what
# transformers uses for any sequence that short; the default (512, the scaled context) is checked below
LLM_KW = {"llama-dynamic": {"max_model_len": 256}}
FAMILIES = ["qwen3", "mistral", "gemma2", "phi3", "gemma3", "phi4-mini", "llama-yarn", "llama-dynamic", "smollm3"]
ARCH = {"phi4-mini": "phi3", "llama-yarn": "llama", "llama-dynamic": "llama"}
WINDOWS = {"mistral": (8, 8), "gemma2": (8, 0), "phi3": (8, 8), "gemma3": (8, 8, 8, 8, 8, 0)}


def random_model(case: str, seed: int, **overrides):
    arch, kw = VARIANTS.get(case, (case, {}))
    return tm.random_hf_model(arch, seed=seed, **{**kw, **overrides})


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    ids = tm.hf_tokenizer().encode(TEXT).ids
    assert len(ids) > 4 * 8  # several windows long
    return ids


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> (transformers model, HF folder), built once."""
    cache = {}

    def get(family):
        if family not in cache:
            model = random_model(family, seed=5)
            cache[family] = (model, tm.save_hf_folder(model, tmp_path_factory.mktemp(family)))
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_folder_matches_transformers(family, built, prompt_ids):
    model, folder = built(family)
    llm = make_llm(folder, **LLM_KW.get(family, {}))
    cfg = llm.engine.model_config
    assert cfg.architecture == ARCH.get(family, family)
    assert (cfg.qk_norm == "head") == (family in ("qwen3", "gemma3"))
    assert cfg.layer_windows == WINDOWS.get(family, ())
    assert cfg.rotary_dim == (12 if family == "phi4-mini" else 0)
    assert cfg.no_rope_layers == ((1, 1, 1, 0) if family == "smollm3" else ())
    assert cfg.rope_theta == tm.global_rope(model.config)["rope_theta"]
    assert cfg.rope_local_base_freq == (10000.0 if family == "gemma3" else None)
    check_against(llm, model, prompt_ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_default_mode_and_chunked_prefill_match(family, built, prompt_ids):
    """The configuration a user gets (quantization auto, the CPU kernels where they run) and prefill in
    chunks smaller than the prompt (a chunk attends to cached context through the window)."""
    model, folder = built(family)
    ref = tm.hf_greedy(model, prompt_ids, N_GEN)
    llm = make_llm(folder, quantization="auto", max_num_batched_tokens=16, enable_chunked_prefill=True,
                   **LLM_KW.get(family, {}))
    assert engine_greedy(llm, [prompt_ids])[0] == ref
    # a batch of different lengths gives each prompt its own tokens (Phi-4-mini: all past the original context,
    # where transformers takes the long factors too)
    prompts = [prompt_ids[:5], prompt_ids, prompt_ids[3:30]] if family != "phi4-mini" else \
        [prompt_ids[:33], prompt_ids, prompt_ids[1:35]]
    assert engine_greedy(llm, prompts) == [tm.hf_greedy(model, p, N_GEN) for p in prompts]


def _rebuild_rope(m) -> None:
    """transformers' rotary embedding made again from the (edited) config."""
    m.model.rotary_emb = type(m.model.rotary_emb)(m.config)


def _gemma3_one_base(m) -> None:  # the local layers take the global layers' RoPE
    m.config.rope_parameters["sliding_attention"] = dict(m.config.rope_parameters["full_attention"])
    _rebuild_rope(m)


def _gemma3_no_window(m) -> None:  # the same layers local and global, the window as long as the context
    m.config.sliding_window = 256
    for layer in m.model.layers:
        if layer.self_attn.sliding_window:
            layer.self_attn.sliding_window = 256


def _phi4_rope(m, **change) -> None:
    m.config.rope_parameters = {**m.config.rope_parameters, **change}
    _rebuild_rope(m)


def _smollm3_rope_everywhere(m) -> None:
    for layer in m.model.layers:
        layer.self_attn.use_rope = 1


def _rope_default(m) -> None:
    m.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    _rebuild_rope(m)


# What each family's feature is, switched off in the reference: the difference must be far beyond TOL,
# or the tests above could pass with the feature ignored.
GUARDS = {
    "qwen3-qk-norm": ("qwen3", lambda m: [setattr(layer.self_attn, n, torch.nn.Identity())
                                         for layer in m.model.layers for n in ("q_norm", "k_norm")]),
    "mistral-window": ("mistral", lambda m: setattr(m.config, "sliding_window", None)),
    "gemma2-softcap": ("gemma2", lambda m: (setattr(m.config, "attn_logit_softcapping", None),
                                            setattr(m.config, "final_logit_softcapping", None))),
    "gemma2-window": ("gemma2", lambda m: setattr(m.config, "layer_types", ["full_attention"] * 2)),
    "phi3-window": ("phi3", lambda m: setattr(m.config, "sliding_window", None)),
    "gemma3-local-base": ("gemma3", _gemma3_one_base),
    "gemma3-window": ("gemma3", _gemma3_no_window),
    "gemma3-qk-norm": ("gemma3", lambda m: [setattr(layer.self_attn, n, torch.nn.Identity())
                                           for layer in m.model.layers for n in ("q_norm", "k_norm")]),
    "phi4-longrope": ("phi4-mini", lambda m: _phi4_rope(m, rope_type="default")),
    "phi4-partial": ("phi4-mini", lambda m: _phi4_rope(m, partial_rotary_factor=1.0,
                                                       short_factor=PHI4_ROPE["short_factor"] + [1.0, 1.0],
                                                       long_factor=PHI4_ROPE["long_factor"] + [1.0, 1.0])),
    "llama-yarn": ("llama-yarn", _rope_default),
    "smollm3-nope": ("smollm3", _smollm3_rope_everywhere),
}


@pytest.mark.parametrize("case", list(GUARDS))
def test_family_features_matter(case, built, prompt_ids):
    family, switch_off = GUARDS[case]
    model, _ = built(family)
    plain = copy.deepcopy(model)
    switch_off(plain)
    for layer in plain.model.layers:  # attention reads its window/caps from the config at call time
        layer.self_attn.config = plain.config
        if hasattr(layer.self_attn, "sliding_window") and family != "gemma3":
            window = plain.config.sliding_window
            if family == "gemma2":
                window = window if plain.config.layer_types[layer.self_attn.layer_idx] == "sliding_attention" else None
            layer.self_attn.sliding_window = window
        if hasattr(layer.self_attn, "attn_logit_softcapping"):
            layer.self_attn.attn_logit_softcapping = plain.config.attn_logit_softcapping
        if hasattr(layer, "attention_type") and family == "gemma2":
            layer.attention_type = plain.config.layer_types[layer.self_attn.layer_idx]
    assert rel_err(tm.hf_logits(plain, prompt_ids), tm.hf_logits(model, prompt_ids)) > 100 * TOL


# ---- RoPE fixed per configuration (batch invariance) ---------------------------------------

def test_longrope_factors_follow_max_model_len(built, prompt_ids):
    """Phi-3.5/Phi-4-mini: transformers picks the short or long factors by the length of the sequence in each
    forward pass; tokenmill by max_model_len (as vLLM and llama.cpp's context size do), so a request's tokens
    never depend on its batch. Up to the original context (32) the short factors give transformers' logits for
    a sequence that short; past it the long factors (the default: max_model_len 256) give different ones."""
    model, folder = built("phi4-mini")
    short = prompt_ids[:12]  # 12 + 16 generated tokens stay within the original context
    check_against(make_llm(folder, max_model_len=32), model, short)
    long_llm = make_llm(folder)
    assert rel_err(prefill_logits(long_llm.engine, short), tm.hf_logits(model, short)) > 100 * TOL


def test_dynamic_ntk_is_fixed_by_max_model_len(built, prompt_ids):
    """Dynamic NTK: the base transformers would take at a sequence of max_model_len tokens, for every sequence.
    The default max_model_len is the scaled context (2 x 256, vLLM's rule and vLLM's base); transformers set to
    that length's frequencies agrees, and its own short-sequence frequencies (the plain base) do not."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model, folder = built("llama-dynamic")
    llm = make_llm(folder)
    assert llm.engine.max_model_len == 512
    want, _ = ROPE_INIT_FUNCTIONS["dynamic"](model.config, None, seq_len=512)
    assert torch.allclose(llm.engine.runner.model.rope.inv_freq, want, rtol=1e-6)
    scaled = copy.deepcopy(model)
    scaled.model.rotary_emb.inv_freq.copy_(want)  # (36 tokens: transformers' own update leaves it alone)
    check_against(llm, scaled, prompt_ids)
    assert rel_err(prefill_logits(llm.engine, prompt_ids), tm.hf_logits(model, prompt_ids)) > 100 * TOL


@pytest.mark.parametrize("family", ["gemma3", "phi4-mini", "llama-dynamic", "smollm3"])
def test_rope_variants_are_batch_invariant(family, built, prompt_ids):
    """Per-layer RoPE tables, partial RoPE, longrope and dynamic NTK fixed by max_model_len: a request's tokens
    and logprobs are the same bits alone as batched with others and prefilled in chunks."""
    from tokenmill import SamplingParams

    _, folder = built(family)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    alone = make_llm(folder, quantization="auto").generate([prompt_ids], params, use_tqdm=False)[0].outputs[0]
    mixed = make_llm(folder, quantization="auto", max_num_batched_tokens=16, enable_chunked_prefill=True)
    out = mixed.generate([prompt_ids[3:20], prompt_ids, prompt_ids[:9]], params, use_tqdm=False)[1].outputs[0]
    assert alone.logprobs and out.token_ids == alone.token_ids and out.logprobs == alone.logprobs


# ---- GGUF --------------------------------------------------------------------------------

def family_metadata(config) -> tuple[dict, dict]:
    """What llama.cpp's converter writes for ``config``: the metadata (suffixes after the architecture) and the
    extra tensors (Phi-3's longrope factors)."""
    rope, tensors = tm.rope_gguf_metadata(config)
    meta = {**tm.llama_metadata(config), **rope, "attention.key_length": tm.head_dim(config),
            "attention.value_length": tm.head_dim(config)}
    if getattr(config, "sliding_window", None):
        meta["attention.sliding_window"] = config.sliding_window
    elif config.model_type == "phi3":
        meta["attention.sliding_window"] = 0  # (the converter's mark of Phi-4)
    if config.model_type == "gemma2":
        meta["attn_logit_softcapping"] = float(config.attn_logit_softcapping)
    if config.model_type in ("gemma2", "gemma3_text") and config.final_logit_softcapping:
        meta["final_logit_softcapping"] = float(config.final_logit_softcapping)
    return meta, tensors


# family -> GGUF architecture; Gemma 2/3's files get the scale llama.cpp assumes (1/sqrt(head_dim)). Dynamic NTK has
# no GGUF form (the converter drops it): its file is a plain-RoPE model, transformers' dynamic model up to the
# original context.
GGUF_FAMILIES = {"qwen3": ("qwen3", {}), "mistral": ("llama", {}),
                 "gemma2": ("gemma2", {"query_pre_attn_scalar": 16}), "phi3": ("phi3", {}),
                 "gemma3": ("gemma3", {"query_pre_attn_scalar": 16}), "phi4-mini": ("phi3", {}),
                 "llama-yarn": ("llama", {}), "llama-dynamic": ("llama", {}), "smollm3": ("smollm3", {})}


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_file_matches_transformers(family, qtype, tmp_path, prompt_ids):
    arch, overrides = GGUF_FAMILIES[family]
    model = random_model(family, seed=6, **overrides)
    quant = T[qtype]
    tensors = tm.hf_to_gguf_tensors(model, None if qtype == "F32" else (lambda n, w: quant))
    if qtype != "F32":  # the reference sees exactly the values the file holds
        with torch.no_grad():
            for name, p in model.named_parameters():
                stored = tensors[tm.gguf_name(name, arch)]
                if p.dim() == 2:
                    p.copy_(torch.from_numpy(tm.stored_value(p.detach().numpy(), stored[1])))
    meta, extra = family_metadata(model.config)
    path = tm.write_gguf(tmp_path / f"{family}.gguf", {**tensors, **extra}, arch=arch, metadata=meta)
    llm = make_llm(path, **LLM_KW.get(family, {}))
    cfg = llm.engine.model_config
    assert cfg.architecture == arch and (cfg.qk_norm == "head") == (family in ("qwen3", "gemma3"))
    assert cfg.sandwich_norms == (family in ("gemma2", "gemma3"))
    assert cfg.layer_windows == WINDOWS.get(family, ())
    assert (cfg.rotary_dim, cfg.no_rope_layers) == ((12, ()) if family == "phi4-mini" else
                                                    (0, (1, 1, 1, 0)) if family == "smollm3" else (0, ()))
    check_against(llm, model, prompt_ids)
    # the file's own blocks (gguf mode, fused Phi-3 tensors included) give the same greedy tokens here
    if qtype == "Q8_0":
        kept = make_llm(path, quantization="gguf", **LLM_KW.get(family, {}))
        assert engine_greedy(kept, [prompt_ids]) == engine_greedy(llm, [prompt_ids])


def test_gemma3_gguf_serves_through_the_cli(tmp_path, prompt_ids):
    """`tokenmill serve` on a random Gemma 3 GGUF (Q8_0, run in the default mode: its own blocks, the engine core
    in its own process) answers the official client with transformers' greedy tokens."""
    import os
    import subprocess
    import sys

    from helpers import free_port, wait_healthy
    from openai import OpenAI

    model = random_model("gemma3", seed=6, query_pre_attn_scalar=16)
    tensors = tm.hf_to_gguf_tensors(model, lambda n, w: T.Q8_0)
    with torch.no_grad():  # the reference holds the file's values
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.from_numpy(tm.stored_value(p.detach().numpy(), T.Q8_0)))
    meta, _ = family_metadata(model.config)
    path = tm.write_gguf(tmp_path / "gemma3.gguf", tensors, arch="gemma3", metadata=meta)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", str(path), "--port", str(port),
                             "--kv-cache-memory", "16MiB", "--uvicorn-log-level", "warning", "--disable-log-requests"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        client = OpenAI(base_url=url + "/v1", api_key="unused")
        name = client.models.list().data[0].id
        r = client.completions.create(model=name, prompt=prompt_ids, max_tokens=N_GEN, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == N_GEN
        assert r.choices[0].text == tm.hf_tokenizer().decode(tm.hf_greedy(model, prompt_ids, N_GEN))
    finally:
        proc.kill()
        proc.wait(30)


def test_transformers_reads_our_gemma2_gguf(tmp_path, prompt_ids):
    """Our test writer lays Gemma 2 out as llama.cpp does: transformers' own GGUF reader agrees."""
    model = tm.random_hf_model("gemma2", seed=6, head_dim=256, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                               final_logit_softcapping=30.0, sliding_window=4096)
    meta, _ = family_metadata(model.config)
    path = tm.write_gguf(tmp_path / "g.gguf", tm.hf_to_gguf_tensors(model), arch="gemma2", metadata=meta)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    assert rel_err(tm.hf_logits(theirs, prompt_ids), tm.hf_logits(model, prompt_ids)) < TOL
    llm = make_llm(path)
    assert rel_err(prefill_logits(llm.engine, prompt_ids), tm.hf_logits(model, prompt_ids)) < TOL


# ---- bad input ---------------------------------------------------------------------------

def _edited(folder, tmp_path, edit):
    bad = shutil.copytree(folder, tmp_path / "bad", dirs_exist_ok=True)
    cfg = json.loads((bad / "config.json").read_text())
    edit(cfg)
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


REFUSALS = {  # HF config edit -> what the error names
    "rope-type": (lambda c: c.update(rope_scaling={"rope_type": "mrope", "mrope_section": [4, 2, 2]}),
                  r"rope scaling 'mrope' is not supported \(supported: default, linear, llama3, yarn, dynamic, longrope\)"),
    "activation": (lambda c: c.update(hidden_act="relu2"), "relu2"),
    "architecture": (lambda c: c.update(model_type="gemma3n_text"), r"'gemma3n_text' is not supported.*gemma3_text.*smollm3"),
    "gemma3-multimodal": (lambda c: c.update(model_type="gemma3", text_config={}), "multimodal"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_unsupported_settings_are_clear_errors(case, built, tmp_path):
    edit, pattern = REFUSALS[case]
    with pytest.raises(ValueError, match=pattern):
        make_llm(_edited(built("phi3")[1], tmp_path, edit))


def test_unsupported_gguf_rope_is_a_clear_error(tmp_path):
    model = tm.random_hf_model("llama", seed=6)
    meta = {**family_metadata(model.config)[0], "rope.scaling.type": "xpos"}
    path = tm.write_gguf(tmp_path / "x.gguf", tm.hf_to_gguf_tensors(model), metadata=meta)
    with pytest.raises(ValueError, match=r"rope scaling 'xpos' is not supported \(supported: linear, yarn"):
        make_llm(path)


def test_inspect_names_each_familys_features(built):
    from tokenmill.models.inspect import describe

    want = {"qwen3": "q/k RMSNorm per head", "mistral": "sliding window 8 on 2 of 2 layers",
            "gemma2": "final logit soft cap 10", "phi3": "sliding window 8 on 2 of 2 layers",
            "gemma3": "RoPE base 10000 on the 5 sliding-window layers, 1e+06 on the others",
            "phi4-mini": "partial RoPE: 12 of 16 dims", "llama-yarn": "RoPE yarn x4 of 16 positions",
            "llama-dynamic": "RoPE dynamic NTK x2 of 256 positions (base fixed by max_model_len)",
            "smollm3": "no RoPE on 1 of 4 layers"}
    for family, feature in want.items():
        d = describe(str(built(family)[1]))
        assert d["architecture"] == ARCH.get(family, family) and feature in d["features"], d["features"]
    assert any(f.startswith("RoPE longrope") for f in describe(str(built("phi4-mini")[1]))["features"])
