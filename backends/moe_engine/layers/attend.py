"""Batched attention over the paged KV cache.

One forward step carries the tokens of several sequences flattened into one dimension T (prefill chunks and
single decode tokens mixed). Each sequence's keys and values live in the blocks of its block table
(kv_cache.py); the token at position p is in block ``block_tables[b, p // block_size]`` at offset
``p % block_size``.

``ForwardBatch`` describes one step; it is built once per step on the host (one host->device copy) and shared by
all layers. ``attend`` is what a model's attention layer calls: it writes the step's k/v into the cache and
attends each query to the keys of its own sequence, causally (and inside a sliding window when the layer has one).
Models never see blocks, padding or masks.

Two implementations of the same attention:
- the reference (every device; what CPU serving and the parity tests run): gathers each sequence's blocks into a
  dense [B, Hkv, Lk, D] tensor and runs torch's SDPA with a mask, operation by operation as Hugging Face does, so
  that float32 agrees with transformers to rounding and bfloat16 bit for bit;
- on CUDA with the fused kernels on, the Triton kernels of kernels/paged_attention.py: they read only the blocks a
  sequence owns, grouped-query heads share each K/V tile, long decode contexts are split over several programs
  (equal to the reference within the rounding of a different summation order). Prompts that a step prefills from
  position 0 at its end, from the first of at least ``DENSE_PREFILL_MIN_TOKENS`` tokens on, need no cache read:
  their own k/v are all their keys, so they take torch's causal SDPA on those tensors (``dense_causal``: cuDNN's
  kernel, else FlashAttention's; one call per prompt, zero-padded to a length bucket whose cuDNN plan
  ``warm_dense_prefill`` made at start; on an H200 an 8k prompt runs at ~500 TFLOP/s there against the paged
  kernel's ~330), equal to the reference within the same rounding.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..core.uploads import upload
from ..kernels import kv_fp8, paged_attention
from ..kernels import rotary as rotary_kernels

log = logging.getLogger(__name__)

# Prompts prefilled from position 0 that end a step take dense causal SDPA on the kernel path, one call each, from
# the first of them with this many tokens on (below it the paged kernel is as fast: on an H200 cuDNN's kernel runs
# a 4k prompt at the paged kernel's ~330 TFLOP/s, an 8k one at ~500), when that makes no more than
# DENSE_PREFILL_MAX_CALLS calls per layer.
DENSE_PREFILL_MIN_TOKENS = 4096
DENSE_PREFILL_MAX_CALLS = 16
# cuDNN builds an execution plan for every new shape (70 ms to over a second on an H200): prompts are zero-padded
# to a length bucket (multiples of 512, then eight buckets per doubling), whose plans warm_dense_prefill makes at
# start, so that serving never waits for one.
DENSE_PREFILL_BUCKET = 512

@dataclass
class LayerKV:
    """One layer's cache: k [num_blocks, block_size, Hkv, Dk], v [num_blocks, block_size, Hkv, Dv], in the model
    dtype, or float8 e4m3 with the layer's scales (``--kv-cache-dtype fp8``, kernels/kv_fp8.py)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # float32 [1] on the cache's device: FP8 caches only
    v_scale: torch.Tensor | None = None

    @property
    def scales(self) -> dict:
        """The kernels' k_scale / v_scale arguments (None for a cache in the model dtype)."""
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def store_args(self, v: torch.Tensor, slot_mapping: torch.Tensor) -> tuple:
        """``rotary_kernels.qk_norm_rope``'s ``kv_cache``: the fused rotary writes k and ``v`` at the slots."""
        scales = (self.k_scale, self.v_scale) if self.k_scale is not None else ()
        return (v, self.k, self.v, slot_mapping, *scales)

    def read(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered cache contents as attention reads them: FP8 ones dequantised to ``dtype`` (kv_fp8.py)."""
        if self.k_scale is None:
            return k, v
        return kv_fp8.dequantize(k, self.k_scale, dtype), kv_fp8.dequantize(v, self.v_scale, dtype)

    def as_stored(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's k/v as a later read of the cache returns them (FP8: quantised and dequantised)."""
        if self.k_scale is None:
            return k, v
        return kv_fp8.round_trip(k, self.k_scale), kv_fp8.round_trip(v, self.v_scale)


@dataclass
class ForwardBatch:
    """Layout of one forward step. T = total tokens, B = sequences, nb = block-table width."""

    positions: torch.Tensor  # [T] long: absolute position of each token
    slot_mapping: torch.Tensor  # [T] long: flat cache slot (block * block_size + offset) each token's k/v goes to
    block_tables: torch.Tensor  # [B, nb] long: each sequence's blocks (padded with the null block)
    seq_lens: torch.Tensor  # [B] long: tokens in cache after this step (context + chunk)
    cu_seqlens_q: torch.Tensor  # [B+1] long: where each sequence's tokens start in T
    token_seq: torch.Tensor  # [T] long: which sequence (0..B-1) each token belongs to
    token_qidx: torch.Tensor  # [T] long: index of the token inside its sequence's chunk
    last_token_index: torch.Tensor  # [B] long: index into T of each sequence's last token
    query_lens: list[int]  # [B] host copy: tokens of each sequence in this step
    max_query_len: int
    max_seq_len: int  # host upper bound of seq_lens (exact for eager steps, a bucket for graphs)
    block_size: int
    # Mixed steps: [(token_lo, token_hi, sub-batch)] for the decode rows, then the prefill rows, so that the
    # reference path does not pad single decode tokens to the prefill chunk's length.
    parts: list | None = None
    # First of the step's last sequences that take dense causal SDPA with use_kernels (B: none): prompts from
    # position 0, from the first with DENSE_PREFILL_MIN_TOKENS on (see the module docstring and ``build``).
    dense_from: int | None = None
    use_kernels: bool = False  # attention through paged_attention.py's kernels (set by the runner)
    # False in a prefill graph's padded step (core/prefill_graphs.py): query_lens / context_lens do not describe it
    # (zeros), every length is on the device; MLA then takes every row through its absorbed kernel (token_rows).
    host_lengths: bool = True
    # Hybrid models' recurrent layers (layers/recurrent.py): each sequence's state slot [B] long, and on the host
    # (eager steps; None in a captured decode step) the slots, each sequence's tokens before the step and where
    # its tokens start in T
    state_slots: torch.Tensor | None = None
    state_slots_host: list[int] | None = None
    context_lens: list[int] | None = None
    query_starts: list[int] | None = None
    _masks: dict = field(default_factory=dict, repr=False)
    _int32: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        context_lens: list[int],
        query_lens: list[int],
        device: torch.device | str,
        block_size: int,
        null_block: int = 0,
        split_parts: bool = True,
        dense_prefill_min: int | None = None,  # None: DENSE_PREFILL_MIN_TOKENS (read at each call)
        state_slots: list[int] | None = None,  # recurrent-state slot of each sequence (None: slot b for sequence b)
    ) -> "ForwardBatch":
        """Host-side construction from per-sequence (blocks, tokens already cached, new tokens). Each table
        must cover the sequence's context + new tokens."""
        # numpy over the step's tokens (an 8192-token prefill step: ~0.3 ms instead of ~4 ms of Python loops)
        B = len(block_tables)
        q_arr = np.asarray(query_lens, dtype=np.int64).reshape(B)
        ctx_arr = np.asarray(context_lens, dtype=np.int64).reshape(B)
        cu = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(q_arr, out=cu[1:])
        T = int(cu[-1])
        seq_lens = ctx_arr + q_arr
        max_seq_len = int(seq_lens.max()) if B else 0
        nb = max(1, -(-max_seq_len // block_size))
        tables = np.full((B, nb), null_block, dtype=np.int64)
        for b, table in enumerate(block_tables):
            if len(table) * block_size < seq_lens[b]:
                raise ValueError(f"sequence {b}: {len(table)} blocks of {block_size} cannot hold {seq_lens[b]} tokens")
            row = table[:nb]
            tables[b, : len(row)] = row
        token_seq = np.repeat(np.arange(B, dtype=np.int64), q_arr)  # [T]
        token_qidx = np.arange(T, dtype=np.int64) - cu[:-1][token_seq]  # [T]
        positions = ctx_arr[token_seq] + token_qidx  # [T]
        slots = tables[token_seq, positions // block_size] * block_size + positions % block_size  # [T]
        last = cu[1:] - 1  # [B]
        # One host->device copy for all fields, split as views; it does not wait for the step in flight.
        state = np.asarray(list(range(B)) if state_slots is None else state_slots, dtype=np.int64).reshape(B)
        packed = upload(np.concatenate([positions, slots, tables.reshape(-1), seq_lens, cu, token_seq, token_qidx,
                                        last, state]), device)
        names = ("positions", "slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q", "token_seq", "token_qidx",
                 "last_token_index", "state_slots")
        fields = dict(zip(names, torch.split(packed, [T, T, B * nb, B, B + 1, T, T, B, B])))
        fields["block_tables"] = fields["block_tables"].view(B, nb)
        fields.update(state_slots_host=state.tolist(), context_lens=ctx_arr.tolist(), query_starts=cu[:-1].tolist())
        parts = None
        nd = 0  # leading decode rows (the scheduler plans decodes first)
        while nd < B and query_lens[nd] == 1:
            nd += 1
        if split_parts and 0 < nd < B:
            sub = [(block_tables[:nd], context_lens[:nd], query_lens[:nd], state[:nd].tolist()),
                   (block_tables[nd:], context_lens[nd:], query_lens[nd:], state[nd:].tolist())]
            parts = [
                (lo, hi, cls.build(*args[:3], device, block_size, null_block, split_parts=False, state_slots=args[3]))
                for (lo, hi), args in zip(((0, nd), (nd, T)), sub)
            ]
        dense_from = B  # the trailing run of prompts from position 0 (2+ tokens: not a decode) ...
        while dense_from > 0 and context_lens[dense_from - 1] == 0 and query_lens[dense_from - 1] >= 2:
            dense_from -= 1
        minimum = DENSE_PREFILL_MIN_TOKENS if dense_prefill_min is None else dense_prefill_min
        while dense_from < B and query_lens[dense_from] < minimum:  # ... from its first long one on
            dense_from += 1
        if B - dense_from > DENSE_PREFILL_MAX_CALLS:
            dense_from = B
        return cls(
            query_lens=list(query_lens),
            max_query_len=max(query_lens) if query_lens else 0,
            max_seq_len=max_seq_len,
            block_size=block_size,
            parts=parts,
            dense_from=dense_from,
            **fields,
        )

    def leading_decodes(self) -> int:
        """How many of the step's first sequences forward one token each (the scheduler plans decodes first; a
        decode step: all of them). Host ints only; made once per step."""
        key = "leading_decodes"
        if key not in self._int32:
            nd = 0
            while nd < len(self.query_lens) and self.query_lens[nd] == 1:
                nd += 1
            self._int32[key] = nd
        return self._int32[key]

    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token as a one-query sequence of its own: its sequence's block-table row [T, nb] int32 and its keys
        (position + 1) [T] int32, from device tensors alone (no host sync: CUDA-graph capturable; a graph's padding
        tokens get the padding sequence's row and one key). Made once per step."""
        key = "token_rows"
        if key not in self._int32:
            tokens = torch.arange(self.num_tokens, device=self.positions.device)
            seq = torch.searchsorted(self.cu_seqlens_q[1:], tokens, right=True)  # [T]: cu[s] <= t < cu[s + 1]
            self._int32[key] = (self.block_tables.index_select(0, seq).to(torch.int32),
                                (self.positions + 1).to(torch.int32))
        return self._int32[key]

    def int32(self, name: str) -> torch.Tensor:
        """An int32 copy of a field, for the kernels (made once per step)."""
        if name not in self._int32:
            self._int32[name] = getattr(self, name).to(torch.int32)
        return self._int32[name]

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[B, 1, Tq, Lk] bool, True = may attend (reference path). Cached per window size for the step."""
        key = sliding_window
        if key not in self._masks:
            B, Tq = len(self.query_lens), self.max_query_len
            Lk = self.max_seq_len
            device = self.positions.device
            k_pos = torch.arange(Lk, device=device)  # [Lk]
            if Tq == 1:  # decode: each query is its sequence's last token, so causal = inside its length
                allowed = k_pos[None, :] < self.seq_lens[:, None]  # [B, Lk]
                if sliding_window is not None:
                    allowed &= k_pos[None, :] > (self.positions[:, None] - sliding_window)
                self._masks[key] = allowed[:, None, None, :]
                return self._masks[key]
            q_pos = torch.full((B, Tq), -1, dtype=torch.long, device=device)
            q_pos[self.token_seq, self.token_qidx] = self.positions  # [B, Tq], -1 = padding
            allowed = k_pos[None, None, :] <= q_pos[:, :, None]  # causal
            allowed &= k_pos[None, None, :] < self.seq_lens[:, None, None]
            if sliding_window is not None:
                allowed &= k_pos[None, None, :] > (q_pos[:, :, None] - sliding_window)
            # Padding query rows attend to key 0 so that no softmax row is empty (NaN);
            # their outputs are dropped when the step is unpadded.
            allowed[:, :, 0] |= q_pos < 0
            self._masks[key] = allowed[:, None]
        return self._masks[key]


def store_kv(k: torch.Tensor, v: torch.Tensor, cache: LayerKV, batch: ForwardBatch) -> None:
    """Write this step's k [T, Hkv, Dk] / v [T, Hkv, Dv] into the cache at each token's slot (the fused rotary,
    ``rotary_kernels.qk_norm_rope`` with ``kv_cache``, writes them itself and skips this)."""
    if batch.use_kernels:  # one kernel (kernels/rotary.py) instead of two index_puts and their copies
        rotary_kernels.store_kv(k, v, cache.k, cache.v, batch.slot_mapping, **cache.scales)
        return
    if cache.k_scale is not None:
        k, v = kv_fp8.quantize(k, cache.k_scale), kv_fp8.quantize(v, cache.v_scale)
    nb, bs = cache.k.shape[0], cache.k.shape[1]
    cache.k.view(nb * bs, *cache.k.shape[2:])[batch.slot_mapping] = k.to(cache.k.dtype)
    cache.v.view(nb * bs, *cache.v.shape[2:])[batch.slot_mapping] = v.to(cache.v.dtype)


def cached_kv(cache: LayerKV, batch: ForwardBatch, heads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's cached k [B, H, Lk, Dk] and v [B, H, Lk, Dv], gathered from its blocks in one copy each (Lk =
    the step's max_seq_len, exactly the longest sequence's keys as HF would hold them; positions past a sequence's
    own length hold stale values the mask hides). ``heads``: H = the query heads, each kv head repeated for its
    group as HF's repeat_kv does (the gather and the repeat in one copy); None: H = the cache's kv heads."""
    nb_all, bs, Hkv = cache.k.shape[:3]
    H = heads or Hkv
    key = ("slots", H)
    if key not in batch._int32:  # per step: flat cache row of every (sequence, head, position), reused by all layers
        Lk = batch.max_seq_len
        pos = torch.arange(Lk, device=batch.block_tables.device)
        slots = batch.block_tables[:, pos // bs] * bs + pos % bs  # [B, Lk]
        head = torch.arange(H, device=slots.device) // (H // Hkv)  # [H] kv head of each query head
        batch._int32[key] = (slots[:, None, :] * Hkv + head[None, :, None]).reshape(-1)  # [B*H*Lk] rows of (slot, head)
    rows = batch._int32[key]
    B, Lk = batch.block_tables.shape[0], batch.max_seq_len
    k = cache.k.view(nb_all * bs * Hkv, -1).index_select(0, rows).view(B, H, Lk, -1)
    v = cache.v.view(nb_all * bs * Hkv, -1).index_select(0, rows).view(B, H, Lk, -1)
    return k, v


def cached_kv_by_block(cache: LayerKV, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each sequence's cached k [B, Hkv, Lk, Dk] and v [B, Hkv, Lk, Dv] (Lk = the step's max_seq_len, as
    ``cached_kv`` with its kv heads), as strided views of one whole-block gather per tensor: B*nb copies of a
    contiguous [block_size, Hkv, D] block, where ``cached_kv`` indexes every (sequence, head, position) row and,
    for grouped-query heads, copies each kv head once per query head (on CPU at 16 decoding sequences of ~200
    keys that gather and the repeated keys' SDPA were a fifth of a Mixtral decode step). With SDPA's enable_gqa
    the result is bit for bit ``cached_kv(cache, batch, Hq)``'s (the same values, the same kernel).
    None when the block tables cannot hold Lk keys (a padded step whose max_seq_len is a bucket)."""
    nb_all, bs, Hkv = cache.k.shape[:3]
    B, nb = batch.block_tables.shape
    Lk = batch.max_seq_len
    if nb * bs < Lk:
        return None
    blocks = batch.block_tables.reshape(-1)  # [B*nb]
    k = cache.k.index_select(0, blocks).view(B, nb * bs, Hkv, -1)[:, :Lk].transpose(1, 2)  # [B, Hkv, Lk, Dk]
    v = cache.v.index_select(0, blocks).view(B, nb * bs, Hkv, -1)[:, :Lk].transpose(1, 2)  # [B, Hkv, Lk, Dv]
    return k, v


def attend_cached(
    q: torch.Tensor,  # [T, Hq, Dk]
    keys: torch.Tensor,  # [B, Hkv, Lk, Dk]
    values: torch.Tensor,  # [B, Hkv, Lk, Dv]
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, Dv]
    """Reference attention of the step's queries over gathered keys/values (MLA expands its latent cache first)."""
    B, Tq = len(batch.query_lens), batch.max_query_len
    Hq, Dk, Dv = q.shape[1], q.shape[2], values.shape[-1]
    Hkv = keys.shape[1]
    if Tq == 1:
        q_pad = q.view(B, 1, Hq, Dk).transpose(1, 2)  # [B, Hq, 1, Dk]
    else:
        q_pad = q.new_zeros(B, Tq, Hq, Dk)
        q_pad[batch.token_seq, batch.token_qidx] = q
        q_pad = q_pad.transpose(1, 2)  # [B, Hq, Tq, Dk]
    gqa = Hkv != Hq  # grouped-query attention: each kv head serves Hq/Hkv query heads (as HF's repeat_kv)
    mask = batch.mask(sliding_window)  # [B, 1, Tq, Lk]

    if sinks is None:  # SDPA maps each query head to its kv head itself (no repeated copies)
        out = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    else:
        if gqa:
            keys = keys.repeat_interleave(Hq // Hkv, dim=1)
            values = values.repeat_interleave(Hq // Hkv, dim=1)
        # Attention sinks (GPT-OSS), as HF's eager_attention_forward: an extra per-head logit joins the
        # softmax and is dropped after it; the max is subtracted and the softmax runs in the scores' dtype.
        scores = torch.matmul(q_pad, keys.transpose(-1, -2)) * scale  # [B, Hq, Tq, Lk]
        scores = scores.masked_fill(~mask, float("-inf"))
        sink = sinks.to(scores.dtype).reshape(1, Hq, 1, 1).expand(B, Hq, Tq, 1)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
        out = torch.matmul(probs.to(values.dtype), values)  # [B, Hq, Tq, Dv]

    out = out.transpose(1, 2)  # [B, Tq, Hq, Dv]
    if Tq == 1:
        return out.reshape(B, Hq, Dv)
    return out[batch.token_seq, batch.token_qidx]  # [T, Hq, Dv]


_dense_refused: set = set()  # (device type, dtype, head dims) whose dense causal SDPA raised: paged kernel


def _refuse_dense(key: tuple, err: RuntimeError) -> None:
    """Remember that no SDPA backend takes ``key``'s shapes (they stay on the paged kernel); out of memory is no
    refusal and is raised."""
    if isinstance(err, torch.OutOfMemoryError):
        raise err
    log.warning("dense causal SDPA refused %s (%s); prefill attention stays on the paged kernel", key, err)
    _dense_refused.add(key)


def attend_kernels(
    q: torch.Tensor,  # [T, Hq, Dk]
    k: torch.Tensor,  # [T, Hkv, Dk]: this step's keys (already in the cache)
    v: torch.Tensor,  # [T, Hkv, Dv]
    cache: LayerKV,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:  # [T, Hq, Dv]
    """The kernel path: paged attention for the step's sequences, but its trailing prompts prefilled from position
    0 (``batch.dense_from``) through ``dense_causal`` on their own k/v when no window or sink applies."""
    B = len(batch.query_lens)
    nf = batch.dense_from if batch.dense_from is not None else B
    key = (q.device.type, q.dtype, q.shape[-1], v.shape[-1]) if nf < B else None
    if nf < B and (sliding_window is not None or sinks is not None or q.dtype == torch.float32
                   or key in _dense_refused):
        nf = B
    if nf == B:
        return paged_attention.paged_attention(
            q, cache.k, cache.v, batch.int32("block_tables"), batch.int32("cu_seqlens_q"), batch.int32("seq_lens"),
            max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len, scale=scale,
            sliding_window=sliding_window, sinks=sinks, **cache.scales,
        )
    starts = [0]
    for n in batch.query_lens:
        starts.append(starts[-1] + n)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    k, v = cache.as_stored(k, v)  # an FP8 cache: the values the paged kernel would read back
    try:
        for b in range(nf, B):
            lo, hi = starts[b], starts[b + 1]
            out[lo:hi] = dense_causal(q[lo:hi], k[lo:hi], v[lo:hi], scale)
    except RuntimeError as err:  # no SDPA backend takes these shapes here: the paged kernel does all of it
        _refuse_dense(key, err)
        return attend_kernels(q, k, v, cache, batch, scale, sliding_window, sinks)
    if nf > 0:
        t0 = starts[nf]
        paged_attention.paged_attention(
            q[:t0], cache.k, cache.v, batch.int32("block_tables")[:nf], batch.int32("cu_seqlens_q")[:nf + 1],
            batch.int32("seq_lens")[:nf], max_query_len=max(batch.query_lens[:nf]), max_seq_len=batch.max_seq_len,
            scale=scale, out=out[:t0], **cache.scales,
        )
    return out


def dense_bucket(length: int) -> int:
    """The padded length dense_causal runs a prompt of ``length`` tokens at: a multiple of DENSE_PREFILL_BUCKET,
    or of a sixteenth of the next power of two above that (eight buckets per doubling, <= 1/8 padding)."""
    step = max(DENSE_PREFILL_BUCKET, paged_attention._pow2(length) // 16)
    return -(-length // step) * step


def dense_causal(
    q: torch.Tensor,  # [L, Hq, Dk]: one sequence's queries at positions 0..L-1
    k: torch.Tensor,  # [L, Hkv, Dk]: its keys, the same positions
    v: torch.Tensor,  # [L, Hkv, Dv]
    scale: float,
) -> torch.Tensor:  # [L, Hq, Dv]
    """Causal attention of a prompt over itself by torch's SDPA: on CUDA cuDNN's kernel first, FlashAttention's
    second (grouped-query heads without repeated K/V); elsewhere SDPA's default. q/k/v are copied into zero-padded
    contiguous [1, H, dense_bucket(L), D] tensors: one layout and a few lengths, so a few cuDNN plans; the padding
    sits after every real position, which causal attention never lets a real query see (and zeros, not stale
    memory: a masked score still multiplies its value by 0). Raises RuntimeError when no backend takes the call."""
    L = q.shape[0]
    Lp = dense_bucket(L)

    def padded(x: torch.Tensor) -> torch.Tensor:  # [L, H, D] -> [1, H, Lp, D]
        out = x.new_zeros(1, x.shape[1], Lp, x.shape[2])
        out[0, :, :L] = x.transpose(0, 1)
        return out

    qp, kp, vp = padded(q), padded(k), padded(v)
    gqa = q.shape[1] != k.shape[1]
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True):
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa)
    return o[0, :, :L].transpose(0, 1)


def warm_dense_prefill(
    shapes: set[tuple[int, int, int, int]],  # (Hq, Hkv, Dk, Dv) of the layers that may take dense_causal
    device: torch.device,
    dtype: torch.dtype,
    max_tokens: int,  # the longest prompt chunk a step can hold
) -> int:
    """Run dense_causal once per length bucket from DENSE_PREFILL_MIN_TOKENS to ``max_tokens`` and per shape, so
    that cuDNN's plans exist before serving; returns the calls made. A shape no backend takes is remembered (its
    layers stay on the paged kernel) and logged."""
    calls = 0
    for hq, hkv, dk, dv in sorted(shapes):
        key = (device.type, dtype, dk, dv)
        length = DENSE_PREFILL_MIN_TOKENS
        while length <= max_tokens and key not in _dense_refused:
            bucket = dense_bucket(length)
            q = torch.zeros(bucket, hq, dk, device=device, dtype=dtype)
            k = torch.zeros(bucket, hkv, dk, device=device, dtype=dtype)
            v = torch.zeros(bucket, hkv, dv, device=device, dtype=dtype)
            try:
                dense_causal(q, k, v, dk**-0.5)
                calls += 1
            except RuntimeError as err:
                _refuse_dense(key, err)
            length = bucket + 1
    return calls


def attend(
    q: torch.Tensor,  # [T, Hq, Dk]
    k: torch.Tensor,  # [T, Hkv, Dk]
    v: torch.Tensor,  # [T, Hkv, Dv]
    cache: LayerKV,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq] per-head sink logits (GPT-OSS), or None
    invariant: bool = False,  # deterministic inference: the batch-invariant attention (``attend_stored``)
) -> torch.Tensor:  # [T, Hq, Dv]
    """Write this step's k/v into the cache, then attend causally within each sequence (``attend_stored``)."""
    store_kv(k, v, cache, batch)
    return attend_stored(q, k, v, cache, batch, scale, sliding_window, sinks, invariant)


def attend_stored(
    q: torch.Tensor,  # [T, Hq, Dk]
    k: torch.Tensor,  # [T, Hkv, Dk]: this step's keys, already in the cache
    v: torch.Tensor,  # [T, Hkv, Dv]
    cache: LayerKV,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    invariant: bool = False,
) -> torch.Tensor:  # [T, Hq, Dv]
    """Attend causally within each sequence over the cache, which holds this step's k/v already. ``invariant``
    (deterministic inference): kernels/batch_invariant.py's attention on the kernel path, else
    layers/invariant.py's; a query's result then depends on its own keys only."""
    if invariant:
        if batch.use_kernels:
            from ..kernels import batch_invariant as bi_kernels

            return bi_kernels.attention(
                q, cache.k, cache.v, batch.int32("block_tables"), batch.int32("cu_seqlens_q"),
                batch.int32("seq_lens"), max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
                scale=scale, sliding_window=sliding_window, sinks=sinks)
        from . import invariant as inv

        return inv.attention_from_cache(q, cache, batch, scale, sliding_window, sinks)
    if batch.use_kernels:
        return attend_kernels(q, k, v, cache, batch, scale, sliding_window, sinks)
    if batch.parts is not None:
        return torch.cat([
            attend_cached(q[a:b], *_gathered_kv(cache, sub, q, sinks), sub, scale, sliding_window, sinks)
            for a, b, sub in batch.parts
        ])
    return attend_cached(q, *_gathered_kv(cache, batch, q, sinks), batch, scale, sliding_window, sinks)


def _gathered_kv(cache: LayerKV, batch: ForwardBatch, q: torch.Tensor, sinks: torch.Tensor | None):
    """The reference path's keys/values, in q's dtype (an FP8 cache dequantised as the kernels read it): on CPU
    without sinks whole blocks (``cached_kv_by_block``, kv heads); elsewhere ``cached_kv`` repeated to the query
    heads (CUDA's SDPA backends differ in what takes enable_gqa, and the sinks' matmuls want the heads repeated)."""
    gathered = None
    if sinks is None and cache.k.device.type == "cpu":
        gathered = cached_kv_by_block(cache, batch)
    return cache.read(*(gathered or cached_kv(cache, batch, q.shape[1])), q.dtype)
