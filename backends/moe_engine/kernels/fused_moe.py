"""Expert MLPs of a MoE layer as two Triton GEMMs that read only the hit experts' weights.

Input: the (token, slot) pairs of a step grouped by expert, as ``routing_kernels.route`` produces them: ``tok [P]`` the
token of grouped row r, ``offs [E]`` int32 row ends (rows of expert e are offs[e-1]..offs[e]), P = T*K. Output:
``y [P, H]`` in the model dtype and in the same grouped order, which ``routing_kernels.combine`` weights and sums in HF
order, unchanged.

    expert_mlp(x, gate_up, down, pos, tok, offs) -> y       (gate_up [E, 2I, H], down [E, H, I]: HF v5 layout)

In ``Experts._forward_fused`` it replaces the two grouped GEMMs (and x[tok], silu, the product):
    pos, tok, offs = routing_kernels.route(ids, E, capture)
    y = fused_moe.expert_mlp(x, self.gate_up_proj, self.down_proj, pos, tok, offs)
    return ExpertOutputs(y, ids, pos, weights)  # summed by routing_kernels.combine, or by the next norm's launch

Two launches, no host sync, CUDA-graph capturable (grid sizes from host ints only):

* ``gate_up_swiglu``: h[r] = round(round(silu(round(g))) * round(u)), with g, u = gate_up[e] @ x[tok[r]] split
  in halves (gate rows, then up rows). One program owns a [BLOCK_M rows, BLOCK_N] tile of h: it accumulates
  the gate tile and the matching up tile over the same loads of x, and applies SwiGLU in its epilogue, so the
  [P, 2I] GEMM output never reaches memory.
* ``down_proj``: y[r] = round(down[e] @ h[r]).

Rows are cut into BLOCK_M tiles per expert ON THE DEVICE: every program reads offs (E ints), computes the
tile count of each expert and their prefix sum, and finds its expert and first row; programs past the last
tile return at once. The grid is an upper bound on the tile count, cdiv(P, BLOCK_M) + min(E, P), times the
column tiles. An expert with no rows has no tile: its weights are never read (a grouped GEMM over all E
experts, as torch's, visits every group).

Numerics: the op-by-op torch path, rounding for rounding (as support.py: ``_round`` rounds float32 to the model
dtype with integer ops, which the interpreter gets right too): GEMM outputs accumulated in float32 and rounded
to the model dtype; silu as torch's CUDA kernel computes it on a bf16/fp16 tensor (upcast, x / (1 + exp(-x))
with libdevice's expf, the CUDA math library's, not Triton's approximate exp, and an IEEE division; round);
times up, rounded. Only the GEMMs' float32 summation order differs from
torch's (cuBLAS/CUTLASS order is not reproducible), so y equals torch's within a rounding of the model dtype
(tests/unit/test_fused_moe.py bounds it; bf16 elements are bit-identical but for ~0.1-1%). float32 models use
IEEE float32 products (no TF32), as torch's default matmul.

Tile configs: per bucket of P = T*K (``BUCKETS``; above 2048 pairs split at 8192 and 16384, since T*K = 4096
wants smaller row tiles than 131072, and 16384 pairs, a 2,048-token step replayed from a CUDA graph, other tiles
than 65536), separately for the two GEMMs. Defaults derive from vLLM's
tuned tables for this shape on Hopper (E=128, N=768, NVIDIA_H200 / H100_80GB_HBM3; vLLM's BLOCK_SIZE_N counts
the 2I gate_up columns, ours counts h columns, so gate_up's BLOCK_N is half of vLLM's). A JSON file written by
``loadtest/tune/bench_fused_moe.py --tune`` overrides them for a (device, E, H, I, dtype): ``fused_moe_configs.json``
beside this module, or the path in $MOE_FUSED_MOE_CONFIGS. A config's ``tma`` loads the weight tiles (and down's
rows of h) through TMA descriptors on Hopper: the same sums; on the H200 it serves the decode buckets and down
(batch-1 down 11.3 -> 9.7 us per layer), not gate_up's prefill tiles (its rows of x are gathered by token).

Decode (P = 8 for one Qwen3-30B-A3B token) is weight-bandwidth bound: 8 x (2*768*2048 + 2048*768) x 2 bytes =
75.5 MB per layer, 17.6 us at 4.3 TB/s. With BLOCK_M 16 and narrow column tiles the 8 hit experts give
8 x 768/32 = 192 gate_up programs (256 KB of weights each), all resident at once on the 132 SMs, without a tail
wave; down's TMA tiles of 128 columns give 128 programs of 192 KB, which TMA's bulk copies (three stages of
256-deep K tiles) keep streaming. That is why there is no split-K variant: it would only add parallelism, which the
column tiles already give, at the price of a float32 reduction pass before the SwiGLU. The H200 table's batch-1
tiles were chosen by timing them inside a 48-layer CUDA graph, where they beat the ones that were fastest alone
(``loadtest/tune/tile_table_variant.py`` with ``loadtest/bench/ab_real_shape.py -- --cases a``).
"""
from __future__ import annotations

import functools
import json
import os
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from . import support as kernel_support
from .support import _DT, _launch, interpreting, triton

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    from .support import _await_inputs, _grouped_tile, _round

CONFIG_ENV = "MOE_FUSED_MOE_CONFIGS"
CONFIG_FILE = Path(__file__).with_name("fused_moe_configs.json")

# Buckets of P = T*K pairs: (name, largest P in it). A step's pairs pick the first bucket that holds them.
BUCKETS: tuple[tuple[str, int | None], ...] = (
    ("1", 1), ("2-8", 8), ("9-32", 32), ("33-128", 128), ("129-512", 512),
    ("513-2048", 2048), ("2049-8192", 8192), ("8193-16384", 16384), (">16384", None),
)


@dataclass(frozen=True)
class TileConfig:
    """One GEMM's launch: tile sizes (BLOCK_N counts output columns: h columns for gate_up, y for down),
    GROUP_M row tiles per program group (L2 reuse of weight tiles), warps, software-pipeline stages, and ``tma``:
    1 = weight tiles (and down's rows of h, which are contiguous) loaded through TMA tensor descriptors (Hopper
    and later; where the shape does not allow it, e.g. N not a multiple of BLOCK_N, the pointer loads serve)."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int = 1
    num_warps: int = 4
    num_stages: int = 3
    tma: int = 0

    @classmethod
    def from_dict(cls, d: dict) -> "TileConfig":
        return cls(**{k: int(v) for k, v in d.items() if k in cls.__dataclass_fields__})


def _tc(m: int, n: int, k: int, g: int, w: int, s: int) -> TileConfig:
    return TileConfig(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=g, num_warps=w, num_stages=s)


# bucket -> (gate_up config, down config). From vLLM E=128,N=768,device_name=NVIDIA_H200.json (keys are tokens
# M there; with top-8, P = 8M): M=1 -> "2-8", M=2..4 -> "9-32", M=8..16 -> "33-128", M=24..64 -> "129-512",
# M=96..256 -> "513-2048", M=512 -> "2049-8192", M>=1024 -> "8193-16384" and ">16384".
DEFAULT_CONFIGS: dict[str, tuple[TileConfig, TileConfig]] = {
    "1": (_tc(16, 32, 64, 1, 4, 5), _tc(16, 64, 64, 1, 4, 5)),
    "2-8": (_tc(16, 32, 64, 1, 4, 5), _tc(16, 64, 64, 1, 4, 5)),
    "9-32": (_tc(16, 32, 128, 1, 4, 3), _tc(16, 64, 128, 1, 4, 3)),
    "33-128": (_tc(16, 32, 128, 1, 4, 3), _tc(16, 64, 128, 1, 4, 3)),
    "129-512": (_tc(16, 64, 128, 1, 4, 3), _tc(16, 128, 128, 1, 4, 3)),
    "513-2048": (_tc(32, 128, 128, 16, 4, 2), _tc(32, 256, 128, 16, 4, 2)),
    "2049-8192": (_tc(64, 64, 64, 1, 4, 3), _tc(64, 128, 64, 1, 4, 3)),
    "8193-16384": (_tc(128, 128, 64, 16, 8, 3), _tc(128, 256, 64, 16, 8, 4)),
    ">16384": (_tc(128, 128, 64, 16, 8, 3), _tc(128, 256, 64, 16, 8, 4)),
}


# --enable-deterministic-inference: one (gate_up, down) config for every step size, so that a row's K loop, tile and
# tensor-core instruction are the same whatever the other rows of its expert (a "deterministic" bucket in the JSON
# file overrides it: ``loadtest/tune/tile_table_variant.py --bucket deterministic``). Row tiles of 64, the Hopper
# instruction's height: a decode step's few rows per expert cost no more weight reads than in 16-row tiles. The
# columns are the batch-1 table's (gate_up 32 wide: 192 programs for one Qwen3 token's 8 experts; down 128 wide
# through TMA); a large prefill step gets narrower tiles than its bucket's 128 x 128.
DETERMINISTIC = "deterministic"
DETERMINISTIC_CONFIGS = (_tc(64, 32, 64, 8, 4, 4), replace(_tc(64, 128, 64, 8, 4, 3), tma=1))


def bucket_of(pairs: int) -> str:
    for name, top in BUCKETS:
        if top is None or pairs <= top:
            return name
    raise AssertionError("unreachable")


def device_name(device: torch.device | str) -> str:
    return _device_name(torch.device(device))


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device)


def config_path() -> Path:
    return Path(os.environ.get(CONFIG_ENV) or CONFIG_FILE)


def table_key(device: str, E: int, H: int, I: int, dtype: torch.dtype) -> dict:
    return {"device": device, "E": E, "H": H, "I": I, "dtype": str(dtype).removeprefix("torch.")}


@functools.lru_cache(maxsize=None)
def _table(device: str, E: int, H: int, I: int, dtype: torch.dtype, path: str) -> dict[str, tuple[TileConfig, ...]]:
    """The defaults, with the buckets of the JSON file's table for exactly this (device, shape, dtype) over them
    (a ">8192" bucket, written before that range was split, serves both of its halves; an unknown bucket name is
    warned about). A file that cannot be read leaves the defaults (with a warning): a bad table must not stop a
    server."""
    table = dict(DEFAULT_CONFIGS)
    table[DETERMINISTIC] = DETERMINISTIC_CONFIGS
    p = Path(path)
    if p.is_file():
        key = table_key(device, E, H, I, dtype)
        try:
            for entry in json.loads(p.read_text()).get("tables", []):
                if {k: entry.get(k) for k in key} == key:
                    buckets = entry.get("buckets", {})
                    for name, pair in buckets.items():
                        configs = (TileConfig.from_dict(pair["gate_up"]), TileConfig.from_dict(pair["down"]))
                        if name in table:
                            table[name] = configs
                        else:
                            warnings.warn(f"fused_moe: bucket {name!r} in {p} is not one of {list(table)}; ignored",
                                          stacklevel=2)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
            warnings.warn(f"fused_moe: ignoring tile configs in {p} ({err!r}); using the defaults", stacklevel=2)
            return dict(DEFAULT_CONFIGS)
    return table


def tile_configs(
    pairs: int, device: torch.device | str, E: int, H: int, I: int, dtype: torch.dtype
) -> tuple[TileConfig, TileConfig]:
    """(gate_up, down) configs for a step of ``pairs`` (token, slot) pairs."""
    return _table(device_name(device), E, H, I, dtype, str(config_path()))[bucket_of(pairs)]


def deterministic_configs(device: torch.device | str, E: int, H: int, I: int, dtype: torch.dtype
                          ) -> tuple[TileConfig, TileConfig]:
    """(gate_up, down) configs of every step under deterministic inference."""
    return _table(device_name(device), E, H, I, dtype, str(config_path()))[DETERMINISTIC]


def write_table(path: Path, key: dict, buckets: dict[str, tuple[TileConfig, TileConfig]]) -> None:
    """Add (or replace) the table for ``key`` in the JSON file at ``path``, keeping other tables."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    tables = [t for t in data.get("tables", []) if {k: t.get(k) for k in key} != key]
    entry = dict(key, buckets={name: {"gate_up": asdict(g), "down": asdict(d)} for name, (g, d) in buckets.items()})
    path.write_text(json.dumps({"tables": tables + [entry]}, indent=1) + "\n")
    _table.cache_clear()


if triton is not None:

    @triton.jit
    def _expert_tile(pid_m, offs_ptr, E, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr):
        """Row tile pid_m of the expert-grouped rows -> (expert, first row, end row of the expert). Each expert's
        rows are cut into cdiv(count, BLOCK_M) tiles, experts in order; expert >= E: past the last tile."""
        e = tl.arange(0, BLOCK_E)
        ends = tl.load(offs_ptr + e, mask=e < E, other=0)
        starts = tl.load(offs_ptr + e - 1, mask=(e > 0) & (e < E), other=0)
        tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
        expert = tl.sum((tl.cumsum(tiles, 0) <= pid_m).to(tl.int32), 0)  # tiles of experts 0..e <= pid_m
        first_tile = tl.sum(tl.where(e < expert, tiles, 0), 0)
        valid = expert < E
        start = tl.load(offs_ptr + expert - 1, mask=valid & (expert > 0), other=0)
        end = tl.load(offs_ptr + expert, mask=valid, other=0)
        return expert, start + (pid_m - first_tile) * BLOCK_M, end

    @triton.jit(do_not_specialize=["num_pid_m"])  # varies with the step size: no recompile per step size
    def _moe_gemm_kernel(
        a_ptr, w_ptr, out_ptr, tok_ptr, offs_ptr, a_desc, w_desc,
        E, N, K, num_pid_m,
        s_a, s_we, s_wn, s_wk, s_out,
        GATE_UP: tl.constexpr,  # a = x gathered by tok; w rows [0, N) gate, [N, 2N) up; SwiGLU epilogue
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr, DT: tl.constexpr,
        UPCAST: tl.constexpr, PRECISE: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
        TMA: tl.constexpr,  # w_desc: w as [E * (N or 2N), K] rows, [BLOCK_N, BLOCK_K] boxes (N % BLOCK_N == 0);
        # down: a_desc too, h as [P, K] rows, [BLOCK_M, BLOCK_K] boxes (the rows past the expert's end that a box
        # brings belong to the next expert or are zeros past P: their outputs are never stored)
        ROWWISE: tl.constexpr,  # deterministic inference under the interpreter: each row's products summed by
        # themselves (numpy's matmul, the interpreter's dot, sums a row by its place in the tile)
    ):
        """out[r, n] for the rows r of one expert tile and BLOCK_N columns n: down_proj (out = y, a = h rows) or
        gate_up with SwiGLU (out = h, a = x[tok[r]]). w: [E, N or 2N, K] with strides (s_we, s_wn, s_wk).
        TMA or pointer loads feed the same dots in the same order: the same sums either way."""
        _await_inputs(PDL)  # (the weights a program reads depend on offs, an earlier kernel's output)
        pid = tl.program_id(0)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = _grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)

        expert, row0, row_end = _expert_tile(pid_m, offs_ptr, E, BLOCK_E, BLOCK_M)
        if expert >= E:
            return
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        rows64 = rows.to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        # columns wrap instead of being masked on load (always in bounds); the store masks them
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        if GATE_UP:
            toks = tl.load(tok_ptr + rows64, mask=rmask, other=0)
            a_ptrs = a_ptr + toks[:, None] * s_a + offs_k[None, :]
        else:
            a_ptrs = a_ptr + rows64[:, None] * s_a + offs_k[None, :]
        w_ptrs = w_ptr + expert.to(tl.int64) * s_we + offs_n[None, :] * s_wn + offs_k[:, None] * s_wk  # [BK, BN]
        if GATE_UP:  # TMA: the tile's first weight row (gate rows; the up rows are N further)
            w_row = expert * 2 * N + pid_n * BLOCK_N
        else:
            w_row = expert * N + pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if GATE_UP:
            u_ptrs = w_ptrs + N * s_wn
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if not EVEN_K:
                kmask = offs_k < K - k * BLOCK_K
            if TMA and not GATE_UP:
                a = a_desc.load([row0, k * BLOCK_K])  # [BM, BK]; zeros past K
            elif EVEN_K:
                a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            if TMA:
                w = tl.trans(w_desc.load([w_row, k * BLOCK_K]))  # [BN, BK] box -> [BK, BN]; zeros past K
            elif EVEN_K:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=kmask[:, None], other=0.0)
            if UPCAST:  # the interpreter's dot reads bf16 as integers: products of the same values in float32
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            if ROWWISE:
                acc += tl.sum(a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
            else:
                acc = tl.dot(a, w, acc, input_precision=PREC)
            if GATE_UP:
                if TMA:
                    wu = tl.trans(w_desc.load([w_row + N, k * BLOCK_K]))
                elif EVEN_K:
                    wu = tl.load(u_ptrs)
                else:
                    wu = tl.load(u_ptrs, mask=kmask[:, None], other=0.0)
                if UPCAST:
                    wu = wu.to(tl.float32)
                if ROWWISE:
                    acc_up += tl.sum(a.to(tl.float32)[:, :, None] * wu.to(tl.float32)[None, :, :], axis=1)
                else:
                    acc_up = tl.dot(a, wu, acc_up, input_precision=PREC)
                u_ptrs += BLOCK_K * s_wk
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * s_wk
        out = _round(acc, DT)
        if GATE_UP:
            # torch: F.silu on the rounded gate (float32 x / (1 + exp(-x)), rounded), times the rounded up
            if PRECISE:
                denom = 1.0 + libdevice.exp(-out)  # expf, as torch's kernel; tl.exp is an approximation
            else:
                denom = 1.0 + tl.exp(-out)
            out = _round(_round(tl.math.div_rn(out, denom), DT) * _round(acc_up, DT), DT)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + rows64[:, None] * s_out + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & (cols[None, :] < N))


# configs that failed to compile for lack of shared memory/registers -> the smaller config that replaced them
_SHRUNK: dict[tuple, TileConfig] = {}


@functools.lru_cache(maxsize=None)
def _fit(cfg: TileConfig, N: int, K: int) -> TileConfig:
    """Tiles no wider than the (power-of-two-rounded) matrix: small models need no special table."""
    cap = lambda b, n: min(b, max(16, kernel_support._pow2(n)))  # noqa: E731
    return replace(cfg, BLOCK_N=cap(cfg.BLOCK_N, N), BLOCK_K=cap(cfg.BLOCK_K, K))


def _shrink(cfg: TileConfig) -> TileConfig | None:
    if cfg.num_stages > 2:
        return replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.BLOCK_K > 32:
        return replace(cfg, BLOCK_K=cfg.BLOCK_K // 2)
    return None


def _tma_fits(a: torch.Tensor, w: torch.Tensor, N: int, K: int, cfg: TileConfig) -> bool:
    """Whether ``cfg.tma`` can be honoured: Hopper or later (or the interpreter), a 16-bit dtype, whole column tiles
    (no wrapped columns), and rows whose strides TMA accepts (contiguous, 16-byte aligned)."""
    if not cfg.tma or a.dtype not in (torch.bfloat16, torch.float16) or N % cfg.BLOCK_N:
        return False
    if not interpreting() and (a.device.type != "cuda" or torch.cuda.get_device_capability(a.device)[0] < 9):
        return False
    aligned = lambda t: t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and all(  # noqa: E731
        s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
    return w.is_contiguous() and aligned(w) and aligned(a) and K * a.element_size() % 16 == 0


def _descriptors(a, w, K: int, cfg: TileConfig, gate_up: bool):
    """(a_desc, w_desc) for the TMA loads: w as [E * rows, K], and down's h as [P, K] (gate_up gathers its rows of x
    by token: pointer loads)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    w_desc = TensorDescriptor.from_tensor(w.view(-1, K), [cfg.BLOCK_N, cfg.BLOCK_K])
    a_desc = None if gate_up else TensorDescriptor(a, list(a.shape), list(a.stride()), [cfg.BLOCK_M, cfg.BLOCK_K])
    return a_desc, w_desc


def _gemm(a, w, out, tok, offs, N: int, K: int, cfg: TileConfig, gate_up: bool, rowwise: bool = False) -> None:
    P, E = out.shape[0], w.shape[0]
    cfg = _fit(cfg, N, K)
    key = (gate_up, cfg, a.dtype, N, K)
    cfg = _SHRUNK.get(key, cfg)
    num_pid_m = triton.cdiv(P, cfg.BLOCK_M) + min(E, P)  # >= the tiles of any split of P rows over E experts
    while True:
        grid = (num_pid_m * triton.cdiv(N, cfg.BLOCK_N),)
        tma = _tma_fits(a, w, N, K, cfg)
        a_desc, w_desc = _descriptors(a, w, K, cfg, gate_up) if tma else (None, None)
        try:
            _launch(
                _moe_gemm_kernel, grid, a, w, out, tok, offs, a_desc, w_desc, E, N, K, num_pid_m,
                a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
                GATE_UP=gate_up, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
                BLOCK_E=kernel_support._pow2(E), EVEN_K=K % cfg.BLOCK_K == 0, DT=_DT[a.dtype],
                UPCAST=interpreting(), PRECISE=not interpreting(),
                PREC="ieee" if a.dtype == torch.float32 else "tf32", PDL=kernel_support.pdl(a.device), TMA=tma,
                ROWWISE=rowwise, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )
            return
        except triton.runtime.errors.OutOfResources as err:
            smaller = _shrink(cfg)
            if smaller is None:
                raise
            warnings.warn(f"fused_moe: {cfg} does not fit on this GPU ({err}); using {smaller}", stacklevel=3)
            _SHRUNK[key] = cfg = smaller


def gate_up_swiglu(x: torch.Tensor, gate_up: torch.Tensor, tok: torch.Tensor, offs: torch.Tensor, cfg: TileConfig,
                   out: torch.Tensor | None = None, rowwise: bool = False) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H], tok [P] long, offs [E] int32 -> h [P, I] (into ``out`` when given):
    h[r] = silu(gate) * up of expert e's projection of x[tok[r]], every step rounded as torch's."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    I, H = gate_up.shape[1] // 2, gate_up.shape[2]
    h = out if out is not None else torch.empty(tok.shape[0], I, dtype=x.dtype, device=x.device)
    if tok.shape[0]:
        _gemm(x, gate_up, h, tok, offs, I, H, cfg, gate_up=True, rowwise=rowwise)
    return h


def down_proj(h: torch.Tensor, down: torch.Tensor, offs: torch.Tensor, cfg: TileConfig,
              out: torch.Tensor | None = None, rowwise: bool = False) -> torch.Tensor:
    """h [P, I] grouped rows, down [E, H, I], offs [E] int32 -> y [P, H]: y[r] = down[e] @ h[r], rounded."""
    if h.stride(-1) != 1:
        h = h.contiguous()
    H, I = down.shape[1], down.shape[2]
    y = out if out is not None else torch.empty(h.shape[0], H, dtype=h.dtype, device=h.device)
    if h.shape[0]:
        _gemm(h, down, y, offs, offs, H, I, cfg, gate_up=False, rowwise=rowwise)  # tok unused: rows grouped already
    return y


def expert_mlp(
    x: torch.Tensor,  # [T, H] model dtype
    gate_up: torch.Tensor,  # [E, 2I, H] gate rows, then up rows
    down: torch.Tensor,  # [E, H, I]
    pos: torch.Tensor,  # [T, K] grouped row of each (token, slot): only its shape is used (P = T*K)
    tok: torch.Tensor,  # [T*K] long: token of each grouped row
    offs: torch.Tensor,  # [E] int32: end row of each expert's group
    configs: tuple[TileConfig, TileConfig] | None = None,  # (gate_up, down); default: the table's, by T*K
    deterministic: bool = False,  # deterministic inference: the table's one config for every step size
) -> torch.Tensor:  # [T*K, H] model dtype, grouped order (routing_kernels.combine's input)
    """The routed experts' SwiGLU MLPs on expert-grouped rows, reading only the experts that have rows."""
    E, I2, H = gate_up.shape
    P = pos.numel()
    if x.dim() != 2 or x.shape[1] != H or down.shape != (E, H, I2 // 2) or tok.shape != (P,) or offs.shape != (E,):
        raise ValueError(
            f"expert_mlp: shapes x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}, "
            f"pos {tuple(pos.shape)}, tok {tuple(tok.shape)}, offs {tuple(offs.shape)} do not fit together"
        )
    if offs.dtype != torch.int32:
        raise ValueError(f"expert_mlp: offs must be int32, got {offs.dtype}")
    if x.dtype not in _DT or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"expert_mlp: x, gate_up, down must share one of {list(_DT)}")
    if configs is None and deterministic:
        configs = deterministic_configs(x.device, E, H, I2 // 2, x.dtype)
    g_cfg, d_cfg = configs or tile_configs(P, x.device, E, H, I2 // 2, x.dtype)
    rowwise = deterministic and interpreting()
    h = gate_up_swiglu(x, gate_up, tok, offs, g_cfg, rowwise=rowwise)
    return down_proj(h, down, offs, d_cfg, rowwise=rowwise)
