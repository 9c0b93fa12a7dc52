"""Triton opened to clients with --triton-api-key (the session server runs so): only key holders get in,
and nobody, key or not, can load, unload or upload a model."""
from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def http(moe_server, method, path, body=None, headers=None):
    req = urllib.request.Request(f"http://{moe_server.triton_http_url}{path}", method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def ids_input():
    t = grpcclient.InferInput("input_ids", [3], "INT64")
    t.set_data_from_numpy(np.array([1, 2, 3], np.int64))
    return t


def test_grpc_needs_the_key(moe_server):
    client = grpcclient.InferenceServerClient(moe_server.triton_grpc_url)
    for headers in (None, {"triton-grpc-protocol-moe-serve-key": "wrong"}):
        with pytest.raises(InferenceServerException, match="restricted"):
            client.infer("moe", [ids_input()], headers=headers)
        with pytest.raises(InferenceServerException, match="restricted"):
            client.is_model_ready("moe", headers=headers)
    results: queue.Queue = queue.Queue()
    for headers in (None, moe_server.triton_grpc_headers):  # the model is decoupled: a stream
        client.start_stream(callback=lambda result, error: results.put((result, error)), headers=headers)
        try:
            client.async_stream_infer("moe", [ids_input()])
        except InferenceServerException:  # the keyless stream can be refused before the request goes out
            assert headers is None
        result, error = results.get(timeout=60)
        client.stop_stream()
        if headers is None:
            assert error is not None and "restricted" in str(error)
        else:
            assert error is None and result.as_numpy("output_ids").size > 0
    client.close()


def test_http_needs_the_key_and_model_control_is_off_even_with_it(moe_server, tmp_path):
    status, _ = http(moe_server, "GET", "/v2/models/moe/config")
    assert status == 403
    status, body = http(moe_server, "GET", "/v2/models/moe/config", headers=moe_server.triton_http_headers)
    assert status == 200 and json.loads(body)["name"] == "moe"
    # The attack of issue 14: a load with a file override runs the uploaded model.py as the server's user.
    marker = tmp_path / "pwned"
    code = f"open({str(marker)!r}, 'w').write('x')\nclass TritonPythonModel:\n    pass\n"
    upload = {"parameters": {"config": json.dumps({"backend": "python"}),
                             "file:1/model.py": __import__("base64").b64encode(code.encode()).decode()}}
    for headers in ({}, moe_server.triton_http_headers):
        status, body = http(moe_server, "POST", "/v2/repository/models/moe/load", upload, headers)
        assert status in (400, 403) and ("restricted" in body or "not allowed" in body), body
        status, body = http(moe_server, "POST", "/v2/repository/models/moe/unload", {}, headers)
        assert status in (400, 403), body
    assert not marker.exists()
    status, _ = http(moe_server, "GET", "/v2/models/moe/ready", headers=moe_server.triton_http_headers)
    assert status == 200
