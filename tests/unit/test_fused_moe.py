"""Triton expert GEMMs (moe_engine/fused_moe.py) against the op-by-op torch computation of the routed experts.

Only the GEMMs' float32 summation order may differ from torch's, so in bf16/fp16 the outputs must lie within
a bound derived from one rounding of the model dtype (``h_bound``, ``gemm_rounding_bound``) and, since every other
rounding is placed as torch places it, be bit-identical for all but a sliver of elements; float32 agrees to 1e-5. Runs under
Triton's interpreter on CPU (tests/conftest.py); ``MOE_TEST_DEVICE=cuda`` runs the compiled kernels on a GPU.
"""
from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from moe_engine.kernels import fused_moe
from moe_engine.kernels import moe_routing as routing_kernels
from moe_engine.kernels import support as kernel_support
from moe_engine.kernels.fused_moe import TileConfig, expert_mlp
from moe_engine.layers.experts import Experts

DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# H, I deliberately not multiples of the tiles (K tails, wrapped column tiles); small tiles keep the
# interpreter quick and give experts with more rows than one BLOCK_M several row tiles.
H, I = 48, 40
SMALL = (TileConfig(16, 32, 32, GROUP_M=4), TileConfig(16, 64, 32))

pytestmark = pytest.mark.skipif(not kernel_support.available(DEVICE), reason="Triton not available for this device")


def make_weights(E: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * I, H, generator=g) / H**0.5  # gate ~ N(0, |x|^2 / H): silu sees O(1) inputs
    down = torch.randn(E, H, I, generator=g) / I**0.5
    return gate_up.to(DEVICE, dtype), down.to(DEVICE, dtype)


def random_ids(T: int, K: int, E: int, seed: int, skew: bool = False) -> torch.Tensor:
    """[T, K] distinct experts per token; ``skew``: every token's first slot is expert 1 and the others come
    from experts 2..min(E, K+3), so expert 1 gets all T rows (several row tiles) and most experts none."""
    g = torch.Generator().manual_seed(seed)
    pool = min(E, K + 3) if skew else E
    rows = []
    for _ in range(T):
        if skew:
            rows.append(torch.cat([torch.tensor([1]), 2 + torch.randperm(pool - 2, generator=g)[: K - 1]]))
        else:
            rows.append(torch.randperm(pool, generator=g)[:K])
    return torch.stack(rows).to(DEVICE)


def torch_experts(x, gate_up, down, tok, offs):
    """The op-by-op computation, expert by expert on its grouped rows: y [P, H], h [P, I], gate_up output [P, 2I]."""
    P, I2 = tok.shape[0], gate_up.shape[1]
    y = torch.zeros(P, gate_up.shape[2], dtype=x.dtype, device=x.device)
    gu = torch.zeros(P, I2, dtype=x.dtype, device=x.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            gu[start:end] = F.linear(x[tok[start:end]], gate_up[e])
            gate, up = gu[start:end].chunk(2, dim=-1)
            y[start:end] = F.linear(F.silu(gate) * up, down[e])
        start = end
    gate, up = gu.chunk(2, dim=-1)
    return y, F.silu(gate) * up, gu


def h_bound(h_ref, gu_ref, dtype):
    """How far h may be from torch's when the GEMMs sum in another float32 order: gate and up may each round to
    the neighbouring value (|d| <= 2u|v|, u the unit roundoff); silu' <= 1.1 carries the gate's step as
    <= 2.2u|gate|, silu's rounding adds 2u|silu|, the product |silu|*2u|up| and its rounding 2u|h|. With
    |silu(g)| <= |g|: |dh| <= 2u(1.1 + 1 + 1)|gate||up| + 2u|h|, bounded here by 8u|gate||up| + 2u|h|."""
    u = UNIT_ROUNDOFF[dtype]
    gate, up = gu_ref.float().abs().chunk(2, dim=-1)
    return 8 * u * gate * up + 2 * u * h_ref.float().abs() + 1e-6


def expert_of_rows(offs: torch.Tensor) -> torch.Tensor:
    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    return torch.repeat_interleave(torch.arange(offs.shape[0], device=offs.device), counts)


def gemm_rounding_bound(h_ref, gu_ref, down, offs, y_ref, dtype):
    """Per element of y: h's bound carried through the down GEMM (|W| @ dh), then y's own rounding (2u|y|)."""
    u = UNIT_ROUNDOFF[dtype]
    w = down[expert_of_rows(offs)].float().abs()  # [P, H, I]
    return torch.einsum("pi,phi->ph", h_bound(h_ref, gu_ref, dtype), w) + 2 * u * y_ref.float().abs() + 1e-6


def assert_like_torch(y, y_ref, bound, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        return
    err = (y.float() - y_ref.float()).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {err.max().item():.3g} exceeds the GEMM-rounding bound by {worst:.2f}x"
    same = (y == y_ref).float().mean().item()
    # rounding placed differently (e.g. silu not rounded) would leave most elements differing
    assert same >= 0.99, f"only {same:.2%} of the elements bit-identical to torch"


CASES = [  # (T, K, E)
    (1, 1, 4), (1, 8, 64), (3, 2, 4), (3, 8, 8), (17, 1, 8), (17, 2, 64), (17, 8, 8), (64, 1, 4), (64, 2, 8),
    (64, 8, 8),
]


@pytest.mark.parametrize("T,K,E", CASES)
def test_expert_mlp_equals_torch_per_expert_computation(T, K, E):
    dtype = torch.bfloat16
    gate_up, down = make_weights(E, dtype)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(DEVICE, dtype)
    pos, tok, offs = routing_kernels.route(random_ids(T, K, E, seed=T * K + E), E)
    y = expert_mlp(x, gate_up, down, pos, tok, offs, SMALL)
    y_ref, h_ref, gu_ref = torch_experts(x, gate_up, down, tok, offs)
    assert y.shape == (T * K, H) and y.dtype == dtype
    assert_like_torch(y, y_ref, gemm_rounding_bound(h_ref, gu_ref, down, offs, y_ref, dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_uneven_and_empty_groups_in_every_dtype_with_the_default_tiles(dtype):
    """One expert holds all 64 tokens (several row tiles), most hold none; experts without rows have NaN
    weights, which must not reach the output. The default tile table (wider tiles, K tails) picks the config."""
    T, K, E = 64, 4, 16
    gate_up, down = make_weights(E, dtype, seed=1)
    ids = random_ids(T, K, E, seed=5, skew=True)
    unused = torch.ones(E, dtype=torch.bool)
    unused[ids.unique().cpu()] = False
    gate_up[unused.to(DEVICE)] = float("nan")
    down[unused.to(DEVICE)] = float("nan")
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    pos, tok, offs = routing_kernels.route(ids, E)
    y = expert_mlp(x, gate_up, down, pos, tok, offs)
    y_ref, h_ref, gu_ref = torch_experts(x, gate_up, down, tok, offs)
    assert torch.isfinite(y).all()
    bound = None if dtype == torch.float32 else gemm_rounding_bound(h_ref, gu_ref, down, offs, y_ref, dtype)
    assert_like_torch(y, y_ref, bound, dtype)


@pytest.mark.parametrize("T,K,E,dtype", [(5, 8, 64, torch.bfloat16), (40, 2, 8, torch.bfloat16), (9, 8, 8, torch.float32)])
def test_moe_output_after_combine_equals_the_grouped_mm_path(T, K, E, dtype):
    """The integration: route -> expert_mlp -> combine gives what Experts._forward_fused (torch's grouped GEMMs)
    gives, within the GEMM-rounding bound carried through the weighted HF-order sum; same capture."""
    experts = Experts(SimpleNamespace(num_experts=E, intermediate_size=I), H).to(DEVICE)
    gate_up, down = make_weights(E, dtype, seed=3)
    experts.gate_up_proj.data, experts.down_proj.data = gate_up, down
    experts.fused = True
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    ids = random_ids(T, K, E, seed=T)
    weights = torch.softmax(torch.randn(T, K, generator=g), -1).to(DEVICE, dtype)
    capture_ref = torch.full((T, K), -1, dtype=torch.int32, device=DEVICE)
    expected = experts(x, ids, weights, capture_ref)

    capture = torch.full((T, K), -1, dtype=torch.int32, device=DEVICE)
    pos, tok, offs = routing_kernels.route(ids, E, capture)
    y = expert_mlp(x, gate_up, down, pos, tok, offs)
    out = routing_kernels.combine(y, ids, pos, weights, dtype)
    assert torch.equal(capture, capture_ref) and torch.equal(capture.long(), ids)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        return
    y_ref, h_ref, gu_ref = torch_experts(x, gate_up, down, tok, offs)
    u = UNIT_ROUNDOFF[dtype]
    per_pair = gemm_rounding_bound(h_ref, gu_ref, down, offs, y_ref, dtype) + 2 * u * K * y_ref.float().abs()
    bound = (weights.float()[..., None] * per_pair[pos]).sum(1)  # [T, H]: each weighted term, each rounded add
    assert_like_torch(out, expected, bound, dtype)


@pytest.mark.parametrize("T,K,E", [(1, 8, 16), (17, 2, 8), (64, 4, 16)])
def test_tma_loads_give_the_pointer_loads_bits(T, K, E):
    """``tma=1`` loads the weight tiles (and down's rows of h) through TMA descriptors into the same dots: the
    same bits as the pointer loads, including the K tails (48 = 32 + 16: the descriptor's zeros past K) and row
    tiles whose box runs into the next expert's rows or past the last row (never stored), and within the GEMM-
    rounding bound of torch. Shapes where TMA cannot serve (columns not a multiple of BLOCK_N) keep pointers."""
    dtype, h_dim, i_dim = torch.bfloat16, 48, 48
    g = torch.Generator().manual_seed(T)
    gate_up = (torch.randn(E, 2 * i_dim, h_dim, generator=g) / h_dim**0.5).to(DEVICE, dtype)
    down = (torch.randn(E, h_dim, i_dim, generator=g) / i_dim**0.5).to(DEVICE, dtype)
    x = torch.randn(T, h_dim, generator=g).to(DEVICE, dtype)
    pos, tok, offs = routing_kernels.route(random_ids(T, K, E, seed=T + E, skew=T == 64), E)
    pointers = (TileConfig(16, 16, 32), TileConfig(16, 16, 32))
    tma = tuple(dataclasses.replace(c, tma=1) for c in pointers)
    if DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper or later")
    assert fused_moe._tma_fits(x, gate_up, i_dim, h_dim, tma[0])
    assert not fused_moe._tma_fits(x, gate_up, 40, h_dim, tma[0])  # 40 columns: no whole 16-column tiles
    y = expert_mlp(x, gate_up, down, pos, tok, offs, tma)
    assert torch.equal(y, expert_mlp(x, gate_up, down, pos, tok, offs, pointers))
    y_ref, h_ref, gu_ref = torch_experts(x, gate_up, down, tok, offs)
    assert_like_torch(y, y_ref, gemm_rounding_bound(h_ref, gu_ref, down, offs, y_ref, dtype), dtype)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_tma_launches_replay_in_a_cuda_graph_on_new_inputs():
    """Decode steps replay CUDA graphs: the TMA descriptors captured with the launch (w's, and down's over the
    step's h buffer) must serve every replay, with the routing and activations copied into the captured inputs."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper or later")
    T, K, E, dtype = 4, 8, 16, torch.bfloat16
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(E, 2 * 64, 64, generator=g) / 8).to(DEVICE, dtype)
    down = (torch.randn(E, 64, 64, generator=g) / 8).to(DEVICE, dtype)
    tma = (TileConfig(16, 32, 32, tma=1), TileConfig(16, 64, 32, tma=1))
    inputs = []
    for seed in range(3):
        x = torch.randn(T, 64, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
        inputs.append((x, *routing_kernels.route(random_ids(T, K, E, seed=seed), E)))
    static = [t.clone() for t in inputs[0]]
    expert_mlp(*static[:1], gate_up, down, *static[1:], tma)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = expert_mlp(*static[:1], gate_up, down, *static[1:], tma)
    for x, pos, tok, offs in inputs[1:] + inputs[:1]:
        for dst, src in zip(static, (x, pos, tok, offs)):
            dst.copy_(src)
        graph.replay()
        assert torch.equal(y, expert_mlp(x, gate_up, down, pos, tok, offs, tma))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swiglu_epilogue_rounds_like_torch(dtype):
    """h = silu(gate) * up from the first kernel against torch's bf16/fp16 ops, with gates from about -12 to 12
    (silu's curved part and both tails): equal but for the rare element whose gate or up rounded the other way
    (the GEMM order), and never further than that rounding carries."""
    T, K, E = 64, 2, 4
    gate_up, down = make_weights(E, dtype, seed=4)
    gate_up[:, :I] *= 4  # gates ~ N(0, 4^2)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(6)).to(DEVICE, dtype)
    pos, tok, offs = routing_kernels.route(random_ids(T, K, E, seed=8), E)
    h = fused_moe.gate_up_swiglu(x, gate_up, tok, offs, SMALL[0])
    _, h_ref, gu_ref = torch_experts(x, gate_up, down, tok, offs)
    assert_like_torch(h, h_ref, h_bound(h_ref, gu_ref, dtype), dtype)


def test_empty_step_and_bad_inputs():
    gate_up, down = make_weights(4, torch.bfloat16)
    x = torch.zeros(0, H, dtype=torch.bfloat16, device=DEVICE)
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    offs = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    assert expert_mlp(x, gate_up, down, empty.view(0, 2), empty, offs).shape == (0, H)
    with pytest.raises(ValueError, match="int32"):
        expert_mlp(x, gate_up, down, empty.view(0, 2), empty, offs.long())
    with pytest.raises(ValueError, match="do not fit"):
        expert_mlp(x, gate_up, down.transpose(1, 2), empty.view(0, 2), empty, offs)


def test_tile_table_from_json_overrides_only_its_own_shape(tmp_path, monkeypatch):
    path = tmp_path / "configs.json"
    tuned = (TileConfig(32, 64, 64, 8, 8, 4), TileConfig(64, 128, 64, 1, 4, 2))
    key = fused_moe.table_key(fused_moe.device_name(DEVICE), 128, 2048, 768, torch.bfloat16)
    fused_moe.write_table(path, key, {"2-8": tuned})
    fused_moe.write_table(path, dict(key, I=1536), {"2-8": (tuned[1], tuned[0])})  # another shape, kept beside
    monkeypatch.setenv(fused_moe.CONFIG_ENV, str(path))
    assert len(json.loads(path.read_text())["tables"]) == 2
    assert fused_moe.tile_configs(8, DEVICE, 128, 2048, 768, torch.bfloat16) == tuned  # T=1, top-8
    assert fused_moe.tile_configs(9, DEVICE, 128, 2048, 768, torch.bfloat16) == fused_moe.DEFAULT_CONFIGS["9-32"]
    assert fused_moe.tile_configs(8, DEVICE, 128, 2048, 768, torch.float16) == fused_moe.DEFAULT_CONFIGS["2-8"]
    assert fused_moe.tile_configs(8, DEVICE, 128, 2048, 1536, torch.bfloat16) == (tuned[1], tuned[0])
    assert [fused_moe.bucket_of(p) for p in (1, 2, 8, 2048, 2049, 8193, 16384, 16385)] == [
        "1", "2-8", "2-8", "513-2048", "2049-8192", "8193-16384", "8193-16384", ">16384"]


def test_a_table_variant_changes_one_config_and_keeps_the_rest(tmp_path):
    """loadtest/tune/tile_table_variant.py: the shipped H200 table with one bucket's down config replaced, read back
    by the engine's loader exactly so; every other config as shipped."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "variant.json"
    env = {k: v for k, v in os.environ.items() if k != fused_moe.CONFIG_ENV}
    done = subprocess.run([sys.executable, str(repo / "loadtest/tune/tile_table_variant.py"), "--bucket", "2-8",
                           "--kernel", "down", "--config", "16,128,64,1,4,3,1", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    shipped = fused_moe._table("NVIDIA H200", 128, 2048, 768, torch.bfloat16, str(fused_moe.CONFIG_FILE))
    variant = fused_moe._table("NVIDIA H200", 128, 2048, 768, torch.bfloat16, str(out))
    assert variant["2-8"] == (shipped["2-8"][0], TileConfig(16, 128, 64, 1, 4, 3, tma=1))
    assert {b: c for b, c in variant.items() if b != "2-8"} == {b: c for b, c in shipped.items() if b != "2-8"}


def test_a_bucket_the_table_does_not_know_is_reported_and_the_others_serve(tmp_path, monkeypatch):
    """A tuned JSON with a bucket name this version does not know (">8192", say, from a table tuned before that
    bucket was split) reports it, not silently dropped; its known buckets still serve, the others keep the
    defaults."""
    import warnings

    path = tmp_path / "configs.json"
    tuned = (TileConfig(64, 64, 64, 8, 4, 3), TileConfig(128, 256, 64, 1, 8, 4))
    key = fused_moe.table_key(fused_moe.device_name(DEVICE), 128, 2048, 768, torch.bfloat16)
    entry = dict(key, buckets={">8192": {"gate_up": dataclasses.asdict(tuned[0]), "down": dataclasses.asdict(tuned[1])},
                               ">16384": {"gate_up": dataclasses.asdict(tuned[0]), "down": dataclasses.asdict(tuned[1])}})
    path.write_text(json.dumps({"tables": [entry]}))
    monkeypatch.setenv(fused_moe.CONFIG_ENV, str(path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fused_moe.tile_configs(65536, DEVICE, 128, 2048, 768, torch.bfloat16) == tuned
        assert fused_moe.tile_configs(16384, DEVICE, 128, 2048, 768, torch.bfloat16) == fused_moe.DEFAULT_CONFIGS[
            fused_moe.bucket_of(16384)]
    assert any("'>8192'" in str(w.message) for w in caught)


def test_the_committed_h200_table_is_the_one_in_use_for_its_shape():
    """fused_moe_configs.json (tuned on the H200 by loadtest/tune/bench_fused_moe.py --tune) parses, and every
    bucket it tunes replaces the default for the Qwen3-30B-A3B shape on that GPU (a broken file would fall back to
    the defaults with only a warning)."""
    entry = next(t for t in json.loads(fused_moe.CONFIG_FILE.read_text())["tables"] if t["device"] == "NVIDIA H200")
    key = fused_moe.table_key("NVIDIA H200", 128, 2048, 768, torch.bfloat16)
    assert {k: entry[k] for k in key} == key and entry["buckets"]
    table = fused_moe._table("NVIDIA H200", 128, 2048, 768, torch.bfloat16, str(fused_moe.CONFIG_FILE))
    for name, pair in entry["buckets"].items():
        assert table[name] == (TileConfig.from_dict(pair["gate_up"]), TileConfig.from_dict(pair["down"])), name


HOPPER_COMPILE = r"""
import json, sys
import torch
from loadtest.probes.kernel_ptx_stats import compile_moe_gemm  # the launch the engine makes, compiled for sm_90
from moe_engine.kernels import fused_moe as fm

out = {}
tuned = fm._table("NVIDIA H200", 128, 2048, 768, torch.bfloat16, str(fm.CONFIG_FILE))  # the shipped table
for bucket in sys.argv[1:]:
    for table, gate_up in ((t, g) for t in ("default", "tuned") for g in (True, False)):
        cfg = (fm.DEFAULT_CONFIGS if table == "default" else tuned)[bucket][0 if gate_up else 1]
        N, K = (768, 2048) if gate_up else (2048, 768)  # Qwen3-30B-A3B
        ck, tma = compile_moe_gemm(cfg, gate_up, N, K)
        out[f"{table} {bucket} {'gate_up' if gate_up else 'down'}"] = {
            "shared": ck.metadata.shared, "div_rn": "div.rn.f32" in ck.asm["ptx"], "wgmma": "wgmma" in ck.asm["ptx"],
            "pdl": "griddepcontrol.wait" in ck.asm["ptx"], "tma": tma,
            "tma_loads": "cp.async.bulk.tensor" in ck.asm["ptx"]}
print(json.dumps(out))
"""


def test_default_tiles_compile_for_hopper_within_its_shared_memory(tmp_path):
    """The interpreter cannot see the compiled path (libdevice exp, IEEE division, shared memory, the PDL wait, TMA
    loads): compile the kernels for sm_90 with ptxas from the Triton wheel (no GPU needed) for a decode, a mid and a
    prefill bucket, with the default tiles and with the shipped H200 table's."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(repo / "backends"), str(repo)]),
               TRITON_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", HOPPER_COMPILE, "2-8", "513-2048", ">16384"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result) == 12
    for name, r in result.items():
        assert r["shared"] <= 227 * 1024, f"{name}: {r['shared']} bytes of shared memory"
        assert r["div_rn"] == name.endswith("gate_up"), name  # silu's division is IEEE (torch's), only in gate_up
        assert r["pdl"], name  # programmatic dependent launch: the wait for the previous kernel is compiled in
        assert r["tma_loads"] == r["tma"], name  # a TMA config loads through the tensor memory accelerator
    for table in ("default", "tuned"):  # prefill tiles on Hopper's MMA
        assert result[f"{table} >16384 gate_up"]["wgmma"] and result[f"{table} >16384 down"]["wgmma"]
    assert any(r["tma"] for r in result.values())  # the shipped table uses TMA loads somewhere
