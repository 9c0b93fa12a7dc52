"""`moe-serve` with FP8: a block-FP8 checkpoint (the published layout) served on the CPU, where it loads dequantised,
and a float32 checkpoint served with ``--quantization fp8`` (W8A8, the op-by-op reference on the CPU). In both the
routed experts the API returns are the ids of the engine's own forward of the model it serves, and /v1/models says
the weights' format and what they are served as."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from moe_engine.checkpoint import load_model
from moe_engine.config import load_config
from moe_engine.models.decoder import reference_forward
from openai_frontend.server_process import start_server

from ..unit.hf_checkpoints import rewrite_as_fp8, write_servable_checkpoint

# hidden 256 and expert width 256: past one 128-block, whole blocks for the experts
SHAPE = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256, head_dim=64)
CASES = {"fp8-checkpoint": ([], "fp8", "float32", None), "quantization-fp8": (["--quantization", "fp8"], "none", "fp8",
                                                                               "quantize")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_served_fp8(case, tmp_path):
    import openai

    flags, weights, served_as, fp8 = CASES[case]
    ckpt = write_servable_checkpoint("qwen3_moe", tmp_path / "ckpt", **SHAPE)
    if weights == "fp8":
        rewrite_as_fp8(ckpt)
    cfg = load_config(ckpt)
    (tmp_path / "run").mkdir()
    server = start_server(tmp_path / "run", ["--model", str(ckpt), "--served-model-name", case, "--max-model-len",
                                             "128", *flags], model_name=case)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        card = client.models.retrieve(case).model_dump()
        assert card["quantization"] == {"weights": weights, "served_as": served_as, "kv_cache": "auto"}
        r = client.completions.create(model=case, prompt="The router picks the top-k experts", max_tokens=8,
                                      temperature=0, extra_body={"return_token_ids": True})
        choice = r.choices[0]
        arr = np.load(io.BytesIO(base64.b64decode(choice.routed_experts)))
        ids = choice.prompt_token_ids + choice.token_ids[:-1]
        _, ref = reference_forward(load_model(ckpt, progress=False, fp8=fp8), ids)
        for layer in cfg.moe_layers:
            np.testing.assert_array_equal(np.sort(arr[:, layer], -1), np.sort(ref[:, layer].numpy(), -1))
    finally:
        code = server.stop()
    assert code == 0, server.log_tail()


def test_served_fp8_kv_cache_returns_the_engines_own_tokens_and_routing(tmp_path):
    """`--kv-cache-dtype fp8` through the whole server: /v1/models says the KV blocks are fp8_e4m3, and the tokens and
    routed experts the API returns are those of the engine's own forward over an FP8 cache (an engine in this
    process with the same settings, fed the same prompt ids), row for row."""
    import openai

    from moe_engine.engine import Engine, EngineConfig

    from ..unit.test_engine import run_all, submit

    name = "kv-fp8"
    ckpt = write_servable_checkpoint("qwen3_moe", tmp_path / "ckpt", **SHAPE)
    (tmp_path / "run").mkdir()
    server = start_server(tmp_path / "run", ["--model", str(ckpt), "--served-model-name", name, "--max-model-len",
                                             "128", "--kv-cache-dtype", "fp8"], model_name=name)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        card = client.models.retrieve(name).model_dump()
        assert card["quantization"] == {"weights": "none", "served_as": "float32", "kv_cache": "fp8_e4m3"}
        r = client.completions.create(model=name, prompt="The router picks the top-k experts", max_tokens=8,
                                      temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
        choice = r.choices[0]
        served = np.load(io.BytesIO(base64.b64decode(choice.routed_experts)))
    finally:
        code = server.stop()
    assert code == 0, server.log_tail()
    engine = Engine(load_model(ckpt, progress=False), load_config(ckpt),
                    EngineConfig(max_model_len=128, kv_cache_dtype="fp8"))
    assert engine.settings.kv_cache_dtype == "fp8_e4m3"
    mine = submit(engine, choice.prompt_token_ids, max_tokens=8, ignore_eos=True)
    run_all(engine, [mine])
    assert mine.tokens == choice.token_ids
    rows = np.concatenate(mine.rows)
    assert served.shape == (len(choice.prompt_token_ids) + 7, *rows.shape[1:])
    np.testing.assert_array_equal(served, rows[:len(served)])
