"""Per-sequence recurrent state of the hybrid models' linear-attention (Gated DeltaNet) and Mamba-2 layers, and the
short causal convolution both run before their recurrence.

A recurrent layer keeps, per sequence, a fixed-size state instead of a KV cache: ``LayerState.conv`` holds the
last ``conv_kernel`` inputs of its convolution (what HF's cache holds: ``conv_states``), ``LayerState.ssm`` the
recurrence's state (Gated DeltaNet: [num_v_heads, head_k_dim, head_v_dim] float32; Mamba-2: [num_heads, head_dim,
state_size]). Both are preallocated for every sequence slot (core/kv_cache.py allocates them beside the paged KV,
counted in the same budget; the block manager hands each running sequence a slot) plus one null slot that CUDA-graph
padding rows write, at fixed addresses: a step reads and writes them in place by slot index, and a sequence whose
step starts at position 0 starts from zeros whatever its slot held.

``ForwardBatch`` (layers/attend.py) carries each sequence's slot (``state_slots``) and, for eager steps, its context
on the host (``context_lens``): a sequence continues its state when its context is > 0 (a later prefill chunk, a
decode step) and starts from zeros otherwise (a prompt's first chunk, a preempted sequence recomputed).

The convolution follows HF's three calls exactly (``causal_conv1d_fn`` on a prompt's first chunk, padded to the
kernel size when shorter; the same on [state, chunk] for a later chunk; ``causal_conv1d_update`` for one token),
so that float32 agrees with transformers to rounding and bfloat16 bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class StateSpec:
    """A recurrent layer's per-sequence state geometry (``MoEForCausalLM.kv_layout``'s entry for such a layer)."""

    conv_dim: int  # channels of the causal convolution
    conv_kernel: int  # its width; the state keeps this many past inputs (HF's layout)
    ssm_shape: tuple[int, ...]  # the recurrence's state per sequence
    ssm_dtype: torch.dtype = torch.float32

    def nbytes(self, dtype: torch.dtype) -> int:
        """Bytes per sequence slot (the convolution's inputs in the model dtype ``dtype``)."""
        elem = torch.empty((), dtype=dtype).element_size()
        ssm = torch.empty((), dtype=self.ssm_dtype).element_size()
        n = 1
        for d in self.ssm_shape:
            n *= d
        return self.conv_dim * self.conv_kernel * elem + n * ssm


@dataclass
class LayerState:
    """One recurrent layer's states for every slot: conv [slots + 1, conv_dim, K] (model dtype), ssm [slots + 1,
    *ssm_shape]; the last slot is the null slot (CUDA-graph padding)."""

    conv: Tensor
    ssm: Tensor

    @classmethod
    def allocate(cls, spec: StateSpec, num_slots: int, dtype: torch.dtype, device) -> "LayerState":
        return cls(
            conv=torch.zeros(num_slots + 1, spec.conv_dim, spec.conv_kernel, dtype=dtype, device=device),
            ssm=torch.zeros(num_slots + 1, *spec.ssm_shape, dtype=spec.ssm_dtype, device=device),
        )

    @property
    def null_slot(self) -> int:
        return self.conv.shape[0] - 1

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes


class Conv1d(nn.Module):
    """The depthwise causal convolution's parameters under HF's names (``conv1d.weight`` [C, 1, K], ``conv1d.bias``)."""

    def __init__(self, channels: int, kernel: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None


def _act(x: Tensor, activation: str) -> Tensor:
    if activation == "silu":
        return F.silu(x)
    if activation in (None, "identity"):
        return x
    raise ValueError(f"unsupported convolution activation {activation!r}")


def conv_prefill(x: Tensor, conv: Tensor | None, weight: Tensor, bias: Tensor | None, activation: str
                 ) -> tuple[Tensor, Tensor]:
    """One sequence's chunk x [n, C] (model dtype) -> (activated convolution [n, C], the new conv state [C, K]).
    ``conv`` [C, K]: the state before the chunk (None: the sequence starts here, as HF's first call); weight
    [C, 1, K]."""
    n, K = x.shape[0], weight.shape[-1]
    full = x.t()[None]  # [1, C, n]
    if conv is None:
        if n < K:  # HF's update_conv_state pads a short first chunk to the kernel size
            full = F.pad(full, (K - n, 0), value=0)
    else:
        full = torch.cat([conv[None].to(full.dtype), full], dim=-1)  # [1, C, K + n]
    state = full[0, :, -K:]
    out = F.conv1d(full.to(weight.dtype), weight=weight, bias=bias, padding=K - 1,
                   groups=full.shape[1])[:, :, : full.shape[-1]]  # HF causal_conv1d_fn
    out = _act(out, activation).to(x.dtype)[:, :, -n:]
    return out[0].t(), state


def conv_decode(x: Tensor, conv: Tensor, weight: Tensor, bias: Tensor | None, activation: str
                ) -> tuple[Tensor, Tensor]:
    """One token of each of B sequences x [B, C] with their states conv [B, C, K] -> (activated convolution [B, C],
    new states [B, C, K]) (HF ``causal_conv1d_update``)."""
    K = conv.shape[-1]
    full = torch.cat([conv, x[:, :, None].to(conv.dtype)], dim=-1).to(weight.dtype)  # [B, C, K + 1]
    out = F.conv1d(full, weight, bias, padding=0, groups=full.shape[1])[:, :, -1:]
    return _act(out, activation).to(x.dtype)[:, :, 0], full[:, :, -K:]
