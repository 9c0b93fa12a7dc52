"""Paged KV cache: per layer, one buffer pair of fixed-size blocks, and the budget that sizes it.

Layout per layer: ``k [num_blocks, block_size, Hkv, Dk]``, ``v [num_blocks, block_size, Hkv, Dv]`` (MLA layers
cache the compressed latent as "k" and the shared rotated key as "v", one "head"). A sequence's token at position
p lives in block ``block_table[p // block_size]`` at offset ``p % block_size``; the flat *slot* of that token is
``block * block_size + offset``. Which blocks a sequence owns is the block manager's business
(block_manager.py); this module only allocates memory and says how many blocks a budget holds.

The last block is never handed out: CUDA-graph padding rows write their keys there (``null_block``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import LayerKV


@dataclass(frozen=True)
class KVSpec:
    """Per-layer cache geometry a model asks for (MLA layers have k_dim != v_dim)."""

    num_kv_heads: int
    k_dim: int
    v_dim: int


def bytes_per_block(specs: list[KVSpec], block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(s.num_kv_heads * (s.k_dim + s.v_dim) for s in specs) * block_size * elem


def blocks_for_budget(specs: list[KVSpec], block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """Blocks that fit ``budget_bytes`` (the null block included)."""
    return int(budget_bytes // bytes_per_block(specs, block_size, dtype))


class KVCache:
    def __init__(
        self, specs: list[KVSpec], num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
    ):
        if num_blocks < 2:
            raise ValueError(f"a KV cache needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.null_block = num_blocks - 1
        self.layers = [
            LayerKV(
                k=torch.zeros(num_blocks, block_size, s.num_kv_heads, s.k_dim, dtype=dtype, device=device),
                v=torch.zeros(num_blocks, block_size, s.num_kv_heads, s.v_dim, dtype=dtype, device=device),
            )
            for s in specs
        ]
        self.nbytes = sum(layer.k.nbytes + layer.v.nbytes for layer in self.layers)

    @classmethod
    def for_sequences(
        cls, specs: list[KVSpec], num_seqs: int, max_len: int, dtype: torch.dtype, device: torch.device | str,
        block_size: int = 16,
    ) -> "KVCache":
        """A cache in which sequence s owns the fixed blocks ``sequence_blocks(s)`` (reference runs, tests)."""
        per_seq = -(-max_len // block_size)
        cache = cls(specs, num_seqs * per_seq + 1, block_size, dtype, device)
        cache._per_seq = per_seq
        return cache

    def sequence_blocks(self, s: int) -> list[int]:
        n = self._per_seq
        return list(range(s * n, (s + 1) * n))

    def __getitem__(self, layer: int) -> LayerKV:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)
