"""The MLP of a decoder layer: the dense SwiGLU MLP, and the MoE blocks (router -> routed experts, with the shared
experts of each family): Mixtral / Qwen / OLMoE, DeepSeek-V2/V3, GPT-OSS."""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ExpertsSpec, RouterSpec
from ..kernels import fused_moe
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


# DeepSeek's shared experts on the fused path (within rounding): steps of up to this many tokens run them as one
# "expert" over every token through fused_moe.py's two kernels (gate/up GEMM with SwiGLU in its epilogue, down GEMM:
# two launches instead of five), larger steps as one gate/up GEMM (the weights laid out back to back), SwiGLU, down.
# $MOE_SHARED_FUSED_MAX_TOKENS overrides it (0: never). Not measured yet on a GPU against cuBLAS's GEMVs.
SHARED_FUSED_MAX_TOKENS = int(os.environ.get("MOE_SHARED_FUSED_MAX_TOKENS", "64"))
# One expert's many column tiles (the routed experts' tables assume K experts per token): a batch-1 gate/up of
# Moonlight's 2 x 1408 shared width in 176 programs of 16 columns, its down in 128 programs.
SHARED_TILES = (fused_moe.TileConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=4),
                fused_moe.TileConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=4))

_ROWS: dict = {}  # device -> (arange int64, arange int32): every token's row, and "T" as a one-expert offs


def _all_rows(T: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(tok [T] = 0..T-1 int64, offs [1] = T int32) as views of per-device buffers (fixed addresses: no launch, and
    CUDA graphs replay them)."""
    rows = _ROWS.get(device)
    if rows is None or rows[0].shape[0] <= T:
        n = max(4096, T + 1)
        rows = _ROWS[device] = (torch.arange(n, dtype=torch.long, device=device),
                                torch.arange(n, dtype=torch.int32, device=device))
    return rows[0][:T], rows[1][T : T + 1]


class DeepseekMoE(nn.Module):
    """DeepSeek-V2/V3 (HF ``DeepseekV2Moe`` / ``DeepseekV3MoE``): fp32 router -> routed experts (fp32 weights,
    outputs cast to the model dtype) + ungated shared experts.

    On the fused path the routed experts' combine also adds the shared experts' output (HF's ``experts(x) +
    shared_experts(x)``, the same rounding), in the next norm's launch for large steps (``defer_combine``); with the
    within-rounding kernels (``fused_shared``) the shared experts run through fused_moe.py's kernels for small steps
    (``SHARED_FUSED_MAX_TOKENS``), their gate/up as one GEMM otherwise."""

    fused_shared = False  # set by MoEForCausalLM.use_fused_kernels (within rounding)
    batch_invariant = False  # deterministic inference: the shared experts' plain MLP (its invariant Linears)

    def __init__(self, router: RouterSpec, experts: ExpertsSpec, hidden_size: int):
        super().__init__()
        self.gate = make_router(router, hidden_size)
        self.experts = Experts(experts, hidden_size)
        width = experts.shared_intermediate_size
        self.shared_experts = MLP(hidden_size, width, bias=experts.shared_bias) if width else None

    def forward(self, x: Tensor, routing: LayerRouting = NO_ROUTING,
                defer_combine: bool = False) -> Tensor | ExpertOutputs:
        """x [T, H] -> the layer's output [T, H]; ``defer_combine`` (on the fused path): the routed experts'
        ``ExpertOutputs`` with the shared experts' output in it, for the next norm's launch to sum."""
        # [T, K] int64 (unsorted, as HF's topk(sorted=False); the fused router: descending), float32; for the fused
        # experts, a one-token step's expert-grouped order from the router's launch (which also writes the capture)
        grouped = None
        fused = self.experts.takes_fused_path(x, self.gate.top_k)
        if fused:
            ids, weights, grouped = self.gate.forward_grouped(x, routing.forced, routing.ids)
        else:
            ids, weights = self.gate(x, routing.forced)
        out = self.experts(x, ids, weights, routing.ids, routing.weights, grouped=grouped, defer_combine=fused)
        shared = self._shared(x) if self.shared_experts is not None else None
        if isinstance(out, ExpertOutputs):
            out = dataclasses.replace(out, shared=shared)
            return out if defer_combine else out.combine(x.dtype)
        return out if shared is None else out + shared

    def _shared(self, x: Tensor) -> Tensor:
        mlp = self.shared_experts
        gate_up = self._shared_gate_up() if self.fused_shared and not self.batch_invariant else None
        if gate_up is None or mlp.down_proj.bias is not None:
            return mlp(x)
        T, H = x.shape
        width = mlp.down_proj.weight.shape[1]
        if 0 < T <= SHARED_FUSED_MAX_TOKENS and (x.is_cuda or fused_moe.interpreting()):
            tok, offs = _all_rows(T, x.device)
            h = fused_moe.gate_up_swiglu(x, gate_up.view(1, 2 * width, H), tok, offs, SHARED_TILES[0])
            return fused_moe.down_proj(h, mlp.down_proj.weight.view(1, H, width), offs, SHARED_TILES[1])
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return mlp.down_proj(F.silu(gate) * up)

    def _shared_gate_up(self) -> Tensor | None:
        """The shared experts' [gate; up] weight [2 I, H], if ``fuse_shared`` laid them out back to back (views)."""
        g, u = self.shared_experts.gate_proj.weight, self.shared_experts.up_proj.weight
        if not (g.is_contiguous() and u.is_contiguous() and u.data_ptr() == g.data_ptr() + g.nbytes
                and u.untyped_storage().data_ptr() == g.untyped_storage().data_ptr()):
            return None
        return g.as_strided((2 * g.shape[0], g.shape[1]), g.stride())

    @torch.no_grad()
    def fuse_shared(self) -> None:
        """Lay the shared experts' gate and up weights out back to back in one tensor, each a view of its rows (as
        Attention.fuse_qkv; weight updates write into them in place). Idempotent."""
        mlp = self.shared_experts
        if mlp is None or self._shared_gate_up() is not None or type(mlp.gate_proj) is not nn.Linear:
            return  # (FP8 shared experts, fp8_load.py: each projection its own W8A8 GEMM)
        joined = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        n = mlp.gate_proj.weight.shape[0]
        mlp.gate_proj.weight = nn.Parameter(joined[:n], requires_grad=False)
        mlp.up_proj.weight = nn.Parameter(joined[n:], requires_grad=False)


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
