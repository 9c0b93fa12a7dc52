"""Can torch's ragged cuDNN attention serve prefill chunks that follow a cached prefix? (One GPU, ~20 s.)

The engine's paged kernel runs such chunks at ~336 TFLOP/s on an H200; cuDNN's dense causal attention runs 570. This
probes ``torch.ops.aten._cudnn_attention_forward`` with cumulative sequence lengths (the nested-tensor path: a
step's sequences packed, grouped-query heads without repeated K/V) for what the engine would need:
  * correctness against float32 math, non-causal (queries over their cached keys) and causal, and which diagonal
    the causal mask takes when a sequence has fewer queries than keys (bottom-right is what a chunk after a cached
    prefix needs; top-left would let it see nothing of the cache);
  * the log-sum-exp it returns (natural log?), for merging a cached part and a causal part;
  * time per call on a multi-turn turn-16 step (27 x 303 queries over 7,500 cached keys), on repeated calls with new
    lengths, new maxima and new batch sizes (does it rebuild its cuDNN graph?); the paged kernel and the gather of
    the cached K/V into a contiguous buffer on the same step, for scale.
torch 2.11 on an H200 (this probe, no flags): correct, natural-log LSE, top-left
causal only, and ~74 ms per call whatever the shapes (its graph is rebuilt each call): not usable yet.

    PYTHONPATH=backends:. python3 loadtest/probes/probe_cudnn_ragged.py
"""
from __future__ import annotations

import time

import torch

from moe_engine.kernels import paged_attention as pa

HQ, HKV, D = 32, 4, 128
SCALE = D**-0.5
OP = torch.ops.aten._cudnn_attention_forward


def wall_ms(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def median_ms(fn, reps: int = 10) -> float:
    fn()
    return sorted(wall_ms(fn) for _ in range(reps))[reps // 2]


def reference(q, k, v, causal: bool):
    """float32 attention of one sequence, q [L, Hq, D] over k/v [S, Hkv, D]; bottom-right causal mask if causal.
    -> (out [L, Hq, D], lse [L, Hq] natural log)."""
    L, S = q.shape[0], k.shape[0]
    kk = k.float().repeat_interleave(HQ // HKV, 1)
    vv = v.float().repeat_interleave(HQ // HKV, 1)
    s = torch.einsum("lhd,shd->hls", q.float(), kk) * SCALE
    if causal:
        future = torch.arange(S, device=q.device)[None, :] > torch.arange(L, device=q.device)[:, None] + (S - L)
        s = s.masked_fill(future, float("-inf"))
    return torch.einsum("hls,shd->lhd", s.softmax(-1), vv), torch.logsumexp(s, -1).transpose(0, 1)


def packed(qlens: list[int], klens: list[int]):
    q = torch.randn(sum(qlens), HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(klens), HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = [torch.tensor([0] + list(torch.tensor(x).cumsum(0)), device="cuda", dtype=torch.int32) for x in (qlens, klens)]
    return q, k, v, cu[0], cu[1]


def call(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool):
    return OP(q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, causal, False, scale=SCALE)


def check(label: str, qlens: list[int], klens: list[int], causal: bool):
    """Correctness of sequences 0 and last against float32 math (both diagonals when causal); the inputs."""
    q, k, v, cu_q, cu_k = packed(qlens, klens)
    try:
        first = wall_ms(lambda: call(q, k, v, cu_q, cu_k, max(qlens), max(klens), causal))
        out, lse = call(q, k, v, cu_q, cu_k, max(qlens), max(klens), causal)[:2]
    except RuntimeError as exc:
        print(f"{label}: {exc!s:.300}", flush=True)
        return None
    print(f"{label}: out {tuple(out.shape)}, lse {tuple(lse.shape)} {lse.dtype}, first call {first:.1f} ms", flush=True)
    for b in (0, len(qlens) - 1):
        qs, ks, L, S = sum(qlens[:b]), sum(klens[:b]), qlens[b], klens[b]
        masks = {"bottom-right": (k[ks:ks + S], v[ks:ks + S]), "top-left": (k[ks:ks + L], v[ks:ks + L])} if causal \
            else {"no mask": (k[ks:ks + S], v[ks:ks + S])}
        for name, (kb, vb) in masks.items():
            o_ref, l_ref = reference(q[qs:qs + L], kb, vb, causal)
            err = (out[qs:qs + L].float() - o_ref).abs().max().item()
            lse_err = (lse[qs:qs + L].reshape(L, HQ).float() - l_ref).abs().max().item()
            print(f"   sequence {b} vs {name}: max |out - ref| {err:.4f}, max |lse - ln ref| {lse_err:.4f}", flush=True)
    return q, k, v, cu_q, cu_k


def main() -> None:
    torch.manual_seed(0)
    print(torch.__version__, "cuDNN", torch.backends.cudnn.version(), flush=True)
    check("non-causal", [5, 37, 130], [300, 77, 513], False)
    check("causal, fewer queries than keys", [5, 37, 130], [300, 77, 513], True)
    check("causal, square", [64, 37, 130], [64, 37, 130], True)

    B, L, C = 27, 303, 7500  # a multi-turn agent's turn 16
    inputs = check(f"turn 16: {B} x {L} queries over {C} cached keys", [L] * B, [C] * B, False)
    if inputs is None:
        return
    ms = median_ms(lambda: call(*inputs, L, C, False))
    print(f"turn 16, cached part: {ms:.2f} ms per call, {4 * B * L * C * D * HQ / ms / 1e9:.0f} TFLOP/s", flush=True)
    other = packed([L - i for i in range(B)], [C - 7 * i for i in range(B)])
    for i in range(3):
        print(f"  new lengths, same maxima, call {i}: {wall_ms(lambda: call(*other, L, C, False)):.1f} ms", flush=True)
    for mq, mk in ((320, 7680), (512, 8192)):
        print(f"  maxima ({mq}, {mk}): first call {wall_ms(lambda: call(*other, mq, mk, False)):.1f} ms, then "
              f"{median_ms(lambda: call(*other, mq, mk, False)):.2f} ms", flush=True)
    for b2 in (26, 32):
        more = packed([L] * b2, [C] * b2)
        print(f"  {b2} sequences: first call {wall_ms(lambda: call(*more, L, C, False)):.1f} ms", flush=True)

    # the same step on the paged kernel (cache and new keys in blocks of 16), and gathering the cached K/V
    bs = 16
    nb = B * -(-(C + L) // bs)
    k_cache = torch.randn(nb, bs, HKV, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(nb, device="cuda", dtype=torch.int32).reshape(B, -1)
    cu = torch.arange(B + 1, device="cuda", dtype=torch.int32) * L
    seq_lens = torch.full((B,), C + L, device="cuda", dtype=torch.int32)
    q = torch.randn(B * L, HQ, D, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: pa.paged_attention(q, k_cache, v_cache, tables, cu, seq_lens, max_query_len=L,
                                              max_seq_len=C + L, scale=SCALE))
    print(f"turn 16 on the paged kernel (cached + causal new keys): {ms:.2f} ms, "
          f"{4 * B * L * (C + L / 2) * D * HQ / ms / 1e9:.0f} TFLOP/s", flush=True)
    slots = (tables[:, :, None] * bs + torch.arange(bs, device="cuda", dtype=torch.int32)).reshape(B, -1)
    slots = slots[:, :C].reshape(-1).long()
    flat_k, flat_v = k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D)
    ms = median_ms(lambda: (flat_k.index_select(0, slots), flat_v.index_select(0, slots)))
    print(f"gathering the cached K and V ({B * C} tokens) contiguous: {ms:.2f} ms per layer", flush=True)


if __name__ == "__main__":
    main()
