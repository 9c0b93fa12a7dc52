"""DeepSeek-family models (MLA + DeepSeek routers) on the fast path against transformers, on checkpoints
transformers wrote: every fused kernel on (the within-rounding set a GPU runs: fused routers, one-pass norms, fused
experts) and the attention kernels (absorbed MLA decode, expanded prefill over the latent cache), under Triton's
interpreter on CPU (``MOE_TEST_DEVICE=cuda`` compiles them).

float32: greedy tokens equal HF ``generate``, logits within 1e-4, and the routed expert ids equal HF's routers' own
ids for every (token, MoE layer) (as sets: DeepSeek's top-k is unsorted, HF defines no slot order), for a prompt
prefilled in two chunks (the second over cached latents) and decode steps, on every DeepSeek variant: V2 softmax
group-limited and greedy, V3 sigmoid with correction bias and groups (some, all), q_lora_rank null and set,
complex / interleaved / half rope, yarn, GLM-4.7-Flash's MLA. Engines on the fast path: combine weights, replay and
prompt logprobs, a prefix-cache hit on latent blocks; a prefill graph's step (every row absorbed) against the eager
step, and on a GPU replayed from graphs against eager steps.
"""
from __future__ import annotations

import os

import pytest
import torch

from moe_engine.checkpoint import load_model
from moe_engine.core.kv_cache import KVCache
from moe_engine.kernels import mla_attention as mla_kernels
from moe_engine.kernels import moe_routing as routing_kernels
from moe_engine.kernels import paged_attention as pa
from moe_engine.layers.attend import ForwardBatch
from moe_engine.layers.experts import StepRouting

from .hf_checkpoints import hf_forward_with_routing, hf_router_modules, load_hf, make_hf_model, save_hf_checkpoint
from .test_deepseek_gpt_oss import VARIANTS

DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")
needs_kernels = pytest.mark.skipif(not pa.available(DEVICE), reason="Triton (or its interpreter) unavailable")

CASES = {
    "v2_group_limited_q_proj": ("deepseek_v2", {}),
    "v2_greedy_qlora_yarn_biases": VARIANTS["v2_greedy_qlora_yarn_biases"],
    "v3_groups_bias_qlora_yarn": ("deepseek_v3", {}),
    "v3_all_groups_q_proj_half_rope": VARIANTS["v3_no_interleave_all_groups"],
    "glm4_moe_lite": ("glm4_moe_lite", {}),
}


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def fast_path_generate(model, prompt: list[int], new: int, chunks: list[int], block_size: int = 4):
    """Greedy tokens, per-step logits and the routing capture of prompt + new - 1 positions, on the fast path: the
    prompt in ``chunks`` (prefill steps), then one-token decode steps, every step with the attention kernels."""
    cfg = model.config
    cache = KVCache.for_sequences(model.kv_layout(), 1, len(prompt) + new, model.dtype, DEVICE, block_size=block_size)
    capture = torch.zeros(len(prompt) + new - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok, dtype=torch.int32,
                          device=DEVICE)
    tokens, logits, context = [], [], 0
    steps = [prompt[sum(chunks[:i]):sum(chunks[: i + 1])] for i in range(len(chunks))]
    with torch.inference_mode():
        while len(tokens) < new:
            ids = steps.pop(0) if steps else tokens[-1:]
            batch = ForwardBatch.build([cache.sequence_blocks(0)], [context], [len(ids)], DEVICE, block_size)
            batch.use_kernels = True
            hidden = model(torch.tensor(ids, device=DEVICE), batch, cache, StepRouting(ids=capture[context:]))
            context += len(ids)
            if context >= len(prompt):
                step_logits = model.compute_logits(hidden[batch.last_token_index])
                logits.append(step_logits[0].cpu())
                tokens.append(int(step_logits.argmax(-1)))
    return tokens, torch.stack(logits), capture.cpu()


@needs_kernels
@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_path_float32_matches_transformers(case, tmp_path, monkeypatch):
    from moe_engine.layers.mla import MLAttention

    arch, overrides = CASES[case]
    path = save_hf_checkpoint(make_hf_model(arch, seed=3, **overrides), tmp_path / case)
    hf = load_hf(path, torch.float32)
    model = load_model(path, device=DEVICE, progress=False)
    assert model.use_fused_kernels(True, within_rounding=True)
    monkeypatch.setattr(MLAttention, "prefill_config", pa.KernelConfig(
        prefill_block_m=16, prefill_tile_n=16, prefill_num_warps=4, prefill_num_stages=1, prefill_tma=False))
    prompt, new = prompt_of(9, seed=1), 6
    calls = {}
    for module, name in ((mla_kernels, "mla_decode"), (pa, "paged_attention"), (routing_kernels, "route")):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _fn=fn, _n=name, **kw: (
            calls.__setitem__(_n, calls.get(_n, 0) + 1), _fn(*a, **kw))[1])

    hf_rows: dict[int, list[torch.Tensor]] = {}
    hooks = [gate.register_forward_hook(lambda _m, _i, out, l=l: hf_rows.setdefault(l, []).append(out[2].clone()))
             for l, gate in hf_router_modules(hf).items()]
    try:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    finally:
        for h in hooks:
            h.remove()
    hf_tokens = out[0, len(prompt):].tolist()

    tokens, logits, capture = fast_path_generate(model, prompt, new, chunks=[6, 3])
    n_mla, n_moe = len(model.config.attention_layers), len(model.config.moe_layers)
    # the fast path: absorbed decode in every decode step, the paged prefill kernel for both chunks, fused experts
    assert calls == {"mla_decode": n_mla * (new - 1), "paged_attention": 2 * n_mla, "route": n_moe * 2}, calls  # decode steps: grouped in the router launch
    assert tokens == hf_tokens, (case, tokens, hf_tokens)
    hf_logits, _ = hf_forward_with_routing(hf, torch.tensor([prompt + hf_tokens[:-1]]))
    torch.testing.assert_close(logits, hf_logits[0, len(prompt) - 1:], atol=1e-4, rtol=1e-4)
    cfg = model.config
    for layer in range(cfg.num_hidden_layers):
        if layer in hf_rows:
            ref = torch.cat(hf_rows[layer])  # [prompt + new - 1, K]: the prefill's rows, then each decode's
            assert torch.equal(capture[:, layer].long().sort(-1).values, ref.sort(-1).values), (case, layer)
        else:
            assert not capture[:, layer].any()


def fast_engine(model, cfg, **kw):
    """An engine on the fast path on this device: the fused kernels with the within-rounding set (what a GPU runs)
    and the attention kernels (absorbed MLA decode, expanded prefill), under the interpreter on CPU."""
    from moe_engine.engine import Engine, EngineConfig

    if DEVICE == "cuda":  # a small KV cache and few decode graphs (captured at start: the MLA decode kernel in them)
        kw = {"kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 4, **kw}
    engine = Engine(model, cfg, EngineConfig(**{"max_model_len": 64, "enable_prefix_caching": False,
                                                "fused_kernels": True, **kw}))
    assert model.use_fused_kernels(True, within_rounding=True)
    engine.runner.use_kernels = True
    return engine


@needs_kernels
@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_fast_path_replay_combine_weights_and_prompt_logprobs_match_transformers(arch, tmp_path, monkeypatch):
    """test_replay.py's check on the fast path: the combine weights are HF's router weights (within float32
    rounding), a replayed routing is used exactly and gives HF's prompt logprobs with its top-k forced to the same
    ids, and decoding after it (absorbed decode steps) gives the op-by-op engine's tokens."""
    import numpy as np

    from moe_engine.config import load_config
    from moe_engine.layers.mla import MLAttention

    from .test_hf_parity import random_ids
    from .test_replay import hf_forced_topk, hf_run, replacement, run

    monkeypatch.setattr(MLAttention, "prefill_config", pa.KernelConfig(
        prefill_block_m=16, prefill_tile_n=16, prefill_num_warps=4, prefill_num_stages=1, prefill_tma=False))
    path = save_hf_checkpoint(make_hf_model(arch, seed=0), tmp_path / arch)
    hf = load_hf(path, torch.float32)
    cfg = load_config(path)
    model = load_model(path, dtype="float32", device=DEVICE, progress=False)
    ids = random_ids(24, seed=31)  # test_replay.py's prompt on its checkpoint (a free expert in every group)
    moe, E, K = list(cfg.moe_layers), cfg.num_experts, cfg.num_experts_per_tok

    engine = fast_engine(model, cfg)
    own = run(engine, ids, max_tokens=4, return_routed_weights=True, prompt_logprobs=0)
    hf_logits, hf_ids, hf_weights = hf_run(hf, ids)
    for layer in moe:
        order = np.argsort(own.routing[: len(ids), layer], -1), hf_ids[layer].argsort(-1).numpy()
        np.testing.assert_array_equal(np.take_along_axis(own.routing[: len(ids), layer], order[0], -1),
                                      np.take_along_axis(hf_ids[layer].numpy(), order[1], -1))
        got = np.take_along_axis(own.routed_weights[: len(ids), layer], order[0], -1)
        want = np.take_along_axis(hf_weights[layer].numpy(), order[1], -1)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{arch} layer {layer}")
    hf_lp = torch.log_softmax(hf_logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    np.testing.assert_allclose(own.prompt_logprobs[0], hf_lp.numpy(), rtol=1e-4, atol=1e-4)

    group = E // max(1, cfg.router.n_group)
    forced = own.routing[:15].astype(np.int64).copy()
    for t in range(3, 15):
        for layer in moe:
            slot = (t + layer) % K
            forced[t, layer, slot] = replacement(forced[t, layer], slot, E, group)
    res = run(engine, ids, replay=forced, max_tokens=4, return_routed_weights=True, prompt_logprobs=0)
    np.testing.assert_array_equal(res.routing[:15][:, moe], forced[:, moe])
    with hf_forced_topk(hf, {layer: torch.from_numpy(forced[:, layer]) for layer in moe}, K, E):
        f_logits, f_ids, f_weights = hf_run(hf, ids)
    f_lp = torch.log_softmax(f_logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    np.testing.assert_allclose(res.prompt_logprobs[0], f_lp.numpy(), rtol=1e-4, atol=1e-4)
    for layer in moe:
        np.testing.assert_array_equal(np.sort(res.routing[15 : len(ids), layer], -1),
                                      np.sort(f_ids[layer][15:].numpy(), -1))
    # the op-by-op engine on the same requests: the same tokens (prefill, then absorbed decode steps)
    model.use_fused_kernels(False)
    from moe_engine.engine import Engine, EngineConfig

    gpu = {"kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 4} if DEVICE == "cuda" else {}
    ref_engine = Engine(model, cfg, EngineConfig(max_model_len=64, enable_prefix_caching=False, fused_kernels=False,
                                                 **gpu))
    assert run(ref_engine, ids, max_tokens=4).tokens == own.tokens
    assert run(ref_engine, ids, replay=forced, max_tokens=4).tokens == res.tokens


def run_mixed_requests(model, cfg, **engine_args):
    """test_cuda_graphs.py's mixed batch on an MLA model: seven greedy requests of different prompt and output
    lengths arriving over time (prefill chunks of up to 64 tokens, some beside decodes), on the fast path."""
    from moe_engine.engine import Engine, EngineConfig

    from .test_engine import run_all, submit

    engine = Engine(model, cfg, EngineConfig(max_model_len=160, max_num_batched_tokens=64, fused_kernels=True,
                                             kv_cache_memory_bytes=256 << 20, max_num_seqs=8, **engine_args))
    out = []
    for i in range(7):
        out.append(submit(engine, prompt_of(3 + 13 * i, 50 + i), max_tokens=6 + 5 * i, ignore_eos=True))
        engine.step()
    run_all(engine, out)
    return engine, out


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU (MOE_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe_lite"])
def test_mla_prefill_graph_steps_equal_eager_steps(arch, tmp_path):
    """MLA's prefill and mixed steps replayed from CUDA graphs (every row through the absorbed kernel) against the
    same requests with those steps eager (max_cudagraph_capture_size=8: decode graphs only; prompt rows expanded),
    float32: the same tokens and routing rows."""
    import numpy as np

    from moe_engine.config import load_config

    path = save_hf_checkpoint(make_hf_model(arch, seed=3), tmp_path / arch)
    cfg = load_config(path)
    model = load_model(path, dtype="float32", device=DEVICE, progress=False)
    eager, want = run_mixed_requests(model, cfg, max_cudagraph_capture_size=8)
    graphed, got = run_mixed_requests(model, cfg)
    assert eager.runner.prefill_graphs is None and eager.runner.use_kernels
    assert graphed.runner.prefill_graphs is not None and graphed.runner.prefill_graphs.replays >= 5
    for w, g in zip(want, got):
        assert (g.finish_reason, g.tokens) == (w.finish_reason, w.tokens)
        np.testing.assert_array_equal(np.sort(g.routing, -1), np.sort(w.routing, -1))


@needs_kernels
def test_fast_path_prefix_cache_hit_on_latent_blocks_matches_op_by_op(tmp_path):
    """Prefix caching on latent blocks: a second prompt sharing 16 tokens (four blocks of 4) with the first reuses
    them, its 6 new tokens prefilled over the cached latents (the expanded paged kernel), then absorbed decode:
    the op-by-op engine's tokens and routing rows (the reused ones from the block manager), float32."""
    import numpy as np

    from moe_engine.config import load_config
    from moe_engine.engine import Engine, EngineConfig

    from .test_replay import run

    path = save_hf_checkpoint(make_hf_model("deepseek_v3", seed=3), tmp_path / "v3")
    cfg = load_config(path)
    model = load_model(path, dtype="float32", device=DEVICE, progress=False)
    first = prompt_of(20, seed=7)
    second = first[:16] + prompt_of(6, seed=8)
    engine = fast_engine(model, cfg, enable_prefix_caching=True, block_size=4)
    run(engine, first, max_tokens=3, return_routed_experts=True)
    got = run(engine, second, max_tokens=3, return_routed_experts=True)
    assert engine.stats()["prefix_cache_hits"] >= 16
    model.use_fused_kernels(False)
    gpu = {"kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 4} if DEVICE == "cuda" else {}
    ref = Engine(model, cfg, EngineConfig(max_model_len=64, enable_prefix_caching=False, fused_kernels=False,
                                          block_size=4, **gpu))
    want = run(ref, second, max_tokens=3, return_routed_experts=True)
    assert got.tokens == want.tokens
    np.testing.assert_array_equal(np.sort(got.routing, -1), np.sort(want.routing, -1))


@needs_kernels
@pytest.mark.parametrize("arch", ["deepseek_v2", "glm4_moe_lite"])
def test_prefill_graph_step_forward_equals_the_eager_step(arch, tmp_path, monkeypatch):
    """The forward of a step as a prefill graph replays it (core/prefill_graphs.py's stage_step and replay_batch:
    padded to its token bucket, lengths on the device only, every MLA row absorbed), here run without the graph
    (under the interpreter on CPU), against the eager fast-path step (prompt rows expanded): a decode, a chunk after
    cached tokens and a prompt from position 0 give each sequence's last-token logits within float32 rounding and
    the same routing rows, and write the same cache (the null block aside)."""
    import numpy as np

    from moe_engine.core.prefill_graphs import StagingLayout, replay_batch, stage_step
    from moe_engine.layers.mla import MLAttention

    expanded = []
    real = MLAttention._prefill_expanded
    monkeypatch.setattr(MLAttention, "_prefill_expanded", lambda self, *a: expanded.append(1) or real(self, *a))
    path = save_hf_checkpoint(make_hf_model(arch, seed=3), tmp_path / arch)
    model = load_model(path, device=DEVICE, progress=False)  # float32
    assert model.use_fused_kernels(True, within_rounding=True)
    cfg, bs, max_len = model.config, 4, 32
    L, K = cfg.num_hidden_layers, cfg.num_experts_per_tok
    caches = [KVCache.for_sequences(model.kv_layout(), 3, max_len, model.dtype, DEVICE, block_size=bs)
              for _ in range(2)]
    tables = [caches[0].sequence_blocks(s) for s in range(3)]
    with torch.inference_mode():
        history = ForwardBatch.build(tables[:2], [0, 0], [10, 5], DEVICE, bs)
        history.use_kernels = True
        model(torch.tensor(prompt_of(15, seed=4), device=DEVICE), history, caches[0], StepRouting(ids=None))
        for a, b in zip(caches[0].kv_layers, caches[1].kv_layers):
            b.k.copy_(a.k)
            b.v.copy_(a.v)
        context, q_lens = [10, 5, 0], [1, 6, 7]
        expanded.clear()
        ids = prompt_of(sum(q_lens), seed=5)
        T, Tp = sum(q_lens), 16
        eager = ForwardBatch.build(tables, context, q_lens, DEVICE, bs)
        eager.use_kernels = True
        want_rows = torch.zeros(T, L, K, dtype=torch.int32, device=DEVICE)
        hidden = model(torch.tensor(ids, device=DEVICE), eager, caches[0], StepRouting(ids=want_rows))
        want = model.compute_logits(hidden[eager.last_token_index])
        n_eager, expanded[:] = len(expanded), []

        layout = StagingLayout.for_engine(Tp, 4, max_len, bs)
        host = np.zeros(layout.size, dtype=np.int64)
        stage_step(host, layout, ids, context, q_lens, tables, Tp, caches[1].null_block, bs)
        inputs = torch.from_numpy(host).to(DEVICE)
        graph = replay_batch(inputs, layout, Tp, max_len, bs)
        got_rows = torch.zeros(Tp, L, K, dtype=torch.int32, device=DEVICE)
        hidden = model(layout.views(inputs)[0][0, :Tp], graph, caches[1], StepRouting(ids=got_rows))
        got = model.compute_logits(hidden[graph.last_token_index[:3]])
    assert n_eager == len(cfg.attention_layers) and not expanded  # the graph's step expands nothing
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got_rows[:T].sort(-1).values, want_rows.sort(-1).values)
    null = caches[1].null_block
    for a, b in zip(caches[0].kv_layers, caches[1].kv_layers):
        torch.testing.assert_close(b.k[:null], a.k[:null], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(b.v[:null], a.v[:null], atol=1e-6, rtol=1e-6)
