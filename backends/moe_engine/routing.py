"""Router math per architecture: hidden states -> (top-k expert ids, their weights).

Each router reproduces the reference implementation (Hugging Face transformers
5.24) operation by operation, including its dtype pipeline, because R3 needs the
exact ids the reference selects (see reference/moe_router_math.md §0-2):

- the router matmul runs in the model dtype (bf16 logits for a bf16 model),
- the softmax runs in float32 on those logits,
- ``torch.topk(sorted=True)`` gives the slot order (descending probability),
- renormalisation and the weights' dtype follow the architecture.

A router returns ``ids`` [T, K] (int64, slot order of the reference) and
``weights`` [T, K]; the MoE block captures ``ids`` right here, before anything
else uses them, so the captured ids are exactly the ids the forward uses.

Adding an architecture: subclass ``Router`` (DeepSeek-V2 grouped top-k with fp32
logits, DeepSeek-V3 sigmoid + e_score_correction_bias, GPT-OSS bias + top-k then
softmax), register it in ``ROUTERS`` and set ``MoEConfig.router`` in config.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoEConfig


class Router(nn.Module):
    """Base class: ``forward(x [T, H]) -> (ids [T, K] int64, weights [T, K])``."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class SoftmaxTopKRouter(Router):
    """Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE (HF ``*TopKRouter``): softmax over all experts, then top-k.

    Mixtral: renormalise, weights stay float32.
    Qwen2/3-MoE, OLMoE: renormalise only if ``norm_topk_prob``; weights cast to the logits' dtype.
    """

    def __init__(self, cfg: MoEConfig):
        super().__init__(cfg)
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weights_fp32 = cfg.router_weights_fp32
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size), requires_grad=False)  # [E, H]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)  # [T, E] in the model dtype (bf16 logits for a bf16 model)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E] float32
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, K], sorted descending
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_fp32:
            weights = weights.to(logits.dtype)
        return ids, weights


ROUTERS: dict[str, type[Router]] = {
    "softmax_topk": SoftmaxTopKRouter,
}


def make_router(cfg: MoEConfig) -> Router:
    if cfg.router not in ROUTERS:
        raise ValueError(f"unknown router {cfg.router!r}; known: {', '.join(sorted(ROUTERS))}")
    return ROUTERS[cfg.router](cfg)
