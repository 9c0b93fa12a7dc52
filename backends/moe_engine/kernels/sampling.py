"""Triton kernels of the batched sampler (core/sampling.py): per-row filter thresholds (top-k / top-p, exact, with a
bisection for nuclei past the candidates), the Gumbel race over the vocabulary split across programs (Philox noise
keyed by (seed, draw, token)), and a row-wise logsumexp. CUDA; CPU tensors under TRITON_INTERPRET=1 in tests.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU wheels of torch do not bring Triton
    triton = None


# ---- Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1 in tests) --------------------------------
def triton_available(device: torch.device | str) -> bool:
    return triton is not None and torch.device(device).type == "cuda"


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _programs(device: torch.device) -> int:
    """Programs to aim for in a vocabulary-split launch: enough to fill the GPU."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def _split(V: int, block: int, parts: int) -> tuple[int, int]:
    """(splits, chunk): the vocabulary cut into at most ``parts`` chunks of whole blocks."""
    parts = max(1, min(parts, _cdiv(V, block)))
    chunk = _cdiv(_cdiv(V, parts), block) * block
    return _cdiv(V, chunk), chunk


# The top-p mass is summed in chunks of this many blocks whatever the batch: its rounding, hence the nucleus
# of a row, does not depend on the batch's size.
_MASS_BLOCKS = 8


def triton_filter_thresholds(
    x: torch.Tensor, cols: dict, C: int, block: int, rows: int = 1, block_c: int | None = None
) -> torch.Tensor:
    """lo [N] float32 for logits x [N, V] (unit last stride): the filter threshold of each row. ``rows``:
    rows per program of the row-wise kernels. ``block_c`` (>= C): the width of the candidates' prefix sum;
    the sampler keeps it fixed, so that a row's rounding (its nucleus) does not depend on the batch's C."""
    N, V = x.shape
    cand = torch.topk(x, C, dim=-1, sorted=True).values  # [N, C] descending
    S, chunk = _split(V, block, _cdiv(V, block * _MASS_BLOCKS))
    part = torch.empty(N, S, dtype=torch.float32, device=x.device)  # [N, S] top-p mass per chunk
    params = (cand, C, cols["temperature"], cols["top_k"], cols["top_p"])
    _mass_kernel[(_cdiv(N, rows), S)](x, x.stride(0), *params, part, N, V, chunk, S, ROWS=rows, BLOCK=block)
    lo = torch.empty(N, dtype=torch.float32, device=x.device)
    unsettled = torch.empty(N, dtype=torch.int32, device=x.device)
    _threshold_kernel[(_cdiv(N, rows),)](
        *params, part, lo, unsettled, N, S, ROWS=rows, BLOCK_C=_pow2(max(C, block_c or C)), BLOCK_S=_pow2(S)
    )
    _bisect_kernel[(N,)](x, x.stride(0), *params, lo, unsettled, V, BLOCK=block)
    return lo


def triton_race(
    x: torch.Tensor, cols: dict, lo: torch.Tensor | None, block: int, out: torch.Tensor | None = None, rows: int = 1
) -> torch.Tensor:
    """tokens [N] long: per row the argmax of x (greedy rows) or of x + T * Gumbel over x >= lo."""
    N, V = x.shape
    S, chunk = _split(V, block, _cdiv(_programs(x.device), _cdiv(N, rows)))
    best = torch.empty(N, S, dtype=torch.float32, device=x.device)  # [N, S] best score per chunk
    where = torch.empty(N, S, dtype=torch.int32, device=x.device)  # [N, S] its token
    _race_kernel[(_cdiv(N, rows), S)](
        x, x.stride(0), cols["temperature"], cols["greedy"], cols["seed"], cols["draw"],
        x if lo is None else lo, best, where, N, V, chunk, S, HAS_LO=lo is not None, ROWS=rows, BLOCK=block,
    )
    out = torch.empty(N, dtype=torch.long, device=x.device) if out is None else out
    _race_finish_kernel[(_cdiv(N, rows),)](best, where, out, N, S, ROWS=rows, BLOCK_S=_pow2(S))
    return out


def triton_logsumexp(x: torch.Tensor, block: int) -> torch.Tensor:
    """logsumexp of each row of x [N, V] in one pass over x (online max and sum per chunk)."""
    N, V = x.shape
    S, chunk = _split(V, block, _cdiv(_programs(x.device), N))
    pm = torch.empty(N, S, dtype=torch.float32, device=x.device)
    ps = torch.empty(N, S, dtype=torch.float32, device=x.device)
    _lse_kernel[(N, S)](x, x.stride(0), pm, ps, V, chunk, S, BLOCK=block)
    m = pm.amax(dim=-1, keepdim=True)
    return (m + torch.log((ps * torch.exp(pm - m)).sum(dim=-1, keepdim=True))).squeeze(1)


if triton is not None:

    @triton.jit
    def _key(x):
        """float32 -> int32 of the same order (-0.0 counted as +0.0)."""
        b = (x + 0.0).to(tl.int32, bitcast=True)
        return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)

    @triton.jit
    def _unkey(k):
        return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)

    @triton.jit
    def _gumbel(r):
        """Gumbel noise -log(E) from 32 random bits: E = -log(1 - w) exponential, w = (r + 1/2) / 2^32 in
        (0, 1); small E (the large noise that wins races) is w + w^2/2, exact where 1 - w would round."""
        w = (r.to(tl.float32) + 0.5) * 2.3283064365386963e-10
        e = tl.where(w < 0.0009765625, w + 0.5 * w * w, -tl.log(1.0 - w))
        return -tl.log(e)

    @triton.jit
    def _race_update(best, best_tok, x_rows, offs, end, live, r, t, lo, greedy):
        x = tl.load(x_rows + offs[None, :], mask=live & (offs < end)[None, :], other=float("-inf")).to(tl.float32)
        score = tl.where(greedy, x, tl.where(x >= lo, x + t * _gumbel(r), float("-inf")))
        take = score > best  # strict: a lane keeps its first (lowest) token among equal scores
        return tl.where(take, score, best), tl.where(take, offs[None, :], best_tok)

    @triton.jit
    def _race_kernel(
        x_ptr, stride, temp_ptr, greedy_ptr, seed_ptr, draw_ptr, lo_ptr, best_ptr, where_ptr, N, V, CHUNK, S,
        HAS_LO: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """Program (row group, s): each row's best (score, token) in chunk s; ties: the lowest token.

        Noise: Philox4x32-10 keyed by the row's seed; one call (counter = (c, draw)) gives 4 words, for the
        tokens base + j * BLOCK/4 + lane (j = 0..3) of the block starting at base, c = base / 4 + lane."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        s = tl.program_id(1)
        ok = rows < N
        live = ok[:, None]
        Q: tl.constexpr = BLOCK // 4
        lanes = tl.arange(0, Q)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride
        t = tl.load(temp_ptr + rows, mask=ok, other=1.0)[:, None]
        greedy = (tl.load(greedy_ptr + rows, mask=ok, other=1) != 0)[:, None]
        seed = tl.load(seed_ptr + rows, mask=ok, other=0)[:, None]
        draw = tl.load(draw_ptr + rows, mask=ok, other=0)[:, None]
        lo = tl.full([ROWS, 1], float("-inf"), tl.float32)
        if HAS_LO:
            lo = tl.load(lo_ptr + rows, mask=ok, other=float("-inf"))[:, None]
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, V)
        best = tl.full([ROWS, Q], float("-inf"), tl.float32)
        best_tok = tl.full([ROWS, Q], 2147483647, tl.int32)
        for off in range(start, end, BLOCK):
            r0, r1, r2, r3 = tl.randint4x(seed, (draw << 32) | (off // 4 + lanes).to(tl.int64)[None, :])
            best, best_tok = _race_update(best, best_tok, x_rows, off + lanes, end, live, r0, t, lo, greedy)
            best, best_tok = _race_update(best, best_tok, x_rows, off + Q + lanes, end, live, r1, t, lo, greedy)
            best, best_tok = _race_update(best, best_tok, x_rows, off + 2 * Q + lanes, end, live, r2, t, lo, greedy)
            best, best_tok = _race_update(best, best_tok, x_rows, off + 3 * Q + lanes, end, live, r3, t, lo, greedy)
        top = tl.max(best, 1)
        tok = tl.min(tl.where(best == top[:, None], best_tok, 2147483647), 1)
        tl.store(best_ptr + rows * S + s, top, mask=ok)
        tl.store(where_ptr + rows * S + s, tok, mask=ok)

    @triton.jit
    def _race_finish_kernel(best_ptr, where_ptr, out_ptr, N, S, ROWS: tl.constexpr, BLOCK_S: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        ok = rows < N
        j = tl.arange(0, BLOCK_S)[None, :]
        at = rows[:, None] * S + j
        live = ok[:, None] & (j < S)
        best = tl.load(best_ptr + at, mask=live, other=float("-inf"))
        tok = tl.load(where_ptr + at, mask=live, other=2147483647)
        tok = tl.min(tl.where(best == tl.max(best, 1)[:, None], tok, 2147483647), 1)
        tl.store(out_ptr + rows, tl.where(tok == 2147483647, 0, tok).to(tl.int64), mask=ok)  # all -inf: 0

    @triton.jit
    def _top_k_value(cand_ptr, rows, k, C, ok):
        """The k-th largest logit of each row when its candidates hold it, else -inf (no top-k, or k > C)."""
        t_k = tl.load(cand_ptr + rows * C + tl.minimum(tl.maximum(k - 1, 0), C - 1), mask=ok, other=0.0)
        return tl.where((k > 0) & (k <= C), t_k, float("-inf"))

    @triton.jit
    def _mass_kernel(
        x_ptr, stride, cand_ptr, C, temp_ptr, top_k_ptr, top_p_ptr, part_ptr, N, V, CHUNK, S,
        ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """Program (row group, s): sum over chunk s of exp((x - max) / T) for the x that top-k keeps, for
        the rows with top-p (0 for the others)."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        s = tl.program_id(1)
        ok = rows < N
        need = ok & (tl.load(top_p_ptr + rows, mask=ok, other=1.0) < 1.0)
        t = tl.load(temp_ptr + rows, mask=ok, other=1.0)[:, None]
        m = tl.load(cand_ptr + rows * C, mask=ok, other=0.0)[:, None]
        t_k = _top_k_value(cand_ptr, rows, tl.load(top_k_ptr + rows, mask=ok, other=0), C, ok)[:, None]
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, V)
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for off in range(start, end, BLOCK):
            offs = (off + tl.arange(0, BLOCK))[None, :]
            x = tl.load(x_rows + offs, mask=need[:, None] & (offs < end), other=float("-inf")).to(tl.float32)
            acc += tl.where((x >= t_k) & (x > float("-inf")), tl.exp((x - m) / t), 0.0)
        tl.store(part_ptr + rows * S + s, tl.sum(acc, 1), mask=ok)

    @triton.jit
    def _threshold_kernel(
        cand_ptr, C, temp_ptr, top_k_ptr, top_p_ptr, part_ptr, lo_ptr, unsettled_ptr, N, S,
        ROWS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        """Program row group: lo = max(k-th largest logit, nucleus boundary) from the sorted candidates. The
        nucleus ends at the last candidate whose preceding mass is < p * (the mass top-k keeps); rows the
        candidates cannot settle (k > C, or a nucleus that may go on past them) are flagged for bisection."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        ok = rows < N
        k = tl.load(top_k_ptr + rows, mask=ok, other=0)
        p = tl.load(top_p_ptr + rows, mask=ok, other=1.0)
        t = tl.load(temp_ptr + rows, mask=ok, other=1.0)
        need = ok & (p < 1.0)
        m = tl.load(cand_ptr + rows * C, mask=ok, other=0.0)
        t_k = _top_k_value(cand_ptr, rows, k, C, ok)
        j = tl.arange(0, BLOCK_C)[None, :]
        c = tl.load(cand_ptr + rows[:, None] * C + j, mask=need[:, None] & (j < C), other=float("-inf"))
        e = tl.where((c >= t_k[:, None]) & (c > float("-inf")), tl.exp((c - m[:, None]) / t[:, None]), 0.0)
        incl = tl.cumsum(e, 1)  # mass up to and including candidate j
        sj = tl.arange(0, BLOCK_S)[None, :]
        z = tl.sum(tl.load(part_ptr + rows[:, None] * S + sj, mask=need[:, None] & (sj < S), other=0.0), 1)
        below = tl.sum(((incl < (p * z)[:, None]) & (j < C)).to(tl.int32), 1)  # candidates 0..below are kept
        t_p = tl.load(cand_ptr + rows * C + tl.minimum(below, C - 1), mask=ok, other=0.0)
        tl.store(lo_ptr + rows, tl.where(need, tl.maximum(t_k, t_p), t_k), mask=ok)
        unsettled = (k > C) | (need & (k == 0) & (below >= C))
        tl.store(unsettled_ptr + rows, unsettled.to(tl.int32), mask=ok)

    @triton.jit
    def _count_at_least(x_row, V, key, BLOCK: tl.constexpr):
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for off in range(0, V, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            acc += ((_key(x) >= key) & (offs < V)).to(tl.int32)
        return tl.sum(acc, 0)

    @triton.jit
    def _mass_above(x_row, V, key, m, t, BLOCK: tl.constexpr):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(0, V, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            acc += tl.where((_key(x) > key) & (x > float("-inf")), tl.exp((x - m) / t), 0.0)
        return tl.sum(acc, 0)

    @triton.jit
    def _bisect_kernel(
        x_ptr, stride, cand_ptr, C, temp_ptr, top_k_ptr, top_p_ptr, lo_ptr, unsettled_ptr, V, BLOCK: tl.constexpr
    ):
        """Program row, for a row flagged unsettled (others return at once): its exact threshold by bisection
        over the int keys of its logits, one pass over the row per step, at most 32 steps each: the k-th
        largest logit (k > 0), then the smallest key whose strictly-greater mass is < p (p < 1)."""
        row = tl.program_id(0)
        if tl.load(unsettled_ptr + row) != 0:
            x_row = x_ptr + row.to(tl.int64) * stride
            k = tl.load(top_k_ptr + row)
            p = tl.load(top_p_ptr + row)
            t = tl.load(temp_ptr + row)
            m = tl.load(cand_ptr + row * C)
            t_k = tl.full([], float("-inf"), tl.float32)
            if k > 0:  # the largest key with at least k logits at or above it
                lo = tl.full([], -2139095041, tl.int64)  # _key(-inf): every logit is at or above it
                hi = _key(m).to(tl.int64)
                while lo < hi:
                    mid = lo + (hi - lo + 1) // 2
                    if _count_at_least(x_row, V, mid.to(tl.int32), BLOCK) >= k:
                        lo = mid
                    else:
                        hi = mid - 1
                t_k = _unkey(lo.to(tl.int32))
            out = t_k
            if p < 1.0:  # the smallest key a with mass(keys > a) < p * mass(logits >= t_k)
                a = _key(t_k).to(tl.int64) - 1
                b = _key(m).to(tl.int64)
                target = p * _mass_above(x_row, V, a.to(tl.int32), m, t, BLOCK)
                while a < b:
                    mid = a + (b - a) // 2
                    if _mass_above(x_row, V, mid.to(tl.int32), m, t, BLOCK) < target:
                        b = mid
                    else:
                        a = mid + 1
                out = tl.maximum(t_k, _unkey(a.to(tl.int32)))
            tl.store(lo_ptr + row, out)

    @triton.jit
    def _lse_kernel(x_ptr, stride, pm_ptr, ps_ptr, V, CHUNK, S, BLOCK: tl.constexpr):
        """Program (row, s): max m and sum of exp(x - m) over chunk s (online: one read of the logits)."""
        row = tl.program_id(0)
        s = tl.program_id(1)
        x_row = x_ptr + row.to(tl.int64) * stride
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, V)
        m_run = tl.full([BLOCK], float("-inf"), tl.float32)
        s_run = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(start, end, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < end, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m_run, x)
            live = m_new > float("-inf")
            s_run = tl.where(live, s_run * tl.exp(m_run - m_new) + tl.exp(x - m_new), 0.0)
            m_run = m_new
        top = tl.max(m_run, 0)
        total = tl.sum(tl.where(m_run > float("-inf"), s_run * tl.exp(m_run - top), 0.0), 0)
        tl.store(pm_ptr + row * S + s, top)
        tl.store(ps_ptr + row * S + s, total)
