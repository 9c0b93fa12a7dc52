"""The Triton model as any Triton client sees it: tritonclient gRPC streaming and HTTP generate_stream."""
from __future__ import annotations

import json
import queue
import re
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from ..tolerances import assert_close_across_batches

MODEL = "moe"


def tensor(name, values, dtype):
    arr = np.asarray(values, dtype={"INT64": np.int64, "INT32": np.int32, "FP32": np.float32, "BOOL": bool}[dtype])
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def inputs(ids, max_tokens=6, stream=False, **extra):
    ins = [
        tensor("input_ids", ids, "INT64"),
        tensor("max_tokens", [max_tokens], "INT32"),
        tensor("stream", [stream], "BOOL"),
    ]
    types = {"temperature": "FP32", "top_p": "FP32", "top_k": "INT32", "seed": "INT64", "ignore_eos": "BOOL",
             "logprobs": "INT32", "return_routed_experts": "BOOL", "routed_experts_prompt_start": "INT32"}
    for k, v in extra.items():
        ins.append(tensor(k, [v], types[k]))
    return ins


class Stream:
    """One gRPC bidirectional stream; results grouped by request id until each final response."""

    def __init__(self, url, headers=None):
        self.client = grpcclient.InferenceServerClient(url)
        self.q: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.q.put((result, error)), headers=headers)

    def send(self, rid, ins):
        self.client.async_stream_infer(MODEL, ins, request_id=rid, enable_empty_final_response=True)

    def collect(self, rids, timeout=120):
        out = {r: [] for r in rids}
        errors = {}
        done = set()
        deadline = time.monotonic() + timeout
        while done != set(rids):
            result, error = self.q.get(timeout=max(0.1, deadline - time.monotonic()))
            if error is not None:
                # An error response is final; its request id is in the message only for some
                # versions, so tests that expect errors send one request at a time.
                rid = next(r for r in rids if r not in done)
                errors[rid] = error
                done.add(rid)
                continue
            resp = result.get_response()
            if resp.outputs:
                out[resp.id].append(result)
            if resp.parameters["triton_final_response"].bool_param:
                done.add(resp.id)
        return out, errors

    def close(self, cancel=False):
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


@pytest.fixture
def stream(moe_server):
    s = Stream(moe_server.triton_grpc_url, moe_server.triton_grpc_headers)
    yield s
    s.close()


def concat(results, name):
    parts = [r.as_numpy(name) for r in results if r.as_numpy(name) is not None]
    return np.concatenate(parts) if parts else None


def test_streamed_rows_concatenate_to_the_non_streamed_array(stream, moe_server):
    ids = [1, 400, 17, 466, 418, 22, 91]
    stream.send("s", inputs(ids, max_tokens=8, stream=True, temperature=0.0, ignore_eos=True, logprobs=2))
    stream.send("n", inputs(ids, max_tokens=8, stream=False, temperature=0.0, ignore_eos=True, logprobs=2))
    out, errors = stream.collect(["s", "n"])
    assert not errors
    # One response vs several (one per engine step, or fewer when queued steps are sent together).
    assert len(out["n"]) == 1 and len(out["s"]) >= 2
    s_ids, n_ids = concat(out["s"], "output_ids"), concat(out["n"], "output_ids")
    np.testing.assert_array_equal(s_ids, n_ids)
    s_rows, n_rows = concat(out["s"], "routed_experts"), concat(out["n"], "routed_experts")
    assert s_rows.dtype == np.uint16 and n_rows.shape == (len(ids) + 8 - 1, 4, 2)
    np.testing.assert_array_equal(s_rows, n_rows)
    assert_close_across_batches(concat(out["s"], "logprobs"), concat(out["n"], "logprobs"))  # batched together
    assert concat(out["n"], "top_logprob_ids").shape == (8, 2)
    reasons = [r.as_numpy("finish_reason")[0] for r in out["s"]]
    assert all(x == b"" for x in reasons[:-1]) and reasons[-1] == b"length"
    last = out["s"][-1]
    assert last.as_numpy("num_prompt_tokens")[0] == len(ids) and last.as_numpy("num_output_tokens")[0] == 8


def test_a_client_gets_the_outputs_it_asks_for_and_all_of_them_by_default(stream):
    ids = [5, 6, 7]
    asked = [grpcclient.InferRequestedOutput(n) for n in ("output_ids", "finish_reason")]
    stream.client.async_stream_infer(MODEL, inputs(ids, max_tokens=3, temperature=0.0), request_id="some",
                                     outputs=asked, enable_empty_final_response=True)
    some, errors = stream.collect(["some"])
    assert not errors
    assert {o.name for r in some["some"] for o in r.get_response().outputs} == {"output_ids", "finish_reason"}
    stream.send("all", inputs(ids, max_tokens=3, temperature=0.0))
    every, errors = stream.collect(["all"])
    assert not errors
    last = every["all"][-1]
    assert last.as_numpy("num_cached_tokens") is not None and last.as_numpy("num_prompt_tokens")[0] == len(ids)
    assert concat(every["all"], "output_ids").tolist() == concat(some["some"], "output_ids").tolist()


def test_metadata_is_in_the_model_config(moe_server):
    client = grpcclient.InferenceServerClient(moe_server.triton_grpc_url)
    cfg = client.get_model_config(MODEL, as_json=True, headers=moe_server.triton_grpc_headers)["config"]
    meta = json.loads(cfg["parameters"]["moe_metadata"]["string_value"])
    assert meta["num_hidden_layers"] == 4 and meta["num_experts"] == 8 and meta["num_experts_per_tok"] == 2
    assert meta["moe_layers"] == [0, 1, 2, 3] and meta["routed_experts_dtype"] == "uint8"
    assert cfg["model_transaction_policy"]["decoupled"] is True


def test_sixteen_concurrent_streams_all_complete(stream):
    rids = [f"c{i}" for i in range(16)]
    for i, rid in enumerate(rids):
        stream.send(rid, inputs([1, 5 + i, 9, 13 + i], max_tokens=3 + i % 5, stream=True, temperature=0.8, seed=i,
                                ignore_eos=True))
    out, errors = stream.collect(rids)
    assert not errors
    for i, rid in enumerate(rids):
        assert len(concat(out[rid], "output_ids")) == 3 + i % 5
        assert concat(out[rid], "routed_experts").shape[0] == 4 + 3 + i % 5 - 1
        assert out[rid][-1].as_numpy("finish_reason")[0] == b"length"


def engine_gauge(moe_server, state, family="moe_engine_requests"):
    text = urllib.request.urlopen(moe_server.triton_metrics_url, timeout=5).read().decode()
    m = re.search(r'^%s\{[^}]*state="%s"[^}]*\} (\S+)$' % (family, state), text, re.M)
    return float(m.group(1))


def free_blocks(moe_server) -> tuple[float, float]:
    return engine_gauge(moe_server, "free", "moe_engine_kv_blocks"), engine_gauge(moe_server, "total", "moe_engine_kv_blocks")


def test_cancelling_a_stream_frees_the_engine_blocks(moe_server):
    s = Stream(moe_server.triton_grpc_url, moe_server.triton_grpc_headers)
    s.send("long", inputs([1, 2, 3], max_tokens=900, stream=True, ignore_eos=True, temperature=0.0))
    s.q.get(timeout=60)  # it is running
    deadline = time.monotonic() + 10
    while engine_gauge(moe_server, "running") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_gauge(moe_server, "running") >= 1
    s.close(cancel=True)
    # Triton refreshes its metrics every couple of seconds; wait for the engine to settle.
    deadline = time.monotonic() + 15
    while (engine_gauge(moe_server, "running") > 0 or free_blocks(moe_server)[0] < free_blocks(moe_server)[1]) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine_gauge(moe_server, "running") == 0
    free, total = free_blocks(moe_server)
    assert total > 0 and free == total  # every KV block the cancelled request held is free again
    assert "cancelled by the client" in moe_server.log_path.read_text()


@pytest.mark.parametrize(
    "ids, extra, message",
    [
        ([], {}, "empty"),
        ([1, 2, 99999], {}, "outside the vocabulary"),
        ([1, -5], {}, "outside the vocabulary"),
        ([1] * 1020, {}, "maximum context length"),
        ([1, 2], {"temperature": -0.5}, "temperature"),
        ([1, 2], {"top_p": 0.0}, "top_p"),
        ([1, 2], {"routed_experts_prompt_start": 5}, "routed_experts_prompt_start"),
        ([1, 2], {"logprobs": 500}, "logprobs"),
    ],
)
def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(stream, ids, extra, message):
    stream.send("bad", inputs(ids, max_tokens=8, **extra))
    _, errors = stream.collect(["bad"])
    assert "bad" in errors and message in str(errors["bad"])
    stream.send("good", inputs([1, 2, 3], max_tokens=2))
    out, errors = stream.collect(["good"])
    assert not errors and len(concat(out["good"], "output_ids")) == 2


def test_http_generate_stream(moe_server):
    body = json.dumps({"input_ids": [1, 2, 3, 4], "max_tokens": 3, "stream": True, "temperature": 0.0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://{moe_server.triton_http_url}/v2/models/{MODEL}/generate_stream",
                                 data=body, headers={"Content-Type": "application/json", **moe_server.triton_http_headers})
    events = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
    # The generate extension writes one-element tensors as scalars and others as flat lists.
    tokens = [t for e in events for t in np.atleast_1d(e["output_ids"]).tolist()]
    assert len(tokens) == 3
    ids = np.concatenate([np.atleast_1d(e["routed_experts"]) for e in events])
    assert ids.size == (4 + 3 - 1) * 4 * 2 and ids.max() < 8
    # Streamed: the first step alone, later steps possibly sent together when they queue up.
    reasons = [e["finish_reason"] for e in events]
    assert len(reasons) >= 2 and set(reasons[:-1]) == {""} and reasons[-1] == "length"
