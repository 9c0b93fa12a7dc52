"""CUDA graphs for decode steps, and for prefill and mixed steps of up to a few hundred tokens: a replayed, padded
step gives every request what an eager step gives.

The bucket and staging tests run everywhere; the engine tests need a GPU (run them with ``MOE_TEST_DEVICE=cuda``).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_engine.checkpoint import load_model
from moe_engine.config import load_config
from moe_engine.core import warmup
from moe_engine.core.cuda_graphs import batch_buckets, kv_len_buckets
from moe_engine.core.prefill_graphs import StagingLayout, stage_step, token_buckets
from moe_engine.core.warmup import prefill_warm_shapes
from moe_engine.engine import Engine, EngineConfig
from moe_engine.kernels import fused_moe, moe_routing, norm, paged_attention, rotary, sampling, small_linear, support
from moe_engine.layers.attend import ForwardBatch

from .test_engine import prompt_of, run_all, submit
from .test_replay import run as run_request


@pytest.mark.parametrize("max_batch", [1, 3, 8, 64, 100, 256])
def test_every_batch_size_has_a_bucket_with_little_padding(max_batch):
    sizes = batch_buckets(max_batch)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_batch
    for n in range(1, max_batch + 1):
        bucket = next(b for b in sizes if b >= n)
        assert bucket - n <= max(1, n // 4 + 8), (n, bucket)


@pytest.mark.parametrize("max_len", [64, 192, 2048, 3000])
def test_kv_len_buckets_cover_the_model_length_at_most_doubling(max_len):
    sizes = kv_len_buckets(max_len)
    assert sizes[-1] == max_len and sizes == sorted(set(sizes))
    for lo, hi in zip(sizes, sizes[1:]):
        assert hi <= 2 * lo


@pytest.mark.parametrize("max_tokens", [16, 100, 512, 1024])
def test_every_prefill_step_size_has_a_token_bucket_with_little_padding(max_tokens):
    sizes = token_buckets(max_tokens)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_tokens and sizes[0] == 16
    for t in range(2, max_tokens + 1):
        bucket = next(b for b in sizes if b >= t)
        assert bucket - t <= max(15, t // 4), (t, bucket)


@pytest.mark.parametrize("query_lens,context,max_model_len", [
    ([5, 1, 1, 30], [0, 40, 17, 100], 256),  # a prompt, two decodes, a chunk after cached context
    ([16], [0], 256),  # exactly a bucket: no padding tokens
    ([1] * 6 + [40], [33, 2, 90, 7, 15, 64, 0], 256),  # continuous batching: decodes and a new prompt
    ([60] * 30, [0] * 30, 64),  # 1,800 tokens padded to 2,048: 248 padding tokens, past max_model_len
])
def test_a_prefill_graph_step_is_staged_as_the_eager_step_then_padding(query_lens, context, max_model_len):
    """The graph's inputs: the step's sequences exactly as ``ForwardBatch.build`` lays out the eager step, then one
    padding sequence whose tokens only touch the null block (at rotary position 0, with a table row of null blocks
    for every one of them, however short max_model_len is), then sequences with nothing; whatever an earlier step
    left in the staging buffer."""
    bs, null, n = 16, 0, len(query_lens)
    tables = [[1 + 20 * i + j for j in range(-(-(c + q) // bs))] for i, (c, q) in enumerate(zip(context, query_lens))]
    T = sum(query_lens)
    Tp = next(t for t in token_buckets(2048) if t >= T)
    layout = StagingLayout.for_engine(max_tokens=2048, max_seqs=32, max_model_len=max_model_len, block_size=bs)
    host = np.full(layout.size, 12345, dtype=np.int64)  # stale values from an earlier, larger step
    ids = list(range(100, 100 + T))
    used = stage_step(host, layout, ids, context, query_lens, tables, Tp, null, bs)
    eager = ForwardBatch.build(tables, context, query_lens, "cpu", bs)
    tok, seq_lens, last, cu, rows = layout.views(host)
    assert tok[0, :T].tolist() == ids
    np.testing.assert_array_equal(tok[1, :T], eager.positions)
    np.testing.assert_array_equal(tok[2, :T], eager.slot_mapping)
    np.testing.assert_array_equal(seq_lens[:n], eager.seq_lens)
    np.testing.assert_array_equal(cu[: n + 1], eager.cu_seqlens_q)
    np.testing.assert_array_equal(last[:n], eager.last_token_index)
    for i, table in enumerate(tables):
        assert rows[i, : len(table)].tolist() == table
    P = Tp - T  # the padding sequence n: token 0 at positions 0..P-1, its keys and writes in the null block
    assert seq_lens[n] == P and cu[n + 1] == Tp and (tok[0, T:Tp] == 0).all()
    assert (tok[1, T:Tp] == 0).all() and (tok[2, T:Tp] // bs == null).all()
    assert rows.shape[1] >= -(-P // bs) and (rows[n, : -(-P // bs)] == null).all()
    assert (seq_lens[n + 1 :] == 0).all() and (cu[n + 1 :] == Tp).all()  # then nothing
    assert used == layout.tables_at + (n + 1) * layout.max_blocks  # the rows past the padding one are not copied


@pytest.mark.parametrize("step_tokens,top_k", [(8192, 8), (512, 2), (64, 4), (2048, 6), (100, 1)])
def test_prefill_warm_shapes_cover_every_step_size_class(step_tokens, top_k):
    """Every prefill step of 2..step_tokens tokens shares its fused-MoE pair bucket and the Triton classes of its
    token and pair counts with a step the engine runs at start; the sequence counts cover 1, a multiple of 16
    and neither."""
    shapes = prefill_warm_shapes(step_tokens, top_k, max_num_seqs=64)

    def key(t: int) -> tuple:
        return fused_moe.bucket_of(t * top_k), t % 16 == 0, t * top_k % 16 == 0

    warmed = {key(t) for t, _ in shapes}
    assert [t for t in range(2, step_tokens + 1) if key(t) not in warmed] == []
    assert all(2 <= t <= step_tokens and 1 <= b <= min(t, 64) for t, b in shapes)
    assert len(shapes) == len(set(shapes))
    seqs = {b for _, b in shapes}
    assert 1 in seqs and 16 in seqs and seqs - {1, 16}
    assert max(b for _, b in prefill_warm_shapes(step_tokens, top_k, max_num_seqs=2)) <= 2


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.fixture(scope="module")
def tiny_cuda(tiny_checkpoint):
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU")
    # bfloat16: the serving dtype, and the one torch's grouped GEMM runs without the host (capturable).
    return load_config(tiny_checkpoint), load_model(tiny_checkpoint, dtype="bfloat16", device="cuda", progress=False)


def run_mixed_batch(tiny, enforce_eager: bool, overlap: bool = True, **engine_args):
    """Seven requests of different prompt and output lengths (greedy and seeded sampling) arriving over time:
    decode steps of 1..7 sequences, padded to buckets 1, 2, 4, 8, mixed with prefill steps (chunks of up to 64
    tokens, some with decodes beside them)."""
    cfg, model = tiny
    ecfg = EngineConfig(max_model_len=256, max_num_batched_tokens=64, enforce_eager=enforce_eager,
                        async_scheduling=overlap, kv_cache_memory_bytes=256 << 20, **engine_args)
    engine = Engine(model, cfg, ecfg)
    out = []
    for i in range(7):
        sampling = dict(max_tokens=6 + 5 * i, ignore_eos=True)
        if i % 2:
            sampling.update(temperature=0.8, top_p=0.9, seed=1000 + i)
        out.append(submit(engine, prompt_of(3 + 13 * i, 50 + i), **sampling))
        engine.step()
    run_all(engine, out)
    return engine, out


@cuda
def test_graph_replayed_decode_equals_eager_decode(tiny_cuda):
    eager, want = run_mixed_batch(tiny_cuda, enforce_eager=True)
    graphed, got = run_mixed_batch(tiny_cuda, enforce_eager=False)
    assert eager.runner.graphs is None and eager.runner.prefill_graphs is None
    keys = graphed.runner.graphs._graphs  # (batch bucket, key bucket, capture)
    assert len({k[0] for k in keys}) >= 3  # several batch buckets were replayed
    assert graphed.runner.prefill_graphs.replays >= 5  # and the prefill steps' graphs
    for w, g in zip(want, got):
        assert g.finish_reason == w.finish_reason == "length"
        assert g.tokens == w.tokens
        np.testing.assert_array_equal(g.routing, w.routing)


@cuda
def test_prefill_graph_steps_equal_eager_prefill_steps(tiny_cuda):
    """The same requests with prefill and mixed steps replayed from graphs and run eagerly (decode steps replay
    graphs in both): every token, routing row and output count equal."""
    eager_prefill, want = run_mixed_batch(tiny_cuda, enforce_eager=False, max_cudagraph_capture_size=8)
    graphed, got = run_mixed_batch(tiny_cuda, enforce_eager=False)
    assert eager_prefill.runner.prefill_graphs is None and eager_prefill.runner.graphs.max_batch == 8
    steps = graphed.runner.prefill_graphs.replays
    assert steps >= 5 and len({k[0] for k in graphed.runner.prefill_graphs._graphs}) >= 2
    for w, g in zip(want, got):
        assert (g.finish_reason, g.tokens, g.num_outputs) == (w.finish_reason, w.tokens, w.num_outputs)
        np.testing.assert_array_equal(g.routing, w.routing)


@cuda
def test_engine_captures_every_prefill_graph_at_start(tiny_cuda):
    """Prefill and mixed steps of up to 128 tokens (the step budget) replay graphs captured at start, one per
    token bucket: prompts of any length up to it, alone or beside decodes, capture nothing later."""
    cfg, model = tiny_cuda
    engine = Engine(model, cfg, EngineConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128,
                                             kv_cache_memory_bytes=256 << 20))
    graphs = engine.runner.prefill_graphs
    assert graphs.token_sizes == token_buckets(128)
    at_start = set(graphs._graphs)
    assert at_start == {(t, True, False) for t in token_buckets(128)}
    for lens in ([37], [2, 100], [5] * 8, [128]):
        out = [submit(engine, prompt_of(n, 500 + n + i), max_tokens=4, ignore_eos=True) for i, n in enumerate(lens)]
        run_all(engine, out)
        assert all(len(c.tokens) == 4 for c in out)
    assert graphs.replays >= 4 and set(graphs._graphs) == at_start


@cuda
def test_graphs_made_again_after_a_release_keep_writing_routed_weights(tiny_cuda):
    """Release / resume drops the graphs and makes them again (new KV addresses): the new ones still write the
    combine weights a request asks for, in prefill and decode steps alike."""
    cfg, model = tiny_cuda
    engine = Engine(model, cfg, EngineConfig(max_model_len=256, max_num_seqs=4, kv_cache_memory_bytes=256 << 20))
    prompt = prompt_of(40, 901)
    before = run_request(engine, prompt, max_tokens=8, return_routed_experts=True, return_routed_weights=True)
    runner = engine.runner
    runner.release_kv()
    engine.blocks.flush()
    runner.allocate_kv()
    runner.reset_graphs()
    assert runner.graphs is not None and runner.prefill_graphs is not None and not runner.graphs._graphs
    after = run_request(engine, prompt, max_tokens=8, return_routed_experts=True, return_routed_weights=True)
    assert runner.prefill_graphs.replays >= 1 and runner.graphs._graphs  # both kinds replayed after the reset
    assert after.tokens == before.tokens
    np.testing.assert_array_equal(after.routing, before.routing)
    np.testing.assert_array_equal(after.routed_weights, before.routed_weights)


def every_graph(graphs, captures=(True,)) -> set[tuple[int, int, bool, bool]]:
    """The keys of every graph a decode step can replay: each batch bucket at each key bucket's graph."""
    return {(B, graphs.graph_len(B, Lk), c, False) for B in graphs.batch_sizes for Lk in graphs.kv_lens
            for c in captures}


@cuda
def test_engine_captures_every_decode_graph_at_start(tiny_cuda):
    """A batch size's first graph compiles its kernels (seconds at real shapes), any later one costs a step a
    capture (70-175 ms there): all of them are captured when the engine starts, so decode batches of any size up
    to max_num_seqs, at any context up to max_model_len, replay without a capture."""
    cfg, model = tiny_cuda
    engine = Engine(model, cfg, EngineConfig(max_model_len=256, max_num_seqs=12, kv_cache_memory_bytes=256 << 20))
    at_start = set(engine.runner.graphs._graphs)
    assert at_start == every_graph(engine.runner.graphs)
    assert {Lk for _, Lk, _, _ in at_start} == {128, 256}  # both key buckets of 256 tokens
    for n, prompt in ((5, 9), (12, 9), (3, 200), (12, 130)):
        out = [submit(engine, prompt_of(prompt, 70 + i), max_tokens=6, ignore_eos=True) for i in range(n)]
        run_all(engine, out)
        assert all(len(c.tokens) == 6 for c in out)
    assert set(engine.runner.graphs._graphs) == at_start
    assert {Lk for _, Lk, _, _ in engine.runner.graphs.replays} == {128, 256}  # steps at both key buckets replayed


@cuda
def test_key_buckets_that_split_alike_replay_one_graph_as_eager_steps_decode(tiny_cuda):
    """With the paged kernels a decode graph depends on its key bucket only through the attention's split count
    (each sequence's key ranges come from its own length): 12 sequences of 2 kv heads split their keys 16 ways at
    1,024 keys and at 2,048, so their steps at ~600 keys replay the 2,048-key graph. They decode what eager
    steps decode, tokens and routing."""
    cfg, model = tiny_cuda

    def run(enforce_eager: bool):
        engine = Engine(model, cfg, EngineConfig(max_model_len=2048, max_num_seqs=12, max_num_batched_tokens=8192,
                                                 enforce_eager=enforce_eager, kv_cache_memory_bytes=256 << 20))
        out = [submit(engine, prompt_of(600 + 3 * i, 500 + i), max_tokens=5, ignore_eos=True) for i in range(12)]
        run_all(engine, out)
        return engine, out

    eager, want = run(True)
    graphed, got = run(False)
    graphs = graphed.runner.graphs
    assert graphs.split_counts(12, 1024) == graphs.split_counts(12, 2048) == (16,)
    assert graphs.graph_len(12, 1024) == 2048 and graphs.graph_len(12, 512) == 512
    assert graphs.replays[(12, 2048, True, False)] == 4 and not any(Lk == 1024 for _, Lk, _, _ in graphs.replays)
    assert set(graphs._graphs) == every_graph(graphs)  # nothing captured after start
    for w, g in zip(want, got):
        assert g.tokens == w.tokens and len(g.tokens) == 5
        np.testing.assert_array_equal(g.routing, w.routing)


def _compiled_variants() -> int:
    """Kernels compiled so far by this process for the engine's Triton kernels (all devices, all variants)."""
    jitted = {id(fn): fn for module in (support, norm, rotary, moe_routing, small_linear, fused_moe, paged_attention,
                                        sampling) for fn in vars(module).values()}  # helpers imported by name: once
    n = 0
    for fn in jitted.values():
        caches = getattr(fn, "device_caches", None)  # a JITFunction (module-level helpers too)
        if isinstance(caches, dict):
            n += sum(len(c[0]) for c in caches.values())
    return n


@cuda
def test_engine_start_compiles_the_prefill_kernels(tiny_cuda):
    """A prefill step of a new size class compiles kernels (about a second each at real shapes): the engine runs
    one step of each class at start, so prompts of other lengths, alone or together, after cached prefixes or
    not, and decode steps at longer contexts (graphs captured later) compile nothing new."""
    cfg, model = tiny_cuda
    engine = Engine(model, cfg, EngineConfig(max_model_len=256, max_num_seqs=20, max_num_batched_tokens=128,
                                             kv_cache_memory_bytes=256 << 20))
    before = _compiled_variants()
    assert before > 0
    # [250]: a block table 16 wide, alone, then decode graphs of a longer key bucket; 240 + 15 x 3 (twice, the
    # second time from the prefix cache): 16 sequences, a multiple of 16, in mixed steps.
    for lens in ([37], [20, 33, 50], [5] * 17, [120], [9, 64], [250], [240] + [3] * 15, [240] + [3] * 15):
        out = [submit(engine, prompt_of(n, 300 + n + i), max_tokens=3, ignore_eos=True) for i, n in enumerate(lens)]
        run_all(engine, out)
        assert all(len(c.tokens) == 3 for c in out)
    assert engine.stats()["prefix_cache_hits"] > 0
    assert _compiled_variants() == before


@cuda
def test_decode_at_longer_contexts_compiles_nothing_after_start(tiny_cuda):
    """The graphs of longer key buckets split their attention's keys (split-decode kernels, a merge variant per
    power-of-two split count): they are captured, those variants compiled, at start, so decoding after long
    prompts, alone and together, waits for no compile and no capture."""
    cfg, model = tiny_cuda
    engine = Engine(model, cfg, EngineConfig(max_model_len=2048, max_num_seqs=4, kv_cache_memory_bytes=256 << 20))
    graphs = engine.runner.graphs
    splits = {c for B in graphs.batch_sizes for Lk in graphs.kv_lens for c in graphs.split_counts(B, Lk)}
    assert len(splits - {1}) >= 2  # the case this test is about: several split counts past the first key bucket
    before, at_start = _compiled_variants(), set(graphs._graphs)
    for lens in ([1500], [700], [1500, 700, 300]):
        out = [submit(engine, prompt_of(n, 900 + n + i), max_tokens=3, ignore_eos=True) for i, n in enumerate(lens)]
        run_all(engine, out)
        assert all(len(c.tokens) == 3 for c in out)
    assert len({k[1] for k in graphs.replays}) >= 2  # graphs of longer key buckets replayed
    assert _compiled_variants() == before and set(graphs._graphs) == at_start


def test_kernels_compiled_while_an_engine_starts_up_are_not_logged_as_late(caplog, monkeypatch):
    """The late-compile hook is process-wide (Triton's jit_cache_hook): the compiles of a second engine's start-up
    in the same process (a benchmark comparing two engines; the multi-turn run logged eight) are not stalls inside
    a step and are not logged as such; the same first use outside a start-up is, once."""
    triton = pytest.importorskip("triton")
    knobs = triton.knobs.runtime
    monkeypatch.setattr(knobs, "jit_cache_hook", None)
    assert warmup.log_late_compiles()
    hook = knobs.jit_cache_hook
    first_use = dict(key="k", repr="_some_kernel[num_warps=4]", fn=None, compile={}, is_manual_warmup=False,
                     already_compiled=False)
    with caplog.at_level("WARNING", logger="moe_engine.core.runner"):
        with warmup.starting_up():
            hook(**first_use)
        assert not [r for r in caplog.records if "first used after start-up" in r.message]
        hook(**first_use)
        hook(**dict(first_use, already_compiled=True))
    lines = [r.message for r in caplog.records if "first used after start-up" in r.message]
    assert len(lines) == 1 and "_some_kernel" in lines[0]


@cuda
def test_a_kernel_variant_first_used_after_start_is_logged(tiny_cuda, caplog):
    """After start-up a new kernel variant compiles inside a step (a stall): the engine logs it with its name."""
    cfg, model = tiny_cuda
    Engine(model, cfg, EngineConfig(max_model_len=256, max_num_seqs=4, kv_cache_memory_bytes=256 << 20))
    q = torch.randn(40, 4, 16, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(8, 16, 2, 16, device="cuda", dtype=torch.bfloat16)
    tables = torch.arange(8, device="cuda", dtype=torch.int32).reshape(2, 4)
    cu = torch.tensor([0, 20, 40], device="cuda", dtype=torch.int32)
    seq_lens = torch.tensor([30, 50], device="cuda", dtype=torch.int32)
    odd = paged_attention.KernelConfig(prefill_block_m=64, prefill_tile_n=32, prefill_num_warps=2,
                                       prefill_num_stages=1)  # tiles nothing else in the suite uses
    with caplog.at_level("WARNING", logger="moe_engine.core.runner"):
        paged_attention.paged_attention(q, k_cache, k_cache, tables, cu, seq_lens, max_query_len=20, max_seq_len=50,
                                        scale=0.25, config=odd)
        torch.cuda.synchronize()
    # One line naming the kernel, its launch options and the argument classes that select the variant.
    lines = [r.message for r in caplog.records if "first used after start-up" in r.message]
    assert any("_attn_2d_kernel[num_warps=2, num_stages=1](" in m and "BLOCK_M=64" in m and "TILE_N=32" in m
               and "num_seqs," in m for m in lines), lines


@cuda
def test_graph_decode_without_routing_requests_skips_capture(tiny_cuda):
    cfg, model = tiny_cuda
    # Prefix caching and the expert load off: with either on, every step captures (cached blocks keep their routing
    # rows; the expert load counts them).
    engine = Engine(model, cfg, EngineConfig(max_model_len=256, kv_cache_memory_bytes=256 << 20,
                                             enable_prefix_caching=False, expert_load=False))
    with_rows = submit(engine, prompt_of(11, 5), max_tokens=8, ignore_eos=True)
    run_all(engine, [with_rows])
    without = submit(engine, prompt_of(11, 5), routing=False, max_tokens=8, ignore_eos=True)
    run_all(engine, [without])
    assert without.routing is None and without.tokens == with_rows.tokens
    assert {key[2] for key in engine.runner.graphs._graphs} == {True, False}


@cuda
def test_without_prefix_caching_steps_without_routing_requests_compile_nothing_after_start(tiny_cuda):
    """Routed experts on, prefix cache and expert load off: a decode step in which no request asks for routing
    replays a graph without the capture (other variants of the router's and route's kernels). Those graphs are
    captured at start too, so the first such step, at any batch size, waits for no compile and no capture."""
    cfg, model = tiny_cuda
    engine = Engine(model, cfg, EngineConfig(max_model_len=256, max_num_seqs=4, kv_cache_memory_bytes=256 << 20,
                                             enable_prefix_caching=False, expert_load=False))
    at_start = set(engine.runner.graphs._graphs)
    assert at_start == every_graph(engine.runner.graphs, captures=(True, False))
    before = _compiled_variants()
    for n, routing in ((1, False), (3, False), (1, True), (3, True)):
        out = [submit(engine, prompt_of(9, 40 + i), routing=routing, max_tokens=6, ignore_eos=True) for i in range(n)]
        run_all(engine, out)
        assert all(len(c.tokens) == 6 and (c.routing is not None) == routing for c in out)
    assert set(engine.runner.graphs._graphs) == at_start
    assert _compiled_variants() == before


@cuda
def test_overlapped_graph_decode_equals_sequential_graph_decode(tiny_cuda):
    """Overlap feeds each graph step the previous step's samples on the device and double-buffers the host
    staging and transfers; the results must be those of steps run one after another."""
    _, want = run_mixed_batch(tiny_cuda, enforce_eager=False, overlap=False)
    engine, got = run_mixed_batch(tiny_cuda, enforce_eager=False, overlap=True)
    assert engine.settings.async_scheduling and engine._inflight is None
    for w, g in zip(want, got):
        assert (g.finish_reason, g.tokens, g.num_outputs) == (w.finish_reason, w.tokens, w.num_outputs)
        np.testing.assert_array_equal(g.routing, w.routing)


@cuda
@pytest.mark.parametrize("all_sample", [True, False])
def test_an_eager_prefill_steps_launch_returns_while_the_device_computes_it(tiny_cuda, monkeypatch, all_sample):
    """``launch`` queues what follows an eager step's forward (the sampling rows' logits, sampling, the transfer)
    without waiting for the device, so that the host work the engine does meanwhile (``Scheduler.prepare_outputs``)
    overlaps the step. A ~100 ms device sleep is queued right after the forward: launch must return before it has
    run. With sequences whose chunk samples nothing (a prompt longer than the step) and without."""
    cfg, model = tiny_cuda
    engine = Engine(model, cfg, EngineConfig(max_model_len=512, max_num_batched_tokens=256,
                                             max_cudagraph_capture_size=0, kv_cache_memory_bytes=256 << 20))
    r = engine.runner
    plain_model = r.model
    forward = plain_model.forward
    cycles = int(0.1 * torch.cuda.get_device_properties(0).clock_rate * 1e3)  # clock_rate in kHz

    slept = []

    def forward_then_sleep(*a, **k):
        hidden = forward(*a, **k)
        torch.cuda._sleep(cycles)
        slept.append(torch.cuda.Event())
        slept[-1].record()  # completes when the forward and the sleep have run
        return hidden

    monkeypatch.setattr(plain_model, "forward", forward_then_sleep)
    busy = []
    launch = r.launch

    def launch_and_look(plan, *a, **k):
        step = launch(plan, *a, **k)
        busy.append(not slept[-1].query())
        return step

    monkeypatch.setattr(r, "launch", launch_and_look)
    lens = (40, 50, 300) if not all_sample else (40, 50, 60)  # 300 tokens: its first chunk does not sample
    out = [submit(engine, prompt_of(n, 70 + n), max_tokens=2, ignore_eos=True) for n in lens]
    run_all(engine, out)
    assert busy and all(busy)
    assert all(c.finish_reason == "length" and len(c.tokens) == 2 for c in out)
