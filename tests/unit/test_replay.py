"""Routing replay, combine weights and prompt scoring in the engine, checked against Hugging Face transformers.

For every architecture, on a checkpoint transformers wrote (float32):
- the combine weights the engine returns equal the weights HF's router computes (its forward hooks), to 1e-6;
- replaying a routing with some ids changed returns exactly the forced ids, and the prompt logprobs equal HF's on
  the same checkpoint with its router's top-k replaced by the same ids (``torch.topk`` patched inside HF's router
  modules, so that HF's own renormalisation / scaling pipeline computes the weights), to 1e-5;
and, on the tiny model, replaying a request's own routing changes nothing, and bad replays are refused by name.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from moe_engine.checkpoint import load_model
from moe_engine.core.sampling import SamplingParams
from moe_engine.engine import Engine, EngineConfig, Request
from moe_engine.errors import InvalidRequestError

from .hf_checkpoints import ARCHS, hf_router_modules, load_hf
from .test_engine import Collector, make_engine, prompt_of, run_all, tiny  # noqa: F401 (fixture)
from .test_hf_parity import checkpoints, random_ids  # noqa: F401 (fixture)


class Result(Collector):
    """A Collector that also keeps combine weights and prompt logprobs."""

    def __init__(self):
        super().__init__()
        self.weights: list[np.ndarray] = []
        self.prompt_logprobs = None

    def __call__(self, out):
        if out.routed_weights is not None:
            self.weights.append(out.routed_weights)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = (out.prompt_logprobs, out.prompt_logprob_ranks, out.prompt_top_logprob_ids,
                                    out.prompt_top_logprobs)
        super().__call__(out)

    @property
    def routed_weights(self) -> np.ndarray | None:
        return np.concatenate(self.weights) if self.weights else None


def run(engine: Engine, prompt, replay=None, max_tokens=1, **req) -> Result:
    r = Result()
    engine.add_request(Request(
        request_id=engine.new_request_id(), prompt_token_ids=list(prompt),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=req.pop("logprobs", None)),
        on_output=r, replay_routed_experts=replay, **req,
    ))
    run_all(engine, [r])
    assert r.error is None, r.error
    return r


@contextlib.contextmanager
def hf_forced_topk(hf, forced: dict[int, torch.Tensor], top_k: int, num_experts: int):
    """Inside HF's router of MoE layer l, ``torch.topk`` over the experts returns, for the first R tokens, the ids
    ``forced[l]`` [R, K] (and the input's values at them) instead of its choice; the other tokens keep HF's choice,
    and everything else in HF's router is its own code."""
    real_topk = torch.topk
    current = {}

    def topk(input, k, *args, **kwargs):
        values, ids = real_topk(input, k, *args, **kwargs)
        layer = current.get("layer")
        if layer is not None and k == top_k and input.shape[-1] == num_experts:
            ids = ids.clone()
            ids[: len(forced[layer])] = forced[layer].to(ids.device)
            values = input.gather(-1, ids)
        return torch.return_types.topk((values, ids))

    hooks = []
    for layer, gate in hf_router_modules(hf).items():
        hooks.append(gate.register_forward_pre_hook(lambda _m, _i, layer=layer: current.update(layer=layer)))
        hooks.append(gate.register_forward_hook(lambda _m, _i, _o: current.update(layer=None)))
    torch.topk = topk
    try:
        yield
    finally:
        torch.topk = real_topk
        for h in hooks:
            h.remove()


@torch.no_grad()
def hf_run(hf, ids: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """HF logits [T, V], and per MoE layer its router's ids [T, K] and combine weights [T, K] (from hooks)."""
    ids_out, weights_out, hooks = {}, {}, []
    for layer, gate in hf_router_modules(hf).items():
        def hook(_m, _i, out, layer=layer):
            weights_out[layer] = out[1].detach().float().clone()
            ids_out[layer] = out[2].detach().clone()

        hooks.append(gate.register_forward_hook(hook))
    try:
        logits = hf(torch.tensor([ids])).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    return logits, ids_out, weights_out


def replacement(row: np.ndarray, slot: int, num_experts: int, group: int) -> int:
    """Another expert for ``row[slot]`` in the same routing group (so that group-limited routers in HF would
    have chosen among it too), not already in the row."""
    g0 = (int(row[slot]) // group) * group
    for e in list(range(g0, g0 + group)):
        if e not in row:
            return e
    raise AssertionError("no free expert in the group")


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_and_forced_routing_match_transformers(arch, checkpoints):
    path = checkpoints(arch, torch.float32)
    hf = load_hf(path, torch.float32)
    model = load_model(path, dtype="float32", progress=False)
    cfg = model.config
    engine = Engine(model, cfg, EngineConfig(max_model_len=64, enable_prefix_caching=False))
    ids = random_ids(24, seed=31)
    n = len(ids)
    moe = list(cfg.moe_layers)
    E, K = cfg.num_experts, cfg.num_experts_per_tok

    # Unforced: the engine's routed weights are HF's router weights.
    own = run(engine, ids, return_routed_weights=True, prompt_logprobs=0)
    hf_logits, hf_ids, hf_weights = hf_run(hf, ids)
    assert own.routing.shape == own.routed_weights.shape == (n, cfg.num_hidden_layers, K)
    for layer in moe:
        order = np.argsort(own.routing[:, layer], -1), hf_ids[layer].argsort(-1).numpy()
        got = np.take_along_axis(own.routed_weights[:, layer], order[0], -1)
        want = np.take_along_axis(hf_weights[layer].numpy(), order[1], -1)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"{arch} layer {layer}")
    for layer in sorted(set(range(cfg.num_hidden_layers)) - set(moe)):
        assert not own.routed_weights[:, layer].any()  # dense layers: 0
    hf_lp = torch.log_softmax(hf_logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    np.testing.assert_allclose(own.prompt_logprobs[0], hf_lp.numpy(), rtol=1e-5, atol=1e-5)

    # Forced: change one expert of tokens 3..14 in every MoE layer; the rest of the prompt routes freely.
    group = E // max(1, cfg.router.n_group)
    forced = own.routing[:15].astype(np.int64).copy()
    for t in range(3, 15):
        for layer in moe:
            slot = (t + layer) % K
            forced[t, layer, slot] = replacement(forced[t, layer], slot, E, group)
    res = run(engine, ids, replay=forced, return_routed_weights=True, prompt_logprobs=0)
    np.testing.assert_array_equal(res.routing[:15][:, moe], forced[:, moe])  # the forward used the forced ids
    assert not np.array_equal(res.prompt_logprobs[0], own.prompt_logprobs[0])  # and that changed the model

    # HF with its top-k replaced by the same ids for the same tokens; the tokens past the replay route as HF's
    # router chooses, which must be what the engine chose for them.
    with hf_forced_topk(hf, {layer: torch.from_numpy(forced[:, layer]) for layer in moe}, K, E):
        f_logits, f_ids, f_weights = hf_run(hf, ids)
    f_lp = torch.log_softmax(f_logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    np.testing.assert_allclose(res.prompt_logprobs[0], f_lp.numpy(), rtol=1e-5, atol=1e-5)
    for layer in moe:
        np.testing.assert_array_equal(np.sort(res.routing[15:, layer], -1), np.sort(f_ids[layer][15:].numpy(), -1))
        np.testing.assert_allclose(res.routed_weights[:, layer], f_weights[layer].numpy(), rtol=1e-6, atol=1e-6)


def test_replaying_a_requests_own_routing_changes_nothing(tiny):
    engine = make_engine(tiny, enable_prefix_caching=False)
    p = prompt_of(30, 41)
    first = run(engine, p, max_tokens=8, logprobs=2, prompt_logprobs=3, return_routed_weights=True)
    again = run(engine, p, replay=first.routing[:30], max_tokens=8, logprobs=2, prompt_logprobs=3,
                return_routed_weights=True)
    assert again.tokens == first.tokens and again.logprobs == first.logprobs
    np.testing.assert_array_equal(again.routing, first.routing)
    np.testing.assert_array_equal(again.routed_weights, first.routed_weights)
    for a, b in zip(again.prompt_logprobs, first.prompt_logprobs):
        np.testing.assert_array_equal(a, b)
    lp, ranks, top_ids, top_vals = first.prompt_logprobs
    assert lp.shape == ranks.shape == (29,) and top_ids.shape == top_vals.shape == (29, 3)
    assert (lp <= 0).all() and (ranks >= 1).all() and (top_vals[:, 0] >= lp - 1e-6).all()
    # rank 1 <=> the prompt token is the top-1 of its position
    np.testing.assert_array_equal(ranks == 1, top_ids[:, 0] == np.asarray(p[1:]))


def test_replay_weights_and_prompt_scoring_through_overlapped_chunked_steps(tiny):
    """The R3 features in steps planned before the previous step's results are read (overlapped steps, the CUDA
    default): prompts chunked over several steps, one replaying a routing, one scoring its prompt, both asking
    for combine weights, while a third decodes beside them. Each gets exactly what sequential steps give it."""
    def workload(engine):
        first = run(engine, prompt_of(30, 48), max_tokens=4)
        out = [Result() for _ in range(3)]
        reqs = [dict(prompt=prompt_of(30, 48), replay=first.routing[:30], return_routed_weights=True),
                dict(prompt=prompt_of(45, 49), prompt_logprobs=3, return_routed_weights=True),
                dict(prompt=prompt_of(9, 50))]
        for r, kw in zip(out, reqs):
            engine.add_request(Request(
                request_id=engine.new_request_id(), prompt_token_ids=kw.pop("prompt"), on_output=r,
                sampling=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                replay_routed_experts=kw.pop("replay", None), **kw))
        run_all(engine, out)
        return out

    kw = dict(enable_prefix_caching=False, max_num_batched_tokens=16, max_num_seqs=4)
    want = workload(make_engine(tiny, async_scheduling=False, **kw))
    engine = make_engine(tiny, async_scheduling=True, **kw)
    got = workload(engine)
    assert engine.stats()["overlapped_steps"] > engine.stats()["steps"] // 2
    for a, b in zip(got, want):
        assert a.error is None and a.tokens == b.tokens
        np.testing.assert_array_equal(a.routing, b.routing)
        if b.weights:
            np.testing.assert_array_equal(a.routed_weights, b.routed_weights)
    for x, y in zip(got[1].prompt_logprobs, want[1].prompt_logprobs):
        np.testing.assert_array_equal(x, y)
    assert want[1].prompt_logprobs[0].shape == (44,)


def test_replay_with_prompt_start_and_a_partial_replay(tiny):
    engine = make_engine(tiny)
    p = prompt_of(40, 42)
    first = run(engine, p, max_tokens=4)
    cut = run(engine, p, replay=first.routing[:10], max_tokens=4, routed_experts_prompt_start=5,
              return_routed_weights=True)
    np.testing.assert_array_equal(cut.routing, first.routing[5:])  # rows 10.. route freely, as before
    assert cut.routed_weights.shape == cut.routing.shape
    assert cut.tokens == first.tokens


def test_forced_requests_never_share_prefix_blocks_with_unforced_ones(tiny):
    engine = make_engine(tiny)
    p = prompt_of(64 + 5, 43)
    plain = run(engine, p, max_tokens=3)
    forced = plain.routing[:40].astype(np.int64).copy()
    forced[:, :, 0], forced[:, :, 1] = plain.routing[:40, :, 1], plain.routing[:40, :, 0]  # same sets, other order
    forced[20:40, 1] = (forced[20:40, 1] + 1) % 8
    forced[20:40, 1, 1] = np.where(forced[20:40, 1, 1] == forced[20:40, 1, 0], (forced[20:40, 1, 1] + 1) % 8,
                                   forced[20:40, 1, 1])
    hits = engine.stats()["prefix_cache_hits"]
    f1 = run(engine, p, replay=forced, max_tokens=3)
    assert engine.stats()["prefix_cache_hits"] == hits  # the plain request's blocks were not used
    np.testing.assert_array_equal(f1.routing[:40, 1], forced[:, 1])
    again = run(engine, p, max_tokens=3)  # and the forced request's blocks do not serve an unforced one
    np.testing.assert_array_equal(again.routing, plain.routing)
    assert again.tokens == plain.tokens


@pytest.mark.parametrize("replay, match", [
    (np.zeros((5, 4, 3), np.int64), r"expected shape \[R, 4, 2\]"),
    (np.zeros((0, 4, 2), np.int64), r"expected shape"),
    (np.zeros((11, 4, 2), np.int64), r"11 rows but the prompt has only 10"),
    (np.full((3, 4, 2), 8, np.int64), r"expert id 8 .* outside \[0, 8\)"),
    (np.full((3, 4, 2), -1, np.int64), r"expert id -1"),
    (np.ones((3, 4, 2), np.int64), r"repeats an expert id"),
    (np.zeros((3, 4, 2), np.float32), r"integer array"),
])
def test_bad_replays_are_refused_by_name(tiny, replay, match):
    engine = make_engine(tiny)
    with pytest.raises(InvalidRequestError, match=match) as e:
        run(engine, prompt_of(10, 44), replay=replay)
    assert e.value.param == "replay_routed_experts"
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        run(engine, prompt_of(10, 44), prompt_logprobs=21)
