"""Sharding a model across the ranks of a tensor-parallel group (Megatron style), before its weights are read.

``shard_model(model, group, expert_parallel)`` runs on the model built on the ``meta`` device: it shrinks each
sharded parameter to this rank's part, sets the modules' local sizes (heads, experts), swaps the embedding and
the lm_head for their vocabulary-parallel versions, and returns, per parameter name, where this rank's part lies
in the checkpoint's tensor (a ``Selection``), so that checkpoint.py reads only that part from the memory map.
Module and parameter names stay Hugging Face's.

What rank r of N holds:
- attention: query heads [r*Hq/N, (r+1)*Hq/N) (q/k/v column-parallel by heads, o_proj row-parallel); key/value
  heads split the same way, or replicated when Hkv < N (rank r keeps head r*Hkv/N, the one its query heads
  read); each rank's paged KV cache holds its own key/value heads. MLA: the heads of q_proj / q_b_proj /
  kv_b_proj / o_proj; the latent projections are replicated (every rank caches the same latent);
- dense MLPs and shared experts: gate/up column-parallel, down row-parallel;
- routed experts: with expert parallelism experts [r*E/N, (r+1)*E/N), whole; without, every expert's width
  split (gate/up rows, down columns);
- routers and norms: replicated, so every rank routes the same hidden states to the same (logical) experts;
- embedding and lm_head: vocabulary rows [r*V', (r+1)*V') with V' = ceil(V/N), the last part zero-padded.
Row-parallel biases are rank 0's (zeros elsewhere), so that the all-reduce adds them once.

The partial outputs of a block are summed by one all-reduce in the decoder layer (model.py): one after attention
and one after the MLP or MoE block (routed and shared experts together). The embedding all-reduces its masked
lookups; the lm_head's logits are all-gathered (the runner samples on rank 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

Range = tuple[int, int]


class ShardingError(ValueError):
    """The model cannot be split this way (a size not divisible by the number of ranks)."""


@dataclass(frozen=True)
class Selection:
    """This rank's part of a checkpoint tensor: per dimension, the (start, stop) ranges read, concatenated in
    order; the local tensor may be larger (zero padding). ``zeros``: nothing is read, the part is zeros."""

    full_shape: tuple[int, ...]
    ranges: tuple[tuple[Range, ...], ...]
    zeros: bool = False

    def read_shape(self) -> tuple[int, ...]:
        return tuple(sum(b - a for a, b in rs) for rs in self.ranges)


def _split(n: int, world: int, rank: int, what: str) -> Range:
    if n % world:
        raise ShardingError(f"{what} ({n}) is not divisible by the tensor-parallel size {world}")
    k = n // world
    return rank * k, (rank + 1) * k


class _Sharder:
    """Collects the selections while it shrinks parameters on the meta model."""

    def __init__(self, model: nn.Module, rank: int, world: int):
        self.model, self.rank, self.world = model, rank, world
        self.names = {id(p): n for n, p in model.named_parameters()}  # a tied weight: its first name
        self.selections: dict[str, Selection] = {}

    def take(self, module: nn.Module, attr: str, ranges_by_dim: dict[int, tuple[Range, ...]],
             local: tuple[int, ...] | None = None) -> None:
        """Shrink ``module.attr`` to the given ranges (other dims whole); ``local``: a larger (padded) shape."""
        p = getattr(module, attr)
        full = tuple(p.shape)
        ranges = tuple(ranges_by_dim.get(d, ((0, n),)) for d, n in enumerate(full))
        sel = Selection(full, ranges)
        self._replace(module, attr, p, sel, local or sel.read_shape())

    def zero_unless_first(self, module: nn.Module, attr: str) -> None:
        """A row-parallel bias: rank 0 reads it whole, the others hold zeros."""
        p = getattr(module, attr)
        full = tuple(p.shape)
        sel = Selection(full, tuple(((0, n),) for n in full), zeros=self.rank != 0)
        self._replace(module, attr, p, sel, full)

    def _replace(self, module: nn.Module, attr: str, p: torch.Tensor, sel: Selection, shape) -> None:
        self.selections[self.names[id(p)]] = sel
        setattr(module, attr, nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"), requires_grad=False))

    def column(self, linear: nn.Linear, rows: tuple[Range, ...]) -> None:
        self.take(linear, "weight", {0: rows})
        if linear.bias is not None:
            self.take(linear, "bias", {0: rows})

    def row(self, linear: nn.Linear, cols: tuple[Range, ...]) -> None:
        self.take(linear, "weight", {1: cols})
        if linear.bias is not None:
            self.zero_unless_first(linear, "bias")


# ----------------------------------------------------------------------------- per module kind


def _shard_attention(s: _Sharder, a: nn.Module) -> None:
    r, N = s.rank, s.world
    Hq, Hkv, D = a.num_heads, a.num_kv_heads, a.head_dim
    q0, q1 = _split(Hq, N, r, "num_attention_heads")
    if Hkv >= N:
        k0, k1 = _split(Hkv, N, r, "num_key_value_heads")
    else:  # replicated: rank r's query heads all read key/value head r*Hkv/N
        if N % Hkv:
            raise ShardingError(f"the tensor-parallel size {N} is not a multiple of num_key_value_heads ({Hkv})")
        if a.qk_norm == "full":
            raise ShardingError(f"a full-width q/k norm needs num_key_value_heads ({Hkv}) >= tensor-parallel size {N}")
        k0 = r * Hkv // N
        k1 = k0 + 1
    s.column(a.q_proj, ((q0 * D, q1 * D),))
    s.column(a.k_proj, ((k0 * D, k1 * D),))
    s.column(a.v_proj, ((k0 * D, k1 * D),))
    s.row(a.o_proj, ((q0 * D, q1 * D),))
    if a.sinks is not None:
        s.take(a, "sinks", {0: ((q0, q1),)})
    if a.qk_norm == "full":  # the norm spans every head: the forward gathers q and k (model.py)
        a.tp_slices = ((q0 * D, q1 * D), (k0 * D, k1 * D))
    a.num_heads, a.num_kv_heads = q1 - q0, k1 - k0


def _shard_mla(s: _Sharder, a: nn.Module) -> None:
    q0, q1 = _split(a.num_heads, s.world, s.rank, "num_attention_heads")
    qk, kv = a.qk_head_dim, a.nope + a.v_dim
    s.column(a.q_proj if hasattr(a, "q_proj") else a.q_b_proj, ((q0 * qk, q1 * qk),))
    s.column(a.kv_b_proj, ((q0 * kv, q1 * kv),))
    s.row(a.o_proj, ((q0 * a.v_dim, q1 * a.v_dim),))
    a.num_heads = q1 - q0


def _shard_mlp(s: _Sharder, mlp: nn.Module) -> None:
    i0, i1 = _split(mlp.gate_proj.out_features, s.world, s.rank, "an MLP's intermediate_size")
    s.column(mlp.gate_proj, ((i0, i1),))
    s.column(mlp.up_proj, ((i0, i1),))
    s.row(mlp.down_proj, ((i0, i1),))


def _shard_experts(s: _Sharder, ex: nn.Module, expert_parallel: bool) -> None:
    from ..layers.experts import GptOssExperts

    E = ex.num_experts
    if expert_parallel:
        e0, e1 = _split(E, s.world, s.rank, "the number of experts")
        for name, _ in list(ex.named_parameters(recurse=False)):
            s.take(ex, name, {0: ((e0, e1),)})
        ex.num_experts, ex.first_expert = e1 - e0, e0
        return
    if isinstance(ex, GptOssExperts):  # gate_up [E, H, 2I] interleaved (gate 2i, up 2i+1), down [E, I, H]
        i0, i1 = _split(ex.down_proj.shape[1], s.world, s.rank, "moe_intermediate_size")
        s.take(ex, "gate_up_proj", {2: ((2 * i0, 2 * i1),)})
        s.take(ex, "gate_up_proj_bias", {1: ((2 * i0, 2 * i1),)})
        s.take(ex, "down_proj", {1: ((i0, i1),)})
        s.zero_unless_first(ex, "down_proj_bias")
        return
    I = ex.down_proj.shape[2]  # gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I]
    i0, i1 = _split(I, s.world, s.rank, "moe_intermediate_size")
    s.take(ex, "gate_up_proj", {1: ((i0, i1), (I + i0, I + i1))})
    s.take(ex, "down_proj", {2: ((i0, i1),)})


def _vocab_rows(V: int, world: int, rank: int) -> tuple[Range, int]:
    per = -(-V // world)
    return (min(V, rank * per), min(V, (rank + 1) * per)), per


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of the embedding (``weight`` [V', H], zero-padded); a token outside them looks up
    zeros, and the all-reduce adds the one rank's row to zeros (exact)."""

    def __init__(self, weight: nn.Parameter, start: int, stop: int, group):
        super().__init__()
        self.weight = weight
        self.start, self.stop, self.group = start, stop, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        mine = (ids >= self.start) & (ids < self.stop)
        x = F.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        return self.group.all_reduce(x.masked_fill(~mine[:, None], 0))


class VocabParallelHead(nn.Module):
    """lm_head rows [r*V', (r+1)*V'): each rank's logits [N, V'] are all-gathered into [N, V] on every rank."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, group):
        super().__init__()
        self.weight = weight
        self.vocab_size, self.group = vocab_size, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        local = F.linear(hidden, self.weight)  # [N, V'] in the model dtype, as the unsharded lm_head
        N, per, W = local.shape[0], local.shape[1], self.group.world_size
        gathered = self.group.all_gather(local).view(W, N, per)  # [W, N, V']
        return gathered.permute(1, 0, 2).reshape(N, W * per)[:, : self.vocab_size]


def _shard_vocab(s: _Sharder, model: nn.Module, group) -> None:
    cfg = model.config
    V, H = cfg.vocab_size, cfg.hidden_size
    (v0, v1), per = _vocab_rows(V, s.world, s.rank)
    embed = model.model.embedding()
    s.take(embed, "weight", {0: ((v0, v1),)}, local=(per, H))
    model.model.set_embedding(VocabParallelEmbedding(embed.weight, v0, v1, group))
    if cfg.tie_word_embeddings:
        head_weight = model.model.embedding().weight
    else:
        s.take(model.lm_head, "weight", {0: ((v0, v1),)}, local=(per, H))
        head_weight = model.lm_head.weight
    model.lm_head = VocabParallelHead(head_weight, V, group)


def shard_model(model: nn.Module, group, expert_parallel: bool) -> dict[str, Selection]:
    """Shard ``model`` (MoEForCausalLM on the meta device) for ``group``'s rank in place; returns the checkpoint
    selections of the sharded parameters (the others are read whole). Raises ShardingError."""
    from ..layers.mla import MLAttention
    from ..layers.moe import MLP

    s = _Sharder(model, group.rank, group.world_size)
    for layer in model.model.layers:
        if isinstance(layer.self_attn, MLAttention):
            _shard_mla(s, layer.self_attn)
        else:
            _shard_attention(s, layer.self_attn)
            layer.self_attn.tp = group
        if isinstance(layer.mlp, MLP):
            _shard_mlp(s, layer.mlp)
        else:
            _shard_experts(s, layer.mlp.experts, expert_parallel)
            shared = getattr(layer.mlp, "shared_expert", None) or getattr(layer.mlp, "shared_experts", None)
            if shared is not None:
                _shard_mlp(s, shared)
        layer.tp = group
    _shard_vocab(s, model, group)
    return s.selections
