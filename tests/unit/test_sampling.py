"""Batched sampling (moe_engine/sampling.py): what a user of temperature / top-k / top-p / seeds checks.

Every behaviour is checked on both paths: the pure-torch one (CPU serving) and the Triton kernels (CUDA
serving), which run here on CPU tensors under Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1`` without a GPU; ``MOE_TEST_DEVICE=cuda`` runs them compiled on a GPU). Distributions
are checked by drawing many tokens with fixed seeds: the test is deterministic, and its chi-square bound
(significance 1e-4) is what a correct sampler passes.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moe_engine.core import sampling
from moe_engine.core.sampling import Sampler, SamplingParams, compute_logprobs, make_state
from moe_engine.kernels import sampling as sampling_kernels

DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")
PATHS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(sampling_kernels.triton is None, reason="no Triton"))]


def make_sampler(path: str, vocab: int, **kw) -> Sampler:
    """Small blocks: the kernels' loops over blocks and chunks run on a small vocabulary. As many candidates as
    logits unless a test asks for fewer (their bisection is slow under the interpreter). 64 rows per program:
    the interpreter's cost is per program."""
    kw.setdefault("block", 16)
    kw.setdefault("candidates", vocab)
    kw.setdefault("rows_per_program", 64)
    return Sampler(vocab, DEVICE, max_rows=kw.pop("max_rows", 64), use_triton=path == "triton", **kw)


def draw_many(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, n: int = 512, seed: int = 1) -> torch.Tensor:
    """n draws (draw indices 0..n-1) of one seeded request from the same logits row, in one batch."""
    st = make_state(replace(params, seed=seed))
    batch = sampler.prepare([st] * n, list(range(n)))
    return sampler.sample(logits.to(DEVICE).expand(n, -1).contiguous(), batch).cpu()


def chi_square_ok(tokens: torch.Tensor, probs: torch.Tensor) -> bool:
    """Counts of ``tokens`` against ``probs`` (zero outside the support): within the 1e-4 quantile."""
    support = probs > 0
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = tokens.numel() * probs.double()
    stat = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    df = int(support.sum()) - 1
    z = 3.719  # standard normal 1 - 1e-4 quantile; Wilson-Hilferty approximation of the chi-square quantile
    bound = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < bound


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


@pytest.mark.parametrize("path", PATHS)
def test_greedy_takes_the_argmax_and_the_lowest_index_on_ties(path):
    V = 40
    x = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    x[1, 1] = x[1, 5] = x[1, 30] = x[1].max() + 1  # tie (1 and 5 share a kernel lane): token 1, as torch.argmax
    x[3, 35] = x[3, 12] = x[3].max() + 1  # tie across vocabulary chunks: token 12
    s = make_sampler(path, V)
    greedy = [make_state(SamplingParams(temperature=0.0)), make_state(SamplingParams(top_k=1, temperature=0.8))]
    alone = s.sample(x.to(DEVICE), s.prepare([greedy[i % 2] for i in range(5)], [0] * 5)).cpu()
    assert alone.tolist() == torch.argmax(x, dim=-1).tolist() and alone[1] == 1 and alone[3] == 12
    # greedy rows (the tied ones) beside sampled rows: the race kernel's greedy rows, still the argmax
    mixed = [make_state(SamplingParams(seed=3)), greedy[0], make_state(SamplingParams(top_p=0.5)), greedy[1],
             make_state(SamplingParams(temperature=0.5, top_k=3))]
    tokens = s.sample(x.to(DEVICE), s.prepare(mixed, [0] * 5)).cpu()
    assert tokens[1] == 1 and tokens[3] == 12


@pytest.mark.parametrize("path", PATHS)
def test_temperature_draws_follow_the_tempered_softmax(path):
    x = logits_of([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.05])
    s = make_sampler(path, x.numel())
    for T in (0.7, 1.6):
        tokens = draw_many(s, x, SamplingParams(temperature=T), seed=11)
        assert chi_square_ok(tokens, torch.softmax(x / T, dim=-1)), T
    # far from the distribution without temperature: the check can fail
    assert not chi_square_ok(draw_many(s, x, SamplingParams(temperature=0.3), seed=11), torch.softmax(x, -1))


@pytest.mark.parametrize("path", PATHS)
def test_top_k_keeps_exactly_the_k_largest_logits(path):
    x = torch.randn(48, generator=torch.Generator().manual_seed(2))
    s = make_sampler(path, x.numel(), candidates=16)
    for k, T in ((5, 1.0), (12, 3.0)):
        tokens = draw_many(s, x, SamplingParams(temperature=T, top_k=k), seed=k)
        top = torch.topk(x, k).indices
        assert set(tokens.tolist()) <= set(top.tolist())
        probs = torch.zeros_like(x)
        probs[top] = torch.softmax(x[top] / T, dim=-1)
        assert chi_square_ok(tokens, probs)
    # a tie at the k-th largest logit keeps every tied token
    y = torch.tensor([3.0, 2.0, 1.0, 1.0, 1.0, 0.0, -1.0, -2.0])
    tokens = draw_many(make_sampler(path, 8), y, SamplingParams(temperature=5.0, top_k=3), seed=5)
    assert set(tokens.tolist()) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("path", PATHS)
def test_top_p_keeps_exactly_the_nucleus(path):
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02])
    x = logits_of(probs.tolist())
    s = make_sampler(path, x.numel())
    # the nucleus: tokens whose more likely tokens weigh < p; 0.4 + 0.25 < 0.7 keeps token 2, not token 3
    tokens = draw_many(s, x, SamplingParams(top_p=0.7), seed=3)
    assert set(tokens.tolist()) == {0, 1, 2}
    assert chi_square_ok(tokens, torch.cat([probs[:3] / probs[:3].sum(), torch.zeros(4)]))
    # temperature first, then top-p over the tempered distribution: at T=3 the same p keeps 4 tokens
    tempered = torch.softmax(x / 3.0, dim=-1)
    tokens = draw_many(s, x, SamplingParams(temperature=3.0, top_p=0.7), seed=4)
    expected = torch.cat([tempered[:4] / tempered[:4].sum(), torch.zeros(3)])
    assert set(tokens.tolist()) == {0, 1, 2, 3} and chi_square_ok(tokens, expected)
    # top-k, then top-p over the renormalised top-k: top_k=2 leaves (0.4, 0.25)/0.65; p=0.5 keeps token 0 only
    assert set(draw_many(s, x, SamplingParams(top_k=2, top_p=0.5), 64, seed=6).tolist()) == {0}
    # a tie at the boundary keeps every tied token (a sort would keep one of them, either)
    tied = logits_of([0.4, 0.2, 0.2, 0.1, 0.1])
    tokens = draw_many(make_sampler(path, 5), tied, SamplingParams(top_p=0.5), seed=7)
    assert set(tokens.tolist()) == {0, 1, 2}


@pytest.mark.parametrize("path", PATHS)
def test_a_large_nucleus_is_found_exactly(path):
    """Flat rows: nuclei of tens of tokens, and a top-k, past the Triton path's 4 candidates (which its
    bisection then settles): the kept set is exactly the rule's, as a full sort computes it."""
    V = 40
    x = torch.randn(4, V, generator=torch.Generator().manual_seed(9))
    params = [SamplingParams(temperature=2.0, top_p=0.8), SamplingParams(temperature=1.5, top_p=0.95),
              SamplingParams(temperature=1.5, top_k=12, top_p=0.9), SamplingParams(temperature=1.0, top_k=30)]
    keep = []
    for i, p in enumerate(params):
        xt = x[i] / p.temperature
        if p.top_k:
            xt = xt.masked_fill(xt < torch.topk(xt, p.top_k).values[-1], float("-inf"))
        order = torch.argsort(xt, descending=True)
        probs = torch.softmax(xt, -1)[order]
        keep.append(set(order[(torch.cumsum(probs, 0) - probs) < p.top_p].tolist()))  # no ties in random logits
        assert len(keep[-1]) > 4
    if path == "torch":
        s = make_sampler(path, V)
        for i, p in enumerate(params):
            tokens = set(draw_many(s, x[i], p, 400, seed=i).tolist())
            assert tokens <= keep[i] and len(tokens) > len(keep[i]) // 2
    else:
        s = make_sampler(path, V, candidates=4)
        batch = s.prepare([make_state(p) for p in params], [0] * 4)
        assert batch.candidates == 4
        lo = sampling_kernels.triton_filter_thresholds(x.to(DEVICE), batch.tensors, 4, 16).cpu()
        for i in range(4):
            assert set(torch.nonzero(x[i] >= lo[i]).flatten().tolist()) == keep[i]


@pytest.mark.parametrize("path", PATHS)
def test_a_seeded_request_draws_the_same_tokens_whatever_shares_the_batch(path):
    V = 80
    x = torch.randn(8, V, generator=torch.Generator().manual_seed(4))
    params = [
        SamplingParams(seed=100), SamplingParams(temperature=0.8, top_k=10, top_p=0.9, seed=101),
        SamplingParams(top_p=0.9, seed=102), SamplingParams(temperature=1.2, top_k=40, top_p=0.8, seed=103),
        SamplingParams(temperature=0.0), SamplingParams(top_p=0.6), SamplingParams(seed=106),
        SamplingParams(temperature=2.0, seed=107),
    ]
    states = [make_state(p) for p in params]
    # one row per program, as on a GPU; 32 candidates: the bisection settles some rows (top_k=40, large nuclei)
    s = make_sampler(path, V, rows_per_program=1, candidates=32)
    draws = [3, 0, 7, 1, 0, 2, 5, 9]
    alone = s.sample(x.to(DEVICE), s.prepare(states, draws)).cpu()
    # reversed, two rows dropped, another request added, padded to 12 rows: the kept rows' tokens are unchanged
    order = [7, 6, 5, 3, 2, 1, 0]
    other = make_state(SamplingParams(temperature=1.0, top_p=0.3, seed=5))
    rows = torch.cat([x[order], torch.randn(1, V)])
    rows = torch.cat([rows, torch.zeros(12 - len(rows), V)])
    batch = s.prepare([states[i] for i in order] + [other], [draws[i] for i in order] + [4], pad_to=12)
    assert batch.rows == 12
    again = s.sample(rows.to(DEVICE), batch).cpu()
    assert again[: len(order)].tolist() == alone[order].tolist()
    # one at a time (row 1 alone takes 16 candidates, in the batch 32): the same
    for i in (0, 1, 3):
        assert s.sample(x[i : i + 1].to(DEVICE), s.prepare([states[i]], [draws[i]])).item() == alone[i]


@pytest.mark.parametrize("path", PATHS)
def test_seeds_and_draw_indices_select_the_noise(path):
    x = torch.zeros(32)  # uniform: any token can come
    s = make_sampler(path, 32)
    a = draw_many(s, x, SamplingParams(), 40, seed=1)
    assert draw_many(s, x, SamplingParams(), 40, seed=1).tolist() == a.tolist()
    assert draw_many(s, x, SamplingParams(), 40, seed=2).tolist() != a.tolist()
    assert len(set(a.tolist())) > 10  # draws 0..39 of one request differ from each other
    # a draw recomputed (after a preemption) repeats: draws 30..39 alone give the same tokens
    st = make_state(SamplingParams(seed=1))
    again = s.sample(x.to(DEVICE).expand(10, -1).contiguous(), s.prepare([st] * 10, list(range(30, 40)))).cpu()
    assert again.tolist() == a[30:].tolist()


@pytest.mark.parametrize("path", PATHS)
def test_logprobs_are_the_log_softmax_of_the_raw_logits(path):
    V = 70
    x = torch.randn(4, V, generator=torch.Generator().manual_seed(5)) * 3
    states = [make_state(SamplingParams(temperature=0.5, logprobs=n, seed=n)) for n in (0, 3, 5)]
    states.append(make_state(SamplingParams(temperature=0.0)))
    s = make_sampler(path, V)
    batch = s.prepare(states, [0] * 4)
    assert batch.max_top_n == 5
    tokens = s.sample(x.to(DEVICE), batch)
    chosen, ids, values = (t.cpu() for t in s.logprobs(x.to(DEVICE), tokens, batch))
    ref = torch.log_softmax(x, dim=-1)
    torch.testing.assert_close(chosen, ref.gather(1, tokens.cpu()[:, None]).squeeze(1), rtol=0, atol=1e-5)
    top = torch.topk(ref, 5, dim=-1)
    assert torch.equal(ids, top.indices)
    torch.testing.assert_close(values, top.values, rtol=0, atol=1e-5)
    # the engine's function, and no logprobs work when no row asks
    c2, i2, v2 = compute_logprobs(x, tokens.cpu(), 2)
    torch.testing.assert_close(c2, chosen, rtol=0, atol=1e-5)
    assert torch.equal(i2, top.indices[:, :2]) and compute_logprobs(x, tokens.cpu(), 0)[1] is None
    assert s.logprobs(x.to(DEVICE), tokens, s.prepare(states[3:] * 4, [0] * 4)) is None


def test_prepare_writes_fixed_buffers_and_pads_with_greedy_rows():
    s = Sampler(100, DEVICE, max_rows=8, use_triton=False)
    a = s.prepare([make_state(SamplingParams(top_k=500, top_p=0.9, seed=3))], [4], pad_to=4)
    ptrs = {name: t.data_ptr() for name, t in a.tensors.items()}
    b = s.prepare([make_state(SamplingParams(temperature=0.0))] * 3, [0, 1, 2], pad_to=8)
    assert {name: t.data_ptr() for name, t in b.tensors.items()} == ptrs  # a captured graph reads these
    assert a.host["top_k"].tolist() == [0, 0, 0, 0]  # top_k >= the vocabulary: off
    assert a.host["greedy"].tolist() == [0, 1, 1, 1] and a.host["draw"][0] == 4 and a.host["seed"][0] == 3
    assert a.kind == "filter" and a.any_top_p and not a.any_top_k
    assert b.kind == "greedy" and b.all_greedy and b.path == ("greedy", 0, -1)
    assert s.prepare([make_state(SamplingParams())], [0]).kind == "sample"
    huge = s.prepare([make_state(SamplingParams(top_k=10**12, temperature=1e-40, seed=1))], [0])
    assert huge.kind == "sample" and huge.host["top_k"][0] == 0 and huge.host["temperature"][0] > 0


def test_seeded_requests_draw_the_same_tokens_beside_any_companions():
    """A draw is keyed by (seed, output index): two requests with one seed draw the same sequence whether they
    share their steps with other requests or run alone; requests without a seed get different random seeds."""
    x = torch.zeros(3, 64)
    s = Sampler(64, DEVICE, max_rows=4)
    a, b = make_state(SamplingParams(seed=42, top_p=0.95)), make_state(SamplingParams(seed=42, top_p=0.95))
    first, second = [], []
    for draw in range(6):
        crowd = [make_state(SamplingParams()), a, make_state(SamplingParams())]
        first.append(s.sample(x.to(DEVICE), s.prepare(crowd, [draw + 3, draw, 0]))[1].item())
        second.append(s.sample(x[:1].to(DEVICE), s.prepare([b], [draw]))[0].item())
    assert first == second and len(set(first)) > 1
    assert make_state(SamplingParams()).seed != make_state(SamplingParams()).seed


@pytest.mark.skipif(sampling_kernels.triton is None, reason="no Triton")
def test_the_kernels_compile_for_hopper():
    """The interpreter does not type-check as the compiler does: compile every kernel for sm_90 (no GPU
    needed) in a process without TRITON_INTERPRET."""
    code = f"""
import sys; sys.path.insert(0, {str(Path(sampling.__file__).parents[1])!r})
import triton
from triton.backends.compiler import GPUTarget
from moe_engine.kernels import sampling as S
P, I, C = "*fp32", "i32", "constexpr"
x = dict(x_ptr=P, stride=I)
par = dict(cand_ptr=P, C=I, temp_ptr=P, top_k_ptr="*i32", top_p_ptr=P)
jobs = [
    ("_race_kernel", dict(x, temp_ptr=P, greedy_ptr="*i32", seed_ptr="*i64", draw_ptr="*i64", lo_ptr=P, best_ptr=P,
        where_ptr="*i32", N=I, V=I, CHUNK=I, S=I, HAS_LO=C, ROWS=C, BLOCK=C), dict(ROWS=1, BLOCK=1024)),
    ("_race_finish_kernel", dict(best_ptr=P, where_ptr="*i32", out_ptr="*i64", N=I, S=I, ROWS=C, BLOCK_S=C),
        dict(ROWS=1, BLOCK_S=256)),
    ("_mass_kernel", dict(x, **par, part_ptr=P, N=I, V=I, CHUNK=I, S=I, ROWS=C, BLOCK=C), dict(ROWS=1, BLOCK=1024)),
    ("_threshold_kernel", dict(par, part_ptr=P, lo_ptr=P, unsettled_ptr="*i32", N=I, S=I, ROWS=C, BLOCK_C=C,
        BLOCK_S=C), dict(ROWS=1, BLOCK_C=1024, BLOCK_S=32)),
    ("_bisect_kernel", dict(x, **par, lo_ptr=P, unsettled_ptr="*i32", V=I, BLOCK=C), dict(BLOCK=1024)),
    ("_lse_kernel", dict(x, pm_ptr=P, ps_ptr=P, V=I, CHUNK=I, S=I, BLOCK=C), dict(BLOCK=1024)),
]
for name, sig, const in jobs:
    for has_lo in ((True, False) if "HAS_LO" in sig else (None,)):
        c = dict(const, HAS_LO=has_lo) if has_lo is not None else const
        triton.compile(triton.compiler.ASTSource(getattr(S, name), sig, c), target=GPUTarget("cuda", 90, 32))
print("compiled")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
