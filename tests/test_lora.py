"""Multi-LoRA serving (tokenmill/lora/): adapters made with peft on transformers' tiny models against peft's merged
weights, a mixed batch giving each request its alone-bits, the prefix cache keyed by adapter, slots under
pressure, GGUF LoRA files, bad adapters refused clearly, the server's API through the official client, and the
embedded model with a random adapter on its quantized base."""

from __future__ import annotations

import copy
import json
import random
import types

import numpy as np
import pytest
import tiny_models as tm
import torch
from helpers import metric, served_engine

from tokenmill import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (seed, peft LoraConfig keywords): ranks 8, 4 and 12 (padded to 16 in the slots), different targets,
# rsLoRA with an alpha pattern
ADAPTERS = {"a": (1, dict(r=8, lora_alpha=16, target_modules=ALL)),
            "b": (2, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
            "c": (3, dict(r=12, lora_alpha=6, use_rslora=True, target_modules=["k_proj", "o_proj", "down_proj"],
                          alpha_pattern={"down_proj": 24}))}
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)


def make_adapter(arch: str, folder, seed: int, **lora):
    """A random PEFT adapter on the tiny ``arch`` model, saved to ``folder``; peft's merged model (the reference)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(tm.random_hf_model(arch), LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(3)  # a delta large enough to change the greedy tokens
    model.save_pretrained(str(folder))
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama, three adapters and an engine over its int8 blocks with two adapter slots and host memory for
    two: three adapters mixed keep the slot and host pools under pressure."""
    root = tmp_path_factory.mktemp("lora")
    folder = tm.save_hf_folder(tm.random_hf_model("llama"), root / "base")
    paths = {name: root / name for name in ADAPTERS}
    merged = {name: make_adapter("llama", paths[name], seed, **kw) for name, (seed, kw) in ADAPTERS.items()}
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", quantization="int8", enable_lora=True,
              max_loras=2, max_cpu_loras=2)
    loras = {name: LoRARequest(name, i + 1, str(paths[name])) for i, name in enumerate(ADAPTERS)}
    return types.SimpleNamespace(folder=folder, root=root, paths=paths, merged=merged, llm=llm, loras=loras)


def one(llm, ids, lora=None, params=GREEDY):
    c = llm.generate([ids], params, lora_request=lora, use_tqdm=False)[0].outputs[0]
    return c.token_ids, c.logprobs


@pytest.mark.parametrize("arch", ["qwen2", "phi3"])
def test_outputs_match_peft_merged_weights(tmp_path, arch):
    """Two families (Qwen2's q/k/v biases; Phi-3's fused checkpoint, its adapter on the fused qkv_proj and
    gate_up_proj) over float weights: greedy tokens equal transformers + peft's merged model's, and every prompt
    position's logprob is within float rounding of its; the base model is untouched."""
    folder = tm.save_hf_folder(tm.random_hf_model(arch), tmp_path / "base")
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if arch == "phi3" else ALL
    merged = make_adapter(arch, tmp_path / "ad", 5, r=8, lora_alpha=32, target_modules=targets)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", quantization="none", enable_lora=True)
    ids = list(range(3, 25))
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate([ids], sp, lora_request=LoRARequest("ad", 1, str(tmp_path / "ad")), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == tm.hf_greedy(merged, ids, 12)
    ref = tm.hf_logits(merged, ids).log_softmax(-1)
    diffs = [abs(out.prompt_logprobs[i][ids[i]] - float(ref[i - 1, ids[i]])) for i in range(1, len(ids))]
    assert max(diffs) < 1e-4, max(diffs)
    base = llm.generate([ids], sp, use_tqdm=False)[0]
    assert base.outputs[0].token_ids == tm.hf_greedy(tm.random_hf_model(arch), ids, 12)
    assert base.outputs[0].token_ids != out.outputs[0].token_ids


def test_ranks_targets_and_rslora_match_peft(tiny):
    """Each adapter (ranks 4 to 12 in slots of rank 16, different targets, rsLoRA with an alpha pattern), on the
    float weights, gives peft's merged model's greedy tokens; one slot runs them in turn."""
    llm = LLM(str(tiny.folder), dtype="float32", kv_cache_memory="16MiB", quantization="none", enable_lora=True)
    ids = list(range(5, 21))
    for name, merged in tiny.merged.items():
        assert one(llm, ids, tiny.loras[name])[0] == tm.hf_greedy(merged, ids, 10), name


def run_mix(llm, jobs, budget: int, stagger: int) -> list:
    """Greedy outputs of (prompt, adapter) jobs arriving ``stagger`` steps apart under a token budget."""
    engine = llm.engine
    saved = engine.scheduler.config
    import dataclasses

    engine.scheduler.config = dataclasses.replace(saved, max_num_batched_tokens=budget)
    try:
        pending, ids, results = list(jobs), {}, {}
        while pending or engine.has_unfinished_requests():
            if pending:
                prompt, lora = pending.pop(0)
                ids[engine.add_request(prompt, GREEDY, lora_request=lora)] = len(ids)
            for _ in range(stagger if pending else 1):
                for out in engine.step():
                    if out.finished:
                        c = out.outputs[0]
                        results[ids[out.request_id]] = (c.token_ids, c.logprobs)
        return [results[i] for i in range(len(jobs))]
    finally:
        engine.scheduler.config = saved


def invariance_violations(tiny, trials: int, seed: int) -> int:
    """Random mixes of prompts with adapters and none, batched under random budgets and arrivals, against each
    (prompt, adapter) run alone; how many differ in a token or a logprob bit."""
    rng = random.Random(seed)
    loras = [None, *tiny.loras.values()]
    jobs = [(list(range(3 + i, 3 + i + rng.randint(3, 40))), loras[i % len(loras)]) for i in range(8)]
    alone = [run_mix(tiny.llm, [j], 2048, 0)[0] for j in jobs]
    bad = 0
    for _ in range(trials):
        pick = rng.sample(range(len(jobs)), rng.randint(3, len(jobs)))
        got = run_mix(tiny.llm, [jobs[i] for i in pick], rng.choice([16, 29, 64, 2048]), rng.randint(0, 2))
        bad += sum(g != alone[i] for g, i in zip(got, pick))
    return bad


def test_mixed_batch_gives_each_request_its_alone_bits(tiny):
    """One step mixes requests with different adapters and none, chunked prefills and decodes: each request's
    tokens and logprobs are the bits it gets alone (three adapters over two slots: the scheduler holds back what
    has no slot, the slots and host memory evict least recently used). Base-only steps take the fused layer
    kernels, mixed ones the wrapped projections: the same bits."""
    lora, model = tiny.llm.engine.runner.lora, tiny.llm.engine.runner.model
    before = (lora.stats.slot_evictions, lora.stats.host_evictions)
    one_call, fused = model._fused_layers, set()
    model._fused_layers = lambda *args: fused.add((out := one_call(*args)) is not None) or out
    try:
        assert invariance_violations(tiny, trials=4, seed=0) == 0
    finally:
        del model._fused_layers
    assert fused == {True, False}  # both paths ran: the fused kernels for base-only steps
    assert lora.stats.slot_evictions > before[0] and lora.stats.host_evictions > before[1]
    assert not lora.users and tiny.llm.engine.kv_cache.num_free_blocks == tiny.llm.engine.kv_cache.num_blocks


def test_the_invariance_check_catches_a_row_count_dependent_delta(tiny, monkeypatch):
    """Negative control: a delta whose arithmetic depends on how many rows the step has (as torch's GEMM, which
    picks its blocking by the rows, may) must be caught by the same property."""
    from tokenmill.lora.layer import LoRALinear

    real = LoRALinear._mm
    monkeypatch.setattr(LoRALinear, "_mm", lambda self, x, w, n: real(self, x, w, n) * (1 + 1e-3 * x.shape[0]))
    assert invariance_violations(tiny, trials=2, seed=0) > 0


def test_prefix_cache_is_keyed_by_adapter(tiny):
    """Two adapters (and the base) never share KV blocks; the same adapter's files share them, under another
    name too, and a cached prefix gives the bits of computing it."""
    llm, ids = tiny.llm, list(range(40, 90))
    a, b = tiny.loras["a"], tiny.loras["b"]
    again = LoRARequest("a-again", 99, str(tiny.paths["a"]))  # the same files under another name and id

    def cached(lora):
        out = llm.generate([ids], GREEDY, lora_request=lora, use_tqdm=False)[0]
        return out.num_cached_tokens, (out.outputs[0].token_ids, out.outputs[0].logprobs)

    first_a = cached(a)
    assert first_a[0] == 0
    assert cached(b)[0] == 0 and cached(None)[0] == 0
    hit = cached(a)
    assert hit[0] == 48 and hit[1] == first_a[1]
    assert cached(again) == (48, first_a[1])
    assert cached(b)[0] == 48 and cached(None)[0] == 48


def test_gguf_lora_matches_the_peft_adapter(tiny):
    """A GGUF LoRA as llama.cpp's convert_lora_to_gguf.py writes one (q/k lora_b rows permuted like the base
    weights, adapter.lora.alpha) gives the PEFT adapter's bits."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((tiny.paths["a"] / "adapter_config.json").read_text())
    tensors = load_file(str(tiny.paths["a"] / "adapter_model.safetensors"))
    path = tiny.root / "a.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(cfg["lora_alpha"]))
    heads = {"q_proj": 4, "k_proj": 2}  # tiny_models' BASE
    for key, arr in sorted(tensors.items()):
        hf = key.removeprefix("base_model.model.").replace(".lora_A.", ".").replace(".lora_B.", ".")
        module = hf.split(".")[-2]
        if ".lora_B." in key and module in heads:
            arr = tm.llama_cpp_permute(arr, heads[module])
        w.add_tensor(tm.gguf_name(hf) + (".lora_a" if ".lora_A." in key else ".lora_b"), np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ids = list(range(7, 30))
    assert one(tiny.llm, ids, LoRARequest("a-gguf", 50, str(path))) == one(tiny.llm, ids, tiny.loras["a"])


def test_bad_adapters_are_refused_clearly_and_nothing_leaks(tiny, tmp_path):
    """A missing or corrupt file, a rank over --max-lora-rank, a module the model lacks, another base model's
    shapes, DoRA, no adapters enabled: each a ValueError saying what; the engine keeps serving, nothing held."""
    from safetensors.numpy import save_file

    def folder(name: str, tensors: dict, **config) -> str:
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 4, **config}))
        save_file({k: np.ones(v, dtype=np.float32) for k, v in tensors.items()}, str(d / "adapter_model.safetensors"))
        return str(d)

    key = "base_model.model.model.layers.0.self_attn.{}.lora_{}.weight"
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((tiny.paths["a"] / "adapter_config.json").read_text())
    whole = (tiny.paths["a"] / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(whole[:500])
    cases = {
        str(tmp_path / "nowhere"): "does not exist",
        str(corrupt): "corrupt",
        folder("rank", {key.format("q_proj", "A"): (32, 64), key.format("q_proj", "B"): (64, 32)}): "rank 32 is above",
        folder("module", {key.format("c_attn", "A"): (4, 64), key.format("c_attn", "B"): (192, 4)}):
            "targets module 'c_attn', which this llama model does not have",
        folder("shapes", {key.format("q_proj", "A"): (4, 32), key.format("q_proj", "B"): (32, 4)}):
            "trained for another base model",
        folder("dora", {key.format("q_proj", "A"): (4, 64), key.format("q_proj", "B"): (64, 4)}, use_dora=True):
            "DoRA is not supported",
        folder("embed", {"base_model.model.model.embed_tokens.lora_embedding_A": (4, 320)}): "LoRA on embed",
    }
    engine = tiny.llm.engine
    for i, (path, why) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=why):
            tiny.llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest(f"bad{i}", 100 + i, path), use_tqdm=False)
    plain = LLM(str(tiny.folder), dtype="float32", kv_cache_memory="16MiB", quantization="int8")
    with pytest.raises(ValueError, match="--enable-lora"):
        plain.generate([[5, 6, 7]], GREEDY, lora_request=tiny.loras["a"], use_tqdm=False)
    with pytest.raises(ValueError, match="already loaded from"):  # one id, two adapters
        tiny.llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("x", 1, str(tiny.paths["b"])),
                          use_tqdm=False)
    assert one(tiny.llm, [5, 6, 7], tiny.loras["a"])[0]  # still serving
    assert not engine.runner.lora.users and not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_server_serves_adapters_by_model_name(tiny):
    """vLLM's API through the official client: /v1/models lists --lora-modules adapters with their parent, the
    model field picks the adapter (its offline bits), an unknown name is a 404; adapters load and unload at run
    time (400 twice, 404 for a path or a name that is not there), behind the API key; /metrics counts them."""
    import httpx
    import openai

    llm = LLM(str(tiny.folder), dtype="float32", kv_cache_memory="16MiB", quantization="int8", enable_lora=True,
              max_loras=2, max_cpu_loras=3)
    prompt, sp = list(range(10, 30)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = {name: llm.generate([prompt], sp, lora_request=lora, use_tqdm=False)[0].outputs[0].text
            for name, lora in (("a", tiny.loras["a"]), ("b", tiny.loras["b"]), ("base", None))}
    assert len(set(want.values())) == 3
    with served_engine(llm.engine, "k", lora_modules=[("a", str(tiny.paths["a"]))]) as http:
        client = openai.OpenAI(base_url=f"{http.url}/v1", api_key="k", max_retries=0)
        cards = {m.id: m for m in client.models.list().data}
        assert cards["a"].parent == http.model and set(cards) == {http.model, "a"}

        def complete(model: str) -> str:
            r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
            return r.choices[0].text

        assert complete("a") == want["a"] and complete(http.model) == want["base"]
        with pytest.raises(openai.NotFoundError):
            complete("b")
        body = {"lora_name": "b", "lora_path": str(tiny.paths["b"])}
        assert httpx.post(f"{http.url}/v1/load_lora_adapter", json=body).status_code == 401  # no API key
        ok = http.post("/v1/load_lora_adapter", json=body)
        assert ok.status_code == 200, ok.text
        assert complete("b") == want["b"]
        assert http.post("/v1/load_lora_adapter", json=body).status_code == 400  # the name is taken
        missing = http.post("/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": str(tiny.root / "no")})
        assert missing.status_code == 404 and "does not exist" in missing.json()["error"]["message"]
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": str(tiny.folder)}
                         ).status_code == 400  # a model folder, not an adapter
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 404
        with pytest.raises(openai.NotFoundError):
            complete("b")
        text = http.get("/metrics").text
        assert metric(text, "tokenmill:lora_loads_total", tier="host") >= 2
        assert 'vllm:lora_requests_info{max_lora="2"' in text


@pytest.mark.slow
def test_default_model_with_a_random_adapter_matches_peft(hf_model, tmp_path):
    """The embedded model on its own Q4_1/Q8_0 blocks (the default mode) with a random adapter: greedy tokens equal
    transformers + peft's merged weights on the dequantized model, prompt logprobs within the int16 activations'
    error."""
    from peft import LoraConfig, get_peft_model

    from tokenmill.models.registry import DEFAULT_MODEL

    torch.manual_seed(0)
    model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                                                target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    model.save_pretrained(str(tmp_path / "ad"), save_embedding_layers=False)
    merged = model.merge_and_unload().eval()
    llm = LLM(DEFAULT_MODEL, kv_cache_memory="64MiB", max_model_len=512, enable_lora=True)
    lora = LoRARequest("ad", 1, str(tmp_path / "ad"))
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0)
    for text in ("The capital of France is", "def fibonacci(n):"):
        ids = llm.tokenizer.encode(text)
        out = llm.generate([ids], sp, lora_request=lora, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == tm.hf_greedy(merged, ids, 16), text
        ref = tm.hf_logits(merged, ids).log_softmax(-1)
        diffs = [abs(out.prompt_logprobs[i][ids[i]] - float(ref[i - 1, ids[i]])) for i in range(1, len(ids))]
        assert max(diffs) < 0.05, (text, max(diffs))
        base = llm.generate([ids], sp, use_tqdm=False)[0].outputs[0].token_ids
        assert base != out.outputs[0].token_ids, text  # the adapter changes the answer
