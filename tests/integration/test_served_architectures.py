"""`moe-serve --model <dir>` on a DeepSeek-V3 checkpoint written by transformers (dense first layer, grouped
sigmoid router with a non-zero e_score_correction_bias, MLA with a latent KV cache): the routed experts the
API returns are the ids the engine's own forward selects, dense-layer columns stay 0, and /v1/models lists
only the MoE layers. One server start."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from moe_engine.checkpoint import load_model
from moe_engine.config import load_config
from moe_engine.model import reference_forward
from openai_frontend.server_process import start_server

from ..unit.hf_checkpoints import write_servable_checkpoint


def decode(s: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(s)))


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    ckpt = write_servable_checkpoint("deepseek_v3", tmp_path_factory.mktemp("ckpt") / "dsv3")
    server = start_server(
        tmp_path_factory.mktemp("moe_serve_dsv3"),
        ["--model", str(ckpt), "--served-model-name", "dsv3", "--max-model-len", "256"],
        model_name="dsv3",
    )
    yield server, ckpt
    code = server.stop()
    assert code == 0, f"moe-serve exited with {code} on SIGTERM:\n{server.log_tail()}"


def test_deepseek_v3_served_routed_experts(dsv3):
    import openai

    server, ckpt = dsv3
    cfg = load_config(ckpt)
    assert cfg.architecture == "deepseek_v3" and cfg.dense_layers == (0,) and cfg.moe_layers == (1, 2)
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)

    cards = {m.id: m for m in client.models.list().data}
    card = cards["dsv3"].model_dump()
    assert card["architecture"] == "deepseek_v3" and card["num_hidden_layers"] == 3
    assert card["moe_layers"] == [1, 2]  # the dense layer 0 is not listed
    assert card["num_experts"] == 16 and card["num_experts_per_tok"] == 4

    r = client.completions.create(
        model="dsv3",
        prompt="The router picks the top-k experts",
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    choice = r.choices[0]
    prompt_ids, token_ids = choice.prompt_token_ids, choice.token_ids
    assert prompt_ids and token_ids
    arr = decode(choice.routed_experts)
    assert arr.dtype == np.uint8
    assert arr.shape == (len(prompt_ids) + len(token_ids) - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)

    # The engine's own forward over the same tokens (one prefill) selects the same expert sets as the server's
    # chunked prefill + decode steps did; DeepSeek's top-k slot order is unsorted, so sets are compared.
    model = load_model(ckpt, progress=False)
    logits, ref = reference_forward(model, prompt_ids + token_ids[:-1])
    ref = ref.numpy()
    for layer in cfg.moe_layers:
        np.testing.assert_array_equal(np.sort(arr[:, layer], -1), np.sort(ref[:, layer], -1).astype(np.uint8))
        assert len({tuple(row) for row in np.sort(arr[:, layer], -1)}) > 1  # informative, not constant
    assert not arr[:, list(cfg.dense_layers)].any()  # dense-layer columns are never written
    # greedy: each generated token is the argmax after its prefix (float32 checkpoint, float32 serving)
    assert logits[len(prompt_ids) - 1 :].argmax(-1).tolist() == token_ids
