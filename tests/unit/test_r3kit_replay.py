"""r3kit on every supported family, with engine-produced routing (the engine in-process on CPU, float32) and the
transformers model of the same checkpoint (transformers wrote it):

- a 3-turn conversation, prefix cache on, later turns asking only for the rows they lack
  (``routed_experts_prompt_start``), stitched by the kit, equals the routing of the whole conversation forwarded at
  once with nothing cached;
- transformers under ``replay_routing`` gives the rollout's logprobs to 1e-5; when the rollout's routing differs
  from what transformers' routers choose (the engine forced another expert in ~25% of (position, layer) cells,
  as rollout and trainer engines disagree), transformers without replay shows the mismatch and with replay
  matches to 1e-5 (mismatch 0: routing was the only difference);
- a backward step runs through the replayed forward: every router and the experts get finite, non-zero gradients,
  the same with gradient checkpointing (the recompute replays the same ids);
- replay refuses dense layers, missing layers, misaligned rows and routers it cannot force.

Responses are written with the server's own codec (``routing_codec``); the real server does the same in
tests/integration/test_r3kit_server.py on a subset of the families.
"""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

import r3kit
from moe_engine.checkpoint import load_model
from moe_engine.core.sampling import SamplingParams
from moe_engine.engine import Engine, EngineConfig, Request
from openai_frontend.routing_codec import encode_npy_b64
from r3kit.hf_replay import capture_routing, find_routers, replay_routing
from r3kit.mismatch import measure_mismatch, sequence_logprobs

from .hf_checkpoints import ARCHS, HYBRID_ARCHS, load_hf
from .test_engine import run_all
from .test_hf_parity import checkpoints, random_ids  # noqa: F401 (fixture)
from .test_replay import Result


def card_of(cfg) -> r3kit.ModelCard:
    return r3kit.ModelCard(num_hidden_layers=cfg.num_hidden_layers, moe_layers=tuple(cfg.moe_layers),
                           num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, id=cfg.architecture)


class Rollout(Result):
    """A request's outputs, plus how many prompt tokens the prefix cache served."""

    num_cached = 0

    def __call__(self, out):
        self.num_cached = max(self.num_cached, out.num_cached_tokens)
        super().__call__(out)


def engine_request(engine, prompt, *, prompt_start=0, max_tokens=6, seed=0, salt=None, **kw) -> Rollout:
    r = Rollout()
    engine.add_request(Request(
        request_id=engine.new_request_id(), prompt_token_ids=list(prompt), routed_experts_prompt_start=prompt_start,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True, logprobs=0),
        on_output=r, cache_salt=salt, **kw))
    run_all(engine, [r])
    assert r.error is None, r.error
    return r


def as_response(prompt, r: Result, num_experts: int) -> dict:
    """What /v1/completions returns for this engine request (return_token_ids, logprobs=0), as the frontend
    writes it: the rows cast to the routed-experts dtype, base64 .npy."""
    dtype = np.uint8 if num_experts <= 256 else np.uint16
    return {"choices": [{
        "index": 0, "text": "", "finish_reason": r.finish_reason, "token_ids": r.tokens,
        "prompt_token_ids": list(prompt), "routed_experts": encode_npy_b64(r.routing.astype(dtype)),
        "logprobs": {"tokens": [""] * len(r.tokens), "token_logprobs": r.logprobs}, "weight_version": "w0"}]}


@pytest.fixture(scope="module")
def rollouts(checkpoints):  # noqa: F811
    """arch -> (hf model, card, stitched 3-turn Conversation, whole-forward rows, cached tokens per turn, engine)."""
    cache = {}

    def get(arch):
        if arch not in cache:
            path = checkpoints(arch, torch.float32)
            model = load_model(path, dtype="float32", progress=False)
            cfg = model.config
            engine = Engine(model, cfg, EngineConfig(max_model_len=128, block_size=8, enable_prefix_caching=True))
            card = card_of(cfg)
            conv = r3kit.Conversation(card)
            cached = []
            for t, new in enumerate((random_ids(21, seed=5), random_ids(7, seed=6), random_ids(5, seed=7))):
                prompt = conv.next_prompt(new)
                r = engine_request(engine, prompt, prompt_start=conv.prompt_start, seed=t)
                cached.append(r.num_cached)
                conv.add(as_response(prompt, r, cfg.num_experts), allow_truncated=True)  # tiny models: max_tokens
            whole = engine_request(engine, conv.tokens, max_tokens=1, salt="nothing-cached")
            assert whole.num_cached == 0
            cache[arch] = (load_hf(path, torch.float32), card, conv, whole.routing, cached, engine)
        return cache[arch]

    return get


def flipped(conv: r3kit.Conversation, card, fraction=0.25, seed=0) -> np.ndarray:
    """The conversation's rows with one expert replaced (by one the row does not have) in ``fraction`` of the
    (position, MoE layer) cells: another engine's routing of the same tokens."""
    rng = np.random.default_rng(seed)
    out = conv.routed_experts.astype(np.int64).copy()
    for p in range(len(out)):
        for layer in card.moe_layers:
            if rng.random() < fraction:
                row = out[p, layer]
                slot = rng.integers(card.top_k)
                row[slot] = rng.choice([e for e in range(card.num_experts) if e not in row])
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_three_turns_stitched_equal_the_whole_conversation(arch, rollouts):
    _, card, conv, whole, cached, _ = rollouts(arch)
    N = len(conv.tokens)
    assert [t.prompt_start for t in conv.turns] == [0, 21 + 6 - 1, 21 + 6 + 7 + 6 - 1]
    if arch in HYBRID_ARCHS:  # no prefix cache for hybrids: every turn recomputes its history, rows as they were
        assert cached == [0, 0, 0]
    else:
        assert cached[0] == 0 and cached[1] > 0 and cached[2] > 0  # later turns' history came from the prefix cache
    assert whole.shape == (N, card.num_hidden_layers, card.top_k)
    np.testing.assert_array_equal(conv.routed_experts, whole[: N - 1])  # every layer, the boundary rows included
    if card.dense_layers:
        assert not conv.routed_experts[:, list(card.dense_layers)].any()


@pytest.mark.parametrize("arch", ARCHS)
def test_replay_gives_the_rollouts_logprobs_and_gradients_flow(arch, rollouts):
    hf, card, conv, _, _, engine = rollouts(arch)
    batch = r3kit.build_batch([conv])
    assert set(find_routers(hf)) == set(card.moe_layers) == set(batch.layers)
    gen = batch.loss_mask[0]
    with torch.no_grad():
        lp = sequence_logprobs(hf, batch, replay=True)[0].numpy()
    np.testing.assert_allclose(lp[gen], batch.rollout_logprobs[0, gen], rtol=0, atol=1e-5)

    # The rollout under another routing: the engine scores the same tokens with ~25% of the cells forced to
    # another expert (its logprobs are the old-policy logprobs under that routing).
    forced = flipped(conv, card)
    N = len(conv.tokens)
    scored = Result()
    engine.add_request(Request(request_id=engine.new_request_id(), prompt_token_ids=conv.tokens, on_output=scored,
                               sampling=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                               replay_routed_experts=forced, prompt_logprobs=0))
    run_all(engine, [scored])
    moe = list(card.moe_layers)
    np.testing.assert_array_equal(scored.routing[: N - 1][:, moe], forced[:, moe])
    other = copy.deepcopy(batch)
    other.routed_experts[0, : N - 1] = forced[:, moe]
    positions = np.flatnonzero(gen)
    other.rollout_logprobs[0, positions] = scored.prompt_logprobs[0][positions - 1]
    report = measure_mismatch(hf, other)
    assert report["router_flips"] > 0.1 and report["positions_with_flip"] > 0.3
    # The flips change the logprobs (tiny random models: logits near uniform, so 7e-5 to 1e-1 here); replay
    # removes the whole difference (float32 rounding is left: ~5e-7).
    assert report["with_replay"]["max_abs"] <= 1e-5, report
    assert report["without_replay"]["max_abs"] > max(2e-5, 50 * report["with_replay"]["max_abs"]), report

    # A backward step through the replayed forward.
    routers = find_routers(hf)
    params = {name: p for name, p in hf.named_parameters() if p.requires_grad}
    expert = next(n for n in params if ".experts." in n and ".layers." in n)

    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        hf.zero_grad(set_to_none=True)
        if checkpointing:
            hf.activation_checkpointing_enable({"use_reentrant": False})
            hf.train()
        try:
            with replay_routing(hf, other) as replay:  # backward inside: a checkpointed recompute replays too
                lp = sequence_logprobs(hf, other, replay=False)  # (replay=False: the context around already does)
                loss = -(lp * torch.as_tensor(other.loss_mask)).sum()
                loss.backward()
        finally:
            hf.activation_checkpointing_disable()
            hf.eval()
        calls = {layer: s["calls"] for layer, s in replay.stats.items()}
        assert set(calls.values()) == {2 if checkpointing else 1}, calls  # the recompute replayed too
        return {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}

    plain = grads(False)
    for layer, router in routers.items():
        g = router.weight.grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, f"{arch} layer {layer}"
    assert plain[expert].abs().sum() > 0
    again = grads(True)
    for name in plain:
        torch.testing.assert_close(again[name], plain[name], rtol=1e-4, atol=1e-6)


def test_a_padded_batch_replays_each_sequence(rollouts):
    hf, card, conv, _, _, _ = rollouts("qwen3_moe")
    short = conv.truncate(30)
    batch = r3kit.build_batch([short, conv])
    assert (batch.routed_experts[0, 29:] == r3kit.MISSING_ROUTE).all()
    with torch.no_grad():
        lp = sequence_logprobs(hf, batch, replay=True).numpy()
        alone = sequence_logprobs(hf, r3kit.build_batch([short]), replay=True).numpy()
    for b in range(2):
        gen = batch.loss_mask[b]
        np.testing.assert_allclose(lp[b, gen], batch.rollout_logprobs[b, gen], rtol=0, atol=1e-5)
    np.testing.assert_allclose(lp[0, :30], alone[0], rtol=0, atol=1e-5)
    with replay_routing(hf, batch) as replay, torch.no_grad():
        sequence_logprobs(hf, batch, replay=False)
    stats = replay.stats[card.moe_layers[0]]
    assert stats["replayed_rows"] == int(batch.route_mask.sum()) and stats["live_rows"] == batch.input_ids.size - \
        int(batch.route_mask.sum())


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])  # a dense middle layer, a dense first layer
def test_replay_refuses_what_it_cannot_replay(arch, rollouts):
    hf, card, conv, _, _, _ = rollouts(arch)
    batch = r3kit.build_batch([conv])
    every = r3kit.build_batch([conv], layers="all")
    dense = card.dense_layers[0]
    with pytest.raises(r3kit.DenseLayerError, match=rf"layers \[{dense}\], which have no router"):
        replay_routing(hf, every.routed_experts, layers=every.layers)  # dense columns passed as if they routed
    with pytest.raises(r3kit.DenseLayerError, match="never guesses"):
        replay_routing(hf, batch.routed_experts)
    # the dense column dropped by the card is fine; a TrainerBatch with layers="all" drops its dense layers itself
    with replay_routing(hf, every), torch.no_grad():
        hf(torch.as_tensor(every.input_ids))
    routes = {layer: batch.layer_routes(layer) for layer in batch.layers}
    with pytest.raises(r3kit.ReplayError, match=rf"layers \[{card.moe_layers[-1]}\] of the model route but no routes"):
        replay_routing(hf, {k: v for k, v in routes.items() if k != card.moe_layers[-1]})
    with pytest.raises(r3kit.ReplayError, match="sees 7 tokens but the routes hold"):
        with replay_routing(hf, batch), torch.no_grad():
            hf(torch.as_tensor(batch.input_ids[:, :7]))
    bad = copy.deepcopy(batch)
    bad.routed_experts[0, 3, 0, 0] = card.num_experts
    with pytest.raises(r3kit.ReplayError, match="outside"):
        replay_routing(hf, bad)
    bad.routed_experts[0, 3, 0] = bad.routed_experts[0, 4, 0, 0]
    with pytest.raises(r3kit.ReplayError, match="repeat an expert"):
        replay_routing(hf, bad)
    with pytest.raises(r3kit.ReplayError, match="on_missing='error'"):
        replay_routing(hf, batch, on_missing="error")  # the last token has no row
    with pytest.raises(r3kit.ReplayError, match="never ran under replay"):
        with replay_routing(hf, batch):
            pass
    # a router that does not pick with one top-k over the experts is refused, not left to route on its own
    layer = card.moe_layers[0]
    router = find_routers(hf)[layer]
    real = type(router).forward
    try:
        type(router).forward = lambda self, h: real(self, h)[:2] + (real(self, h)[2],)  # two top-k selections
        with pytest.raises(r3kit.ReplayError, match="made 2 top-k selections"):
            with replay_routing(hf, batch), torch.no_grad():
                hf(torch.as_tensor(batch.input_ids))
    finally:
        type(router).forward = real
    # and the context left nothing behind
    with capture_routing(hf) as own, torch.no_grad():
        hf(torch.as_tensor(batch.input_ids))
    assert "forward" not in vars(router)
    np.testing.assert_array_equal(np.sort(own.ids[layer].numpy()[: len(conv.tokens) - 1], -1),
                                  np.sort(conv.routed_experts[:, layer].astype(np.int64), -1))


def test_the_mismatch_command_on_saved_conversations(rollouts, checkpoints, tmp_path, capsys):  # noqa: F811
    from r3kit.mismatch import main

    _, _, conv, _, _, _ = rollouts("deepseek_v3")
    conv.save(tmp_path / "a.json")
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(c.to_dict()) for c in (conv.truncate(30), conv)))
    path = checkpoints("deepseek_v3", torch.float32)
    assert main(["--model", str(path), "--conversations", str(tmp_path / "a.json"), str(tmp_path / "b.jsonl"),
                 "--json", str(tmp_path / "report.json")]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["sequences"] == 3 and report["generated_tokens"] == 18 + 6 + 18  # the cut one keeps turn 1's 6
    assert report["router_flips"] == 0.0  # float32: the server's routing is transformers' own
    assert report["with_replay"]["max_abs"] <= 1e-5 and report["without_replay"]["max_abs"] <= 1e-5
    assert "with replay:" in capsys.readouterr().out
