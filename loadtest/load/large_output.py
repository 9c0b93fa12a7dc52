"""Large routed-experts outputs through the whole server.

A 32k-token request on a 48-layer, top-8 shape: 32768 rows x 48 x 8 ids,
25 MB as Triton's UINT16 tensor, 12.6 MB as the API's uint8 .npy (16.8 MB of
base64). The script builds such a checkpoint (tiny widths, real depth and
top-k), starts `moe-serve` on it, and sends the request twice: over Triton gRPC
(non-streaming) and over the OpenAI-compatible /inference/v1/generate. It checks
shapes and that both paths return the same ids, and prints times and sizes.

    .venv/bin/python loadtest/load/large_output.py [--tokens 32768] [--layers 48]

On the 2-core CPU machine the 32k prefill itself takes about 6 minutes; the
transport adds seconds.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768, help="prompt tokens (rows returned = tokens)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=2048, help="--max-num-batched-tokens")
    args = ap.parse_args()

    import tritonclient.grpc as grpcclient

    from moe_engine.tiny import write_tiny_checkpoint
    from openai_frontend.server_process import start_server

    work = Path(tempfile.mkdtemp(prefix="moe-large-"))
    ckpt = work / "ckpt"
    write_tiny_checkpoint(
        ckpt,
        num_hidden_layers=args.layers,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        hidden_size=32,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=args.tokens + 64,
    )
    print(f"checkpoint: {args.layers} layers, {args.experts} experts, top-{args.top_k} in {ckpt}", flush=True)
    server = start_server(
        work,
        ["--model", str(ckpt), "--served-model-name", "large", "--max-model-len", str(args.tokens + 1),
         "--max-num-seqs", "1", "--max-num-batched-tokens", str(args.chunk), "--num-threads", "1",
         "--engine-stall-timeout", "60"],  # one CPU prefill step of this model takes ~8 s
        model_name="large",
    )
    print(f"server up: {server.base_url} (log {server.log_path})", flush=True)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 500, size=args.tokens).astype(np.int64)
    try:
        # 1. Triton gRPC, non-streaming: one response with every row.
        client = grpcclient.InferenceServerClient(server.triton_grpc_url)
        results = []
        client.start_stream(callback=lambda result, error: results.append((result, error)),
                            headers=server.triton_grpc_headers)
        ins = []
        for name, arr, dt in [("input_ids", prompt, "INT64"), ("max_tokens", np.array([1], np.int32), "INT32"),
                              ("temperature", np.array([0.0], np.float32), "FP32")]:
            t = grpcclient.InferInput(name, list(arr.shape), dt)
            t.set_data_from_numpy(arr)
            ins.append(t)
        t0 = time.monotonic()
        client.async_stream_infer("moe", ins, request_id="large", enable_empty_final_response=True)
        while not any(r is not None and r.get_response().parameters["triton_final_response"].bool_param
                      for r, _ in results) and not any(e for _, e in results):
            time.sleep(0.5)
        client.stop_stream()
        grpc_s = time.monotonic() - t0
        errors = [e for _, e in results if e]
        assert not errors, errors
        rows = np.concatenate([r.as_numpy("routed_experts") for r, _ in results
                               if r.as_numpy("routed_experts") is not None])
        assert rows.shape == (args.tokens, args.layers, args.top_k), rows.shape
        print(f"gRPC: {rows.shape} uint16 = {rows.nbytes / 1e6:.1f} MB in {grpc_s:.1f} s", flush=True)

        # 2. The OpenAI-compatible tokens-in/tokens-out endpoint.
        body = json.dumps({"model": "large", "token_ids": prompt.tolist(),
                           "sampling_params": {"max_tokens": 1, "temperature": 0}}).encode()
        req = urllib.request.Request(server.root_url + "/inference/v1/generate", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=3600) as r:
            payload = r.read()
        api_s = time.monotonic() - t0
        choice = json.loads(payload)["choices"][0]
        t1 = time.monotonic()
        arr = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))
        decode_s = time.monotonic() - t1
        assert arr.shape == rows.shape and arr.dtype == np.uint8
        np.testing.assert_array_equal(arr, rows)
        print(f"API:  {arr.shape} {arr.dtype}, response {len(payload) / 1e6:.1f} MB in {api_s:.1f} s "
              f"(client decode {decode_s * 1e3:.0f} ms); ids identical to gRPC", flush=True)
    finally:
        code = server.stop()
        print(f"server stopped ({code})")


if __name__ == "__main__":
    main()
