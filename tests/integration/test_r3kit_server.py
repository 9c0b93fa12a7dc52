"""r3kit against the real server (tritonserver + backend + OpenAI API) on checkpoints transformers wrote.

Per family, one ``moe-serve`` (prefix cache on, float32):
- a 3-turn rollout over three endpoints (chat, completions with token ids, streamed /inference/v1/generate), later
  turns asking only for the rows they lack (``routed_experts_prompt_start``) and served partly from the prefix
  cache, stitched by the kit, equals the routed experts of the whole conversation forwarded at once by the idle
  server with nothing cached (a fresh ``cache_salt``);
- transformers under the kit's replay gives the server's logprobs of the generated tokens to 1e-5; with the server
  scoring the same tokens under another routing (``replay_routed_experts`` with ~25% of the cells changed, as
  rollout and trainer engines disagree) transformers without replay shows the mismatch and with replay matches
  to 1e-5; a backward step runs through the replayed forward;
- the kit's errors on real responses: routed experts off, ``n > 1``, a truncated choice.

Every supported family, one server start each (~10 s; the module takes about 70 s on 2 CPU cores).
``R3KIT_FAMILIES=mixtral,qwen3_moe,deepseek_v3,gpt_oss`` runs a subset (those four cover the router kinds, MLA,
dense layers and sliding windows). tests/unit/test_r3kit_replay.py covers every family with engine-produced
routing without a server.
"""
from __future__ import annotations

import os

import httpx
import numpy as np
import openai
import pytest
import torch

import r3kit
from openai_frontend.server_process import start_server
from r3kit.hf_replay import find_routers, replay_routing
from r3kit.mismatch import measure_mismatch, sequence_logprobs

from ..unit.hf_checkpoints import ARCHS, HYBRID_ARCHS, load_hf, write_servable_checkpoint

FAMILIES = [a for a in os.environ.get("R3KIT_FAMILIES", ",".join(ARCHS)).split(",") if a]
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    arch = request.param
    ckpt = write_servable_checkpoint(arch, tmp_path_factory.mktemp("ckpt") / arch)
    server = start_server(tmp_path_factory.mktemp(f"r3kit_{arch}"),
                          ["--model", str(ckpt), "--served-model-name", arch, "--max-model-len", "256",
                           "--enable-prompt-tokens-details"], model_name=arch)
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    yield arch, server, client, ckpt, {}
    code = server.stop()
    assert code == 0, f"moe-serve exited with {code}:\n{server.log_tail()}"


def user_tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def rollout(served) -> r3kit.Conversation:
    """The 3-turn conversation (made once per server)."""
    arch, server, client, _, memo = served
    if "conv" in memo:
        return memo["conv"]
    card = r3kit.ModelCard.fetch(server.base_url)
    assert card.id == arch
    conv = r3kit.Conversation(card)
    common = {"ignore_eos": True, "return_token_ids": True}
    # turn 1: chat (the server applies the chat template; prompt_token_ids come back)
    r1 = client.chat.completions.create(
        model=arch, messages=[{"role": "user", "content": "Route this sentence through the experts, please. " * 2}],
        max_tokens=MAX_TOKENS, temperature=0, logprobs=True, extra_body=common | conv.request_fields())
    conv.add(r1, allow_truncated=True)  # tiny random models do not stop on their own: every turn hits max_tokens
    # turn 2: completions on token ids (history + new user tokens), rows from the boundary on
    prompt = conv.next_prompt(user_tokens(11, 2))
    r2 = client.completions.create(model=arch, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                                   extra_body=common | conv.request_fields())
    conv.add(r2, allow_truncated=True)
    # turn 3: streamed /inference/v1/generate, SSE lines
    body = {"model": arch, "token_ids": conv.next_prompt(user_tokens(6, 3)), "stream": True,
            "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0} | common |
            conv.request_fields()}
    with httpx.stream("POST", server.root_url + "/inference/v1/generate", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        r3 = r3kit.collect_stream(resp.iter_lines())
    conv.add(r3, allow_truncated=True)
    memo["conv"], memo["cached"] = conv, [r2.usage.prompt_tokens_details.cached_tokens]
    return conv


def score(served, tokens, replay: np.ndarray) -> dict:
    """The server's prompt logprobs and routing of ``tokens`` under forced routing ``replay``."""
    arch, _, client, _, _ = served
    r = client.completions.create(model=arch, prompt=tokens, max_tokens=1, temperature=0,
                                  extra_body={"replay_routed_experts": r3kit.encode_array(replay),
                                              "prompt_logprobs": 0, "return_token_ids": True})
    return r.choices[0].model_dump()


def test_three_turns_stitched_by_the_kit_equal_the_whole_conversation(served):
    arch, _, client, _, memo = served
    conv = rollout(served)
    card = conv.card
    N = len(conv.tokens)
    assert [len(t.token_ids) for t in conv.turns] == [MAX_TOKENS] * 3
    starts = [t.prompt_start for t in conv.turns]
    assert starts[0] == 0 and starts[1] == len(conv.turns[0].tokens) - 1 and starts[2] == len(conv.turns[1].tokens) - 1
    # turn 2's history came from the prefix cache (hybrids have none: it was recomputed)
    assert memo["cached"][0] == 0 if arch in HYBRID_ARCHS else memo["cached"][0] > 0
    whole = client.completions.create(model=arch, prompt=conv.tokens, max_tokens=1, temperature=0,
                                      extra_body={"return_token_ids": True, "cache_salt": "nothing-cached"})
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    rows = r3kit.turn_from_response(whole, card=card, allow_truncated=True).routed_experts
    assert rows.shape == (N, card.num_hidden_layers, card.top_k)
    np.testing.assert_array_equal(conv.routed_experts, rows[: N - 1])  # every layer, each boundary row included
    assert conv.overlap_differences == [0, 0, 0]


def test_transformers_replay_gives_the_servers_logprobs(served):
    arch, _, _, ckpt, _ = served
    conv = rollout(served)
    card = conv.card
    hf = load_hf(ckpt, torch.float32)
    batch = r3kit.build_batch([conv])
    gen = batch.loss_mask[0]
    assert gen.sum() == 3 * MAX_TOKENS
    with torch.no_grad():
        lp = sequence_logprobs(hf, batch, replay=True)[0].numpy()
    np.testing.assert_allclose(lp[gen], batch.rollout_logprobs[0, gen], rtol=0, atol=1e-5)

    # The server scores the conversation under another routing; the kit replays that routing.
    N = len(conv.tokens)
    rng = np.random.default_rng(0)
    forced = conv.routed_experts.astype(np.int64).copy()
    for p in range(N - 1):
        for layer in card.moe_layers:
            if rng.random() < 0.25:
                row = forced[p, layer]
                row[rng.integers(card.top_k)] = rng.choice([e for e in range(card.num_experts) if e not in row])
    scored = score(served, conv.tokens, forced)
    moe = list(card.moe_layers)
    np.testing.assert_array_equal(r3kit.decode_array(scored["routed_experts"])[: N - 1][:, moe], forced[:, moe])
    other = r3kit.build_batch([conv])
    other.routed_experts[0, : N - 1] = forced[:, moe]
    for p in np.flatnonzero(gen):
        other.rollout_logprobs[0, p] = scored["prompt_logprobs"][p][str(conv.tokens[p])]["logprob"]
    report = measure_mismatch(hf, other)
    assert report["router_flips"] > 0.1
    assert report["with_replay"]["max_abs"] <= 1e-5, report
    assert report["without_replay"]["max_abs"] > max(2e-5, 50 * report["with_replay"]["max_abs"]), report

    # A backward step through the replayed forward reaches every router.
    with replay_routing(hf, other):
        loss = -(sequence_logprobs(hf, other, replay=False) * torch.as_tensor(other.loss_mask)).sum()
        loss.backward()
    for layer, router in find_routers(hf).items():
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0, layer


def test_the_kits_errors_on_real_responses(served):
    arch, _, client, _, _ = served
    conv = rollout(served)
    kw = dict(model=arch, prompt=conv.tokens[:20], max_tokens=3, temperature=0)
    off = client.completions.create(**kw, extra_body={"return_routed_experts": False, "return_token_ids": True})
    with pytest.raises(r3kit.MissingRoutedExpertsError, match="return_routed_experts: false"):
        r3kit.turn_from_response(off, allow_truncated=True)
    two = client.completions.create(**kw, n=2, extra_body={"return_token_ids": True, "ignore_eos": True})
    with pytest.raises(r3kit.MultipleChoicesError, match="2 choices"):
        r3kit.Conversation(conv.card).add(two, allow_truncated=True)
    with pytest.raises(r3kit.TruncatedChoiceError, match="'length'"):
        r3kit.turn_from_response(two, choice=1)
    assert len(r3kit.turns_from_response(two, card=conv.card, allow_truncated=True)) == 2
    no_ids = client.completions.create(**kw, extra_body={"ignore_eos": True})
    with pytest.raises(r3kit.MissingTokenIdsError, match="return_token_ids"):
        r3kit.turn_from_response(no_ids, allow_truncated=True)
