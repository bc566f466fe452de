"""Model families beyond Llama/Qwen2: Qwen3 (q/k norms), Mistral (sliding window), Gemma 2 (sandwich norms,
GELU, embedding scale, soft caps, alternating window) and Phi-3 (fused checkpoint tensors).

Each is a tiny random model built with transformers' own classes (tiny_models.py), saved as a Hugging
Face folder and, where the family has GGUF metadata, written as a GGUF file the way llama.cpp's
converter lays it out; tokenmill's logits at every position and its greedy tokens are compared with
transformers' on the same weights. The prompt (36 tokens) is longer than the 8-token windows, so a
model that ignored the window would fail; the guards below check that each feature matters.
"""

from __future__ import annotations

import copy

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

FAMILIES = ["qwen3", "mistral", "gemma2", "phi3"]


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
            model = tm.random_hf_model(family, seed=5)
            cache[family] = (model, tm.save_hf_folder(model, tmp_path_factory.mktemp(family)))
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_folder_matches_transformers(family, built, prompt_ids):
    model, folder = built(family)
    llm = make_llm(folder)
    cfg = llm.engine.model_config
    assert cfg.architecture == family
    assert (cfg.qk_norm == "head") == (family == "qwen3")
    windows = {"qwen3": (), "mistral": (8, 8), "gemma2": (8, 0), "phi3": (8, 8)}[family]
    assert cfg.layer_windows == windows
    check_against(llm, model, prompt_ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_default_mode_and_chunked_prefill_match(family, built, prompt_ids):
    """The configuration a user gets (quantization auto, the CPU kernels where they run) and prefill in
    chunks smaller than the prompt (a chunk attends to cached context through the window)."""
    model, folder = built(family)
    ref = tm.hf_greedy(model, prompt_ids, N_GEN)
    llm = make_llm(folder, quantization="auto", max_num_batched_tokens=16, enable_chunked_prefill=True)
    assert engine_greedy(llm, [prompt_ids])[0] == ref
    # a batch of different lengths gives each prompt its own tokens
    prompts = [prompt_ids[:5], prompt_ids, prompt_ids[3:30]]
    assert engine_greedy(llm, prompts) == [tm.hf_greedy(model, p, N_GEN) for p in prompts]


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
}


@pytest.mark.parametrize("case", list(GUARDS))
def test_family_features_matter(case, built, prompt_ids):
    family, switch_off = GUARDS[case]
    model, _ = built(family)
    plain = copy.deepcopy(model)
    switch_off(plain)
    for layer in plain.model.layers:  # attention reads its window/caps from the config at call time
        layer.self_attn.config = plain.config
        if hasattr(layer.self_attn, "sliding_window"):
            window = plain.config.sliding_window
            if family == "gemma2":
                window = window if plain.config.layer_types[layer.self_attn.layer_idx] == "sliding_attention" else None
            layer.self_attn.sliding_window = window
        if hasattr(layer.self_attn, "attn_logit_softcapping"):
            layer.self_attn.attn_logit_softcapping = plain.config.attn_logit_softcapping
        if hasattr(layer, "attention_type") and family == "gemma2":
            layer.attention_type = plain.config.layer_types[layer.self_attn.layer_idx]
    assert rel_err(tm.hf_logits(plain, prompt_ids), tm.hf_logits(model, prompt_ids)) > 100 * TOL


# ---- GGUF --------------------------------------------------------------------------------

def family_metadata(config) -> dict:
    meta = {**tm.llama_metadata(config), "attention.key_length": tm.head_dim(config),
            "attention.value_length": tm.head_dim(config)}
    if getattr(config, "sliding_window", None):
        meta["attention.sliding_window"] = config.sliding_window
    if config.model_type == "gemma2":
        meta["attn_logit_softcapping"] = float(config.attn_logit_softcapping)
        meta["final_logit_softcapping"] = float(config.final_logit_softcapping)
    return meta


# family -> GGUF architecture; Gemma 2's file gets the scale llama.cpp assumes (1/sqrt(head_dim)).
GGUF_FAMILIES = {"qwen3": ("qwen3", {}), "mistral": ("llama", {}),
                 "gemma2": ("gemma2", {"query_pre_attn_scalar": 16}), "phi3": ("phi3", {})}


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_file_matches_transformers(family, qtype, tmp_path, prompt_ids):
    arch, overrides = GGUF_FAMILIES[family]
    model = tm.random_hf_model(family, seed=6, **overrides)
    quant = T[qtype]
    tensors = tm.hf_to_gguf_tensors(model, None if qtype == "F32" else (lambda n, w: quant))
    if qtype != "F32":  # the reference sees exactly the values the file holds
        with torch.no_grad():
            for name, p in model.named_parameters():
                stored = tensors[tm.gguf_name(name, arch)]
                if p.dim() == 2:
                    p.copy_(torch.from_numpy(tm.stored_value(p.detach().numpy(), stored[1])))
    path = tm.write_gguf(tmp_path / f"{family}.gguf", tensors, arch=arch, metadata=family_metadata(model.config))
    llm = make_llm(path)
    cfg = llm.engine.model_config
    assert cfg.architecture == arch and (cfg.qk_norm == "head") == (family == "qwen3")
    assert cfg.sandwich_norms == (family == "gemma2")
    check_against(llm, model, prompt_ids)
    # the file's own blocks (gguf mode, fused Phi-3 tensors included) give the same greedy tokens here
    if qtype == "Q8_0":
        kept = make_llm(path, quantization="gguf")
        assert engine_greedy(kept, [prompt_ids]) == engine_greedy(llm, [prompt_ids])


def test_transformers_reads_our_gemma2_gguf(tmp_path, prompt_ids):
    """Our test writer lays Gemma 2 out as llama.cpp does: transformers' own GGUF reader agrees."""
    model = tm.random_hf_model("gemma2", seed=6, head_dim=256, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                               final_logit_softcapping=30.0, sliding_window=4096)
    path = tm.write_gguf(tmp_path / "g.gguf", tm.hf_to_gguf_tensors(model), arch="gemma2",
                         metadata=family_metadata(model.config))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    assert rel_err(tm.hf_logits(theirs, prompt_ids), tm.hf_logits(model, prompt_ids)) < TOL
    llm = make_llm(path)
    assert rel_err(prefill_logits(llm.engine, prompt_ids), tm.hf_logits(model, prompt_ids)) < TOL


# ---- bad input ---------------------------------------------------------------------------

def test_unsupported_rope_and_activation_are_clear_errors(built, tmp_path):
    import json
    import shutil

    _, folder = built("phi3")
    bad = shutil.copytree(folder, tmp_path / "longrope")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rope_scaling"] = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="longrope"):
        make_llm(bad)
    cfg.pop("rope_scaling")
    cfg["hidden_act"] = "relu2"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="relu2"):
        make_llm(bad)


def test_inspect_names_each_familys_features(built):
    from tokenmill.models.inspect import describe

    want = {"qwen3": "q/k RMSNorm per head", "mistral": "sliding window 8 on 2 of 2 layers",
            "gemma2": "final logit soft cap 10", "phi3": "sliding window 8 on 2 of 2 layers"}
    for family, feature in want.items():
        d = describe(str(built(family)[1]))
        assert d["architecture"] == family and feature in d["features"], d["features"]
