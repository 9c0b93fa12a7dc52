"""Can cuDNN's dense (padded, not ragged) attention serve prefill chunks that follow a cached prefix faster than the
paged kernel? (One GPU, ~1 minute.)

The ragged cuDNN path rebuilds its graph on every call (``probe_cudnn_ragged.py``: ~74 ms); dense calls are planned
once per shape. A step of B chunks (L queries each over C cached keys plus their own) could run as one dense call
on [B, Hq, Lp, D] queries over [B, Hkv, Sp, D] keys gathered out of the paged cache, the rows padded to the step's
longest chunk and prefix, with the causal diagonal and the padding expressed by a mask. This probes, on a
multi-turn agent's turn-16 step (27 chunks of ~303 queries over ~7,500 cached keys) with equal and unequal lengths:
  * one SDPA call with a boolean mask [B, 1, Lp, Sp] (bottom-right causal + key padding): which backend takes it,
    its error against float32 math, its time;
  * the cached part alone without a mask (equal lengths), through ``aten._scaled_dot_product_cudnn_attention``
    (which also returns the log-sum-exp a split into cached + causal parts needs), and the causal square part;
  * the paged kernel on the same step, and the gather of the cached K/V into the padded layout, for scale.

    PYTHONPATH=backends:. python3 loadtest/probes/probe_cudnn_padded.py
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moe_engine.kernels import paged_attention as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: loadtest.* when run by path
from loadtest.tune.sweep_prefill_tiles import median_ms  # noqa: E402  (CUDA-event timing, median of 10)

HQ, HKV, D, BS = 32, 4, 128, 16
SCALE = D**-0.5


def flops(qlens: list[int], ctx: list[int]) -> float:
    """QK and PV FLOPs the causal step needs (each query sees its context and the chunk up to itself)."""
    return sum(4 * L * (C + (L + 1) / 2) * D * HQ for L, C in zip(qlens, ctx))


def reference(q, k, v):
    """float32 attention of one chunk: q [L, Hq, D] at the last L of the S positions of k/v [S, Hkv, D]."""
    L, S = q.shape[0], k.shape[0]
    kk, vv = (x.float().repeat_interleave(HQ // HKV, 1) for x in (k, v))
    s = torch.einsum("lhd,shd->hls", q.float(), kk) * SCALE
    future = torch.arange(S, device=q.device)[None, :] > torch.arange(L, device=q.device)[:, None] + (S - L)
    return torch.einsum("hls,shd->lhd", s.masked_fill(future, float("-inf")).softmax(-1), vv)


def step(qlens: list[int], ctx: list[int]):
    """A paged cache holding each chunk's context and its own keys, the chunks' queries packed, the block tables."""
    B = len(qlens)
    per = max(-(-(C + L) // BS) for L, C in zip(qlens, ctx))
    k_cache = torch.randn(B * per + 1, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = (1 + torch.randperm(B * per, device="cuda")).to(torch.int32).reshape(B, per)  # blocks out of order
    q = torch.randn(sum(qlens), HQ, D, device="cuda", dtype=torch.bfloat16)
    return q, k_cache, v_cache, tables


def main() -> None:
    torch.manual_seed(0)
    print(torch.__version__, "cuDNN", torch.backends.cudnn.version(), torch.cuda.get_device_name(), flush=True)
    for label, qlens, ctx in (("equal", [303] * 27, [7500] * 27),
                              ("unequal", [303 - 3 * i for i in range(27)], [7500 - 61 * i for i in range(27)])):
        B, Lp = len(qlens), max(qlens)
        Sp = max(L + C for L, C in zip(qlens, ctx))
        Lp, Sp = -(-Lp // 64) * 64, -(-Sp // 64) * 64
        q, k_cache, v_cache, tables = step(qlens, ctx)
        seq_lens = torch.tensor([L + C for L, C in zip(qlens, ctx)], device="cuda", dtype=torch.int32)
        cu = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), device="cuda", dtype=torch.int32)
        fl = flops(qlens, ctx)
        def paged():
            return pa.paged_attention(q, k_cache, v_cache, tables, cu, seq_lens, max_query_len=max(qlens),
                                      max_seq_len=Sp, scale=SCALE)
        paged_out = paged()
        ms = median_ms(paged)
        print(f"[{label}] {B} chunks, {sum(qlens)} queries, padded {Lp} x {Sp}: paged kernel {ms:.3f} ms, "
              f"{fl / ms / 1e9:.0f} TFLOP/s", flush=True)

        # the padded dense layout: keys gathered by slot (padding rows read the null block 0)
        pos = torch.arange(Sp, device="cuda")
        lens = seq_lens.long()
        slot = tables.long()[:, (pos // BS).clamp(max=tables.shape[1] - 1)] * BS + pos % BS  # [B, Sp]
        slot = torch.where(pos[None, :] < lens[:, None], slot, 0)

        def gather():
            kd = k_cache.view(-1, HKV, D)[slot].permute(0, 2, 1, 3)  # [B, Hkv, Sp, D]
            vd = v_cache.view(-1, HKV, D)[slot].permute(0, 2, 1, 3)
            return kd, vd
        ms = median_ms(gather)
        print(f"  gather K and V into [B, Hkv, {Sp}, D]: {ms:.3f} ms", flush=True)
        kd, vd = gather()
        qd = q.new_zeros(B, HQ, Lp, D)
        start = 0
        for b, L in enumerate(qlens):
            qd[b, :, :L] = q[start:start + L].transpose(0, 1)
            start += L
        qpos = (lens[:, None] - torch.tensor(qlens, device="cuda")[:, None]) + torch.arange(Lp, device="cuda")[None]
        mask = (pos[None, None, :] <= qpos[:, :, None]) & (pos[None, None, :] < lens[:, None, None])  # [B, Lp, Sp]
        mask = mask[:, None]
        bias = torch.zeros(mask.shape, device="cuda", dtype=torch.bfloat16).masked_fill(~mask, float("-inf"))

        for name, m in (("bool mask", mask), ("bf16 bias", bias)):
            for backends in ([SDPBackend.CUDNN_ATTENTION], [SDPBackend.EFFICIENT_ATTENTION],
                             [SDPBackend.FLASH_ATTENTION]):
                def run():
                    with sdpa_kernel(backends):
                        return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=m, scale=SCALE, enable_gqa=True)
                try:
                    out = run()
                    ms = median_ms(run)
                except RuntimeError as exc:
                    print(f"  one call, {name}, {backends[0].name}: refused ({str(exc).splitlines()[0][:160]})",
                          flush=True)
                    continue
                errs = []
                start = 0
                for b, L in enumerate(qlens):
                    if b in (0, B - 1):
                        S = L + ctx[b]
                        ref = reference(q[start:start + L], kd[b, :, :S].transpose(0, 1), vd[b, :, :S].transpose(0, 1))
                        errs.append((out[b, :, :L].transpose(0, 1).float() - ref).abs().max().item())
                        errs.append((paged_out[start:start + L].float() - ref).abs().max().item())
                    start += L
                print(f"  one call, {name}, {backends[0].name}: {ms:.3f} ms, {fl / ms / 1e9:.0f} TFLOP/s of real work, "
                      f"max |err| {max(errs[0::2]):.4f} (paged kernel {max(errs[1::2]):.4f})", flush=True)

        if label == "equal":  # the split: cached part unmasked (+ log-sum-exp), the chunk's own keys causal
            C = ctx[0]
            kc, vc = kd[:, :, :C], vd[:, :, :C]
            kn, vn = kd[:, :, C:C + qlens[0]], vd[:, :, C:C + qlens[0]]
            qn = qd[:, :, :qlens[0]].contiguous()
            op = torch.ops.aten._scaled_dot_product_cudnn_attention
            for name, args in (("cached part, cudnn op + lse", (qn, kc.contiguous(), vc.contiguous(), None, True, 0.0,
                                                                 False, False)),
                               ("new part, cudnn op causal + lse", (qn, kn.contiguous(), vn.contiguous(), None, True,
                                                                    0.0, True, False))):
                try:
                    ms = median_ms(lambda: op(*args, scale=SCALE))
                    print(f"  {name}: {ms:.3f} ms", flush=True)
                except RuntimeError as exc:
                    print(f"  {name}: refused ({str(exc).splitlines()[0][:160]})", flush=True)
            for name, kk, vv, causal in (("cached part, SDPA cuDNN", kc, vc, False),
                                         ("new part, SDPA cuDNN causal", kn, vn, True)):
                def run():
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        return F.scaled_dot_product_attention(qn, kk, vv, is_causal=causal, scale=SCALE,
                                                              enable_gqa=True)
                try:
                    ms = median_ms(run)
                    print(f"  {name}: {ms:.3f} ms", flush=True)
                except RuntimeError as exc:
                    print(f"  {name}: refused ({str(exc).splitlines()[0][:160]})", flush=True)
        del kd, vd, mask, bias, k_cache, v_cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"done in {time.perf_counter() - t0:.0f} s", flush=True)
