"""Routed-experts wire format: base64 .npy exactly as vLLM writes it."""
from __future__ import annotations

import base64
import io

import numpy as np
import pybase64
import pytest

from moe_engine.config import routed_experts_dtype
from openai_frontend.routing_codec import (
    RoutedExpertsAccumulator,
    decode_routed_experts,
    encode_npy_b64,
    npy_header,
)


def vllm_encode(arr: np.ndarray) -> str:
    """vLLM's recipe: np.save into BytesIO, then pybase64."""
    buf = io.BytesIO()
    np.save(buf, arr)
    return pybase64.b64encode(buf.getvalue()).decode("ascii")


@pytest.mark.parametrize("num_experts,dtype", [(1, np.uint8), (8, np.uint8), (256, np.uint8), (257, np.uint16),
                                               (512, np.uint16), (65536, np.uint16)])
def test_dtype_choice_matches_vllm(num_experts, dtype):
    assert np.dtype(routed_experts_dtype(num_experts)) == np.dtype(dtype)


def test_dtype_rejects_nonsense():
    with pytest.raises(ValueError):
        routed_experts_dtype(0)
    with pytest.raises(ValueError):
        routed_experts_dtype(65537)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
@pytest.mark.parametrize("shape", [(5, 3, 2), (1, 1, 1), (0, 4, 2), (33, 48, 8)])
def test_encode_is_byte_identical_to_np_save(dtype, shape):
    rng = np.random.default_rng(0)
    arr = rng.integers(0, np.iinfo(dtype).max, size=shape, endpoint=True).astype(dtype)
    s = encode_npy_b64(arr)
    assert s == vllm_encode(arr)
    out = np.load(io.BytesIO(base64.b64decode(s)))  # the client one-liner, stdlib base64
    assert out.dtype == dtype and out.shape == shape
    np.testing.assert_array_equal(out, arr)


def test_header_is_aligned():
    for shape in [(0, 2, 2), (7, 48, 8), (123456, 61, 8)]:
        assert len(npy_header(shape, np.dtype(np.uint8))) % 64 == 0


def test_accumulator_concatenates_and_casts_to_uint8():
    acc = RoutedExpertsAccumulator(num_layers=3, top_k=2, dtype=np.uint8)
    a = np.arange(12, dtype=np.uint16).reshape(2, 3, 2)
    b = np.full((1, 3, 2), 255, np.uint16)
    c = np.zeros((0, 3, 2), np.uint16)
    for chunk in (a, c, None, b):
        acc.add(chunk)
    assert acc.rows == 3
    b64, view = acc.encode()
    assert isinstance(b64, bytes)  # spliced into the JSON body as is
    s = b64.decode("ascii")
    out = decode_routed_experts(s)
    assert out.dtype == np.uint8 and out.shape == (3, 3, 2)
    np.testing.assert_array_equal(out, np.concatenate([a, b]).astype(np.uint8))
    np.testing.assert_array_equal(view, out)
    assert s == vllm_encode(out)


def test_accumulator_keeps_uint16_for_many_experts():
    acc = RoutedExpertsAccumulator(num_layers=2, top_k=4, dtype=np.dtype(routed_experts_dtype(512)))
    chunk = np.array([[[0, 300, 511, 257]] * 2], dtype=np.uint16)
    acc.add(chunk)
    acc.add(chunk)
    out = decode_routed_experts(acc.encode()[0])
    assert out.dtype == np.uint16 and out.shape == (2, 2, 4)
    assert int(out.max()) == 511


def test_accumulator_truncates_to_max_rows():
    acc = RoutedExpertsAccumulator(num_layers=1, top_k=1, dtype=np.uint8)
    for i in range(4):
        acc.add(np.full((3, 1, 1), i, np.uint16))
    out = decode_routed_experts(acc.encode(max_rows=7)[0])
    assert out[:, 0, 0].tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert acc.to_array(max_rows=100).shape[0] == 12


def test_accumulator_empty_is_none():
    acc = RoutedExpertsAccumulator(num_layers=2, top_k=2, dtype=np.uint8)
    assert acc.encode() == (None, None)
    acc.add(np.zeros((0, 2, 2), np.uint16))
    assert acc.encode() == (None, None)
    acc.add(np.zeros((2, 2, 2), np.uint16))
    assert acc.encode(max_rows=0) == (None, None)
    assert acc.encode(max_rows=-3) == (None, None)


def test_accumulator_rejects_wrong_shape():
    acc = RoutedExpertsAccumulator(num_layers=2, top_k=2, dtype=np.uint8)
    with pytest.raises(ValueError, match="shape"):
        acc.add(np.zeros((1, 3, 2), np.uint16))


def test_payload_splicing_into_json():
    import json

    from openai_frontend.protocol import CompletionResponseChoice
    from openai_frontend.routing_codec import Payloads

    p = Payloads()
    big = b"QUJD" * 1000
    choices = [CompletionResponseChoice(index=0, text='say "@@routed-x:0@@"', routed_experts=p.ref(big)),
               CompletionResponseChoice(index=1, text="", routed_experts=p.ref(None)),
               CompletionResponseChoice(index=2, text="b", routed_experts=p.ref(b"AAAA"))]
    for c in choices:
        body = p.dump(c, b"data: ", b"\n\n") if c.index == 2 else p.dump(c)
        if c.index == 2:
            assert body.startswith(b"data: ") and body.endswith(b"\n\n")
            body = body[6:-2]
        got = json.loads(body)
        assert got["text"] == c.text
        assert got["routed_experts"] == {0: big.decode(), 1: None, 2: "AAAA"}[c.index]


def test_raw_json_payloads_splice_in_as_values_and_pieces_join_to_the_same_body():
    """Payloads.raw (prompt logprobs serialised once, spliced into each choice) gives exactly the JSON of the model
    holding the value itself; dump_parts (sent piece by piece) joins to the bytes of dump."""
    import json

    from pydantic import TypeAdapter

    from openai_frontend.bounded import dump_list
    from openai_frontend.protocol import CompletionResponse, CompletionResponseChoice, UsageInfo
    from openai_frontend.protocol_responses import PromptLogprob, PromptLogprobs
    from openai_frontend.routing_codec import Payloads

    scores: PromptLogprobs = [None] + [{7 + i: PromptLogprob(logprob=-0.5 * i, rank=1, decoded_token=f"t{i}")}
                                       for i in range(600)]  # more than one slice of dump_list
    adapter = TypeAdapter(PromptLogprobs)
    assert dump_list(adapter, scores) == adapter.dump_json(scores)

    def response(prompt_logprobs, routed):
        choices = []
        for i in range(3):
            c = CompletionResponseChoice(index=i, text="x", routed_experts=routed[i])
            c.prompt_logprobs = prompt_logprobs[i]
            choices.append(c)
        return CompletionResponse(id="cmpl-1", created=1, model="m", choices=choices,
                                  usage=UsageInfo(prompt_tokens=1, completion_tokens=3, total_tokens=4))

    plain = response([scores] * 3, ["QUJD", None, "REVG"])
    payloads = Payloads()
    once = dump_list(adapter, scores)
    spliced = response([payloads.raw(once) for _ in range(3)],
                       [payloads.ref(b"QUJD"), payloads.ref(None), payloads.ref(b"REVG")])
    parts = payloads.dump_parts(spliced)
    assert json.loads(b"".join(parts)) == json.loads(plain.model_dump_json())
    assert sum(p is once for p in parts) == 3  # the same bytes, not three copies
