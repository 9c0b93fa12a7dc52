"""Router math per architecture: hidden states -> (top-k expert ids, their weights).

Each router reproduces the reference implementation (Hugging Face transformers
5.24) operation by operation, including its dtype pipeline, because R3 needs the
exact ids the reference selects (see reference/moe_router_math.md §0-2):

- the router matmul runs in the model dtype (bf16 logits for a bf16 model),
- the softmax runs in float32 on those logits,
- ``torch.topk(sorted=True)`` gives the slot order (descending probability),
- renormalisation and the weights' dtype follow the architecture.

A router returns ``ids`` [T, K] (int64, slot order of the reference) and
``weights`` [T, K]. Nothing is captured here: the MoE block hands ``ids`` to its
experts, which write exactly the ids they use into the step's capture buffer
(experts.py says where), so the captured ids are exactly the ids the forward uses.

DeepSeek-V2/V3 compute logits in float32 from a float32 gate weight and use
``topk(sorted=False)``: their slot order is whatever that top-k returns (the
reference defines none); the ids captured are still exactly those used below.
With the within-rounding kernels (GPUs) their math after the logits runs in one
launch (kernels/grouped_topk.py: the same ids, in descending order; weights within
float32 rounding), for a one-token step with the grouping of its pairs.
GPT-OSS takes the top-k of its biased logits in the model dtype, then a softmax
over those k values in the model dtype.

Each router is built from the config's ``RouterSpec`` (config.py) and the hidden
size alone. Adding an architecture: subclass ``Router``, register it in
``ROUTERS`` and set ``router.kind`` in its config parser (models/).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import RouterSpec
from ..kernels import grouped_topk as topk_kernels
from ..kernels import moe_routing as routing_kernels
from ..kernels import small_linear as linear_kernels
from . import invariant as inv


class Forced:
    """Routing replay for one MoE layer of a step: tokens whose experts are given instead of chosen.

    ``mask`` [T] bool (which tokens are forced), ``ids`` [T, K] long (their experts, in the slot order to use;
    rows of unforced tokens are ignored). A router applies its own weight formula to the given ids (the
    architecture's softmax / sigmoid / bias / renormalisation / scaling pipeline, as Megatron's RouterReplay does),
    so a forced token's weights are exactly what the reference would compute had its top-k chosen those ids."""

    def __init__(self, mask: torch.Tensor, ids: torch.Tensor):
        self.mask = mask
        self.ids = ids

    def apply(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.where(self.mask[:, None], self.ids, ids)


class Router(nn.Module):
    """Base class: ``forward(x [T, H], forced: Forced | None) -> (ids [T, K] int64, weights [T, K])``.

    With ``forced``, the chosen ids of forced tokens are replaced before the weights are taken, and the weights of
    every token are gathered from the router's scores at its ids: for unforced tokens that is exactly the top-k's
    own values, so a step mixing forced and unforced tokens computes the unforced ones bit for bit as without.

    ``batch_invariant`` (deterministic inference, MoEForCausalLM.use_batch_invariant): the logits' GEMM, softmax,
    sigmoid and sums through layers/invariant.py (``bi_kernels``: its Triton GEMM); the fused router kernel, one
    program per token, is batch-invariant as it is."""

    batch_invariant = False
    bi_kernels = False

    def __init__(self, spec: RouterSpec, hidden_size: int):
        super().__init__()
        self.num_experts = spec.num_experts
        self.top_k = spec.top_k
        # a fused kernel for the router's math, equal within rounding with the same ids (set by
        # MoEForCausalLM.use_fused_kernels; only routers that have one read it)
        self.within_rounding = False

    def forward(self, x: torch.Tensor, forced: Forced | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward_grouped(
        self, x: torch.Tensor, forced: Forced | None = None, capture: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        """``forward``, and where this router's kernel can do it in the same launch, what ``routing_kernels.route``
        returns for the ids (the expert-grouped order; the ids copied into ``capture``), else None (the fused
        experts then route the ids themselves)."""
        ids, weights = self(x, forced)
        return ids, weights, None

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        """x.sum(-1, keepdim=True); left to right under deterministic inference."""
        return inv.row_sum(x, keepdim=True) if self.batch_invariant else x.sum(dim=-1, keepdim=True)

    def _fp32_logits(self, x: torch.Tensor) -> torch.Tensor:
        """DeepSeek's router logits: float32 x times the float32 gate weight."""
        if self.batch_invariant:
            return inv.linear(x.float(), self.weight.float(), None, self.bi_kernels)
        return F.linear(x.float(), self.weight.float())


class SoftmaxTopKRouter(Router):
    """Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE (HF ``*TopKRouter``): softmax over all experts, then top-k.

    Mixtral: renormalise, weights stay float32.
    Qwen2/3-MoE, OLMoE: renormalise only if ``norm_topk_prob``; weights cast to the logits' dtype.
    """

    def __init__(self, spec: RouterSpec, hidden_size: int):
        super().__init__(spec, hidden_size)
        self.norm_topk_prob = spec.norm_topk_prob
        self.weights_fp32 = spec.weights_fp32
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size), requires_grad=False)  # [E, H]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        # [T, E] in the model dtype (bf16 logits for a bf16 model); decode steps: linear_kernels.small_linear
        if self.batch_invariant:
            return inv.linear(x, self.weight, None, self.bi_kernels)
        return linear_kernels.decode_linear(x, self.weight, None, self.within_rounding, linear_kernels.ROUTER_SMALL_LINEAR_TOKENS)

    def _kernel_args(self, logits: torch.Tensor, forced: Forced | None) -> tuple:
        return (self.top_k, self.norm_topk_prob, torch.float32 if self.weights_fp32 else logits.dtype,
                None if forced is None else forced.mask, None if forced is None else forced.ids)

    def forward_grouped(
        self, x: torch.Tensor, forced: Forced | None = None, capture: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        if not (self.within_rounding and x.shape[0] == 1):
            return super().forward_grouped(x, forced, capture)
        # one token (a batch-1 decode step): routing_kernels.softmax_topk_route, the grouping in the router's launch
        logits = self._logits(x)
        top_k, renorm, wdtype, forced_mask, forced_ids = self._kernel_args(logits, forced)
        return routing_kernels.softmax_topk_route(logits, top_k, renorm, wdtype, capture, forced_mask, forced_ids)

    def forward(self, x: torch.Tensor, forced: Forced | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self._logits(x)
        if self.within_rounding:  # routing_kernels.softmax_topk: the lines below in one launch
            return routing_kernels.softmax_topk(logits, *self._kernel_args(logits, forced))
        if self.batch_invariant:
            probs = inv.softmax(logits, torch.float32)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E] float32
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, K], sorted descending
        if forced is not None:
            ids = forced.apply(ids)
            weights = probs.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / self._sum(weights)
        if not self.weights_fp32:
            weights = weights.to(logits.dtype)
        return ids, weights


def _group_mask(group_scores: torch.Tensor, topk_group: int, experts_per_group: int) -> torch.Tensor:
    """[T, G] group scores -> [T, E] bool mask of the experts in each token's topk_group best groups (HF)."""
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    G = group_scores.shape[-1]
    return group_mask.unsqueeze(-1).expand(-1, G, experts_per_group).reshape(-1, G * experts_per_group).bool()


class DeepseekV2Router(Router):
    """HF ``DeepseekV2TopkRouter``: fp32 logits, softmax, greedy or group_limited_greedy top-k (unsorted),
    weights (fp32) times routed_scaling_factor. norm_topk_prob is ignored, as HF does."""

    def __init__(self, spec: RouterSpec, hidden_size: int):
        super().__init__(spec, hidden_size)
        self.topk_method = spec.topk_method
        self.n_group, self.topk_group = spec.n_group, spec.topk_group
        self.routed_scaling_factor = spec.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size, dtype=torch.float32), requires_grad=False)

    def _kernel(self, logits: torch.Tensor, forced: Forced | None, capture=None, route=False):
        """kernels/grouped_topk.py: the lines of ``forward`` after the logits in one launch (same ids, weights
        within float32 rounding; slots in descending order)."""
        return topk_kernels.grouped_topk(
            logits, self.top_k, sigmoid=False, n_group=self.n_group, topk_group=self.topk_group,
            grouped=self.topk_method == "group_limited_greedy", scale=self.routed_scaling_factor,
            forced_mask=None if forced is None else forced.mask, forced_ids=None if forced is None else forced.ids,
            capture=capture, route=route)

    def forward_grouped(self, x, forced=None, capture=None):
        if not (self.within_rounding and x.shape[0] == 1):
            return super().forward_grouped(x, forced, capture)
        return self._kernel(self._fp32_logits(x), forced, capture, route=True)

    def forward(self, x: torch.Tensor, forced: Forced | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self._fp32_logits(x)  # [T, E] float32
        if self.within_rounding:
            return self._kernel(logits, forced)[:2]
        if self.batch_invariant:
            scores = all_scores = inv.softmax(logits, torch.float32)
        else:
            scores = all_scores = logits.softmax(dim=-1, dtype=torch.float32)
        if self.topk_method == "group_limited_greedy":
            E, G = self.num_experts, self.n_group
            group_scores = scores.view(-1, G, E // G).max(dim=-1).values  # [T, G]
            scores = scores.masked_fill(~_group_mask(group_scores, self.topk_group, E // G), 0.0)
        weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        if forced is not None:  # the group mask only chooses; a forced expert's weight is its own score
            ids = forced.apply(ids)
            weights = all_scores.gather(1, ids)
        return ids, weights * self.routed_scaling_factor


class DeepseekV3Router(Router):
    """HF ``DeepseekV3TopkRouter``: fp32 logits, sigmoid; e_score_correction_bias (fp32) is added for choosing
    groups (sum of each group's top-2) and experts only; weights are the unbiased sigmoid scores, renormalised
    if norm_topk_prob (+1e-20), times routed_scaling_factor."""

    def __init__(self, spec: RouterSpec, hidden_size: int):
        super().__init__(spec, hidden_size)
        self.n_group, self.topk_group = spec.n_group, spec.topk_group
        self.norm_topk_prob = spec.norm_topk_prob
        self.routed_scaling_factor = spec.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(spec.num_experts, dtype=torch.float32), requires_grad=False)

    def _kernel(self, logits: torch.Tensor, forced: Forced | None, capture=None, route=False):
        """kernels/grouped_topk.py: the lines of ``forward`` after the logits in one launch (same ids, weights
        within float32 rounding; slots in descending order of the biased scores)."""
        return topk_kernels.grouped_topk(
            logits, self.top_k, sigmoid=True, n_group=self.n_group, topk_group=self.topk_group, grouped=True,
            renorm=self.norm_topk_prob, scale=self.routed_scaling_factor, bias=self.e_score_correction_bias,
            forced_mask=None if forced is None else forced.mask, forced_ids=None if forced is None else forced.ids,
            capture=capture, route=route)

    def forward_grouped(self, x, forced=None, capture=None):
        if not (self.within_rounding and x.shape[0] == 1):
            return super().forward_grouped(x, forced, capture)
        return self._kernel(self._fp32_logits(x), forced, capture, route=True)

    def forward(self, x: torch.Tensor, forced: Forced | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        E, G = self.num_experts, self.n_group
        logits = self._fp32_logits(x)  # [T, E] float32
        if self.within_rounding:
            return self._kernel(logits, forced)[:2]
        scores = inv.sigmoid(logits) if self.batch_invariant else logits.sigmoid()
        choice = scores + self.e_score_correction_bias  # [T, E] float32
        group_scores = self._sum(choice.view(-1, G, E // G).topk(2, dim=-1)[0]).squeeze(-1)  # [T, G]
        choice = choice.masked_fill(~_group_mask(group_scores, self.topk_group, E // G), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]  # [T, K]
        if forced is not None:
            ids = forced.apply(ids)
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (self._sum(weights) + 1e-20)
        return ids, weights * self.routed_scaling_factor


class GptOssRouter(Router):
    """HF ``GptOssTopKRouter``: logits = linear(x, W, b) in the model dtype, top-k (sorted), then softmax over
    the k values in the model dtype. ``within_rounding`` (the GPU default): decode steps' logits through
    ``small_linear`` and the rest in one ``routing_kernels.topk_softmax`` launch (same ids, weights within rounding);
    a one-token step also groups its pairs for the fused experts in that launch (``forward_grouped``)."""

    def __init__(self, spec: RouterSpec, hidden_size: int):
        super().__init__(spec, hidden_size)
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(spec.num_experts), requires_grad=False)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return inv.linear(x, self.weight, self.bias, self.bi_kernels)
        # [T, E] in the model dtype; F.linear unless within_rounding and a decode-sized step
        return linear_kernels.decode_linear(x, self.weight, self.bias, self.within_rounding,
                                            linear_kernels.ROUTER_SMALL_LINEAR_TOKENS)

    def forward_grouped(
        self, x: torch.Tensor, forced: Forced | None = None, capture: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        if not (self.within_rounding and x.shape[0] == 1):
            return super().forward_grouped(x, forced, capture)
        return routing_kernels.topk_softmax_route(self._logits(x), self.top_k, capture,
                                                  None if forced is None else forced.mask,
                                                  None if forced is None else forced.ids)

    def forward(self, x: torch.Tensor, forced: Forced | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self._logits(x)  # [T, E]
        if self.within_rounding:  # the lines below in one launch
            return routing_kernels.topk_softmax(logits, self.top_k, None if forced is None else forced.mask,
                                                None if forced is None else forced.ids)
        top, ids = torch.topk(logits, self.top_k, dim=-1)  # [T, K], sorted descending
        if forced is not None:
            ids = forced.apply(ids)
            top = logits.gather(1, ids)
        if self.batch_invariant:
            return ids, inv.softmax(top, top.dtype)
        return ids, torch.softmax(top, dim=1, dtype=top.dtype)


ROUTERS: dict[str, type[Router]] = {
    "softmax_topk": SoftmaxTopKRouter,
    "deepseek_v2": DeepseekV2Router,
    "deepseek_v3": DeepseekV3Router,
    "gpt_oss": GptOssRouter,
}


def make_router(spec: RouterSpec, hidden_size: int) -> Router:
    if spec.kind not in ROUTERS:
        raise ValueError(f"unknown router {spec.kind!r}; known: {', '.join(sorted(ROUTERS))}")
    return ROUTERS[spec.kind](spec, hidden_size)
