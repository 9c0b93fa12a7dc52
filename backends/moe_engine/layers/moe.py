"""The MLP of a decoder layer: the dense SwiGLU MLP, and the MoE blocks (router -> routed experts, with the shared
experts of each family): Mixtral / Qwen / OLMoE, DeepSeek-V2/V3, GPT-OSS."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ExpertsSpec, RouterSpec
from . import invariant as inv
from .experts import NO_ROUTING, ExpertOutputs, Experts, GptOssExperts, LayerRouting, Relu2Experts
from .routing import make_router


class MLP(nn.Module):
    """SwiGLU MLP: dense layers and shared experts (Qwen2-MoE, DeepSeek); ``act="relu2"``: Nemotron-H's ungated
    MLP, down_proj(relu(up_proj(x)) ** 2) (no gate_proj)."""

    batch_invariant = False  # deterministic inference: silu alike for every element (its Linears are swapped)

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, act: str = "silu"):
        super().__init__()
        self.act = act
        if act == "silu":
            self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.act == "relu2":
            return self.down_proj(relu2(self.up_proj(x)))
        silu = inv.silu if self.batch_invariant else F.silu
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


def relu2(x: Tensor) -> Tensor:
    """HF ``ReLUSquaredActivation``: square(relu(x))."""
    return torch.square(F.relu(x))


class MoEBlock(nn.Module):
    """Router -> routed experts (+ optional shared expert, sigmoid-gated in Qwen2-MoE)."""

    batch_invariant = False  # deterministic inference: the shared expert's gate alike for every element

    def __init__(self, router: RouterSpec, experts: ExpertsSpec, hidden_size: int):
        super().__init__()
        self.gate = make_router(router, hidden_size)
        self.experts = Experts(experts, hidden_size)
        width = experts.shared_intermediate_size
        self.shared_expert = MLP(hidden_size, width) if width else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if experts.shared_gate else None

    def forward(self, x: Tensor, routing: LayerRouting = NO_ROUTING,
                defer_combine: bool = False) -> Tensor | ExpertOutputs:
        """x [T, H] -> the layer's output [T, H]; ``defer_combine`` (a block without shared experts, on the
        fused path): the routed experts' ``ExpertOutputs``, for the next norm's launch to sum."""
        # [T, K] int64, [T, K]; for the fused experts, a one-token step's expert-grouped order from the router's
        # launch (which then also copies the ids into the capture buffer)
        grouped = None
        if self.experts.takes_fused_path(x, self.gate.top_k):
            ids, weights, grouped = self.gate.forward_grouped(x, routing.forced, routing.ids)
        else:
            ids, weights = self.gate(x, routing.forced)
        # the experts write exactly the ids (and weights) they use into the step's capture buffers
        out = self.experts(x, ids, weights, routing.ids, routing.weights, grouped=grouped,
                           defer_combine=defer_combine and self.shared_expert is None)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                sigmoid = inv.sigmoid if self.batch_invariant else torch.sigmoid
                shared = sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


class DeepseekMoE(nn.Module):
    """DeepSeek-V2/V3 (HF ``DeepseekV2Moe`` / ``DeepseekV3MoE``): fp32 router -> routed experts (fp32 weights,
    outputs cast to the model dtype) + ungated shared experts."""

    def __init__(self, router: RouterSpec, experts: ExpertsSpec, hidden_size: int):
        super().__init__()
        self.gate = make_router(router, hidden_size)
        self.experts = Experts(experts, hidden_size)
        width = experts.shared_intermediate_size
        self.shared_experts = MLP(hidden_size, width, bias=experts.shared_bias) if width else None

    def forward(self, x: Tensor, routing: LayerRouting = NO_ROUTING) -> Tensor:
        ids, weights = self.gate(x, routing.forced)  # [T, K] int64 (unsorted, as HF's topk(sorted=False)), fp32
        out = self.experts(x, ids, weights, routing.ids, routing.weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class GptOssMoE(nn.Module):
    """GPT-OSS (HF ``GptOssMLP``): biased router, top-k then softmax in the model dtype -> biased clamped experts."""

    def __init__(self, router: RouterSpec, experts: ExpertsSpec, hidden_size: int):
        super().__init__()
        self.router = make_router(router, hidden_size)
        self.experts = GptOssExperts(experts, hidden_size)

    def forward(self, x: Tensor, routing: LayerRouting = NO_ROUTING,
                defer_combine: bool = False) -> Tensor | ExpertOutputs:
        """x [T, H] -> [T, H]; ``defer_combine`` (fused path): the ``ExpertOutputs``, for the next norm to sum."""
        # [T, K] sorted descending, [T, K] model dtype; fused, one-token steps: the grouping from the router's launch
        grouped = None
        if self.experts.takes_fused_path(x, self.router.top_k):
            ids, weights, grouped = self.router.forward_grouped(x, routing.forced, routing.ids)
        else:
            ids, weights = self.router(x, routing.forced)
        return self.experts(x, ids, weights, routing.ids, routing.weights, grouped=grouped,
                            defer_combine=defer_combine)


class NemotronHMoE(nn.Module):
    """Nemotron-H (HF ``NemotronHMoE``): DeepSeek-V3's sigmoid router (float32, correction bias, groups, scaling) ->
    ungated squared-ReLU experts summed in float32 (optionally in a latent space: fc1 / fc2_latent_proj) + an
    ungated squared-ReLU shared expert."""

    def __init__(self, router: RouterSpec, experts: ExpertsSpec, hidden_size: int):
        super().__init__()
        self.gate = make_router(router, hidden_size)
        latent = experts.latent_size
        self.experts = Relu2Experts(experts, latent or hidden_size)
        self.shared_experts = MLP(hidden_size, experts.shared_intermediate_size, bias=experts.shared_bias, act="relu2")
        if latent:
            self.fc1_latent_proj = nn.Linear(hidden_size, latent, bias=experts.shared_bias)
            self.fc2_latent_proj = nn.Linear(latent, hidden_size, bias=experts.shared_bias)

    def forward(self, x: Tensor, routing: LayerRouting = NO_ROUTING) -> Tensor:
        ids, weights = self.gate(x, routing.forced)  # [T, K] int64 (unsorted), float32
        h = self.fc1_latent_proj(x) if hasattr(self, "fc1_latent_proj") else x
        out = self.experts(h, ids, weights, routing.ids, routing.weights)
        if hasattr(self, "fc2_latent_proj"):
            out = self.fc2_latent_proj(out)
        return out + self.shared_experts(x)
