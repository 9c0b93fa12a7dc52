"""Multi-head latent attention (DeepSeek-V2/V3, Moonlight, Kimi-K2, GLM-4.7-Flash) decode over the paged latent
cache: the absorbed decode kernel, its split-K merge, and the torch reference.

Cache (per layer, core/kv_cache.py): ``latent [num_blocks, block_size, 1, R]`` (the normalised compressed kv, R =
kv_lora_rank: 512 in V2/V3) and ``rope [num_blocks, block_size, 1, P]`` (the rotated key all heads share, P =
qk_rope_head_dim: 64): R + P = 576 values per token and layer, never an expanded key or value. In the model dtype, or
with ``--kv-cache-dtype fp8`` float8 e4m3 (kv_fp8.py) with a float32 scale for the latent and one for the rope key
(LayerKV's k_scale / v_scale): ``mla_rope_store`` quantises, ``mla_decode`` dequantises each tile on load (KV_FP8).

Absorbed decode (DeepSeek's own inference; vLLM's TRITON_MLA and FlashMLA, SGLang's Triton MLA): kv_b_proj's
weight is, per head, [nope + v, R]: W_UK its first nope rows, W_UV the other v. The expanded key of head h at
position j is (W_UK[h] latent_j, rope_j) and its value W_UV[h] latent_j, so a query's score is

    q_nope . (W_UK latent_j) + q_rope . rope_j  =  (W_UK^T q_nope) . latent_j + q_rope . rope_j

and its output W_UV (sum_j p_j latent_j). The layer (layers/mla.py) folds W_UK into the query beforehand
(``q_lat = q_nope @ W_UK``, [Hq, R] per token: one batched GEMM) and W_UV into the output afterwards; between them
attention is multi-query attention with one kv head: keys of R + P dims (the latent and the rope key), values of R
dims (the latent itself). A program takes BLOCK_H query heads of one decode token and walks its keys in tiles of
TILE_N, each tile's latent loaded ONCE and used by both dots (scores and the weighted sum), with an online softmax
in float32. Long contexts are split over the grid's third dimension (flash-decoding, as paged_attention.py's split
kernel): ``num_splits`` ranges of whole tiles computed at run time from each token's length, partial (max, sum,
unnormalised output) per split, merged by a second launch; one split writes the output directly.

Numerics: the same attention as the op-by-op path (layers/mla.py expands the latents with kv_b_proj and runs SDPA),
summed in another order and with the query rounded to the model dtype after the absorption instead of the keys
after the expansion: equal within rounding (float32: ~1e-6 relative), not bit for bit.

CUDA-graph capturable: no host sync, grids from host ints (tokens, head blocks, splits). A token whose seq_len is 1
at the null block (graph padding) reads one key. Any query can be a "decode token": a prefill graph's step passes
every token of its prompt chunks as one, with its sequence's table row and its position + 1 keys (layers/mla.py). Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1`` (tests).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kv_fp8
from .paged_attention import (_check_cache_dtype, _check_triton, _pow2, _scale_args, choose_num_splits, interpreting,
                              triton)
from .support import _DT, pdl
from .support import _launch as _launch_exact

if triton is not None:
    import triton.language as tl

    from .paged_attention import _dot, _kv_scales
    from .support import _await_inputs, _round

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MLAKernelConfig:
    """The absorbed decode kernel's launch: query heads per program (at least 16, a dot's smallest M), keys per
    tile, warps, pipeline stages. Defaults as vLLM's Triton MLA decode on Hopper (16 heads, 32-key tiles, 4 warps,
    2 stages: a [32, 512] bf16 latent tile is 32 KiB per stage); float32 halves the key tile."""

    block_h: int = 16
    tile_n: int = 32
    num_warps: int = 4
    num_stages: int = 2


DEFAULT_CONFIG = MLAKernelConfig()


def head_blocks(num_heads: int, config: MLAKernelConfig = DEFAULT_CONFIG) -> int:
    """Programs per decode token and split: the query heads in blocks of ``config.block_h`` (cuda_graphs.py's split
    rule counts these as the attention's "kv heads")."""
    return -(-num_heads // max(config.block_h, 16))


def num_splits_for(num_tokens: int, num_heads: int, max_seq_len: int, config: MLAKernelConfig = DEFAULT_CONFIG) -> int:
    """paged_attention.py's split rule with (token, head block) programs: split while they are fewer than a wave."""
    return choose_num_splits(num_tokens, head_blocks(num_heads, config), max_seq_len)


if triton is not None:

    @triton.jit
    def _mla_tiles(
        ql, qr, m_i, l_i, acc, key_lo, key_hi, table_ptr, lat_ptr, rope_ptr, s_lb, s_lo, s_rb, s_ro, scale_log2,
        lat_scale, rope_scale,
        R: tl.constexpr, P: tl.constexpr, R_PAD: tl.constexpr, P_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
        KV_FP8: tl.constexpr, DT: tl.constexpr,
    ):
        """Online softmax of the rows of (ql [BLOCK_H, R_PAD], qr [BLOCK_H, P_PAD]) over keys [key_lo, key_hi).
        MASKED: keys past key_hi (the last, partial tile) are neither loaded nor attended; else every tile is whole
        and loads without masks (where R and P are powers of two). KV_FP8: the caches hold float8 e4m3; each tile
        is dequantised right after its load (kv_fp8.from_fp8 with the layer's latent / rope scales), so both dots
        see the values kv_fp8.dequantize gives the op-by-op path."""
        offs_n = tl.arange(0, TILE_N)
        r = tl.arange(0, R_PAD)
        p = tl.arange(0, P_PAD)
        for start in range(key_lo, key_hi, TILE_N):
            kpos = start + offs_n
            if MASKED:
                kvalid = kpos < key_hi
                blk = tl.load(table_ptr + kpos // BLOCK_SIZE, mask=kvalid, other=0).to(tl.int64)
            else:
                blk = tl.load(table_ptr + kpos // BLOCK_SIZE).to(tl.int64)
            off = kpos % BLOCK_SIZE
            lat_ptrs = lat_ptr + blk[:, None] * s_lb + off[:, None] * s_lo + r[None, :]
            rope_ptrs = rope_ptr + blk[:, None] * s_rb + off[:, None] * s_ro + p[None, :]
            if MASKED:
                lat = tl.load(lat_ptrs, mask=kvalid[:, None] & (r[None, :] < R), other=0.0)  # [TILE_N, R_PAD]
                rope = tl.load(rope_ptrs, mask=kvalid[:, None] & (p[None, :] < P), other=0.0)  # [TILE_N, P_PAD]
            else:
                if R == R_PAD:
                    lat = tl.load(lat_ptrs)
                else:
                    lat = tl.load(lat_ptrs, mask=r[None, :] < R, other=0.0)
                if P == P_PAD:
                    rope = tl.load(rope_ptrs)
                else:
                    rope = tl.load(rope_ptrs, mask=p[None, :] < P, other=0.0)
            if KV_FP8:
                lat = kv_fp8.from_fp8(lat, lat_scale, DT, ql.dtype)
                rope = kv_fp8.from_fp8(rope, rope_scale, DT, qr.dtype)
            # the latent tile serves both dots: as keys (transposed) and as values
            s = _dot(ql, tl.trans(lat), IEEE, INTERPRET) + _dot(qr, tl.trans(rope), IEEE, INTERPRET)
            if MASKED:
                s = tl.where(kvalid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            pr = tl.exp2(s * scale_log2 - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            acc = acc * alpha[:, None] + _dot(pr.to(lat.dtype), lat, IEEE, INTERPRET)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit(do_not_specialize=["s_bt"])
    def _mla_decode_kernel(
        out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,  # DIRECT: out; else the partials [N, Hq, S(, R_PAD)] float32
        ql_ptr, qr_ptr, lat_ptr, rope_ptr, tables_ptr, seq_lens_ptr, lat_scale_ptr, rope_scale_ptr, scale_log2,
        s_qlt, s_qlh, s_qrt, s_qrh, s_ot, s_oh, s_bt, s_lb, s_lo, s_rb, s_ro,
        Hq: tl.constexpr, BLOCK_H: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        R: tl.constexpr, P: tl.constexpr, R_PAD: tl.constexpr, P_PAD: tl.constexpr,
        DIRECT: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
        KV_FP8: tl.constexpr, DT: tl.constexpr,
    ):
        """Program (token, head block, split): the heads' one query over the split's share of the token's keys
        (positions < seq_lens[token], read through block table row ``token``; whole tiles, split evenly at run
        time; the split count is the grid's third dimension). Empty splits write (-inf, 0, 0)."""
        _await_inputs(PDL)
        tok = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        split = tl.program_id(2)
        num_splits = tl.num_programs(2)
        seq_len = tl.load(seq_lens_ptr + tok)
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < Hq
        r = tl.arange(0, R_PAD)
        p = tl.arange(0, P_PAD)
        ql = tl.load(ql_ptr + tok * s_qlt + h[:, None] * s_qlh + r[None, :], mask=hm[:, None] & (r[None, :] < R),
                     other=0.0)
        qr = tl.load(qr_ptr + tok * s_qrt + h[:, None] * s_qrh + p[None, :], mask=hm[:, None] & (p[None, :] < P),
                     other=0.0)
        tiles_per_split = tl.cdiv(tl.cdiv(seq_len, TILE_N), num_splits)
        key_lo = split * tiles_per_split * TILE_N
        key_hi = tl.minimum(key_lo + tiles_per_split * TILE_N, seq_len)
        full_hi = key_lo + tl.maximum(key_hi - key_lo, 0) // TILE_N * TILE_N
        table = tables_ptr + tok * s_bt
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, R_PAD], dtype=tl.float32)
        lat_scale, rope_scale = _kv_scales(lat_scale_ptr, rope_scale_ptr, KV_FP8)
        m_i, l_i, acc = _mla_tiles(ql, qr, m_i, l_i, acc, key_lo, full_hi, table, lat_ptr, rope_ptr,
                                   s_lb, s_lo, s_rb, s_ro, scale_log2, lat_scale, rope_scale, R, P, R_PAD, P_PAD,
                                   BLOCK_SIZE, TILE_N, False, IEEE, INTERPRET, KV_FP8, DT)
        m_i, l_i, acc = _mla_tiles(ql, qr, m_i, l_i, acc, full_hi, key_hi, table, lat_ptr, rope_ptr,
                                   s_lb, s_lo, s_rb, s_ro, scale_log2, lat_scale, rope_scale, R, P, R_PAD, P_PAD,
                                   BLOCK_SIZE, TILE_N, True, IEEE, INTERPRET, KV_FP8, DT)
        if DIRECT:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + tok * s_ot + h[:, None] * s_oh + r[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=hm[:, None] & (r[None, :] < R))
        else:
            part = (tok * Hq + h) * num_splits + split  # [BLOCK_H]
            tl.store(part_m_ptr + part, m_i, mask=hm)
            tl.store(part_l_ptr + part, l_i, mask=hm)
            tl.store(part_acc_ptr + part[:, None] * R_PAD + r[None, :], acc, mask=hm[:, None])

    @triton.jit(do_not_specialize=["num_splits"])
    def _mla_merge_kernel(
        out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, s_ot, s_oh, num_splits,
        Hq: tl.constexpr, SPLITS_PAD: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr, PDL: tl.constexpr,
    ):
        """Program (token, head): out = sum_s exp2(m_s - M) acc_s / sum_s exp2(m_s - M) l_s."""
        _await_inputs(PDL)
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        s = tl.arange(0, SPLITS_PAD)
        s_ok = s < num_splits
        part = (tok * Hq + head) * num_splits + s
        pm = tl.load(part_m_ptr + part, mask=s_ok, other=float("-inf"))
        pl = tl.load(part_l_ptr + part, mask=s_ok, other=0.0)
        big = tl.max(pm, axis=0)
        big = tl.where(big == float("-inf"), 0.0, big)
        w = tl.where(s_ok, tl.exp2(pm - big), 0.0)
        total = tl.sum(w * pl, axis=0)
        r = tl.arange(0, R_PAD)
        pacc = tl.load(part_acc_ptr + part[:, None] * R_PAD + r[None, :], mask=s_ok[:, None], other=0.0)
        o = tl.sum(pacc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + tok * s_ot + head * s_oh + r, o.to(out_ptr.dtype.element_ty), mask=r < R)


ROPE_STYLES = {"half": 0, "interleave": 1, "complex": 2}

if triton is not None:

    @triton.jit
    def _rotated(x_ptr, cos_ptr, sin_ptr, t, rows, row_ok, s_row, s_ct, s_st,
                 P: tl.constexpr, P_PAD: tl.constexpr, STYLE: tl.constexpr, DT: tl.constexpr):
        """[rows, P_PAD] rotated rope vectors of token t (x_ptr + row * s_row + d), rounded as layers/rotary.py's
        apply_rotary rounds them: half (x cos + rotate_half(x) sin), interleave (DeepSeek-V3: even/odd pairs in,
        de-interleaved halves out), complex (DeepSeek-V2: consecutive pairs times freqs_cis in float32; cos_ptr:
        its [P/2, 2] real view)."""
        half: tl.constexpr = P // 2
        d = tl.arange(0, P_PAD)[None, :]
        m = row_ok[:, None] & (d < P)
        base = x_ptr + rows[:, None] * s_row
        if STYLE == 0:
            partner = tl.where(d < half, d + half, d - half)
            x = tl.load(base + d, mask=m, other=0.0).to(tl.float32)
            xp = tl.load(base + partner, mask=m, other=0.0).to(tl.float32)
            c = tl.load(cos_ptr + t * s_ct + d, mask=d < P, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + t * s_st + d, mask=d < P, other=0.0).to(tl.float32)
            y = _round(_round(x * c, DT) + _round(tl.where(d < half, -xp, xp) * s, DT), DT)
        elif STYLE == 1:
            j = d % half
            first = d < half
            a = tl.load(base + 2 * j + tl.where(first, 0, 1), mask=m, other=0.0).to(tl.float32)
            b = tl.load(base + 2 * j + tl.where(first, 1, 0), mask=m, other=0.0).to(tl.float32)
            c = tl.load(cos_ptr + t * s_ct + j, mask=d < P, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + t * s_st + j, mask=d < P, other=0.0).to(tl.float32)
            bs = _round(b * s, DT)
            y = _round(_round(a * c, DT) + tl.where(first, -bs, bs), DT)
        else:
            j = d // 2
            even = d % 2 == 0
            xr = tl.load(base + 2 * j, mask=m, other=0.0).to(tl.float32)
            xi = tl.load(base + 2 * j + 1, mask=m, other=0.0).to(tl.float32)
            fr = tl.load(cos_ptr + t * s_ct + 2 * j, mask=d < P, other=0.0)
            fi = tl.load(cos_ptr + t * s_ct + 2 * j + 1, mask=d < P, other=0.0)
            y = _round(tl.where(even, xr * fr - xi * fi, xr * fi + xi * fr), DT)
        return y, d, m

    @triton.jit
    def _mla_rope_kernel(
        q_ptr, kr_ptr, lat_ptr, cos_ptr, sin_ptr, lc_ptr, rc_ptr, slot_ptr, lat_scale_ptr, rope_scale_ptr,
        s_qt, s_qh, s_kt, s_lt, s_ct, s_st, s_lcs, s_rcs, Hq,
        NOPE: tl.constexpr, P: tl.constexpr, P_PAD: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
        STYLE: tl.constexpr, BLOCK_H: tl.constexpr, DT: tl.constexpr, STORE: tl.constexpr, PDL: tl.constexpr,
        KV_FP8: tl.constexpr,
    ):
        """Program (token, head block): the heads' rope dims of q rotated in place; head block 0 also rotates the
        token's shared rope key in place and (STORE) writes it and the token's latent into the caches at its slot
        (slots < 0: padding, not written); KV_FP8: quantised with the layer's latent / rope scales (kv_fp8.py) from
        the model-dtype values (the rotated key as rounded in q's dtype, as kv_fp8.quantize of apply_rotary's)."""
        _await_inputs(PDL)
        t = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < Hq
        qrow = q_ptr + t * s_qt + NOPE
        y, d, m = _rotated(qrow, cos_ptr, sin_ptr, t, h, hm, s_qh, s_ct, s_st, P, P_PAD, STYLE, DT)
        # every program read its heads before writing them (no other program touches them)
        tl.store(qrow + h[:, None] * s_qh + d, y.to(q_ptr.dtype.element_ty), mask=m)
        if hb == 0:
            one = tl.arange(0, 2)
            krow = kr_ptr + t * s_kt
            ky, kd, km = _rotated(krow, cos_ptr, sin_ptr, t, one * 0, one < 1, 0, s_ct, s_st, P, P_PAD, STYLE, DT)
            k_out = ky.to(kr_ptr.dtype.element_ty)
            tl.store(krow + one[:, None] * 0 + kd, k_out, mask=km)
            if STORE:
                slot = tl.load(slot_ptr + t).to(tl.int64)
                if slot >= 0:
                    r = tl.arange(0, R_PAD)
                    lat = tl.load(lat_ptr + t * s_lt + r, mask=r < R, other=0.0)
                    k_cached = k_out
                    if KV_FP8:
                        k_cached = kv_fp8.to_fp8(k_out, tl.load(rope_scale_ptr))
                        lat = kv_fp8.to_fp8(lat, tl.load(lat_scale_ptr))
                    tl.store(rc_ptr + slot * s_rcs + one[:, None] * 0 + kd, k_cached.to(rc_ptr.dtype.element_ty),
                             mask=km)
                    tl.store(lc_ptr + slot * s_lcs + r, lat.to(lc_ptr.dtype.element_ty), mask=r < R)


def mla_rope_store(
    q: torch.Tensor,  # [T, Hq, nope + P]: the rope dims of each head rotated in place
    k_rope: torch.Tensor,  # [T, P] (unit last stride): rotated in place
    cos: torch.Tensor,  # [T, P] model dtype (half / interleave); complex style: view_as_real(freqs_cis) [T, P/2, 2]
    sin: torch.Tensor | None,
    style: str,
    nope: int,
    latent: torch.Tensor | None = None,  # [T, R]: with the caches, written with the rotated key at each slot
    latent_cache: torch.Tensor | None = None,  # [num_blocks, block_size, 1, R]
    rope_cache: torch.Tensor | None = None,  # [num_blocks, block_size, 1, P]
    slots: torch.Tensor | None = None,  # [T] flat slots, < 0: not written
    block_h: int = 16,
    latent_scale: torch.Tensor | None = None,  # float32 [1] each: an FP8 cache's scales (LayerKV's k / v_scale)
    rope_scale: torch.Tensor | None = None,
) -> None:
    """MLA's rotary of q's and k's rope parts and the KV-cache write in one launch: the values layers/rotary.py's
    apply_rotary and store_kv give (half and interleave styles to the bit; the complex style's float32 product in
    its own order, within rounding), written in place; into an FP8 cache (with the scales) as kv_fp8.quantize."""
    T, Hq, D = q.shape
    P = k_rope.shape[-1]
    if D != nope + P or q.stride(-1) != 1 or k_rope.stride(-1) != 1 or style not in ROPE_STYLES:
        raise ValueError(f"mla_rope_store: q {tuple(q.shape)}, k_rope {tuple(k_rope.shape)}, nope {nope}, style {style}")
    if T == 0:
        return
    if style == "complex":
        cos = torch.view_as_real(cos).reshape(T, P)  # [T, P]: (real, imag) pairs, float32
        sin = cos
    store = latent_cache is not None
    R = latent.shape[-1] if store else 1
    if store:
        _check_cache_dtype(q.dtype, latent_cache, rope_cache, latent_scale is not None)
    latent_scale, rope_scale, fp8 = _scale_args(latent_scale, rope_scale, q)
    _launch_exact(
        _mla_rope_kernel, (T, -(-Hq // block_h)), q, k_rope, latent if store else q, cos, sin,
        latent_cache if store else q, rope_cache if store else q, slots if store else q, latent_scale, rope_scale,
        q.stride(0), q.stride(1), k_rope.stride(0), latent.stride(0) if store else 0, cos.stride(0), sin.stride(0),
        latent_cache.stride(1) if store else 0, rope_cache.stride(1) if store else 0, Hq,
        NOPE=nope, P=P, P_PAD=max(_pow2(P), 2), R=R, R_PAD=_pow2(R), STYLE=ROPE_STYLES[style], BLOCK_H=block_h,
        DT=_DT[q.dtype], STORE=store, PDL=pdl(q.device), KV_FP8=fp8,
    )


def _launch(kernel, grid, *args, num_warps: int | None = None, num_stages: int | None = None, **meta):
    if interpreting() or num_warps is None:
        return kernel[grid](*args, **meta)
    if meta.get("PDL"):
        meta["launch_pdl"] = True
    return kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **meta)


def _check(q_lat, q_rope, latent_cache, rope_cache, block_tables, seq_lens, fp8: bool = False) -> None:
    if q_lat.dim() != 3 or q_rope.dim() != 3 or q_lat.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"q_lat [N, Hq, R] and q_rope [N, Hq, P] expected; got {tuple(q_lat.shape)}, "
                         f"{tuple(q_rope.shape)}")
    if latent_cache.dim() != 4 or rope_cache.dim() != 4 or latent_cache.shape[:3] != rope_cache.shape[:3] \
            or latent_cache.shape[2] != 1:
        raise ValueError(f"caches [num_blocks, block_size, 1, R] / [..., P] expected; got "
                         f"{tuple(latent_cache.shape)}, {tuple(rope_cache.shape)}")
    if latent_cache.shape[3] != q_lat.shape[2] or rope_cache.shape[3] != q_rope.shape[2]:
        raise ValueError(f"cache dims {latent_cache.shape[3]} / {rope_cache.shape[3]} do not fit the query's "
                         f"{q_lat.shape[2]} / {q_rope.shape[2]}")
    bs = latent_cache.shape[1]
    if bs & (bs - 1):
        raise ValueError(f"block_size must be a power of two, got {bs}")
    if q_lat.dtype not in _DTYPES or q_rope.dtype != q_lat.dtype:
        raise TypeError("q_lat and q_rope must share a dtype among float32, bfloat16, float16")
    _check_cache_dtype(q_lat.dtype, latent_cache, rope_cache, fp8)  # the model's, or float8 e4m3 with the scales
    N = q_lat.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] < N or seq_lens.shape[0] < N:
        raise ValueError(f"block_tables [N, max_blocks] and seq_lens [N] expected for {N} tokens; got "
                         f"{tuple(block_tables.shape)}, {tuple(seq_lens.shape)}")
    if latent_cache.stride(-1) != 1 or rope_cache.stride(-1) != 1:
        raise ValueError("caches need a unit last stride")


def mla_decode(
    q_lat: torch.Tensor,  # [N, Hq, R]: each decode token's queries folded into latent space (W_UK absorbed)
    q_rope: torch.Tensor,  # [N, Hq, P]: their rotated rope parts
    latent_cache: torch.Tensor,  # [num_blocks, block_size, 1, R]
    rope_cache: torch.Tensor,  # [num_blocks, block_size, 1, P]
    block_tables: torch.Tensor,  # [>= N, max_blocks] int32: token i reads row i
    seq_lens: torch.Tensor,  # [>= N] int32: keys of token i (its position + 1)
    *,
    max_seq_len: int,  # host upper bound of seq_lens (chooses the split count only)
    scale: float,
    out: torch.Tensor | None = None,  # [N, Hq, R] in q_lat's dtype, unit last stride (any other strides)
    num_splits: int | None = None,
    config: MLAKernelConfig = DEFAULT_CONFIG,
    latent_scale: torch.Tensor | None = None,  # float32 [1] each: an FP8 cache's scales (kv_fp8.py), else None
    rope_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [N, Hq, R]: softmax(q_lat . latent + q_rope . rope) @ latent per head
    """Absorbed MLA decode over the paged latent cache (see the module docstring); an FP8 cache dequantised on
    load."""
    _check_triton(q_lat.device)
    _check(q_lat, q_rope, latent_cache, rope_cache, block_tables, seq_lens, latent_scale is not None)
    latent_scale, rope_scale, fp8 = _scale_args(latent_scale, rope_scale, seq_lens)
    N, Hq, R = q_lat.shape
    P = q_rope.shape[2]
    if q_lat.stride(-1) != 1:
        q_lat = q_lat.contiguous()
    if q_rope.stride(-1) != 1:
        q_rope = q_rope.contiguous()
    if out is None:
        out = torch.empty(N, Hq, R, dtype=q_lat.dtype, device=q_lat.device)
    elif out.shape != (N, Hq, R) or out.dtype != q_lat.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [N, Hq, R] = {(N, Hq, R)} of {q_lat.dtype} with a unit last stride")
    if N == 0:
        return out
    block_h = max(config.block_h, 16)
    tile_n = config.tile_n if q_lat.element_size() < 4 else max(16, config.tile_n // 2)
    hb = -(-Hq // block_h)
    if num_splits is None:
        num_splits = num_splits_for(N, Hq, max_seq_len, config)
    R_PAD, P_PAD = max(_pow2(R), 16), max(_pow2(P), 16)
    common = dict(BLOCK_SIZE=latent_cache.shape[1], R=R, P=P, R_PAD=R_PAD, P_PAD=P_PAD,
                  IEEE=q_lat.dtype == torch.float32, INTERPRET=interpreting(), PDL=pdl(q_lat.device),
                  KV_FP8=fp8, DT=_DT[q_lat.dtype])
    strides = (q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), out.stride(0), out.stride(1),
               block_tables.stride(0), latent_cache.stride(0), latent_cache.stride(1), rope_cache.stride(0),
               rope_cache.stride(1))
    scale_log2 = float(scale) * _LOG2E
    if num_splits == 1:
        _launch(_mla_decode_kernel, (N, hb, 1), out, out, out, out, q_lat, q_rope, latent_cache, rope_cache,
                block_tables, seq_lens, latent_scale, rope_scale, scale_log2, *strides, Hq=Hq, BLOCK_H=block_h,
                TILE_N=tile_n, DIRECT=True, **common, num_warps=config.num_warps, num_stages=config.num_stages)
        return out
    part_m = torch.empty(N, Hq, num_splits, dtype=torch.float32, device=q_lat.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(N, Hq, num_splits, R_PAD, dtype=torch.float32, device=q_lat.device)
    _launch(_mla_decode_kernel, (N, hb, num_splits), out, part_m, part_l, part_acc, q_lat, q_rope, latent_cache,
            rope_cache, block_tables, seq_lens, latent_scale, rope_scale, scale_log2, *strides, Hq=Hq,
            BLOCK_H=block_h, TILE_N=tile_n, DIRECT=False, **common, num_warps=config.num_warps,
            num_stages=config.num_stages)
    _launch(_mla_merge_kernel, (N, Hq), out, part_m, part_l, part_acc, out.stride(0), out.stride(1), num_splits,
            Hq=Hq, SPLITS_PAD=_pow2(num_splits), R=R, R_PAD=R_PAD, PDL=common["PDL"], num_warps=4, num_stages=1)
    return out


def mla_decode_reference(q_lat, q_rope, latent_cache, rope_cache, block_tables, seq_lens, *, max_seq_len=None,
                         scale: float, out=None, num_splits=None, config=None, latent_scale=None,
                         rope_scale=None) -> torch.Tensor:
    """``mla_decode`` op by op in torch (same arguments; reads the lengths on the host): per token, gather its keys
    (an FP8 cache's dequantised by kv_fp8.dequantize), scores in float32, softmax, weighted sum of the latents, cast
    to the query's dtype."""
    _check(q_lat, q_rope, latent_cache, rope_cache, block_tables, seq_lens, latent_scale is not None)
    N, Hq, R = q_lat.shape
    bs = latent_cache.shape[1]
    result = q_lat.new_empty(N, Hq, R)
    for i, n in enumerate(seq_lens[:N].tolist()):
        pos = torch.arange(n, device=q_lat.device)
        blocks = block_tables[i, pos // bs].long()
        lat, rope = latent_cache[blocks, pos % bs, 0], rope_cache[blocks, pos % bs, 0]  # [n, R], [n, P]
        if latent_scale is not None:
            lat = kv_fp8.dequantize(lat, latent_scale, q_lat.dtype)
            rope = kv_fp8.dequantize(rope, rope_scale, q_lat.dtype)
        lat, rope = lat.float(), rope.float()
        s = (q_lat[i].float() @ lat.t() + q_rope[i].float() @ rope.t()) * scale  # [Hq, n]
        result[i] = (torch.softmax(s, dim=-1) @ lat).to(q_lat.dtype)
    if out is not None:
        out.copy_(result)
        return out
    return result
