"""Batched attention over a slot-indexed KV cache.

One forward step carries the tokens of several sequences flattened into one
dimension T (prefill chunks and single decode tokens mixed). Each sequence owns
a cache *slot*; its keys and values live at ``cache[slot, :, position]``.

``ForwardBatch`` describes one step; it is built once per step on the host and
shared by all layers. ``attend`` is what a model's attention layer calls: it
writes the step's k/v into the cache and attends each query to the keys of its
own sequence, causally (and inside a sliding window when the layer has one).
Models never see slots, padding or masks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import kernels


@dataclass
class ForwardBatch:
    """Layout of one forward step. T = total tokens, B = sequences."""

    slot_ids: torch.Tensor  # [B] long: cache slot of each sequence
    positions: torch.Tensor  # [T] long: absolute position of each token
    token_seq: torch.Tensor  # [T] long: which sequence (0..B-1) each token belongs to
    token_qidx: torch.Tensor  # [T] long: index of the token inside its sequence's chunk
    kv_lens: torch.Tensor  # [B] long: tokens in cache after this step (context + chunk)
    query_lens: list[int]  # [B] host copy: tokens of each sequence in this step
    max_query_len: int
    max_kv_len: int
    last_token_index: torch.Tensor  # [B] long: index into T of each sequence's last token
    # Slots are slot_start..slot_start+B-1 (the engine hands out the lowest free slot and orders a step
    # by slot, so this is the common case): the cache is then read as a view, with no gather copy.
    slot_start: int | None = None
    # Mixed steps: [(token_lo, token_hi, sub-batch)] for the decode rows, then the prefill rows, so that
    # single decode tokens are not padded to the prefill chunk's length in attention.
    parts: list | None = None
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(
        cls,
        slot_ids: list[int],
        context_lens: list[int],
        query_lens: list[int],
        device: torch.device | str,
    ) -> "ForwardBatch":
        """Host-side construction from per-sequence (slot, tokens already cached, new tokens)."""
        positions, token_seq, token_qidx, last = [], [], [], []
        offset = 0
        for b, (ctx, q) in enumerate(zip(context_lens, query_lens)):
            positions.extend(range(ctx, ctx + q))
            token_seq.extend([b] * q)
            token_qidx.extend(range(q))
            offset += q
            last.append(offset - 1)
        kv_lens = [c + q for c, q in zip(context_lens, query_lens)]
        B, T = len(slot_ids), offset
        # One host->device copy for all fields (each blocking copy waits for the GPU to drain), split as views.
        packed = torch.tensor(
            [*slot_ids, *positions, *token_seq, *token_qidx, *kv_lens, *last], dtype=torch.long, device=device
        )
        names = ("slot_ids", "positions", "token_seq", "token_qidx", "kv_lens", "last_token_index")
        fields = dict(zip(names, torch.split(packed, [B, T, T, T, B, B])))

        slot_start = slot_ids[0] if B and list(slot_ids) == list(range(slot_ids[0], slot_ids[0] + B)) else None
        parts = None
        nd = 0  # leading decode rows (the engine plans decodes first)
        while nd < B and query_lens[nd] == 1:
            nd += 1
        if 0 < nd < B:
            parts = [
                (0, nd, cls.build(slot_ids[:nd], context_lens[:nd], query_lens[:nd], device)),
                (nd, offset, cls.build(slot_ids[nd:], context_lens[nd:], query_lens[nd:], device)),
            ]
        return cls(
            slot_start=slot_start,
            parts=parts,
            query_lens=list(query_lens),
            max_query_len=max(query_lens),
            max_kv_len=max(kv_lens),
            **fields,
        )

    @classmethod
    def single(cls, num_tokens: int, device: torch.device | str = "cpu", slot: int = 0) -> "ForwardBatch":
        """A whole fresh sequence in one step (reference runs, tests)."""
        return cls.build([slot], [0], [num_tokens], device)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[B, 1, Tq, Lk] bool, True = may attend. Cached per window size for the step."""
        key = sliding_window
        if key not in self._masks:
            B, Tq, Lk = len(self.query_lens), self.max_query_len, self.max_kv_len
            device = self.positions.device
            if Tq == 1:  # decode: each query is its sequence's last token, so causal = inside its length
                k_pos = torch.arange(Lk, device=device)  # [Lk]
                allowed = k_pos[None, :] < self.kv_lens[:, None]  # [B, Lk]
                if sliding_window is not None:
                    allowed &= k_pos[None, :] > (self.positions[:, None] - sliding_window)
                self._masks[key] = allowed[:, None, None, :]
                return self._masks[key]
            q_pos = torch.full((B, Tq), -1, dtype=torch.long, device=device)
            q_pos[self.token_seq, self.token_qidx] = self.positions  # [B, Tq], -1 = padding
            k_pos = torch.arange(Lk, device=device)  # [Lk]
            allowed = k_pos[None, None, :] <= q_pos[:, :, None]  # causal
            allowed &= k_pos[None, None, :] < self.kv_lens[:, None, None]
            if sliding_window is not None:
                allowed &= k_pos[None, None, :] > (q_pos[:, :, None] - sliding_window)
            # Padding query rows attend to key 0 so that no softmax row is empty (NaN);
            # their outputs are dropped when the step is unpadded.
            allowed[:, :, 0] |= q_pos < 0
            self._masks[key] = allowed[:, None]
        return self._masks[key]


@dataclass
class LayerKV:
    """One layer's cache: k [S, Hkv, M, Dk], v [S, Hkv, M, Dv] (S slots, M max_model_len)."""

    k: torch.Tensor
    v: torch.Tensor


def store_kv(k: torch.Tensor, v: torch.Tensor, cache: LayerKV, batch: ForwardBatch, fused: bool = False) -> None:
    """Write this step's k [T, Hkv, Dk] / v [T, Hkv, Dv] into the cache at each token's (slot, position)."""
    if fused:  # one kernel (kernels.py) instead of an index, two index_puts and their copies
        kernels.store_kv(k, v, cache.k, cache.v, batch.slot_ids, batch.token_seq, batch.positions)
        return
    token_slot = batch.slot_ids[batch.token_seq]  # [T]
    cache.k[token_slot, :, batch.positions] = k.to(cache.k.dtype)
    cache.v[token_slot, :, batch.positions] = v.to(cache.v.dtype)


def cached_kv(cache: LayerKV, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's cached k [B, Hkv, Lk, Dk] and v [B, Hkv, Lk, Dv] (Lk = longest kv length of the step;
    positions past a sequence's own length hold stale values that the mask hides)."""
    Lk = batch.max_kv_len
    if batch.slot_start is not None:
        s0, B = batch.slot_start, len(batch.query_lens)
        return cache.k[s0 : s0 + B, :, :Lk], cache.v[s0 : s0 + B, :, :Lk]
    return cache.k[:, :, :Lk].index_select(0, batch.slot_ids), cache.v[:, :, :Lk].index_select(0, batch.slot_ids)


def attend_cached(
    q: torch.Tensor,  # [T, Hq, Dk]
    keys: torch.Tensor,  # [B, Hkv, Lk, Dk]
    values: torch.Tensor,  # [B, Hkv, Lk, Dv]
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, Dv]
    """Attention of the step's queries over already gathered keys/values (MLA expands its latent cache first)."""
    B, Tq = len(batch.query_lens), batch.max_query_len
    Hq, Dk, Dv = q.shape[1], q.shape[2], values.shape[-1]
    Hkv = keys.shape[1]
    if Tq == 1:
        q_pad = q.view(B, 1, Hq, Dk).transpose(1, 2)  # [B, Hq, 1, Dk]
    else:
        q_pad = q.new_zeros(B, Tq, Hq, Dk)
        q_pad[batch.token_seq, batch.token_qidx] = q
        q_pad = q_pad.transpose(1, 2)  # [B, Hq, Tq, Dk]
    if Hkv != Hq:  # grouped-query attention: each kv head serves Hq/Hkv query heads
        keys = keys.repeat_interleave(Hq // Hkv, dim=1)
        values = values.repeat_interleave(Hq // Hkv, dim=1)
    mask = batch.mask(sliding_window)  # [B, 1, Tq, Lk]

    if sinks is None:
        out = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=mask, scale=scale)
    else:
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


def attend(
    q: torch.Tensor,  # [T, Hq, Dk]
    k: torch.Tensor,  # [T, Hkv, Dk]
    v: torch.Tensor,  # [T, Hkv, Dv]
    cache: LayerKV,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq] per-head sink logits (GPT-OSS), or None
    fused: bool = False,  # write the cache with the fused kernel (kernels.py)
) -> torch.Tensor:  # [T, Hq, Dv]
    """Write this step's k/v into the cache, then attend causally within each sequence."""
    store_kv(k, v, cache, batch, fused)
    if batch.parts is not None:
        return torch.cat(
            [attend_cached(q[a:b], *cached_kv(cache, sub), sub, scale, sliding_window, sinks) for a, b, sub in batch.parts]
        )
    keys, values = cached_kv(cache, batch)
    return attend_cached(q, keys, values, batch, scale, sliding_window, sinks)
