"""Dense projections of small steps (decode) as one Triton GEMM that streams the weight once.

    linear(x, weight, bias=None) -> y        x [M, K], weight [N, K] (nn.Linear's layout), y [M, N]

A decode step multiplies a few rows by each attention projection: a weight-bandwidth-bound matrix-vector
product. For those shapes cuBLAS splits K over programs and adds a reduction pass (two launches; at the
Qwen3-30B-A3B shape, q/k/v [5120, 2048] took 7 us and o [2048, 4096] 6.1 us per layer on an H200 where
their 20 and 16 MB take 4.7 and 3.8 us at 4.3 TB/s: loadtest/reports/real_shape_h200.md). Here one launch
does it: one program per [BLOCK_M rows, BLOCK_N columns] tile of y, which walks all of K, so narrow column
tiles (16-32 columns) give hundreds of programs and every SM streams weight rows at once, without a split.

Numerics: float32 accumulation over K in BLOCK_K chunks, bias added in float32, one rounding to the model dtype
(as cuBLAS's epilogue). Only the summation order differs from cuBLAS's, so y equals F.linear within one
rounding of the model dtype, and float32 models use IEEE products (no TF32), as torch's default matmul. This
belongs to the fusions equal within rounding (kernels.py's second table): the model uses it where it uses those
(on GPUs unless ``--exact-kernels``). A row's result does not depend on the other rows of its step: rows are
independent in the tile product and the tile config is chosen by the step's row count bucket only.

Tile configs per bucket of M (``BUCKETS``). A JSON file written by ``loadtest/bench_dense_gemm.py --tune`` gives
them for a (device, N, K, dtype), with ``null`` for a bucket where cuBLAS was faster:
``dense_gemm_configs.json`` beside this module, or the path in $MOE_DENSE_GEMM_CONFIGS. Shapes without a table
use ``DEFAULT_CONFIG`` for up to ``DEFAULT_MAX_ROWS`` rows, and cuBLAS above.
"""
from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from . import kernels
from .fused_moe import TileConfig, device_name
from .kernels import _DT, _launch, interpreting, triton

if triton is not None:
    import triton.language as tl

    from .kernels import _round

CONFIG_ENV = "MOE_DENSE_GEMM_CONFIGS"
CONFIG_FILE = Path(__file__).with_name("dense_gemm_configs.json")

# Buckets of M (rows of a step): (name, largest M in it). Steps of more rows than the last bucket use cuBLAS.
BUCKETS: tuple[tuple[str, int], ...] = (("1-16", 16), ("17-32", 32), ("33-64", 64))
MAX_ROWS = BUCKETS[-1][1]
# Untuned shapes: narrow column tiles (many programs, each streaming whole weight rows), up to 16 rows.
DEFAULT_CONFIG = TileConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4)
DEFAULT_MAX_ROWS = 16


def bucket_of(rows: int) -> str | None:
    for name, top in BUCKETS:
        if rows <= top:
            return name
    return None


def config_path() -> Path:
    return Path(os.environ.get(CONFIG_ENV) or CONFIG_FILE)


def table_key(device: str, N: int, K: int, dtype: torch.dtype) -> dict:
    return {"device": device, "N": N, "K": K, "dtype": str(dtype).removeprefix("torch.")}


@functools.lru_cache(maxsize=None)
def _table(device: str, N: int, K: int, dtype: torch.dtype, path: str) -> dict[str, TileConfig | None]:
    """bucket -> config (None: cuBLAS) for exactly this (device, shape, dtype): the JSON file's table if it has
    one, else the defaults. A file that cannot be read leaves the defaults (with a warning)."""
    defaults = {name: DEFAULT_CONFIG if top <= DEFAULT_MAX_ROWS else None for name, top in BUCKETS}
    p = Path(path)
    if not p.is_file():
        return defaults
    key = table_key(device, N, K, dtype)
    try:
        for entry in json.loads(p.read_text()).get("tables", []):
            if {k: entry.get(k) for k in key} == key:
                buckets = entry["buckets"]
                return {name: TileConfig.from_dict(buckets[name]) if buckets.get(name) else None
                        for name, _ in BUCKETS}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        warnings.warn(f"dense_gemm: ignoring tile configs in {p} ({err!r}); using the defaults", stacklevel=2)
    return defaults


def config_for(rows: int, weight: torch.Tensor) -> TileConfig | None:
    """The tile config for a step of ``rows`` rows times ``weight`` [N, K], or None where cuBLAS serves it."""
    bucket = bucket_of(rows)
    if bucket is None:
        return None
    N, K = weight.shape
    return _table(device_name(weight.device), N, K, weight.dtype, str(config_path()))[bucket]


def write_table(path: Path, key: dict, buckets: dict[str, TileConfig | None]) -> None:
    """Add (or replace) the table for ``key`` in the JSON file at ``path``, keeping other tables."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    tables = [t for t in data.get("tables", []) if {k: t.get(k) for k in key} != key]
    entry = dict(key, buckets={name: (cfg.__dict__ if cfg else None) for name, cfg in buckets.items()})
    path.write_text(json.dumps({"tables": tables + [entry]}, indent=1) + "\n")
    _table.cache_clear()


if triton is not None:

    @triton.jit(do_not_specialize=["M"])  # the step's row count: no recompile per decode batch size
    def _dense_gemm_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, s_x, s_w, s_y,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr, DT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    ):
        """y[rows, cols] = x[rows] @ w[cols]^T (+ b[cols]) for one [BLOCK_M, BLOCK_N] tile, over all of K."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # row tiles of one column tile run side by side
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < M
        wcols = cols % N  # columns wrap instead of being masked on load (always in bounds); the store masks them
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * s_x + offs_k[None, :]  # [BM, BK]
        w_ptrs = w_ptr + wcols.to(tl.int64)[None, :] * s_w + offs_k[:, None]  # [BK, BN]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(x_ptrs, mask=rmask[:, None], other=0.0)
                w = tl.load(w_ptrs)
            else:
                kmask = offs_k < K - k * BLOCK_K
                a = tl.load(x_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=kmask[:, None], other=0.0)
            if UPCAST:  # the interpreter's dot reads bf16 as integers: products of the same values in float32
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=PREC)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + wcols).to(tl.float32)
        out = _round(acc, DT)
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * s_y + cols[None, :], out.to(y_ptr.dtype.element_ty),
                 mask=rmask[:, None] & (cols[None, :] < N))


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` may run the kernel for this pair (else it calls F.linear)."""
    return (kernels.available(x.device) and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and x.dtype in _DT and weight.dtype == x.dtype and weight.dim() == 2 and weight.stride(-1) == 1)


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: TileConfig,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) with this tile config -> [M, N] in x's dtype (into ``out``)."""
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K or (bias is not None and bias.shape != (N,)):
        raise ValueError(f"dense_gemm: shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)} do not fit together")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    bm, bn = cfg.BLOCK_M, min(cfg.BLOCK_N, max(16, kernels._pow2(N)))
    bk = min(cfg.BLOCK_K, max(16, kernels._pow2(K)))
    _launch(
        _dense_gemm_kernel, (triton.cdiv(M, bm), triton.cdiv(N, bn)),
        x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=K % bk == 0, DT=_DT[x.dtype],
        UPCAST=interpreting(), PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K]: the Triton GEMM where M is in a bucket with a config for this
    shape and device, cuBLAS (F.linear) elsewhere."""
    cfg = config_for(x.shape[0], weight) if fits(x, weight) else None
    if cfg is None:
        return F.linear(x, weight, bias)
    return gemm(x, weight, bias, cfg)
