"""GPT-OSS's Triton expert GEMMs (moe_engine/kernels/fused_moe_gpt_oss.py) against the op-by-op torch computation of
``GptOssExperts`` (biases, interleaved gate/up, clamped SwiGLU), and the experts module's fused path (route -> the
two GEMMs -> combine) against its reference path.

Only the GEMMs' float32 summation order may differ from torch's, so in bf16/fp16 outputs must lie within a bound
derived from one rounding of each GEMM output carried through the clamped SwiGLU and the down GEMM
(``y_bound``), and most elements must be bit-identical (every other rounding is placed as torch places it);
float32 agrees to 1e-5. Runs under Triton's interpreter on CPU (tests/conftest.py); ``MOE_TEST_DEVICE=cuda`` runs
the compiled kernels on a GPU.
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

from moe_engine.kernels import fused_moe_gpt_oss
from moe_engine.kernels import moe_routing as routing_kernels
from moe_engine.kernels import support as kernel_support
from moe_engine.kernels.fused_moe import TileConfig
from moe_engine.layers.experts import GptOssExperts

DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
ALPHA = 1.702
# H, I not multiples of the tiles (K tails, wrapped column tiles); small tiles keep the interpreter quick
H, I = 48, 40
SMALL = (TileConfig(16, 16, 32, GROUP_M=4), TileConfig(16, 32, 32))

pytestmark = pytest.mark.skipif(not kernel_support.available(DEVICE), reason="Triton not available for this device")


def make_weights(E: int, dtype: torch.dtype, seed: int = 0, gate_scale: float = 1.0):
    """HF GptOssExperts' layout: gate_up [E, H, 2I] (even columns gate), biases, down [E, I, H]."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, H, 2 * I, generator=g) / H**0.5
    gate_up[..., ::2] *= gate_scale
    gate_up_bias = torch.randn(E, 2 * I, generator=g) * 0.3
    down = torch.randn(E, I, H, generator=g) / I**0.5
    down_bias = torch.randn(E, H, generator=g) * 0.3
    return tuple(t.to(DEVICE, dtype) for t in (gate_up, gate_up_bias, down, down_bias))


def random_ids(T: int, K: int, E: int, seed: int, skew: bool = False) -> torch.Tensor:
    """[T, K] distinct experts per token; ``skew``: expert 1 in every token's first slot (several row tiles)."""
    g = torch.Generator().manual_seed(seed)
    pool = min(E, K + 3) if skew else E
    rows = []
    for _ in range(T):
        if skew:
            rows.append(torch.cat([torch.tensor([1]), 2 + torch.randperm(pool - 2, generator=g)[: K - 1]]))
        else:
            rows.append(torch.randperm(pool, generator=g)[:K])
    return torch.stack(rows).to(DEVICE)


def torch_experts(x, weights, tok, offs, limit):
    """HF GptOssExperts' loop body, expert by expert on its grouped rows, keeping what the bound needs:
    y [P, H], and per row the gate_up matmul output, gate_up, clamped gate/up, h, and the down matmul output."""
    gate_up, gate_up_bias, down, down_bias = weights
    P, I2, Hd = tok.shape[0], gate_up.shape[2], down.shape[2]  # (any shape: the MXFP4 tests' too)
    mm_gu = torch.zeros(P, I2, dtype=x.dtype, device=x.device)
    mm_y = torch.zeros(P, Hd, dtype=x.dtype, device=x.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            mm_gu[start:end] = x[tok[start:end]] @ gate_up[e]
        start = end
    e_of = expert_of_rows(offs)
    gu = mm_gu + gate_up_bias[e_of]
    gate = gu[:, ::2].clamp(min=None, max=limit)
    up = gu[:, 1::2].clamp(min=-limit, max=limit)
    h = (up + 1) * (gate * torch.sigmoid(gate * ALPHA))
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            mm_y[start:end] = h[start:end] @ down[e]
        start = end
    y = mm_y + down_bias[e_of]
    return y, SimpleNamespace(mm_gu=mm_gu, gu=gu, gate=gate, up=up, h=h, mm_y=mm_y)


def expert_of_rows(offs: torch.Tensor) -> torch.Tensor:
    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    return torch.repeat_interleave(torch.arange(offs.shape[0], device=offs.device), counts)


def h_bound(r, dtype):
    """How far h may be from torch's when the gate_up GEMM sums in another float32 order: the matmul output may
    round to its neighbour (2u|mm|), and the bias add round the other way (2u|gu|); the clamp only shrinks that.
    d(g * sigmoid(a g))/dg <= 1 + a|g|/4 carries the gate's step times |up + 1|, the up's step times |glu|, and the
    five roundings after them add up to 2u|.| each, bounded by 10u (|up|+1)(|g|+1)."""
    u = UNIT_ROUNDOFF[dtype]
    f = lambda t: t.float().abs()  # noqa: E731
    g_err = 2 * u * (f(r.mm_gu[:, ::2]) + f(r.gu[:, ::2]))
    u_err = 2 * u * (f(r.mm_gu[:, 1::2]) + f(r.gu[:, 1::2]))
    glu = f(r.gate) * torch.sigmoid(ALPHA * r.gate.float()).abs()
    return (g_err * (f(r.up) + 1) * (1 + ALPHA * f(r.gate) / 4) + u_err * glu
            + 10 * u * (f(r.up) + 1) * (f(r.gate) + 1) + 1e-6)


def y_bound(r, down, offs, dtype):
    """h's bound carried through the down GEMM (|W| @ dh), then y's own two roundings (matmul, bias add)."""
    u = UNIT_ROUNDOFF[dtype]
    w = down[expert_of_rows(offs)].float().abs()  # [P, I, H]
    return torch.einsum("pi,pih->ph", h_bound(r, dtype), w) + 2 * u * (r.mm_y.float().abs() + 1) + 1e-6


def assert_like_torch(y, y_ref, bound, dtype, min_same=0.97):
    if dtype == torch.float32:
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        return
    err = (y.float() - y_ref.float()).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {err.max().item():.3g} exceeds the GEMM-rounding bound by {worst:.2f}x"
    same = (y == y_ref).float().mean().item()
    # a rounding placed differently (e.g. the bias added before rounding the matmul) leaves many elements differing
    assert same >= min_same, f"only {same:.2%} of the elements bit-identical to torch"


CASES = [  # (T, K, E, limit): limit 0.5 clamps most gates and ups (HF's tiny test config uses 0.1), 7.0 few
    (1, 1, 4, 7.0), (1, 4, 64, 7.0), (3, 2, 4, 0.5), (17, 1, 8, 7.0), (17, 4, 64, 0.5), (64, 2, 8, 7.0),
    (64, 4, 8, 0.5),
]


@pytest.mark.parametrize("T,K,E,limit", CASES)
def test_expert_mlp_equals_torch_per_expert_computation(T, K, E, limit):
    dtype = torch.bfloat16
    weights = make_weights(E, dtype, gate_scale=3.0)  # gates ~ N(0, 9): sigmoid's curved part and both tails
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(DEVICE, dtype)
    pos, tok, offs = routing_kernels.route(random_ids(T, K, E, seed=T * K + E), E)
    gate_up, gate_up_bias, down, down_bias = weights
    y = fused_moe_gpt_oss.expert_mlp(x, gate_up, gate_up_bias, down, down_bias, pos, tok, offs, limit, ALPHA, SMALL)
    y_ref, r = torch_experts(x, weights, tok, offs, limit)
    assert y.shape == (T * K, H) and y.dtype == dtype
    assert_like_torch(y, y_ref, y_bound(r, down, offs, dtype), dtype)


def test_clamped_swiglu_epilogue_rounds_like_torch():
    """h from the first kernel against torch's ops on the same rows: equal but for the rare element whose gate or
    up rounded the other way in the GEMM, and within the bound that rounding carries."""
    dtype, T, K, E, limit = torch.bfloat16, 64, 2, 4, 2.0
    weights = make_weights(E, dtype, seed=4, gate_scale=4.0)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(6)).to(DEVICE, dtype)
    pos, tok, offs = routing_kernels.route(random_ids(T, K, E, seed=8), E)
    h = fused_moe_gpt_oss.gate_up_clamped_swiglu(x, weights[0], weights[1], tok, offs, SMALL[0], limit, ALPHA)
    _, r = torch_experts(x, weights, tok, offs, limit)
    assert_like_torch(h, r.h, h_bound(r, dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_uneven_and_empty_groups_in_every_dtype_with_the_default_tiles(dtype):
    """One expert holds all 64 tokens (several row tiles), most hold none; experts without rows have NaN weights
    and biases, which must not reach the output. The default tile table (wider tiles, K tails) picks the config."""
    T, K, E, limit = 64, 4, 16, 7.0
    weights = make_weights(E, dtype, seed=1)
    ids = random_ids(T, K, E, seed=5, skew=True)
    unused = torch.ones(E, dtype=torch.bool)
    unused[ids.unique().cpu()] = False
    for w in weights:
        w[unused.to(DEVICE)] = float("nan")
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    pos, tok, offs = routing_kernels.route(ids, E)
    y = fused_moe_gpt_oss.expert_mlp(x, *weights[:2], *weights[2:], pos, tok, offs, limit, ALPHA)
    y_ref, r = torch_experts(x, weights, tok, offs, limit)
    assert torch.isfinite(y).all()
    assert_like_torch(y, y_ref, None if dtype == torch.float32 else y_bound(r, weights[2], offs, dtype), dtype)


def gpt_oss_experts(E: int, dtype: torch.dtype, limit: float, seed: int) -> GptOssExperts:
    spec = SimpleNamespace(num_experts=E, intermediate_size=I, swiglu_limit=limit, swiglu_alpha=ALPHA)
    experts = GptOssExperts(spec, H).to(DEVICE)
    w = make_weights(E, dtype, seed=seed, gate_scale=2.0)
    for name, t in zip(("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"), w):
        getattr(experts, name).data = t
    return experts


@pytest.mark.parametrize("T,K,E,dtype", [(1, 4, 16, torch.bfloat16), (5, 4, 64, torch.bfloat16),
                                         (40, 2, 8, torch.bfloat16), (9, 4, 8, torch.float32)])
def test_fused_path_of_the_experts_module_equals_its_reference_path(T, K, E, dtype):
    """GptOssExperts with the fused path on (what use_fused_kernels switches on a GPU): route (with the capture
    copy) -> the two GEMMs -> combine, against its own op-by-op (grouped) path: the same ids captured, the same
    weights captured, the output within the GEMM-rounding bound carried through the weighted HF-order sum."""
    limit = 1.0
    experts = gpt_oss_experts(E, dtype, limit, seed=3)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    ids = random_ids(T, K, E, seed=T)
    weights = torch.softmax(torch.randn(T, K, generator=g), -1).to(DEVICE, dtype)
    capture_ref = torch.full((T, K), -1, dtype=torch.int32, device=DEVICE)
    wcap_ref = torch.zeros(T, K, dtype=torch.float32, device=DEVICE)
    assert not experts.takes_fused_path(x, K)
    expected = experts(x, ids, weights, capture_ref, wcap_ref)

    experts.fused, experts.triton_gemm_max_pairs = True, sys.maxsize
    assert experts.takes_fused_path(x, K) and experts.graph_unsafe_reason(x.device, dtype) is None
    capture = torch.full((T, K), -1, dtype=torch.int32, device=DEVICE)
    wcap = torch.zeros(T, K, dtype=torch.float32, device=DEVICE)
    out = experts(x, ids, weights, capture, wcap)
    assert torch.equal(capture, capture_ref) and torch.equal(capture.long(), ids) and torch.equal(wcap, wcap_ref)
    deferred = experts(x, ids, weights, defer_combine=True)  # the next norm's launch may sum it instead
    assert torch.equal(deferred.combine(dtype), out)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        return
    pos, tok, offs = routing_kernels.route(ids, E)
    w = (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias)
    y_ref, r = torch_experts(x, w, tok, offs, limit)
    u = UNIT_ROUNDOFF[dtype]
    per_pair = y_bound(r, experts.down_proj, offs, dtype) + 2 * u * K * y_ref.float().abs()
    bound = (weights.float()[..., None] * per_pair[pos]).sum(1)  # [T, H]: each weighted term, each rounded add
    assert_like_torch(out, expected, bound, dtype, min_same=0.9)


def test_fused_path_is_off_where_it_does_not_apply():
    """Expert parallelism and deterministic inference keep the reference paths (and say why graphs cannot run)."""
    experts = gpt_oss_experts(8, torch.bfloat16, 7.0, seed=0)
    x = torch.zeros(2, H, dtype=torch.bfloat16, device=DEVICE)
    assert experts.graph_unsafe_reason(x.device, x.dtype) is not None  # fused kernels off
    experts.fused, experts.triton_gemm_max_pairs = True, sys.maxsize
    assert experts.takes_fused_path(x, 2)
    experts.first_expert = 0
    assert not experts.takes_fused_path(x, 2) and experts.graph_unsafe_reason(x.device, x.dtype) is not None
    experts.first_expert, experts.batch_invariant = None, True
    assert not experts.takes_fused_path(x, 2) and experts.graph_unsafe_reason(x.device, x.dtype) is not None


def test_bad_inputs_are_refused():
    dtype, E = torch.bfloat16, 4
    gate_up, gate_up_bias, down, down_bias = make_weights(E, dtype)
    x = torch.zeros(2, H, dtype=dtype, device=DEVICE)
    pos, tok, offs = routing_kernels.route(random_ids(2, 2, E, seed=0), E)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe_gpt_oss.expert_mlp(x, gate_up, gate_up_bias[:, :-2], down, down_bias, pos, tok, offs, 7.0, ALPHA)
    with pytest.raises(ValueError, match="int32"):
        fused_moe_gpt_oss.expert_mlp(x, gate_up, gate_up_bias, down, down_bias, pos, tok, offs.long(), 7.0, ALPHA)


HOPPER_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_engine.kernels import fused_moe as fm
from moe_engine.kernels import fused_moe_gpt_oss as fg

E, H, I = 128, 2880, 2880  # GPT-OSS-120B's experts
mxfp4 = sys.argv[1] == "mxfp4"  # the weight load: bf16 weights, or MXFP4 bytes + scales decoded in registers
out = {}
for bucket in sys.argv[2:]:
    for gate_up in (True, False):
        N, K = (I, H) if gate_up else (H, I)
        cfg = fm._fit(fm.DEFAULT_CONFIGS[bucket][0 if gate_up else 1], N, K)
        consts = dict(GATE_UP=gate_up, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=max(cfg.BLOCK_K, 32),
                      GROUP_M=cfg.GROUP_M, BLOCK_E=E, EVEN_K=K % max(cfg.BLOCK_K, 32) == 0, DT=1, UPCAST=False,
                      PRECISE=True, PREC="tf32", PDL=True, WIDTH=(2 if gate_up else 1) * cfg.BLOCK_N, MXFP4=mxfp4)
        consts["s_wk" if mxfp4 else "s_wn"] = 1  # the weights' unit stride (Triton specialises an int 1 so too)
        ints = tuple(n for n in ("E", "N", "K", "num_pid_m", "s_a", "s_we", "s_wk", "s_wn", "s_se", "s_sn", "s_be",
                                 "s_out") if n not in consts)
        sig = {"a_ptr": "*bf16", "w_ptr": "*u8" if mxfp4 else "*bf16", "scale_ptr": "*u8" if mxfp4 else "*bf16",
               "bias_ptr": "*bf16", "out_ptr": "*bf16", "tok_ptr": "*i64", "offs_ptr": "*i32",
               **{n: "i32" for n in ints}, "limit": "fp32", "alpha": "fp32", **{n: "constexpr" for n in consts}}
        kernel = fg._biased_moe_gemm_kernel
        aligned = ("a_ptr", "w_ptr", "scale_ptr", "bias_ptr", "out_ptr", "tok_ptr", "offs_ptr") + tuple(
            n for n in ints if n != "num_pid_m")
        attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        ck = triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "enable_fp_fusion": False})
        ptx = ck.asm["ptx"]
        out[f"{bucket} {'gate_up' if gate_up else 'down'}"] = {
            "shared": ck.metadata.shared, "div_rn": "div.rn.f32" in ptx, "wgmma": "wgmma" in ptx,
            "pdl": "griddepcontrol.wait" in ptx}
print(json.dumps(out))
"""


@pytest.mark.parametrize("weights", ["bf16", "mxfp4"])
def test_default_tiles_compile_for_hopper_at_the_gpt_oss_shape(tmp_path, weights):
    """The interpreter cannot see the compiled path (the epilogue's reshape and split of the interleaved tile on
    the MMA layout, the MXFP4 tile's interleave of its nibbles, libdevice exp, IEEE division, shared memory, the
    PDL wait): compile both GEMMs of each weight load for sm_90 with ptxas from the Triton wheel (no GPU needed)
    at GPT-OSS-120B's expert shape for a decode, a mid and a prefill bucket of the default tile table."""
    import json
    import subprocess
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(repo / "backends"), str(repo)]), TRITON_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", HOPPER_COMPILE, weights, "2-8", "129-512", ">16384"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result) == 6
    for name, r in result.items():
        assert r["shared"] <= 227 * 1024, f"{name}: {r['shared']} bytes of shared memory"
        assert r["div_rn"] == name.endswith("gate_up"), name  # the sigmoid's division is IEEE (torch's)
        assert r["pdl"], name  # programmatic dependent launch: the wait for the previous kernel is compiled in
    assert result[">16384 gate_up"]["wgmma"] and result[">16384 down"]["wgmma"]  # prefill tiles on Hopper's MMA


# ------------------------------------------------------------------------------------- the router


def router_reference(logits, top_k, mask=None, given=None):
    """GptOssRouter's op-by-op math (layers/routing.py): top-k of the logits, softmax over those k in their dtype."""
    top, ids = torch.topk(logits, top_k, dim=-1)
    if mask is not None:
        ids = torch.where(mask[:, None], given, ids)
        top = logits.gather(1, ids)
    return ids, torch.softmax(top, dim=1, dtype=top.dtype)


def distinct_logits(T: int, E: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[T, E] logits with no ties within a row (torch.topk leaves the order of ties unspecified): a permutation of
    E distinct values of the dtype per row, spread over about [-4, 4]."""
    g = torch.Generator().manual_seed(seed)
    values = torch.linspace(-4, 4, E).to(dtype).unique()
    assert values.numel() == E
    return torch.stack([values[torch.randperm(E, generator=g)] for _ in range(T)]).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,E,K", [(1, 8, 2), (5, 128, 4), (33, 32, 4)])
def test_fused_router_chooses_the_same_experts_with_weights_within_rounding(T, E, K, dtype):
    logits = distinct_logits(T, E, dtype, seed=T + E)
    ids, w = routing_kernels.topk_softmax(logits, K)
    ids_ref, w_ref = router_reference(logits, K)
    assert torch.equal(ids, ids_ref) and w.dtype == dtype
    tol = 2.0**-8 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(w.float(), w_ref.float(), rtol=tol, atol=tol)  # one rounding of the weights' dtype
    # routing replay: forced tokens take the given ids (any order) and the softmax of their logits
    mask = torch.arange(T, device=DEVICE) % 2 == 0
    given = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:K] for t in range(T)]).to(DEVICE)
    ids, w = routing_kernels.topk_softmax(logits, K, mask, given)
    ids_ref, w_ref = router_reference(logits, K, mask, given)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w.float(), w_ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("forced", [False, True])
def test_one_token_router_launch_also_routes_exactly_as_route(forced):
    E, K = 32, 4
    logits = distinct_logits(1, E, torch.bfloat16, seed=3)
    mask = torch.tensor([forced], device=DEVICE)
    given = torch.tensor([[7, 3, 30, 0]], device=DEVICE)
    capture = torch.full((1, K), -1, dtype=torch.int32, device=DEVICE)
    args = (mask, given) if forced else (None, None)
    ids, w, (pos, tok, offs) = routing_kernels.topk_softmax_route(logits, K, capture, *args)
    ids_ref, w_ref = routing_kernels.topk_softmax(logits, K, *args)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)
    pos_ref, tok_ref, offs_ref = routing_kernels.route(ids_ref, E)
    assert torch.equal(pos, pos_ref) and torch.equal(tok, tok_ref) and torch.equal(offs, offs_ref)
    assert torch.equal(capture.long(), ids)
