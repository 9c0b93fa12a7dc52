"""One choice end to end over the fake engine: stop strings, routing alignment, cancellation."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from openai_frontend.generation import ChoiceGroup, ChoiceRunner, ChoiceSpec
from openai_frontend.routing_codec import decode_routed_experts
from openai_frontend.triton_client import BackendError, BackendRequest
from tests.unit.conftest import SCRIPT_TEXT, make_model_info
from tests.unit.fake_engine import FakeEngine, routing_rows

INFO = make_model_info()


@pytest.fixture
def engine(fe_tokenizer):
    return FakeEngine(info=INFO, script=fe_tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False))


def spec(prompt, *, index=0, stream_engine=True, max_tokens=20, stop=(), include=False, start=0, routed=True,
         logprobs=None, detokenize=True, stop_token_ids=()):
    return ChoiceSpec(
        index=index,
        request=BackendRequest(input_ids=prompt, stream=stream_engine, max_tokens=max_tokens,
                               return_routed_experts=routed, logprobs=logprobs,
                               routed_experts_prompt_start=start or None,
                               stop_token_ids=list(stop_token_ids) or None),
        detokenize=detokenize,
        stop=list(stop),
        include_stop_str_in_output=include,
    )


def run(runner: ChoiceRunner):
    async def go():
        return [d async for d in runner.run()]

    return asyncio.run(go())


def make_runner(engine, tok, s, stream=False):
    return ChoiceRunner(s, engine, tok, INFO, "req", stream=stream)


def test_plain_generation_text_tokens_and_routing(engine, fe_tokenizer):
    prompt = fe_tokenizer.encode("Hi there")
    r = make_runner(engine, fe_tokenizer, spec(prompt, max_tokens=10))
    deltas = run(r)
    res = r.result()
    assert res.finish_reason == "length" and len(res.token_ids) == 10
    assert res.token_ids == engine.script[:10]
    assert res.text == fe_tokenizer.decode(res.token_ids)
    assert "".join(d.text for d in deltas) == res.text
    assert [t for d in deltas for t in d.token_ids] == res.token_ids
    assert deltas[-1].routed_experts == res.routed_experts and all(d.routed_experts is None for d in deltas[:-1])
    arr = decode_routed_experts(res.routed_experts)
    assert arr.dtype == np.uint8
    # rows = prompt + output - 1, row i = position i
    np.testing.assert_array_equal(arr, routing_rows(0, len(prompt) + 10 - 1, INFO))


@pytest.mark.parametrize("stream_engine", [True, False])
@pytest.mark.parametrize("stream_http", [True, False])
def test_stop_string_cuts_text_tokens_and_rows_consistently(engine, fe_tokenizer, stream_engine, stream_http):
    prompt = fe_tokenizer.encode("Go")
    s = spec(prompt, stream_engine=stream_engine, max_tokens=40, stop=["brown fox"])
    r = make_runner(engine, fe_tokenizer, s, stream=stream_http)
    deltas = run(r)
    res = r.result()
    assert res.finish_reason == "stop" and res.stop_reason == "brown fox"
    assert res.text == "Hello world. The quick "
    assert "".join(d.text for d in deltas) == res.text
    # token ids end with the token that completed the stop string; its text contains the match
    full = fe_tokenizer.decode(res.token_ids)
    assert full.startswith(res.text) and "brown fox" in full
    assert "brown fox" not in fe_tokenizer.decode(res.token_ids[:-1])
    arr = decode_routed_experts(res.routed_experts)
    assert arr.shape[0] == len(prompt) + len(res.token_ids) - 1
    np.testing.assert_array_equal(arr, routing_rows(0, arr.shape[0], INFO))
    if stream_engine:  # the engine was stopped early: its request was cancelled
        assert engine.cancelled == ["req-0"]


def test_stop_string_include_in_output_and_earliest_match(engine, fe_tokenizer):
    prompt = fe_tokenizer.encode("Go")
    r = make_runner(engine, fe_tokenizer, spec(prompt, max_tokens=40, stop=["lazy", "quick"], include=True),
                    stream=True)
    run(r)
    assert r.result().text == "Hello world. The quick"
    assert r.result().stop_reason == "quick"


def test_streaming_never_emits_the_start_of_a_stop_string(engine, fe_tokenizer):
    prompt = fe_tokenizer.encode("Go")
    r = make_runner(engine, fe_tokenizer, spec(prompt, max_tokens=40, stop=["The quick brown"]), stream=True)
    deltas = run(r)
    assert "".join(d.text for d in deltas) == "Hello world. "
    assert not any("The" in d.text for d in deltas)


def test_stop_token_id_sets_stop_reason(engine, fe_tokenizer):
    prompt = fe_tokenizer.encode("Go")
    stop_id = engine.script[3]
    r = make_runner(engine, fe_tokenizer, spec(prompt, stop_token_ids=[stop_id]))
    run(r)
    res = r.result()
    assert res.finish_reason == "stop" and res.stop_reason == stop_id and res.token_ids == engine.script[:4]


def test_prompt_start_drops_prompt_rows(engine, fe_tokenizer):
    prompt = fe_tokenizer.encode("A longer prompt here")
    r = make_runner(engine, fe_tokenizer, spec(prompt, max_tokens=5, start=3))
    run(r)
    arr = decode_routed_experts(r.result().routed_experts)
    assert arr.shape[0] == len(prompt) + 5 - 1 - 3
    np.testing.assert_array_equal(arr, routing_rows(3, len(prompt) + 4, INFO))


def test_routing_off_gives_null(engine, fe_tokenizer):
    r = make_runner(engine, fe_tokenizer, spec(fe_tokenizer.encode("x"), routed=False, max_tokens=3))
    run(r)
    assert r.result().routed_experts is None


def test_one_token_one_prompt_token_has_no_rows(engine):
    # prompt of 1 token, 1 output token: 1 + 1 - 1 = 1 row; prompt_start=0
    r = make_runner(engine, None, spec([5], max_tokens=1, detokenize=False))
    run(r)
    assert decode_routed_experts(r.result().routed_experts).shape == (1, 3, 2)


def test_logprobs_follow_the_kept_tokens(engine, fe_tokenizer):
    prompt = fe_tokenizer.encode("Go")
    r = make_runner(engine, fe_tokenizer, spec(prompt, max_tokens=30, stop=["quick"], logprobs=2), stream=True)
    run(r)
    res = r.result()
    assert len(res.logprobs) == len(res.token_ids)
    assert [lp.token_id for lp in res.logprobs] == res.token_ids
    assert len(res.logprobs[0].top) == 2


def test_engine_error_propagates(engine, fe_tokenizer):
    engine.fail_with = BackendError(BackendError.UNAVAILABLE, "queue is full")
    r = make_runner(engine, fe_tokenizer, spec([5, 6]))
    with pytest.raises(BackendError):
        run(r)


def test_group_runs_choices_concurrently_and_cancels_on_close(engine, fe_tokenizer):
    engine.step_delay = 0.01
    prompt = fe_tokenizer.encode("Go")
    released = []

    async def go():
        runners = [make_runner(engine, fe_tokenizer, spec(prompt, index=i, max_tokens=50), stream=True)
                   for i in range(3)]
        group = ChoiceGroup(runners, on_close=lambda: released.append(True))
        seen = set()
        async for d in group.deltas():
            seen.add(d.index)
            if len(seen) == 3:
                break
        await group.aclose()
        return seen

    assert asyncio.run(go()) == {0, 1, 2}
    assert sorted(engine.cancelled) == ["req-0", "req-1", "req-2"]
    assert released == [True]


def test_group_results_in_index_order(engine, fe_tokenizer):
    async def go():
        runners = [make_runner(engine, fe_tokenizer, spec([5, 6], index=i, max_tokens=3 + i)) for i in range(3)]
        return await ChoiceGroup(runners).results()

    results = asyncio.run(go())
    assert [r.index for r in results] == [0, 1, 2]
    assert [len(r.token_ids) for r in results] == [3, 4, 5]
