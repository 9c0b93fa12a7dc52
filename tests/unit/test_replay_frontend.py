"""Frontend side of issue 19: decoding a client's routing array, checking it against the model and prompt,
encoding routed weights, and the prompt-logprob formats (vLLM's ``prompt_logprobs``, OpenAI's echo).

The same behaviours through the real server: tests/integration/test_replay_and_scoring.py.
"""
from __future__ import annotations

import base64
import io
import math
import time

import numpy as np
import pybase64
import pytest
from pydantic import ValidationError

from openai_frontend.errors import BadRequestError
from openai_frontend.generation import PromptScores
from openai_frontend.logprobs_format import echo_logprobs, prompt_logprobs
from openai_frontend.protocol import CompletionRequest, GenerateRequest
from openai_frontend.replay import check_replay
from openai_frontend.routing_codec import (
    ArrayDecodeError,
    RoutedExpertsAccumulator,
    decode_int_array,
    encode_npy_b64,
)
from tests.unit.conftest import make_model_info

INFO = make_model_info()  # 3 layers (layer 0 dense, 1 and 2 MoE), 8 experts, top-2


def npy_b64(arr: np.ndarray, **kw) -> str:
    buf = io.BytesIO()
    np.save(buf, arr, **kw)
    return base64.b64encode(buf.getvalue()).decode("ascii")


# ---------------------------------------------------------------- decoding


@pytest.mark.parametrize("dtype", ["u1", "u2", "u4", "u8", "i1", "i2", "i4", "i8", ">u2", ">i8"])
def test_every_integer_dtype_decodes_to_the_same_values(dtype):
    arr = np.arange(2 * 3 * 2).reshape(2, 3, 2).astype(dtype)
    out = decode_int_array(npy_b64(arr), ndim=3)
    assert out.dtype == np.dtype(dtype) and out.shape == (2, 3, 2)
    np.testing.assert_array_equal(out, arr)


def test_the_servers_own_routed_experts_and_fortran_order_decode():
    arr = np.random.default_rng(0).integers(0, 8, size=(5, 3, 2)).astype(np.uint8)
    np.testing.assert_array_equal(decode_int_array(encode_npy_b64(arr), ndim=3), arr)
    f = np.asfortranarray(arr.astype(np.int32))
    np.testing.assert_array_equal(decode_int_array(npy_b64(f), ndim=3), arr)


def _huge_header() -> str:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<i8", "fortran_order": False, "shape": (10**12, 48, 8)})
    return pybase64.b64encode(buf.getvalue() + b"\0" * 64).decode()


@pytest.mark.parametrize(
    "encoded,says",
    [
        (12, "must be a string"),
        ("not base64!", "not valid base64"),
        ("aGVsbG8gd29ybGQgdGhpcyBpcyBub3QgbnB5", "not a .npy file"),  # "hello world this is not npy"
        (npy_b64(np.zeros((2, 3, 2), np.float32)), "integer array"),
        (npy_b64(np.zeros((2, 3, 2), bool)), "integer array"),
        (npy_b64(np.array([[[None, 1]]], dtype=object), allow_pickle=True), "integer array"),
        (npy_b64(np.zeros((1, 3, 2), dtype=[("a", "<i4")])), "integer array"),
        (npy_b64(np.zeros((2, 3), np.uint8)), "3-D"),
        (npy_b64(np.zeros((1, 2, 3, 2), np.uint8)), "3-D"),
        (npy_b64(np.zeros((2, 3, 2), np.uint8))[:-8], "bytes of data"),  # truncated data
        (_huge_header(), "bytes of data"),
    ],
)
def test_bad_arrays_are_refused_with_a_reason(encoded, says):
    with pytest.raises(ArrayDecodeError) as e:
        decode_int_array(encoded, ndim=3)
    assert says in str(e.value)


def test_a_header_claiming_a_huge_shape_allocates_nothing():
    t0 = time.perf_counter()
    with pytest.raises(ArrayDecodeError):
        decode_int_array(_huge_header(), ndim=3)
    assert time.perf_counter() - t0 < 0.5  # np.load would try to allocate 3 TB first


def test_request_fields_name_the_field_and_keep_the_array():
    arr = np.ones((2, 3, 2), np.int16)
    req = CompletionRequest(prompt="x", replay_routed_experts=npy_b64(arr))
    np.testing.assert_array_equal(req.replay_routed_experts, arr)
    with pytest.raises(ValidationError) as e:
        CompletionRequest(prompt="x", replay_routed_experts=npy_b64(arr.astype(np.float64)))
    assert e.value.errors()[0]["loc"] == ("replay_routed_experts",)
    with pytest.raises(ValidationError) as e:
        GenerateRequest(token_ids=[1], sampling_params={"replay_routed_experts": "%%%"})
    assert e.value.errors()[0]["loc"] == ("sampling_params", "replay_routed_experts")


# ---------------------------------------------------------------- against the model and the prompt


def test_check_replay_returns_int32_with_dense_layers_zeroed():
    arr = np.array([[[9, 9], [3, 1], [0, 7]], [[200, 4], [5, 6], [7, 2]]], dtype=np.uint8)  # layer 0 is dense
    out = check_replay(arr, num_prompt=4, model=INFO, param="p")
    assert out.dtype == np.int32 and out.shape == (2, 3, 2)
    np.testing.assert_array_equal(out[:, 1:], arr[:, 1:])
    assert (out[:, 0] == 0).all()


@pytest.mark.parametrize(
    "arr,num_prompt,says",
    [
        (np.zeros((2, 3, 3), np.uint8), 4, "expected (rows, 3, 2)"),
        (np.zeros((2, 4, 2), np.uint8), 4, "expected (rows, 3, 2)"),
        (np.tile(np.array([0, 1], np.uint8), (5, 3, 1)), 4, "at most 4 rows"),
        (np.zeros((0, 3, 2), np.uint8), 4, "has no rows"),
        (np.tile(np.array([0, 8], np.uint8), (1, 3, 1)), 4, "expert id 8"),
        (np.tile(np.array([-1, 2], np.int64), (1, 3, 1)), 4, "expert id -1"),
        (np.tile(np.array([2**32 + 1, 2], np.uint64), (1, 3, 1)), 4, f"expert id {2**32 + 1}"),  # no int32 wrap
        (np.tile(np.array([3, 3], np.int32), (1, 3, 1)), 4, "repeats an expert id"),
    ],
)
def test_check_replay_refuses_what_the_engine_cannot_force(arr, num_prompt, says):
    with pytest.raises(BadRequestError) as e:
        check_replay(arr, num_prompt, INFO, "replay_routed_experts")
    assert says in e.value.message and e.value.param == "replay_routed_experts"


def test_out_of_range_message_points_at_the_cell():
    arr = np.tile(np.array([0, 1], np.int32), (3, 3, 1))
    arr[2, 1, 1] = 99
    with pytest.raises(BadRequestError) as e:
        check_replay(arr, 3, INFO, "x")
    assert "[2, 1, 1]" in e.value.message


def test_repeats_in_dense_layers_are_ignored():
    arr = np.tile(np.array([0, 1], np.int32), (2, 3, 1))
    arr[:, 0] = 5  # dense layer: ignored, as the server returns 0 there
    check_replay(arr, 2, INFO, "x")


# ---------------------------------------------------------------- routed weights encoding


def test_routed_weights_accumulate_as_float32_and_cut_like_routed_experts():
    acc = RoutedExpertsAccumulator(num_layers=3, top_k=2, dtype=np.float32)
    a = np.random.default_rng(1).random((4, 3, 2)).astype(np.float32)
    b = np.random.default_rng(2).random((2, 3, 2)).astype(np.float32)
    acc.add(a)
    acc.add(b)
    encoded, _ = acc.encode(max_rows=5)
    out = np.load(io.BytesIO(base64.b64decode(encoded)))
    assert out.dtype == np.float32 and out.shape == (5, 3, 2)
    np.testing.assert_array_equal(out, np.concatenate([a, b])[:5])  # bit-exact


# ---------------------------------------------------------------- prompt logprobs formats


class _Tok:
    def token_text(self, tid: int) -> str:
        return f"<{tid}>"


def _scores(values, top_ids=None, top_vals=None) -> PromptScores:
    f = np.asarray
    return PromptScores(f(values, np.float32), None if top_ids is None else f(top_ids, np.int64),
                        None if top_vals is None else f(top_vals, np.float32))


def test_prompt_logprobs_vllm_format():
    prompt = [5, 7, 9]
    s = _scores([-1.5, -0.25], [[3, 7], [9, 4]], [[-0.5, -1.5], [-0.25, -2.0]])
    out = prompt_logprobs(prompt, s, _Tok(), top_n=2)
    assert out[0] is None and len(out) == 3
    # position 1: prompt token 7 is the engine's 2nd choice; top 2 = {3, 7}
    assert set(out[1]) == {7, 3}
    assert out[1][7].logprob == pytest.approx(-1.5) and out[1][7].rank == 2 and out[1][7].decoded_token == "<7>"
    assert out[1][3].rank == 1
    # position 2: prompt token 9 is the top choice
    assert out[2][9].rank == 1 and set(out[2]) == {9, 4}
    # JSON keys are the token ids, as vLLM's
    from openai_frontend.protocol import CompletionResponseChoice

    js = CompletionResponseChoice(index=0, text="", prompt_logprobs=out).model_dump(mode="json")
    assert js["prompt_logprobs"][0] is None and js["prompt_logprobs"][1]["7"]["rank"] == 2


def test_prompt_logprobs_with_n0_or_a_token_outside_the_top():
    s = _scores([-7.0], [[3]], [[-0.1]])
    assert list(prompt_logprobs([5, 7], s, None, top_n=0)[1]) == [7]
    entry = prompt_logprobs([5, 7], s, None, top_n=1)[1]
    assert entry[7].rank is None and entry[7].decoded_token is None and entry[3].rank == 1
    assert prompt_logprobs([5], _scores([]), _Tok(), top_n=1) == [None]
    assert prompt_logprobs([5, 6], _scores([-math.inf]), _Tok(), top_n=0)[1][6].logprob == -9999.0


def test_prompt_logprobs_use_the_engines_ranks():
    s = _scores([-7.0, -0.1], [[3], [9]], [[-0.1], [-0.1]])
    s = s._replace(ranks=np.array([57, 1], np.int64))
    out = prompt_logprobs([5, 7, 9], s, _Tok(), top_n=1)
    assert out[1][7].rank == 57 and out[1][3].rank == 1 and out[2][9].rank == 1 and len(out[2]) == 1


def test_echo_logprobs_put_the_prompt_first_with_a_null():
    s = _scores([-1.5, -0.25], [[3], [9]], [[-0.5], [-0.25]])
    lp = echo_logprobs([5, 7, 9], s, _Tok(), top_n=1)
    assert lp.tokens == ["<5>", "<7>", "<9>"]
    assert lp.token_logprobs == [None, pytest.approx(-1.5), pytest.approx(-0.25)]
    assert lp.top_logprobs[0] is None
    assert lp.top_logprobs[1] == {"<3>": pytest.approx(-0.5), "<7>": pytest.approx(-1.5)}
    assert lp.top_logprobs[2] == {"<9>": pytest.approx(-0.25)}
    assert lp.text_offset == [0, 3, 6]
