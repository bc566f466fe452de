"""One core client, two places the core runs (engine/core_client.py), and one validation per request
(engine/input_processor.py): the grammar is compiled once, in the front end, and the core queues what it was sent."""

from __future__ import annotations

import os

import pytest

from helpers import step_until_done

from tokenmill.config import EngineConfig
from tokenmill.engine.core_client import InprocClient, MPClient
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.messages import EngineCoreRequest, to_core_decoder, to_core_encoder
from tokenmill.sampling_params import InvalidParameter, SamplingParams, StructuredOutputsParams
from tokenmill.structured_output import RequestConstraints

import tiny_models as tm
from test_server_failures import fake_engine

CHOICES = ["the cat", "the dog"]
pytestmark = pytest.mark.usefixtures("one_thread")


def _count_compiles(compiler) -> list:  # noqa: ANN001
    calls = []
    compile_ = compiler.compile

    def counted(so):  # noqa: ANN001, ANN202
        calls.append(so)
        return compile_(so)

    compiler.compile = counted
    return calls


def test_a_grammar_is_compiled_once_per_request_and_the_core_gets_it_compiled():
    engine = fake_engine()
    calls = _count_compiles(engine.grammars)  # in this process the front end's compiler is the core's
    params = SamplingParams(max_tokens=4, n=3, seed=1, structured_outputs=StructuredOutputsParams(choice=CHOICES),
                            bad_words=["mat"])
    rid = engine.add_request("the cat sat", params)
    assert len(calls) == 1  # not once per sequence, and not again in the core
    queued = [r for r in engine.scheduler.requests.values() if r.request_id.startswith(f"{rid}#")]
    assert len(queued) == 3 and len({id(r.constraints) for r in queued}) == 1
    assert queued[0].constraints.grammar and queued[0].constraints.bad_words_token_ids
    engine.abort_request(rid)
    # a bad grammar is refused in the front end, before anything reaches the core, with the same error
    with pytest.raises(InvalidParameter, match="invalid structured output") as e:
        engine.add_request("the cat", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
    assert e.value.param == "structured_outputs" and len(calls) == 2
    assert not engine.has_unfinished_requests() and engine.state.num_waiting == 0


def test_the_compiled_constraints_cross_the_wire_to_a_core_process():
    msg = EngineCoreRequest("a", [1, 2, 3], SamplingParams(max_tokens=2), 2, 1.5,
                            constraints=RequestConstraints("start: \"x\"", ((4, 5), (6,))))
    got = to_core_decoder.decode(to_core_encoder.encode(msg))
    assert isinstance(got, EngineCoreRequest) and got == msg


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tm.save_hf_folder(tm.random_hf_model("llama"), tmp_path_factory.mktemp("llama"))
    return EngineConfig.from_kwargs(model=str(path), dtype="float32", quantization="none", kv_cache_memory="16MiB")


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
CHOSEN = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=CHOICES))


def _generate(engine: LLMEngine) -> dict[str, list[int]]:
    engine.add_request([5, 6, 7, 8], GREEDY, "plain")
    engine.add_request("Hello world", CHOSEN, "choice")
    assert engine.num_waiting == 2  # a core process's count as of its last message, plus what was sent since
    assert {row["id"] for row in engine.request_table()} == {"plain", "choice"}
    done = step_until_done(engine)
    assert done["choice"].outputs[0].text in CHOICES  # the grammar the front end compiled held in the core
    return {rid: out.outputs[0].token_ids for rid, out in done.items()}


@pytest.mark.parametrize("core_process", [False, True], ids=["inproc", "process"])
def test_both_clients_behave_alike(config, core_process):
    reference = LLMEngine(config)
    want = _generate(reference)
    reference.shutdown()
    engine = LLMEngine(config, core_process=core_process)
    try:
        assert isinstance(engine.client, MPClient if core_process else InprocClient)
        assert (engine.core_pid != os.getpid()) == core_process
        calls = _count_compiles(engine.grammars)
        assert _generate(engine) == want and len(want["plain"]) == 6
        assert len(calls) == 1
        engine.add_request([9, 10, 11], SamplingParams(max_tokens=50, ignore_eos=True), "long")
        engine.step()
        assert engine.abort_request("long").outputs[0].finish_reason == "abort"
        engine.check_invariants()
        assert engine.state.num_free_blocks == engine.info.num_blocks and not engine.has_unfinished_requests()
        with pytest.raises(InvalidParameter, match="outside the vocabulary"):
            engine.add_request([10**6], GREEDY)
        if core_process:
            with pytest.raises(RuntimeError, match="--engine-core-process"):
                engine.score([1, 2, 3])
            old = engine.core_pid
            engine.restart_core()
            assert engine.core_pid != old and engine.core.process.is_alive()
            assert _generate(engine) == want
        else:
            assert engine.score([1, 2, 3]).shape == (2,)
            with pytest.raises(RuntimeError, match="only an engine core in its own process can be restarted"):
                engine.restart_core()
    finally:
        engine.shutdown()
