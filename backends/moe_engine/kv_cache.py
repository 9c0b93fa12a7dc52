"""KV cache: one preallocated buffer pair per layer, indexed by sequence slot.

Slot-indexed (not paged): a sequence holds one slot of ``max_model_len``
positions for its whole life. The number of slots is the smaller of
``max_num_seqs`` and what the memory budget allows, so admission control is a
free-slot count and a decode step never allocates.
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


def bytes_per_slot(specs: list[KVSpec], max_model_len: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(s.num_kv_heads * (s.k_dim + s.v_dim) for s in specs) * max_model_len * elem


def slots_for_budget(
    specs: list[KVSpec], max_model_len: int, dtype: torch.dtype, max_num_seqs: int, budget_bytes: int | None
) -> int:
    """How many sequence slots fit: max_num_seqs, capped by the budget (at least one)."""
    if budget_bytes is None:
        return max_num_seqs
    per_slot = bytes_per_slot(specs, max_model_len, dtype)
    fit = budget_bytes // per_slot
    if fit < 1:
        raise ValueError(
            f"KV cache budget of {budget_bytes / 2**20:.1f} MiB cannot hold one sequence of "
            f"max_model_len={max_model_len} ({per_slot / 2**20:.1f} MiB per sequence); "
            "raise the budget or lower max_model_len"
        )
    return int(min(max_num_seqs, fit))


class KVCache:
    def __init__(
        self, specs: list[KVSpec], num_slots: int, max_model_len: int, dtype: torch.dtype, device: torch.device
    ):
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.layers = [
            LayerKV(
                k=torch.zeros(num_slots, s.num_kv_heads, max_model_len, s.k_dim, dtype=dtype, device=device),
                v=torch.zeros(num_slots, s.num_kv_heads, max_model_len, s.v_dim, dtype=dtype, device=device),
            )
            for s in specs
        ]
        self.nbytes = sum(layer.k.nbytes + layer.v.nbytes for layer in self.layers)

    def __getitem__(self, layer: int) -> LayerKV:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)
