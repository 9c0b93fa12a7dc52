"""Triton tensors <-> frontend types, error classification, model metadata."""
from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import serialize_byte_tensor

from openai_frontend.triton_client import (
    BackendError,
    BackendOutput,
    BackendRequest,
    ModelInfo,
    classify_error,
    classify_status,
)

META = {"architecture": "mixtral", "num_hidden_layers": 4, "moe_layers": [1, 3], "num_experts": 300,
        "num_experts_per_tok": 2, "routed_experts_dtype": "uint16", "max_model_len": 64, "eos_token_ids": [2],
        "vocab_size": 512}


def test_model_info_from_get_model_config_json():
    config = {"config": {"name": "moe", "parameters": {"moe_metadata": {"string_value": json.dumps(META)}}}}
    info = ModelInfo.from_model_config(config)
    assert info.moe_layers == (1, 3) and info.num_experts == 300 and info.np_dtype == np.uint16
    assert info.eos_token_ids == (2,)
    no_dtype = {k: v for k, v in META.items() if k not in ("routed_experts_dtype", "moe_layers")}
    info = ModelInfo.from_metadata({**no_dtype, "num_experts": 8})
    assert info.routed_experts_dtype == "uint8" and info.moe_layers == (0, 1, 2, 3)
    with pytest.raises(ValueError):
        ModelInfo.from_model_config({"config": {"parameters": {}}})


def test_request_sends_only_what_is_set():
    inputs = BackendRequest(input_ids=[1, 2, 3], stream=False).to_inputs()
    assert [(i.name(), i.datatype(), i.shape()) for i in inputs] == [("input_ids", "INT64", [3]),
                                                                     ("stream", "BOOL", [1])]
    req = BackendRequest(input_ids=[1], max_tokens=5, temperature=0.5, top_p=0.9, top_k=-1, seed=-7,
                        stop_token_ids=[2, 3], ignore_eos=True, min_tokens=1, logprobs=0,
                        return_routed_experts=False, routed_experts_prompt_start=0)
    got = {i.name(): (i.datatype(), i.shape()) for i in req.to_inputs()}
    assert got == {
        "input_ids": ("INT64", [1]), "max_tokens": ("INT32", [1]), "temperature": ("FP32", [1]),
        "top_p": ("FP32", [1]), "top_k": ("INT32", [1]), "seed": ("INT64", [1]), "ignore_eos": ("BOOL", [1]),
        "min_tokens": ("INT32", [1]), "logprobs": ("INT32", [1]), "return_routed_experts": ("BOOL", [1]),
        "routed_experts_prompt_start": ("INT32", [1]), "stream": ("BOOL", [1]), "stop_token_ids": ("INT64", [2]),
    }


def make_result(tensors: dict[str, tuple[str, np.ndarray]]) -> InferResult:
    resp = service_pb2.ModelInferResponse(model_name="moe")
    for name, (dtype, arr) in tensors.items():
        out = resp.outputs.add()
        out.name, out.datatype = name, dtype
        out.shape.extend(arr.shape)
        raw = serialize_byte_tensor(arr).item() if dtype == "BYTES" else arr.tobytes()
        resp.raw_output_contents.append(raw)
    return InferResult(resp)


def test_output_from_result():
    rows = np.arange(2 * 4 * 2, dtype=np.uint16).reshape(2, 4, 2)
    res = make_result({
        "output_ids": ("INT64", np.array([7, 8], np.int64)),
        "routed_experts": ("UINT16", rows),
        "finish_reason": ("BYTES", np.array([b"length"], dtype=np.object_)),
        "num_prompt_tokens": ("INT32", np.array([3], np.int32)),
        "num_output_tokens": ("INT32", np.array([2], np.int32)),
        "logprobs": ("FP32", np.array([-0.5, -1.5], np.float32)),
        "top_logprob_ids": ("INT64", np.array([[7, 1], [8, 2]], np.int64)),
        "top_logprobs": ("FP32", np.array([[-0.5, -2.0], [-1.5, -3.0]], np.float32)),
    })
    out = BackendOutput.from_result(res)
    assert out.output_ids.tolist() == [7, 8] and out.finish_reason == "length"
    np.testing.assert_array_equal(out.routed_experts, rows)
    assert (out.num_prompt_tokens, out.num_output_tokens) == (3, 2)
    assert out.top_logprob_ids.shape == (2, 2) and out.top_logprobs[1, 1] == -3.0


def test_output_mid_stream_without_routing():
    res = make_result({
        "output_ids": ("INT64", np.array([7], np.int64)),
        "routed_experts": ("UINT16", np.zeros((0, 4, 2), np.uint16)),
        "finish_reason": ("BYTES", np.array([b""], dtype=np.object_)),
    })
    out = BackendOutput.from_result(res)
    assert out.finish_reason is None and out.routed_experts is None and out.logprobs is None


@pytest.mark.parametrize("message,kind", [
    ("request cancelled", BackendError.CANCELLED),
    ("internal error: ValueError('must be')", BackendError.INTERNAL),
    ("something odd", BackendError.INTERNAL),
    # The moe backend's kind prefixes decide, whatever the words after them.
    ("invalid request: request id 'stopped-1' is already in use", BackendError.INVALID),
    ("unavailable: the engine's waiting queue is full (2 requests); retry later", BackendError.UNAVAILABLE),
    ("internal error: engine failure: RuntimeError('invalid value')", BackendError.INTERNAL),
    # Without a prefix the message is not the backend's: the wording decides nothing, it is an internal error.
    ("the engine's waiting queue is full (1024 requests); retry later", BackendError.INTERNAL),
    ("input_ids: token id 900 is outside the vocabulary [0, 512)", BackendError.INTERNAL),
    ("top_p: must be in (0, 1]", BackendError.INTERNAL),
])
def test_classify_error(message, kind):
    assert classify_error(message).kind == kind


def test_classify_error_strips_the_kind_prefix_from_the_message():
    err = classify_error("invalid request: input_ids: token id 900 is outside the vocabulary [0, 512)")
    assert err.message == "input_ids: token id 900 is outside the vocabulary [0, 512)"


@pytest.mark.parametrize("code,kind", [
    (grpc.StatusCode.CANCELLED, BackendError.CANCELLED),
    (grpc.StatusCode.UNAVAILABLE, BackendError.UNAVAILABLE),
    (grpc.StatusCode.INVALID_ARGUMENT, BackendError.INTERNAL),  # the frontend built the request: its bug, a 500
    (grpc.StatusCode.INTERNAL, BackendError.INTERNAL),
    (None, BackendError.INTERNAL),
])
def test_a_failed_call_is_classified_by_its_grpc_status(code, kind):
    assert classify_status(code, "connection reset").kind == kind


def test_model_info_quantization():
    """The weight format the checkpoint declares reaches /v1/models through moe_metadata (older metadata: none)."""
    from openai_frontend.triton_client import ModelInfo

    meta = {"num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2, "max_model_len": 64, "vocab_size": 9}
    assert ModelInfo.from_metadata(meta).quantization == "none"
    assert ModelInfo.from_metadata({**meta, "quantization": "fp8"}).quantization == "fp8"
