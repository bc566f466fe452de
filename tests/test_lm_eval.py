"""lm-evaluation-harness against `tokenmill serve`: its ``local-completions`` model scores a small
multiple-choice task (written here as JSONL: the dataset hub is unreachable) through echo + logprobs,
and gets the very log-likelihoods and accuracy of the offline ``LLM.score`` path."""

from __future__ import annotations

import json
import os

import pytest

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server.app import ServerConfig, build_app
from tokenmill.server.run import BackgroundServer

pytestmark = pytest.mark.slow

DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "Madrid"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["five", "four", "seven"], "answer": 1},
    {"question": "The sky on a clear day is", "choices": ["green", "red", "blue"], "answer": 2},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Kelvin"], "answer": 0},
    {"question": "The opposite of hot is", "choices": ["cold", "loud", "tall"], "answer": 0},
    {"question": "A week has seven", "choices": ["days", "years", "apples"], "answer": 0},
]
TASK = """task: tokenmill_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def offline_loglikelihoods(llm) -> list[list[float]]:
    """lm-eval's split of context and continuation (the continuation is what the whole adds to the
    context's tokens), scored by LLM.score."""
    tok, out = llm.tokenizer, []
    for d in DOCS:
        ctx = tok.encode(d["question"], add_special_tokens=False)
        row = []
        for c in d["choices"]:
            whole = tok.encode(d["question"] + " " + c, add_special_tokens=False)
            lps = llm.engine.score(whole).tolist()  # lps[i]: token i + 1 after those before it
            row.append(sum(lps[len(ctx) - 1:]))
        out.append(row)
    return out


def test_lm_eval_local_completions_scores_like_llm_score(llm_default, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(TASK.format(data=data))
    tokenizer = tmp_path / "tokenizer"  # lm-eval tokenizes locally with transformers: give it the model's own
    tokenizer.mkdir()
    llm_default.tokenizer.hf.save(str(tokenizer / "tokenizer.json"))
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))

    want = offline_loglikelihoods(llm_default)
    want_acc = sum(max(range(len(r)), key=r.__getitem__) == d["answer"] for r, d in zip(want, DOCS)) / len(DOCS)

    ae = AsyncEngine(llm_default.engine, max_waiting_requests=64, log_interval=None)
    srv = BackgroundServer(build_app(ae, ServerConfig())).start()
    try:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"base_url": srv.url + "/v1/completions", "model": "smollm2-135m-instruct",
                        "tokenizer": str(tokenizer), "tokenizer_backend": "huggingface", "num_concurrent": 1,
                        "max_retries": 1, "tokenized_requests": True},
            tasks=["tokenmill_tiny_mc"], task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
            limit=None)
    finally:
        srv.stop(60)
    got_acc = results["results"]["tokenmill_tiny_mc"]["acc,none"]
    samples = sorted(results["samples"]["tokenmill_tiny_mc"], key=lambda s: s["doc_id"])
    got = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
    assert [x for row in got for x in row] == pytest.approx([x for row in want for x in row], abs=1e-5)
    assert got_acc == pytest.approx(want_acc)
    assert os.environ.get("HF_DATASETS_OFFLINE") == "1"
