"""Pooling requests (issue 47): /v1/embeddings through the official client, /v1/score and /v1/rerank, and
LLM.embed / LLM.score, on tiny random models whose reference is transformers on the same weights: a decoder
embedder in the Qwen3-Embedding layout (a Qwen3Model checkpoint with sentence-transformers' Pooling and Normalize
modules) with last-token and mean pooling, the same from a GGUF file with pooling_type, a decoder reranker in the
Qwen3-Reranker shape (P(yes) from two next-token logits), and an embedding model's cosine scores. Vectors are
the same bits alone or batched, chunked or not (the batch-invariance promise)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tiny_models import hf_to_gguf_tensors, llama_metadata, random_hf_model, write_gguf, write_tokenizer_files

pytestmark = pytest.mark.usefixtures("one_thread")
KEY = "pooling-key"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello world",
         "def f(x):\n    return x * 2\n and a longer text so that its prompt spans several chunks of sixteen"]


def embedder_folder(tmp, pooling: str):
    """A Qwen3-Embedding-shaped folder: the base model saved without its head, sentence-transformers' modules."""
    base = random_hf_model("qwen3", seed=3).model
    folder = tmp / f"qwen3-embed-{pooling}"
    base.save_pretrained(str(folder), safe_serialization=True)
    write_tokenizer_files(folder)
    mode = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens"}[pooling]
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, mode: True}))
    return base, folder


@torch.inference_mode()
def reference(base, ids: list[int], pooling: str, dims: int | None = None) -> torch.Tensor:
    h = base(torch.tensor([ids])).last_hidden_state[0].float()
    v = h[-1] if pooling == "last" else h.mean(0)
    return F.normalize(v[:dims], dim=0)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    return embedder_folder(tmp_path_factory.mktemp("emb"), "last")


def _llm(folder):
    from tokenmill import LLM

    return LLM(str(folder), max_num_batched_tokens=16, kv_cache_memory="4MiB")


@pytest.fixture(scope="module")
def last_embedder(embedder):
    """The offline engine (a served one runs its own: an engine is driven from one thread)."""
    llm = _llm(embedder[1])
    yield embedder[0], llm
    llm.shutdown()


@pytest.fixture(scope="module")
def served(embedder):
    from helpers import served_engine

    llm = _llm(embedder[1])
    with served_engine(llm.engine, KEY, live_replay_interval=0) as http:
        http.tokenizer = llm.tokenizer
        yield http
    llm.shutdown()


def test_embeddings_match_transformers_through_the_official_client(embedder, served):
    import openai

    base, llm = embedder[0], served
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY)
    got = client.embeddings.create(model=served.model, input=TEXTS)  # (the client asks for base64)
    floats = client.embeddings.create(model=served.model, input=TEXTS, encoding_format="float")
    assert got.usage.prompt_tokens == sum(len(llm.tokenizer.encode(t)) for t in TEXTS)
    for text, a, b in zip(TEXTS, got.data, floats.data):
        want = reference(base, llm.tokenizer.encode(text), "last")
        assert (torch.tensor(a.embedding) - want).abs().max() < 1e-4
        assert np.array_equal(np.float32(a.embedding), np.float32(b.embedding))
    short = client.embeddings.create(model=served.model, input=TEXTS[0], dimensions=16, encoding_format="float")
    want = reference(base, llm.tokenizer.encode(TEXTS[0]), "last", 16)
    assert len(short.data[0].embedding) == 16
    assert (torch.tensor(short.data[0].embedding) - want).abs().max() < 1e-4
    ids = llm.tokenizer.encode(TEXTS[1])  # token ids in, as the client can send them
    by_ids = client.embeddings.create(model=served.model, input=[ids], encoding_format="float")
    assert by_ids.data[0].embedding == floats.data[1].embedding


def test_a_vector_is_the_same_bits_alone_batched_chunked_and_cached(last_embedder):
    from tokenmill import LLM

    base, llm = last_embedder
    assert llm.engine.info.served.task == "embed"  # detected from the folder
    batched = llm.embed(TEXTS, use_tqdm=False)
    alone = [llm.embed(t, use_tqdm=False)[0] for t in TEXTS]
    assert batched == alone
    again = llm.embed(TEXTS[2], use_tqdm=False)[0]  # its prefix blocks now come from the cache
    assert again == alone[2]
    whole = LLM(llm.engine.config.model, max_num_batched_tokens=512, enable_prefix_caching=False,
                kv_cache_memory="4MiB")
    try:  # one chunk, no cache: the same bits
        assert whole.embed(TEXTS, use_tqdm=False) == batched
    finally:
        whole.shutdown()


def test_mean_pooling_from_the_folder_and_from_gguf(tmp_path):
    from tokenmill import LLM

    base, folder = embedder_folder(tmp_path, "mean")
    llm = LLM(str(folder), max_num_batched_tokens=16, kv_cache_memory="4MiB")
    try:
        vecs = llm.embed(TEXTS, use_tqdm=False)
        for text, v in zip(TEXTS, vecs):
            assert (torch.tensor(v) - reference(base, llm.tokenizer.encode(text), "mean")).abs().max() < 1e-4
        # a second request with the same prefix: mean pooling needs every position, so the cache is not used
        assert llm.embed(TEXTS[2], use_tqdm=False)[0] == vecs[2]
    finally:
        llm.shutdown()
    # the same model as llama.cpp's converter writes an embedding GGUF: pooling_type 1 (mean)
    model = random_hf_model("qwen3", seed=3)
    meta = {**llama_metadata(model.config), "pooling_type": 1, "attention.key_length": 16,
            "attention.value_length": 16}
    path = write_gguf(tmp_path / "embed.gguf", hf_to_gguf_tensors(model), arch="qwen3", metadata=meta)
    llm = LLM(str(path), kv_cache_memory="4MiB", quantization="none")
    try:
        assert llm.engine.info.served.task == "embed"
        for text, v in zip(TEXTS, llm.embed(TEXTS, use_tqdm=False)):
            want = reference(model.model, llm.tokenizer.encode(text), "mean")
            assert (torch.tensor(v) - want).abs().max() < 1e-4
    finally:
        llm.shutdown()


@torch.inference_mode()
def test_a_decoder_reranker_scores_p_yes_as_transformers(tmp_path):
    from helpers import served_engine
    from tokenmill import LLM

    model = random_hf_model("qwen3", seed=5)
    folder = tmp_path / "reranker"
    model.save_pretrained(str(folder), safe_serialization=True)
    write_tokenizer_files(folder)
    llm = LLM(str(folder), task="score", classifier_from_token=("n", "y"), kv_cache_memory="4MiB")
    try:
        tok = llm.tokenizer
        no, yes = tok.encode("n", add_special_tokens=False)[0], tok.encode("y", add_special_tokens=False)[0]
        query, docs = "Which animal jumps?", ["The quick brown fox jumps.", "Hello world", "1, 2, 3, 5, 8"]

        def want(doc: str) -> float:
            ids = tok.hf.encode(query, doc).ids
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            return torch.sigmoid(logits[yes] - logits[no]).item()

        expected = [want(d) for d in docs]
        assert np.allclose(llm.score(query, docs, use_tqdm=False), expected, atol=1e-5)
        with served_engine(llm.engine, KEY, live_replay_interval=0) as http:
            score = http.post("/v1/score", json={"model": http.model, "text_1": query, "text_2": docs}).json()
            assert np.allclose([d["score"] for d in score["data"]], expected, atol=1e-5)
            rerank = http.post("/v1/rerank", json={"model": http.model, "query": query, "documents": docs,
                                                   "top_n": 2}).json()
            best = sorted(range(3), key=lambda i: -expected[i])[:2]
            assert [r["index"] for r in rerank["results"]] == best
            assert rerank["results"][0]["document"]["text"] == docs[best[0]]
            assert np.isclose(rerank["results"][0]["relevance_score"], expected[best[0]], atol=1e-5)
            # a reranker generates nothing, and embeds nothing
            r = http.post("/v1/completions", json={"model": http.model, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 400 and "--task generate" in r.json()["error"]["message"]
            r = http.post("/v1/embeddings", json={"model": http.model, "input": "hi"})
            assert r.status_code == 400 and "--task embed" in r.json()["error"]["message"]
    finally:
        llm.shutdown()


def test_an_embedding_model_scores_pairs_by_cosine_similarity(embedder, served):
    base, llm = embedder[0], served
    r = served.post("/v1/score", json={"model": served.model, "text_1": TEXTS[0], "text_2": TEXTS[1:]})
    assert r.status_code == 200, r.text
    for i, d in enumerate(r.json()["data"]):
        a, b = (reference(base, llm.tokenizer.encode(t), "last") for t in (TEXTS[0], TEXTS[1 + i]))
        assert abs(d["score"] - float(a @ b)) < 1e-4


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [[10 ** 6]]}, "input"),
    ({"input": "x", "dimensions": 65}, "dimensions"),
    ({"input": "x " * 400}, "input"),  # past the 256-token context
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_embedding_requests_are_400s_and_the_server_keeps_serving(served, body, param):
    r = served.post("/v1/embeddings", json={"model": served.model, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = served.post("/v1/embeddings", json={"model": served.model, "input": "still here"})
    assert ok.status_code == 200
    r = served.post("/v1/chat/completions", json={"model": served.model, "messages": [{"role": "user",
                                                                                       "content": "hi"}]})
    assert r.status_code == 400 and "--task generate" in r.json()["error"]["message"]


def test_tasks_refuse_what_they_cannot_serve(tmp_path):
    from tokenmill import LLM

    model = random_hf_model("qwen3", seed=5)
    folder = tmp_path / "gen"
    model.save_pretrained(str(folder), safe_serialization=True)
    write_tokenizer_files(folder)
    with pytest.raises(ValueError, match="--classifier-from-token no,yes"):
        LLM(str(folder), task="score", kv_cache_memory="4MiB")
    with pytest.raises(ValueError, match="one token each"):
        LLM(str(folder), task="score", classifier_from_token=("no such words", "y"), kv_cache_memory="4MiB")
    # a generative model served as an embedder: last-token pooling, normalised (vLLM's default)
    llm = LLM(str(folder), task="embed", kv_cache_memory="4MiB")
    try:
        v = llm.embed(TEXTS[0], use_tqdm=False)[0]
        assert abs(float(torch.tensor(v).norm()) - 1) < 1e-5
        with pytest.raises(ValueError, match="generates no text"):
            llm.generate("hi", use_tqdm=False)
    finally:
        llm.shutdown()


# ---- BERT-family encoders -----------------------------------------------------------------------------------


@torch.inference_mode()
@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_encoder_embeddings_match_transformers(tmp_path, kind):
    from tiny_models import random_bert, save_bert_folder
    from tokenmill import LLM

    model = random_bert(kind, seed=7)
    folder = save_bert_folder(model, tmp_path / kind)
    if kind == "bert":  # a sentence-transformers embedder: mean pooling, normalised
        (folder / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    llm = LLM(str(folder), kv_cache_memory="4MiB", max_num_batched_tokens=16)  # (an encoder runs prompts whole)
    try:
        assert llm.engine.info.served.task == "embed"
        vecs = llm.embed(TEXTS, use_tqdm=False)
        for text, v in zip(TEXTS, vecs):
            h = model(torch.tensor([llm.tokenizer.encode(text)])).last_hidden_state[0]
            want = F.normalize(h.mean(0) if kind == "bert" else h[0], dim=0)  # no pooling module: [CLS]
            assert (torch.tensor(v) - want).abs().max() < 1e-4
        assert [llm.embed(t, use_tqdm=False)[0] for t in TEXTS] == vecs  # alone: the same bits
        if kind == "bert":  # and through the official client
            import openai

            from helpers import served_engine

            with served_engine(llm.engine, KEY, live_replay_interval=0) as http:
                got = openai.OpenAI(base_url=http.url + "/v1", api_key=KEY).embeddings.create(model=http.model,
                                                                                              input=TEXTS)
                assert [np.float32(d.embedding).tolist() for d in got.data] == np.float32(vecs).tolist()
    finally:
        llm.shutdown()


@torch.inference_mode()
def test_cross_encoders_score_and_rerank_as_transformers(tmp_path):
    from helpers import served_engine
    from tiny_models import random_bert, save_bert_folder
    from tokenmill import LLM

    query, docs = "which fox jumps", ["The quick brown fox jumps over the lazy dog.", "Hello world", "1, 2, 3"]
    for kind in ("bert", "xlm-roberta"):
        model = random_bert(kind, seed=11, classifier=True)
        llm = LLM(str(save_bert_folder(model, tmp_path / kind)), kv_cache_memory="4MiB")
        try:
            assert llm.engine.info.served.task == "score"
            tok = llm.tokenizer.hf
            expected = []
            for d in docs:
                enc = tok.encode(query, d)
                types = torch.tensor([enc.type_ids]) if kind == "bert" else None
                expected.append(torch.sigmoid(model(torch.tensor([enc.ids]), token_type_ids=types).logits[0, 0]).item())
            assert np.allclose(llm.score(query, docs, use_tqdm=False), expected, atol=1e-5)
            if kind != "bert":
                continue
            with served_engine(llm.engine, KEY, live_replay_interval=0) as http:
                r = http.post("/v1/rerank", json={"model": http.model, "query": query, "documents": docs,
                                                  "return_documents": False}).json()
                assert [x["index"] for x in r["results"]] == sorted(range(3), key=lambda i: -expected[i])
                assert np.allclose([x["relevance_score"] for x in r["results"]], sorted(expected, reverse=True),
                                   atol=1e-5)
                assert "document" not in r["results"][0]
                s = http.post("/v1/score", json={"model": http.model, "text_1": [query] * 3, "text_2": docs}).json()
                assert np.allclose([x["score"] for x in s["data"]], expected, atol=1e-5)
                bad = http.post("/v1/score", json={"model": http.model, "text_1": [query] * 2, "text_2": docs})
                assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"
                bad = http.post("/v1/rerank", json={"model": http.model, "query": query, "documents": []})
                assert bad.status_code == 400
        finally:
            llm.shutdown()


def _fuzz_bodies():
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.sampled_from([0, 1, 64, 65, -1]),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                        st.sampled_from(["", "hi", "float", "base64"]))
    values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                           st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                          max_leaves=8)
    fields = ["model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens", "normalize",
              "add_special_tokens", "priority", "text_1", "text_2", "query", "documents", "top_n", "return_documents"]
    return st.one_of(st.dictionaries(st.sampled_from(fields), values, max_size=5),
                     st.fixed_dictionaries({"input": st.one_of(st.text(max_size=20), st.lists(st.integers(-3, 400),
                                                                                                 max_size=4))}),
                     st.fixed_dictionaries({"query": st.text(max_size=10),
                                            "documents": st.lists(st.text(max_size=10), max_size=3)}),
                     values)


def test_fuzz_pooling_schemas_never_5xx(served):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/v1/embeddings", "/v1/score", "/v1/rerank"]), body=_fuzz_bodies())
    def check(path, body):
        raw = json.dumps(body, allow_nan=True).encode()
        r = served.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            assert r.json()["error"]["message"]

    check()
    assert served.post("/v1/embeddings", json={"input": "still serving"}).status_code == 200


@torch.inference_mode()
def test_a_bert_gguf_embeds_as_transformers(tmp_path):
    """A BERT embedder as llama.cpp's converter writes it: the WordPiece vocabulary in its spelling (a word's
    first piece with U+2581, continuations without ##), tensors under its names, pooling_type 1 (mean)."""
    import gguf

    from tiny_models import BERT_SPECIALS, bert_tokenizer_json, random_bert
    from tokenmill import LLM
    from tokenmill.models.bert import _GGUF_LAYER, _GGUF_TOP

    model = random_bert("bert", seed=13)
    cfg = model.config
    vocab = json.loads(bert_tokenizer_json())["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    control = [t in BERT_SPECIALS for t in tokens]
    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    for key, value in {"context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
                       "feed_forward_length": cfg.intermediate_size, "block_count": cfg.num_hidden_layers,
                       "attention.head_count": cfg.num_attention_heads, "pooling_type": 1}.items():
        w.add_uint32(f"bert.{key}", value)
    w.add_float32("bert.attention.layer_norm_epsilon", cfg.layer_norm_eps)
    w.add_bool("bert.attention.causal", False)
    w.add_tokenizer_model("bert")
    w.add_token_list([t if c else t[2:] if t.startswith("##") else "\u2581" + t for t, c in zip(tokens, control)])
    w.add_token_types([3 if c else 1 for c in control])
    w.add_uint32("tokenizer.ggml.token_type_count", cfg.type_vocab_size)
    w.add_uint32("tokenizer.ggml.cls_token_id", vocab["[CLS]"])
    w.add_uint32("tokenizer.ggml.seperator_token_id", vocab["[SEP]"])
    w.add_uint32("tokenizer.ggml.unknown_token_id", vocab["[UNK]"])
    ours = {v: k for k, v in _GGUF_TOP.items()}
    layer = {v: k for k, v in _GGUF_LAYER.items()}
    for name, t in model.state_dict().items():
        if name.startswith("pooler.") or name.endswith("position_ids"):
            continue
        head, _, kind = name.rpartition(".")
        if head.startswith("encoder.layer."):
            i, rest = head.removeprefix("encoder.layer.").split(".", 1)
            gname = f"blk.{i}.{layer[rest]}.{kind}"
        else:
            gname = f"{ours[head]}.{kind}"
        w.add_tensor(gname, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    llm = LLM(str(tmp_path / "bert.gguf"), kv_cache_memory="4MiB")
    try:
        assert llm.engine.info.served.task == "embed"
        for text, v in zip(TEXTS, llm.embed(TEXTS, use_tqdm=False)):
            ids = llm.tokenizer.encode(text)
            from tokenizers import Tokenizer

            assert ids == Tokenizer.from_str(bert_tokenizer_json()).encode(text).ids  # the vocabulary rebuilt
            want = F.normalize(model(torch.tensor([ids])).last_hidden_state[0].mean(0), dim=0)
            assert (torch.tensor(v) - want).abs().max() < 1e-4
    finally:
        llm.shutdown()
