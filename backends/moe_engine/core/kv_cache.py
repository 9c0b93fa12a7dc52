"""Paged KV cache: per layer, one buffer pair of fixed-size blocks, and the budget that sizes it.

Layout per layer: ``k [num_blocks, block_size, Hkv, Dk]``, ``v [num_blocks, block_size, Hkv, Dv]`` (MLA layers
cache the compressed latent as "k" and the shared rotated key as "v", one "head"). A sequence's token at position
p lives in block ``block_table[p // block_size]`` at offset ``p % block_size``; the flat *slot* of that token is
``block * block_size + offset``. Which blocks a sequence owns is the block manager's business
(block_manager.py); this module only allocates memory and says how many blocks a budget holds.

The last block is never handed out: CUDA-graph padding rows write their keys there (``null_block``).

``--kv-cache-dtype fp8``: the blocks hold float8 e4m3 (1 byte per value: twice the tokens of a bf16 cache in the same
bytes) with one float32 k_scale and v_scale per layer (kernels/kv_fp8.py), the checkpoint's or 1.0; recurrent states
stay in the model dtype.

Hybrid models: a layer whose ``kv_layout`` entry is a ``StateSpec`` (linear attention, Mamba) has no blocks but a
``LayerState`` (layers/recurrent.py): its states for ``num_state_slots`` sequence slots and one null slot, at fixed
addresses, allocated here beside the blocks and counted in the same budget (``state_bytes``).
"""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from ..kernels import kv_fp8
from ..layers.attend import ForwardBatch, LayerKV
from ..layers.experts import StepRouting
from ..layers.recurrent import LayerState, StateSpec
from .memory_plan import MemoryDivision, estimate_step_activations, quantized_weight_bytes, weight_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVSpec:
    """Per-layer cache geometry a model asks for (MLA layers have k_dim != v_dim)."""

    num_kv_heads: int
    k_dim: int
    v_dim: int


def bytes_per_block(specs: list[KVSpec | StateSpec], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block in every attention layer (``dtype``: the cache's, float8 for an FP8 cache)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(s.num_kv_heads * (s.k_dim + s.v_dim) for s in specs if isinstance(s, KVSpec)) * block_size * elem


def state_bytes(specs: list[KVSpec | StateSpec], num_slots: int, dtype: torch.dtype) -> int:
    """Bytes of the recurrent layers' states for ``num_slots`` sequences and the null slot (0 without such layers)."""
    return sum(s.nbytes(dtype) for s in specs if isinstance(s, StateSpec)) * (num_slots + 1) if num_slots else 0


def blocks_for_budget(specs: list[KVSpec | StateSpec], block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """Blocks that fit ``budget_bytes`` (the null block included)."""
    return int(budget_bytes // bytes_per_block(specs, block_size, dtype))


class KVCache:
    def __init__(
        self, specs: list[KVSpec | StateSpec], num_blocks: int, block_size: int, dtype: torch.dtype,
        device: torch.device | str, num_state_slots: int = 4, kv_dtype: torch.dtype | None = None,
        kv_scales: list[tuple[float, float] | None] | None = None,
    ):
        """``dtype``: the model's (recurrent states; the blocks too unless ``kv_dtype``). ``kv_dtype`` float8 e4m3:
        an FP8 cache, with ``kv_scales[layer]`` = (k_scale, v_scale) (None or missing: 1.0)."""
        if num_blocks < 2:
            raise ValueError(f"a KV cache needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.null_block = num_blocks - 1
        self.device = torch.device(device)
        self.kv_dtype = kv_dtype = kv_dtype or dtype
        fp8 = kv_dtype == kv_fp8.FP8_KV_DTYPE

        def scale(layer: int, which: int) -> torch.Tensor | None:
            pair = kv_scales[layer] if kv_scales is not None and layer < len(kv_scales) else None
            value = 1.0 if pair is None else float(pair[which])
            return torch.full((1,), value, dtype=torch.float32, device=device) if fp8 else None

        hybrid = any(isinstance(s, StateSpec) for s in specs)
        self.num_state_slots = num_state_slots if hybrid else 0  # sequences with a recurrent state at once
        # per layer: its KV blocks, its recurrent states, or None (a Nemotron-H MLP / MoE block keeps nothing)
        self.layers: list[LayerKV | LayerState | None] = [
            None if s is None else LayerState.allocate(s, num_state_slots, dtype, device) if isinstance(s, StateSpec)
            else LayerKV(
                k=torch.zeros(num_blocks, block_size, s.num_kv_heads, s.k_dim, dtype=kv_dtype, device=device),
                v=torch.zeros(num_blocks, block_size, s.num_kv_heads, s.v_dim, dtype=kv_dtype, device=device),
                k_scale=scale(i, 0), v_scale=scale(i, 1),
            )
            for i, s in enumerate(specs)
        ]
        self.kv_layers = [layer for layer in self.layers if isinstance(layer, LayerKV)]
        # what one token's KV costs in every layer (MLA: the latent + the rope key, never expanded K/V)
        self.bytes_per_token = bytes_per_block(specs, 1, kv_dtype)
        self.values_per_token_layer = sorted({s.num_kv_heads * (s.k_dim + s.v_dim) for s in specs
                                              if isinstance(s, KVSpec)})
        self.state_nbytes = sum(layer.nbytes for layer in self.layers if isinstance(layer, LayerState))
        self.nbytes = sum(layer.k.nbytes + layer.v.nbytes for layer in self.kv_layers) + self.state_nbytes

    @property
    def null_state_slot(self) -> int:
        """The state slot CUDA-graph padding rows write (no sequence's)."""
        return self.num_state_slots

    @classmethod
    def for_sequences(
        cls, specs: list[KVSpec | StateSpec], num_seqs: int, max_len: int, dtype: torch.dtype,
        device: torch.device | str, block_size: int = 16,
    ) -> "KVCache":
        """A cache in which sequence s owns the fixed blocks ``sequence_blocks(s)`` and state slot s (reference
        runs, tests)."""
        per_seq = -(-max_len // block_size)
        cache = cls(specs, num_seqs * per_seq + 1, block_size, dtype, device, num_state_slots=num_seqs)
        cache._per_seq = per_seq
        return cache

    def sequence_blocks(self, s: int) -> list[int]:
        n = self._per_seq
        return list(range(s * n, (s + 1) * n))

    def __getitem__(self, layer: int) -> LayerKV:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)


CPU_KV_BUDGET = 2 << 30  # CPU default: 2 GiB, or less when max_num_seqs full-length sequences need less


def kv_cache_budget(model: torch.nn.Module, specs: list[KVSpec], settings) -> int:
    """KV-cache bytes (``settings``: the engine's ResolvedConfig): ``kv_cache_memory_bytes`` when given; on CUDA the share ``gpu_memory_utilization`` of the
    GPU's memory minus what is in use (weights, other processes), a profiled peak step's activations and the same
    again for the decode graphs' pool; on CPU ``CPU_KV_BUDGET`` capped at what max_num_seqs full sequences need.
    Hybrid models' recurrent states (``state_bytes`` for max_num_seqs slots) come out of this budget too
    (runner.py's ``build_runner`` sizes the blocks from what they leave)."""
    if settings.kv_cache_memory_bytes:
        return settings.kv_cache_memory_bytes
    block_size, max_num_seqs, step_tokens = settings.block_size, settings.max_num_seqs, settings.step_tokens
    max_model_len, gpu_memory_utilization = settings.max_model_len, settings.gpu_memory_utilization
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    kv_dtype = kv_fp8.storage_dtype(settings.kv_cache_dtype, dtype)
    if device.type != "cuda":
        need = (max_num_seqs * -(-max_model_len // block_size) + 1) * bytes_per_block(specs, block_size, kv_dtype)
        return min(CPU_KV_BUDGET, need + state_bytes(specs, max_num_seqs, dtype))
    peak = profile_peak_activation(model, specs, block_size, step_tokens, max_num_seqs, settings.attention_kernels,
                                  kv_dtype)
    torch.cuda.synchronize(device)
    # Memory this process's caching allocator holds but no tensor uses (a previous engine's KV cache, the
    # profiling step's activations) is free for this one: hand it back before asking the driver.
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free  # weights, this process's other buffers, CUDA context, other processes
    budget = int(total * gpu_memory_utilization) - in_use - 2 * peak
    weights = weight_bytes(model)
    estimate = estimate_step_activations(model.config, step_tokens, min(max_num_seqs, step_tokens), dtype)["total"]
    division = MemoryDivision(total, gpu_memory_utilization, weights, max(0, in_use - weights), peak, estimate, budget,
                              quantized_weight_bytes(model))
    log.info("KV budget: %s", division.describe())
    if budget <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: {in_use / 2**30:.1f} GiB of {total / 2**30:.1f} GiB in use and "
            f"{2 * peak / 2**30:.1f} GiB needed for activations; raise --gpu-memory-utilization, lower "
            f"--max-num-batched-tokens, or give --kv-cache-memory"
        )
    return budget


@torch.inference_mode()
def profile_peak_activation(
    model: torch.nn.Module, specs: list[KVSpec], block_size: int, step_tokens: int, max_num_seqs: int,
    use_kernels: bool = False, kv_dtype: torch.dtype | None = None,
) -> int:
    """Peak device bytes a step of ``step_tokens`` prefill tokens allocates beyond what is allocated now
    (activations, expert buffers, logits and sampling of ``max_num_seqs`` rows), measured by running one.
    ``use_kernels``: the attention the engine will run (the runner's); the reference path's dense score matrix
    of one long prompt (8 GiB at GPT-OSS's 64 heads x 8,192 tokens) would be reserved for a step that never holds it."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    cfg = model.config
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    cache = KVCache(specs, -(-step_tokens // block_size) + 1, block_size, dtype, device, kv_dtype=kv_dtype)
    batch = ForwardBatch.build([list(range(cache.num_blocks - 1))], [0], [step_tokens], device, block_size,
                               split_parts=not use_kernels)
    batch.use_kernels = use_kernels
    capture = torch.zeros(step_tokens, cfg.num_hidden_layers, cfg.num_experts_per_tok, dtype=torch.int32,
                          device=device)
    ids = torch.randint(0, cfg.vocab_size, (step_tokens,), device=device)
    hidden = model(ids, batch, cache, StepRouting(ids=capture))
    rows = min(max_num_seqs, step_tokens)
    logits = model.compute_logits(hidden[:rows])
    torch.softmax(logits, dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base - cache.nbytes
    del cache, batch, capture, hidden, logits
    torch.cuda.empty_cache()
    return max(int(peak), 0)
