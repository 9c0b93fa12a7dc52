"""DeepSeek-V2/V3 multi-head latent attention (MLA) over the paged cache of compressed latents.

Two paths compute the same attention:
- op-by-op (CPU, the parity tests, ``--disable-fused-kernels``): every step expands the cached latents of its
  sequences with ``kv_b_proj`` into per-head keys and values and runs the reference attention, as HF does;
- the kernel path (``batch.use_kernels``: CUDA with the fused kernels on, or the interpreter in tests), as DeepSeek's
  own inference and vLLM / SGLang run MLA:
  * decode rows (a step's leading one-token sequences; every row of a decode step): *absorbed* attention,
    kernels/mla_attention.py. W_UK (kv_b_proj's key rows) is folded into the query by one batched GEMM, the kernel
    attends over the 576-value latent blocks alone (multi-query attention, split over the keys for long contexts
    and few sequences), and W_UV takes its output out of latent space by a second batched GEMM. Nothing expanded is
    read or written; CUDA-graph capturable.
  * prompt rows: *expanded* attention at tensor-core speed. Prompts from position 0 that end the step, long
    enough (attend.DENSE_PREFILL_MIN_TOKENS), take dense causal SDPA (cuDNN / FlashAttention) on their own
    expanded keys and values (values zero-padded to the key width, one shape); every other prompt chunk (chunked
    prefill, prefix-cache hits) gathers its sequence's cached latents, expands them into a step-local paged
    buffer, and runs paged_attention.py's prefill kernel over it, its queries the chunk's positions.
  * a prefill graph's step (core/prefill_graphs.py: padded, lengths on the device only): every row absorbed, each
    token a one-query sequence of its own keys (position + 1) through its sequence's table row; its work grows with
    tokens x keys, so the runner replays MLA's prefill graphs only within ``GRAPH_MAX_KEY_READS``.
  Equal to the op-by-op path within rounding (another summation order; the absorbed query is rounded to the model
  dtype where the op-by-op path rounds the expanded keys).

``--kv-cache-dtype fp8``: the latent and the rope key are cached in float8 e4m3 (576 bytes per token and layer),
the latent with the layer's k_scale and the rope key with its v_scale (kernels/kv_fp8.py); the store quantises,
and every path reads the same dequantised values: the kernels on load, the op-by-op and expanded-prefill paths
through ``LayerKV.read``, the dense prefill through ``LayerKV.as_stored``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import AttentionSpec, RopeSpec
from ..core.uploads import upload
from ..kernels import mla_attention as mla_kernels
from ..kernels import paged_attention
from ..kernels import small_linear as linear_kernels
from . import attend
from . import invariant as inv
from .attend import ForwardBatch, LayerKV, attend_cached, cached_kv, store_kv
from .fp8_linear import Fp8Linear
from .norm import RMSNorm
from .rotary import apply_rotary, deepseek_softmax_scale


class MLAttention(nn.Module):
    """DeepSeek-V2/V3 multi-head latent attention (HF ``DeepseekV2Attention`` / ``DeepseekV3Attention``).

    The cache holds, per token, the normalised kv latent [kv_lora_rank] (as "k") and the rotated shared rope key
    [qk_rope_head_dim] (as "v"), exactly what HF caches (an FP8 cache: quantised, module docstring); every step
    expands the cached latents of the step's sequences with ``kv_b_proj`` into per-head keys (nope part + shared
    rope part) and values, as HF does."""

    batch_invariant = False  # deterministic inference (MoEForCausalLM.use_batch_invariant)
    # q (or q_a) and kv_a in one GEMM, o_proj of one token in small_linear: equal within rounding (set by
    # MoEForCausalLM.use_fused_kernels)
    within_rounding = False
    # The paged prefill kernel's launch over the expanded keys (heads of qk 192 padded to 256, values 128 in V2/V3):
    # 64 query rows, 64-key tiles, 2 stages fit shared memory without TMA (the keys are not powers of two).
    prefill_config = paged_attention.KernelConfig(prefill_block_m=64, prefill_tile_n=64, prefill_num_warps=4,
                                                  prefill_num_stages=2, prefill_tma=False)
    decode_config = mla_kernels.DEFAULT_CONFIG

    def __init__(self, spec: AttentionSpec, rope: RopeSpec, hidden_size: int, norm_eps: float, layer_idx: int):
        super().__init__()
        mla = spec.mla
        H, self.num_heads = hidden_size, spec.num_heads
        self.nope, self.rope, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_lora_rank = mla.kv_lora_rank
        self.qk_head_dim = self.nope + self.rope
        self.scale = deepseek_softmax_scale(rope, self.qk_head_dim)
        self.rope_style = rope.style
        bias = spec.qkv_bias
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(H, self.num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)  # HF: default eps, not rms_norm_eps
            self.q_b_proj = nn.Linear(mla.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, H, bias=spec.o_bias)

    def _joined_weight(self) -> tuple[Tensor, Tensor | None] | None:
        """[q (or q_a) rows; kv_a rows] (and the biases) viewing the two projections' parameters, when
        ``fuse_projections`` laid them out back to back in one storage; else None."""
        first = self.q_proj if hasattr(self, "q_proj") else self.q_a_proj
        views = []
        for attr in ("weight", "bias"):
            a, b = getattr(first, attr), getattr(self.kv_a_proj_with_mqa, attr)
            if a is None and b is None:
                views.append(None)
                continue
            if a is None or b is None or not (a.is_contiguous() and b.is_contiguous()) or \
                    b.data_ptr() != a.data_ptr() + a.nbytes or \
                    b.untyped_storage().data_ptr() != a.untyped_storage().data_ptr():
                return None
            views.append(a.as_strided((a.shape[0] + b.shape[0], *a.shape[1:]), a.stride()))
        return views[0], views[1]

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Lay the q (or q_a) and kv_a weights (and biases) out back to back in one tensor, each projection's
        parameter a view of its rows (as Attention.fuse_qkv), so that both read x in one GEMM. Idempotent; left
        alone when only one of them has a bias."""
        first = self.q_proj if hasattr(self, "q_proj") else self.q_a_proj
        projs = (first, self.kv_a_proj_with_mqa)
        if self._joined_weight() is not None or (first.bias is None) != (self.kv_a_proj_with_mqa.bias is None):
            return
        if any(isinstance(p, Fp8Linear) for p in projs):  # FP8 (fp8_load.py): each its own W8A8 GEMM
            return
        for attr in ("weight", "bias"):
            if getattr(first, attr) is None:
                continue
            joined = torch.cat([getattr(p, attr) for p in projs])
            for p, part in zip(projs, joined.split([getattr(p, attr).shape[0] for p in projs])):
                setattr(p, attr, nn.Parameter(part, requires_grad=False))

    @property
    def dense_prefill_shape(self) -> tuple[int, int, int, int]:
        """(Hq, Hkv, Dk, Dv) of the dense causal SDPA a long prompt takes on the kernel path: expanded keys, values
        zero-padded to the key width (the runner warms cuDNN's plans for it)."""
        return self.num_heads, self.num_heads, self.qk_head_dim, self.qk_head_dim

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor | None, batch: ForwardBatch, cache: LayerKV) -> Tensor:
        T, Hq = x.shape[0], self.num_heads
        first = self.q_proj if hasattr(self, "q_proj") else self.q_a_proj
        joined = self._joined_weight() if self.within_rounding and not self.batch_invariant else None
        if joined is not None:  # q (or q_a) and kv_a in one GEMM over x (small_linear for one token)
            w, b = joined
            q, kv = linear_kernels.decode_linear(x, w, b, True, linear_kernels.QKV_SMALL_LINEAR_TOKENS).split(
                [first.weight.shape[0], self.kv_a_proj_with_mqa.weight.shape[0]], dim=-1)
        else:
            q, kv = first(x), self.kv_a_proj_with_mqa(x)
        if not hasattr(self, "q_proj"):
            q = self.q_b_proj(self.q_a_layernorm(q))
        kv_latent, k_rot = torch.split(kv, [self.kv_lora_rank, self.rope], dim=-1)
        kv_latent = self.kv_a_layernorm(kv_latent)  # [T, r]
        if batch.use_kernels and not self.batch_invariant:
            # the rope parts of q and k rotated in place and the latent + rotated key cached, in one launch
            q = q.view(T, Hq, self.qk_head_dim)
            mla_kernels.mla_rope_store(q, k_rot, cos, sin, self.rope_style, self.nope, kv_latent, cache.k, cache.v,
                                       batch.slot_mapping, latent_scale=cache.k_scale, rope_scale=cache.v_scale)
            out = self._attend_kernels(q, kv_latent, k_rot, cache, batch)  # [T, Hq, V]
            if isinstance(self.o_proj, Fp8Linear):
                return self.o_proj(out.reshape(T, Hq * self.v_dim))
            return linear_kernels.decode_linear(out.reshape(T, Hq * self.v_dim), self.o_proj.weight, self.o_proj.bias,
                                                self.within_rounding, linear_kernels.O_PROJ_SMALL_LINEAR_TOKENS)
        q_nope, q_rot = torch.split(q.view(T, Hq, self.qk_head_dim), [self.nope, self.rope], dim=-1)
        k_rot = k_rot.view(T, 1, self.rope)  # [T, 1, R]: one rope key shared by all heads
        q_rot = apply_rotary(q_rot, cos, sin, self.rope_style, self.batch_invariant)
        k_rot = apply_rotary(k_rot, cos, sin, self.rope_style, self.batch_invariant)
        store_kv(kv_latent[:, None], k_rot, cache, batch)
        query = torch.cat((q_nope, q_rot), dim=-1)  # [T, Hq, nope + R]
        latent, rot = cache.read(*cached_kv(cache, batch), query.dtype)  # [B, 1, Lk, r], [B, 1, Lk, R]
        B, Lk = latent.shape[0], latent.shape[2]
        kv = self.kv_b_proj(latent[:, 0]).view(B, Lk, Hq, self.nope + self.v_dim).transpose(1, 2)
        k_nope, values = torch.split(kv, [self.nope, self.v_dim], dim=-1)  # [B, Hq, Lk, nope], [B, Hq, Lk, V]
        keys = torch.cat((k_nope, rot.expand(B, Hq, Lk, self.rope)), dim=-1)  # [B, Hq, Lk, nope + R]
        if not self.batch_invariant:
            out = attend_cached(query, keys, values, batch, self.scale)  # [T, Hq, V]
        elif query.is_cuda:
            from ..kernels import batch_invariant as bi_kernels

            out = bi_kernels.attention_dense(query, keys, values, batch, self.scale)
        else:
            out = inv.attention(query, keys, values, batch, self.scale)
        return self.o_proj(out.reshape(T, Hq * self.v_dim))  # [T, H]

    # ------------------------------------------------------------------------------------------- kernel path

    def _attend_kernels(self, q: Tensor, kv_latent: Tensor, k_rot: Tensor, cache: LayerKV,
                        batch: ForwardBatch) -> Tensor:  # [T, Hq, V]
        """Decode rows absorbed, prompt rows expanded (the module docstring); the step's token order. q [T, Hq,
        nope + R] and k_rot [T, R] rotated already."""
        T, B = q.shape[0], len(batch.query_lens)
        if not batch.host_lengths:  # a prefill graph's padded step: every row absorbed, lengths from the device
            return self._decode_absorbed(q, cache, batch, *batch.token_rows())
        nd = batch.leading_decodes()
        if nd == B:
            return self._decode_absorbed(q, cache, batch)
        out = q.new_empty(T, self.num_heads, self.v_dim)
        if nd:
            out[:nd] = self._decode_absorbed(q[:nd], cache, batch)
        self._prefill_expanded(q, kv_latent, k_rot, cache, batch, nd, out)
        return out

    def _w(self) -> Tensor:
        """kv_b_proj's weight per head [Hq, nope + v, R] (a view: weight updates and CUDA graphs see it)."""
        return self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)

    def _decode_absorbed(self, q: Tensor, cache: LayerKV, batch: ForwardBatch, tables: Tensor | None = None,
                         lens: Tensor | None = None) -> Tensor:
        """n = len(q) queries, one per row of ``tables`` [>= n, nb] int32 with ``lens`` [>= n] int32 keys (default:
        the step's first n sequences, a decode token each): q_lat = q_nope @ W_UK, the absorbed kernel over their
        latent blocks, @ W_UV^T. [n, Hq, V] (a transposed view)."""
        if tables is None:
            tables, lens = batch.int32("block_tables"), batch.int32("seq_lens")
        w = self._w()
        q_lat = torch.bmm(q[..., : self.nope].transpose(0, 1), w[:, : self.nope])  # [Hq, n, R]
        o_lat = torch.empty_like(q_lat)
        mla_kernels.mla_decode(
            q_lat.transpose(0, 1), q[..., self.nope:], cache.k, cache.v, tables, lens, max_seq_len=batch.max_seq_len,
            scale=self.scale, out=o_lat.transpose(0, 1), config=self.decode_config, latent_scale=cache.k_scale,
            rope_scale=cache.v_scale)
        return torch.bmm(o_lat, w[:, self.nope:].transpose(1, 2)).transpose(0, 1)  # [n, Hq, V]

    def _expand(self, latent: Tensor, rope: Tensor) -> tuple[Tensor, Tensor]:
        """latent [L, R], rope [L, P] -> (keys [L, Hq, nope + P], kv [L, Hq, nope + v], whose [..., nope:] are the
        values): kv_b_proj and the shared rope key broadcast to every head, as the op-by-op path expands them."""
        L, Hq = latent.shape[0], self.num_heads
        kv = F.linear(latent, self.kv_b_proj.weight).view(L, Hq, self.nope + self.v_dim)
        keys = torch.cat((kv[..., : self.nope], rope[:, None, :].expand(L, Hq, self.rope)), dim=-1)
        return keys, kv

    def _prefill_expanded(self, q: Tensor, kv_latent: Tensor, k_rot: Tensor, cache: LayerKV,
                          batch: ForwardBatch, nd: int, out: Tensor) -> None:
        """Rows of the sequences nd.. into out: dense causal SDPA for the step's trailing long prompts from position
        0 (bf16/fp16), the paged prefill kernel over expanded cached latents for the others."""
        Hq, D, V = self.num_heads, self.qk_head_dim, self.v_dim
        key = (q.device.type, q.dtype, D, D)
        dense_ok = q.dtype != torch.float32 and key not in attend._dense_refused
        plan = _prefill_plan(batch, nd, dense_ok)
        if plan.dense:
            lo = plan.dense[0][0]
            # an FP8 cache: the prompt's own latents and rope keys as a later step reads them back from it
            keys, kv = self._expand(*cache.as_stored(kv_latent[lo:], k_rot[lo:]))
            values = F.pad(kv[..., self.nope:], (0, D - V))  # [n, Hq, D]: one shape with the keys
            try:
                for a, b in plan.dense:
                    out[a:b] = attend.dense_causal(q[a:b], keys[a - lo : b - lo], values[a - lo : b - lo],
                                                   self.scale)[..., :V]
            except RuntimeError as err:  # no SDPA backend takes these shapes here: the paged kernel does all of it
                attend._refuse_dense(key, err)
                return self._prefill_expanded(q, kv_latent, k_rot, cache, batch, nd, out)
        if plan.paged is not None:
            lo, hi, slots, tables, cu, lens, max_q, max_len, nblk = plan.paged
            R, P = self.kv_lora_rank, self.rope
            latent = cache.k.view(-1, R).index_select(0, slots)  # [nblk * TMP_BLOCK, R]
            rope = cache.v.view(-1, P).index_select(0, slots)
            keys, kv = self._expand(*cache.read(latent, rope, q.dtype))  # an FP8 cache dequantised
            k_buf = keys.view(nblk, TMP_BLOCK, Hq, D)
            v_buf = kv.view(nblk, TMP_BLOCK, Hq, self.nope + V)[..., self.nope:]
            paged_attention.paged_attention(q[lo:hi], k_buf, v_buf, tables, cu, lens, max_query_len=max_q,
                                            max_seq_len=max_len, scale=self.scale, out=out[lo:hi],
                                            config=self.prefill_config)


# Prefill and mixed steps replay a CUDA graph (every row absorbed) when their tokens read at most this many keys
# in all (sum over tokens of position + 1), else run eagerly (expanded prompt rows): e.g. 1,024 new tokens from
# position 0, or 240 after 4k cached ones. Absorbed prompt rows read their sequence's latents once per token (16
# heads of one token per program), about 32 us per layer per million key reads on an H100 by its L2 bandwidth
# (an estimate, not yet measured), where the graph saves the eager step's ~1,000 launches (10-20 ms of host time).
GRAPH_MAX_KEY_READS = 1 << 20

TMP_BLOCK = 64  # keys per block of a step's expanded prefill buffer (whole key tiles of the prefill kernel)


@dataclass
class _PrefillPlan:
    """Where a step's prompt rows (sequences nd..) go on the kernel path, made once per step for every MLA layer.
    ``dense``: token ranges of the trailing prompts from position 0 that take dense causal SDPA. ``paged``: (first
    token, end token, cache slots [nblk * TMP_BLOCK] to gather (each sequence's positions 0..len-1 from block-aligned
    offsets, padding rows read its position 0), block tables into the expanded buffer [n, w] int32, cu_seqlens_q
    [n + 1] int32, seq_lens [n] int32, longest chunk, longest sequence, buffer blocks) for the other sequences."""

    dense: list
    paged: tuple | None


def _prefill_plan(batch: ForwardBatch, nd: int, dense_ok: bool) -> _PrefillPlan:
    key = ("mla_prefill", nd, dense_ok)
    if key in batch._int32:
        return batch._int32[key]
    B, q_lens, ctx, starts = len(batch.query_lens), batch.query_lens, batch.context_lens, batch.query_starts
    if ctx is None or starts is None:  # a ForwardBatch built by hand (graphs): lengths from the device copies
        ctx = (batch.seq_lens.cpu() - torch.tensor(q_lens)).tolist()
        starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).tolist()
    nf = batch.dense_from if dense_ok and batch.dense_from is not None else B
    nf = max(nf, nd)
    dense = [(starts[b], starts[b] + q_lens[b]) for b in range(nf, B)]
    paged = None
    if nf > nd:
        seqs = range(nd, nf)
        lens = [ctx[b] + q_lens[b] for b in seqs]
        nblks = [-(-n // TMP_BLOCK) for n in lens]
        nblk, width = sum(nblks), max(nblks)
        firsts = np.concatenate([[0], np.cumsum(nblks)[:-1]])
        tables = np.zeros((len(lens), width), dtype=np.int64)
        rows_seq, rows_pos = [], []
        for i, (b, n, k) in enumerate(zip(seqs, lens, nblks)):
            tables[i, :k] = np.arange(firsts[i], firsts[i] + k)
            pos = np.arange(k * TMP_BLOCK)
            pos[n:] = 0
            rows_pos.append(pos)
            rows_seq.append(np.full(k * TMP_BLOCK, b))
        cu = np.concatenate([[0], np.cumsum([q_lens[b] for b in seqs])])
        m = nblk * TMP_BLOCK
        packed = upload(np.concatenate([np.concatenate(rows_seq), np.concatenate(rows_pos), tables.reshape(-1), cu,
                                        lens]).astype(np.int64), batch.positions.device)
        seq_t, pos_t, tab_t, cu_t, len_t = torch.split(packed, [m, m, tables.size, len(cu), len(lens)])
        bs = batch.block_size
        slots = batch.block_tables[seq_t, pos_t // bs] * bs + pos_t % bs
        lo = starts[nd]
        paged = (lo, lo + int(cu[-1]), slots, tab_t.view(tables.shape).to(torch.int32), cu_t.to(torch.int32),
                 len_t.to(torch.int32), max(q_lens[b] for b in seqs), max(lens), nblk)
    batch._int32[key] = plan = _PrefillPlan(dense, paged)
    return plan
