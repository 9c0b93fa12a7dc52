"""`moe-serve --model <dir>` on checkpoints written by transformers: the routed experts the API returns are
the ids the engine's own forward selects, dense-layer columns stay 0, and /v1/models lists only the MoE
layers. One server start per architecture."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from moe_engine.checkpoint import load_model
from moe_engine.config import load_config
from moe_engine.models.decoder import reference_forward
from openai_frontend.server_process import start_server

from ..unit.hf_checkpoints import ARCHS, write_servable_checkpoint


def decode(s: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(s)))


# Every supported architecture, e.g. DeepSeek-V3: a dense first layer, grouped sigmoid router with a non-zero
# correction bias, MLA; Qwen2-MoE: 60 experts top-4, a sigmoid-gated shared expert, a dense middle layer.
SERVED = list(ARCHS)


@pytest.fixture(scope="module", params=SERVED)
def served(request, tmp_path_factory):
    arch = request.param
    ckpt = write_servable_checkpoint(arch, tmp_path_factory.mktemp("ckpt") / arch)
    server = start_server(
        tmp_path_factory.mktemp(f"moe_serve_{arch}"),
        ["--model", str(ckpt), "--served-model-name", arch, "--max-model-len", "256"],
        model_name=arch,
    )
    yield arch, server, ckpt
    code = server.stop()
    assert code == 0, f"moe-serve exited with {code} on SIGTERM:\n{server.log_tail()}"


def test_served_routed_experts_equal_the_engine_forward(served):
    import openai

    arch, server, ckpt = served
    cfg = load_config(ckpt)
    assert cfg.architecture == arch
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)

    cards = {m.id: m for m in client.models.list().data}
    card = cards[arch].model_dump()
    assert card["architecture"] == arch and card["num_hidden_layers"] == cfg.num_hidden_layers
    assert card["moe_layers"] == list(cfg.moe_layers)  # dense layers are not listed
    assert not set(card["moe_layers"]) & set(cfg.dense_layers)
    assert card["num_experts"] == cfg.num_experts and card["num_experts_per_tok"] == cfg.num_experts_per_tok

    r = client.completions.create(
        model=arch,
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
    # chunked prefill + decode steps did (DeepSeek's top-k slot order is unsorted, so sets are compared).
    model = load_model(ckpt, progress=False)
    logits, ref = reference_forward(model, prompt_ids + token_ids[:-1])
    ref = ref.numpy()
    for layer in cfg.moe_layers:
        np.testing.assert_array_equal(np.sort(arr[:, layer], -1), np.sort(ref[:, layer], -1).astype(np.uint8))
        assert len({tuple(row) for row in np.sort(arr[:, layer], -1)}) > 1  # informative, not constant
    if cfg.dense_layers:
        assert not arr[:, list(cfg.dense_layers)].any()  # dense-layer columns are never written
    # greedy: each generated token is the argmax after its prefix (float32 checkpoint, float32 serving)
    assert logits[len(prompt_ids) - 1 :].argmax(-1).tolist() == token_ids
