"""Routed experts: the expert modules, the ways to run them, and the one place that writes routing capture.

Where routed experts flow (data-path order):
1. ``core/runner.py`` owns the step's capture buffer ``[step_tokens, num_hidden_layers, top_k]`` int32 (preallocated,
   a fixed address for CUDA graphs) and passes it to the model's forward when the step captures.
2. ``MoEForCausalLM.forward`` (models/decoder.py) hands each MoE layer its slice ``capture[:T, layer]`` ([T, K], a view);
   the MoE block passes it on with the router's ids (layers/routing.py).
3. Here, each experts module writes exactly the ids it then uses into that slice: on the fused path inside
   ``routing_kernels.route`` (the kernel that groups (token, slot) pairs by expert, so capture adds no launch; for a
   one-token step the router's own launch does that grouping and the copy, ``Router.forward_grouped``), otherwise
   by one ``copy_`` before the experts run; and, when a request asked for them, the combine weights it multiplies
   the expert outputs by (float32, a second buffer). Dense layers get no slice and their rows stay 0. Forced
   routing (replay) reaches the router through the same per-layer ``LayerRouting``: the ids captured for a forced
   token are the forced ids, because those are the ids the forward used.
4. ``core/runner.py`` copies the step's first T rows to the host with its sampled tokens (one transfer), and
   ``core/scheduler.py`` slices them per request (rows of prefix-cache hits come from the block manager).

Execution paths, one per situation, numerically the same as Hugging Face transformers' per-expert loop (rows of
each expert in HF's order, the routing weight applied before the cast, outputs summed one by one in ascending
expert order):
- ``fused`` (CUDA, Triton): ``routing_kernels.route`` -> expert GEMMs -> ``routing_kernels.combine`` (for a step of at least
  ``routing_kernels.COMBINE_NORM_MIN_TOKENS`` tokens under the within-rounding fusions: inside the next norm's launch, to
  which the decoder hands the ``ExpertOutputs``); graph-capturable. The GEMMs
  are fused_moe.py's Triton kernels (reading only the hit experts' weights; equal to torch's within bf16 GEMM
  rounding, a different summation order) up to ``triton_gemm_max_pairs`` pairs, torch's grouped GEMM beyond;
- ``grouped_mm``: torch's grouped GEMM over all experts with offsets computed on the device (no host sync);
- ``gather`` (small CUDA decode batches without fused kernels): each token's expert weights gathered, one einsum;
- ``grouped`` (the reference): pairs sorted by expert, one matmul per expert (one host sync for the counts).

Expert parallelism (sharding.py): a rank holds experts [first_expert, first_expert + num_experts) whole and runs
only the (token, slot) pairs routed to them (``forward_local``); the others contribute zeros to its partial sum,
which the decoder layer's all-reduce adds to the other ranks'. The router still picks among all experts, on every
rank alike, and the ids captured are those logical ids.

Deterministic inference (``batch_invariant``, MoEForCausalLM.use_batch_invariant): the fused path with
fused_moe.py's one tile configuration for every step size; off it the reference (grouped) path, each expert's rows
through layers/invariant.py's GEMM (fixed row tiles, or its Triton kernel when ``bi_kernels``) and elementwise silu.
A row's result then does not depend on which other rows hit its expert.

Each class declares what it supports (``supports_fused``, ``graph_unsafe_reason``) instead of callers checking
its type.
"""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ExpertsSpec
from ..kernels import fused_moe, fused_moe_gpt_oss
from ..kernels import moe_routing as routing_kernels
from . import invariant as inv
from .routing import Forced


@dataclass(frozen=True)
class LayerRouting:
    """One MoE layer's routing I/O in a step: where to write the ids (``ids`` [T, K] int32) and combine weights
    (``weights`` [T, K] float32) it uses, and the tokens whose experts are given (``forced``)."""

    ids: Tensor | None = None
    weights: Tensor | None = None
    forced: Forced | None = None


NO_ROUTING = LayerRouting()


@dataclass(frozen=True)
class ExpertOutputs:
    """A MoE layer's output before its combine (fused path): ``y`` [T*K, H] the expert outputs in grouped order,
    ``ids`` / ``pos`` / ``weights`` [T, K] as ``routing_kernels.combine`` takes them. The decoder hands it on, not summed,
    to the norm that reads the residual stream next, which sums it in its own launch
    (``routing_kernels.combine_rms_norm``); anything else asks for ``combine()``, the [T, H] output."""

    y: Tensor
    ids: Tensor
    pos: Tensor
    weights: Tensor
    shared: Tensor | None = None  # [T, H]: DeepSeek's shared experts' output, added after the routed sum

    def combine(self, dtype: torch.dtype) -> Tensor:
        return routing_kernels.combine(self.y, self.ids, self.pos, self.weights, dtype, add=self.shared)


@dataclass(frozen=True)
class StepRouting:
    """A step's routing I/O for every layer: capture buffers [>=T, num_hidden_layers, K] (views of the runner's
    step buffer; ``weights`` holds float32) and forced routing (``forced_mask`` [T] bool, ``forced_ids``
    [T, num_hidden_layers, K] long)."""

    ids: Tensor | None = None
    weights: Tensor | None = None
    forced_mask: Tensor | None = None
    forced_ids: Tensor | None = None

    def layer(self, i: int, T: int) -> LayerRouting:
        return LayerRouting(
            ids=self.ids[:T, i] if self.ids is not None else None,
            weights=self.weights[:T, i] if self.weights is not None else None,
            forced=Forced(self.forced_mask, self.forced_ids[:, i]) if self.forced_mask is not None else None,
        )


# A step with at most this many (token, slot) pairs (a small decode batch) gathers each token's expert weights
# and runs one batched matmul, with no host sync (unfused CUDA path only).
GATHER_MAX_SLOTS = 8  # on CUDA; on CPU the copies cost more than the grouped path's sync (measured)
GATHER_MAX_BYTES = 256 << 20  # ... and only while the gathered weight copies stay this small

# Fused path on CUDA: steps of up to this many (token, slot) pairs run fused_moe.py's Triton GEMMs, larger ones
# torch's grouped GEMM (chosen by measurement on the H200, loadtest/tune/bench_fused_moe.py). The environment variable
# overrides it for benchmarks (0: always torch's).
TRITON_GEMM_MAX_PAIRS = int(os.environ.get("MOE_TRITON_GEMM_MAX_PAIRS", sys.maxsize))

# CPU float32 (``Experts._forward_cpu``): an expert with fewer rows than this in a step multiplies as W @ x.T,
# one with more as x @ W.T (measured on the 2-core EPYC: 2-7 rows ~1.4x faster, 1 and 8+ the same).
CPU_WEIGHT_LEFT_MAX_ROWS = 8

_GMM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_GMM_SUPPORT: dict = {}


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch has a grouped GEMM for (device, dtype): probed once with a tiny call, since support
    varies (CUDA kernels need bf16 on recent GPUs; CPU has a reference kernel)."""
    key = (device.type, dtype)
    if key not in _GMM_SUPPORT:
        ok = _GMM is not None
        if ok:
            try:
                a = torch.ones(4, 16, device=device, dtype=dtype)
                b = torch.ones(2, 16, 16, device=device, dtype=dtype)
                offs = torch.tensor([2, 4], device=device, dtype=torch.int32)
                ok = bool(torch.equal(_GMM(a, b, offs=offs), torch.full((4, 16), 16.0, device=device, dtype=dtype)))
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _GMM_SUPPORT[key] = ok
    return _GMM_SUPPORT[key]


def grouped_mm_capturable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the grouped GEMM runs without the host (CUDA-graph capturable): torch's fallback for dtypes
    without a native kernel (float32 on Hopper, torch 2.11) reads the group offsets back. Probed by capturing
    one tiny call."""
    key = ("graph", device.type, dtype)
    if key not in _GMM_SUPPORT:
        ok = device.type == "cuda" and grouped_mm_works(device, dtype)
        if ok:
            a = torch.ones(4, 16, device=device, dtype=dtype)
            b = torch.ones(2, 16, 16, device=device, dtype=dtype)
            offs = torch.tensor([2, 4], device=device, dtype=torch.int32)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            try:
                with torch.cuda.stream(stream), warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "the CUDA graph is empty" when the fallback stopped it
                    _GMM(a, b, offs=offs)  # warm-up outside the capture
                    with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream, capture_error_mode="thread_local"):
                        _GMM(a, b, offs=offs)
            except RuntimeError:
                ok = False
            torch.cuda.synchronize(device)
        _GMM_SUPPORT[key] = ok
    return _GMM_SUPPORT[key]


# ----------------------------------------------------------------------------- HF-order bookkeeping


def group_by_expert(ids: Tensor) -> tuple[Tensor, Tensor]:
    """(token, slot) pairs in HF's order: by expert, then slot k, then token (HF loops over experts and takes
    torch.where(one_hot[e]) of a [K, T] mask), so every expert sees the same rows in the same order.
    ids [T, K] -> (tok [K*T], slot [K*T]) of each grouped row."""
    T = ids.shape[0]
    order = torch.argsort(ids.t().reshape(-1), stable=True)  # [K*T] slot-major pairs grouped by expert
    return order % T, order // T


def rank_in_row(ids: Tensor) -> Tensor:
    """[T, K] -> [T, K]: the rank of each entry within its row (ids in a row are distinct): one sort and a
    scatter, where argsort(argsort(ids)) takes two sorts."""
    order = torch.argsort(ids, dim=-1)
    ranks = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return torch.empty_like(order).scatter_(1, order, ranks)


def sum_in_expert_order(y: Tensor, ids: Tensor, tok: Tensor, slot: Tensor) -> Tensor:
    """Grouped rows y [K*T, H] (already weighted, model dtype) -> [T, H]: each token's K outputs put in ascending
    expert order, then added one at a time in the model dtype. HF accumulates with one index_add_ per expert in
    ascending expert order (rounding after each add); a single index_add_ or a sum() would round differently."""
    T, K = ids.shape
    per_token = torch.empty(T, K, y.shape[1], dtype=y.dtype, device=y.device)
    per_token[tok, rank_in_row(ids)[tok, slot]] = y
    return sum_slots(per_token)


def sum_slots(per_token: Tensor) -> Tensor:
    """[T, K, H] -> [T, H], adding the K outputs one at a time (see ``sum_in_expert_order``)."""
    K = per_token.shape[1]
    if K == 1:
        return torch.zeros_like(per_token[:, 0]) + per_token[:, 0]
    # Starting from the first two terms instead of from zeros adds the same values in the same order
    # (0 + a == a; only a zero's sign could differ), with two kernels fewer per layer.
    out = per_token[:, 0] + per_token[:, 1]
    for j in range(2, K):
        out = out + per_token[:, j]
    return out


def _capture(capture: Tensor | None, ids: Tensor) -> None:
    if capture is not None:
        capture.copy_(ids)


def _capture_weights(capture: Tensor | None, weights: Tensor) -> None:
    """The combine weights exactly as the experts multiply their outputs by them, as float32."""
    if capture is not None:
        capture.copy_(weights)


# ----------------------------------------------------------------------------- SwiGLU experts


class Experts(nn.Module):
    """E SwiGLU experts as 3-D weights (HF v5 fused layout): gate_up_proj [E, 2I, H] (gate rows, then up rows),
    down_proj [E, H, I]."""

    supports_fused = True  # MoEForCausalLM.use_fused_kernels switches ``fused`` on where Triton runs
    batch_invariant = False  # deterministic inference (see the module docstring)
    bi_kernels = False

    def __init__(self, spec: ExpertsSpec, hidden_size: int):
        super().__init__()
        E, H, I = spec.num_experts, hidden_size, spec.intermediate_size
        self.num_experts = E
        self.fused = False
        # Fused path: steps of at most this many (token, slot) pairs run the expert GEMMs as fused_moe.py's
        # Triton kernels (only the hit experts' weights are read; equal to torch's grouped GEMM within bf16
        # GEMM rounding), larger ones as torch's grouped GEMM. 0 (CPU, the interpreter, the bit-exactness
        # tests): always torch's. Set by MoEForCausalLM.use_fused_kernels.
        self.triton_gemm_max_pairs = 0
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, H, I), requires_grad=False)
        self.first_expert: int | None = None  # expert parallelism: this rank's first expert (sharding.py)
        # W8A8 block FP8 (keep_fp8): gate_up_proj / down_proj in e4m3 with *_scale_inv per block; None: model dtype
        self.fp8_block: tuple[int, int] | None = None

    def keep_fp8(self, block: tuple[int, int]) -> None:
        """Hold the expert weights in e4m3 with float32 scales per ``block`` (rows, columns) of each expert's
        projections: ``gate_up_proj_scale_inv`` [E, 2I / bm, H / bn], ``down_proj_scale_inv`` [E, H / bm, I / bn]
        (the checkpoint's names). Called on the meta model before loading; the fused path then runs
        kernels/fp8_moe.py, the others the op-by-op W8A8 reference (fp8.w8a8_linear_reference per expert)."""
        from .. import fp8

        bm, bn = self.fp8_block = tuple(block)
        for name in ("gate_up_proj", "down_proj"):
            E, R, C = getattr(self, name).shape
            device = getattr(self, name).device
            setattr(self, name, nn.Parameter(torch.empty(E, R, C, dtype=fp8.FP8_DTYPE, device=device),
                                             requires_grad=False))
            setattr(self, f"{name}_scale_inv", nn.Parameter(
                torch.empty(E, -(-R // bm), -(-C // bn), dtype=torch.float32, device=device), requires_grad=False))

    def graph_unsafe_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        if self.fused and self.first_expert is None and (self.triton_gemm_max_pairs == sys.maxsize
                                                         or self.fp8_block is not None):
            return None  # never torch's grouped GEMM
        if not grouped_mm_capturable(device, dtype):
            return f"torch's grouped GEMM syncs with the host for {dtype} on this GPU (use bfloat16)"
        return None

    def takes_fused_path(self, x: Tensor, top_k: int) -> bool:
        """Whether ``forward`` runs the fused path (route, grouped GEMMs, combine) for the tokens x [T, H]."""
        T = x.shape[0]
        # Fused, the grouped path is faster than gathering weights even for one token (H200, C=1 decode step:
        # 0.41 vs 0.46 ms), and its route kernel does the capture copy.
        return bool(self.fused and T and self.first_expert is None and (
            self.fp8_block is not None or T * top_k <= self.triton_gemm_max_pairs
            or grouped_mm_works(x.device, x.dtype)))

    def forward(
        self, x: Tensor, ids: Tensor, weights: Tensor, capture: Tensor | None = None,
        weights_capture: Tensor | None = None, grouped: tuple[Tensor, Tensor, Tensor] | None = None,
        defer_combine: bool = False,
    ) -> Tensor | ExpertOutputs:
        """x [T, H], ids [T, K], weights [T, K] -> sum_k weights[t, k] * expert_{ids[t, k]}(x[t])  [T, H].
        capture [T, K] int32 (a view of the step's routing buffer): receives exactly ``ids``, before the experts
        run (on the fused path, by the kernel that reads them to group the pairs); weights_capture [T, K] float32
        receives ``weights``. ``grouped``: ``routing_kernels.route``'s outputs for ``ids`` when the router's launch
        already computed them and wrote ``capture`` (``Router.forward_grouped``; only for the fused path).
        ``defer_combine``: on the fused path, return the ``ExpertOutputs`` instead of their sum."""
        _capture_weights(weights_capture, weights)
        T, K = ids.shape
        if self.takes_fused_path(x, K):
            outputs = self._forward_fused(x, ids, weights, capture, grouped)
            return outputs if defer_combine else outputs.combine(x.dtype)
        assert grouped is None, "grouped pairs are for the fused path"
        _capture(capture, ids)
        if T == 0:
            return torch.zeros_like(x)
        if self.batch_invariant or self.fp8_block is not None:  # (FP8 off the fused path: the W8A8 reference)
            return forward_grouped(self._expert, self.num_experts, x, ids, weights)
        if self.first_expert is not None:  # expert parallelism: torch's grouped GEMM (the fused path is not EP-aware)
            mm = self._grouped_mm_local if grouped_mm_works(x.device, x.dtype) else None
            return forward_local(self._expert, self.first_expert, self.num_experts, x, ids, weights, mm)
        slot_bytes = self.gate_up_proj[0].nbytes + self.down_proj[0].nbytes
        if x.is_cuda and T * K <= GATHER_MAX_SLOTS and T * K * slot_bytes <= GATHER_MAX_BYTES:
            return self._forward_gather(x, ids, weights)
        return self._forward_grouped(x, ids, weights)

    def _forward_grouped(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """Grouped by expert: on CPU in float32 ``_forward_cpu`` (GEMM operand order by rows per expert); elsewhere
        one grouped GEMM per projection where torch has one, else one matmul per expert."""
        if x.device.type == "cpu" and x.dtype == torch.float32:
            return self._forward_cpu(x, ids, weights)
        if grouped_mm_works(x.device, x.dtype):
            return self._forward_grouped_mm(x, ids, weights)
        return forward_grouped(self._expert, self.num_experts, x, ids, weights)

    def _forward_grouped_mm(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """The same rows in the same order as ``forward_grouped``, but each projection is one grouped GEMM over
        all experts (offsets computed on the device): no per-expert Python loop, no host sync."""
        tok, slot = group_by_expert(ids)
        # Counts by scatter_add, not bincount: CUDA's bincount reads the max id back to the host (a sync
        # that would also break CUDA-graph capture).
        flat = ids.reshape(-1)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        offs = torch.cumsum(counts, 0).to(torch.int32)
        gate, up = _GMM(x[tok], self.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        y = _GMM(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offs)
        return sum_in_expert_order((y * weights[tok, slot, None]).to(x.dtype), ids, tok, slot)

    def _forward_cpu(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """The rows of ``forward_grouped`` (HF's order, weighted, summed in ascending expert order), each expert's
        GEMMs in the operand order that streams its weights fastest for its row count. A decode step reads
        every hit expert's whole weights for a few rows each: memory-bound, and MKL's ``x @ W.T`` with 2-7 rows
        reads them at ~6 GB/s on this 2-core EPYC where ``W @ x.T`` (the weights as the left operand, one
        output column per row) reads at ~10 (loadtest/bench/bench_cpu_experts.py; a 4-layer Mixtral decode step
        at 16 sequences: the experts were 55% of it). From CPU_WEIGHT_LEFT_MAX_ROWS rows on the two orders cost
        the same and ``x @ W.T`` stays (as in prefill). Equal to the grouped GEMM within float32 GEMM rounding
        (another blocking of the same sums); a given expert's rows take the same order every time."""
        tok, slot = group_by_expert(ids)  # [K*T] each
        counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts).tolist()  # on CPU: no device wait
        y = self._grouped_rows_cpu(x[tok], counts)  # [K*T, H]
        return sum_in_expert_order((y * weights[tok, slot, None]).to(x.dtype), ids, tok, slot)

    def _grouped_rows_cpu(self, rows: Tensor, counts: list[int]) -> Tensor:
        """rows [K*T, H] grouped by expert (counts[e] rows of expert e, in expert order) -> their expert MLPs
        [K*T, H], each expert's GEMMs in ``_forward_cpu``'s operand order (the fused path's CPU fallback takes
        it too: the same bits as the op-by-op path)."""
        y = torch.empty_like(rows)  # [K*T, H]
        I = self.down_proj.shape[2]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            x_e, y_e = rows[start:start + n], y[start:start + n]  # [n, H]
            if n < CPU_WEIGHT_LEFT_MAX_ROWS:
                h = torch.mm(self.gate_up_proj[e], x_e.t())  # [2I, n]: gate rows, then up rows
                act = (F.silu(h[:I]) * h[I:]).t().contiguous()  # [n, I]: its .t() is the fast right operand
                y_e.copy_(torch.mm(self.down_proj[e], act.t()).t())  # [H, n] -> [n, H]
            else:
                gate, up = F.linear(x_e, self.gate_up_proj[e]).chunk(2, dim=-1)  # [n, I] each
                torch.mm(F.silu(gate) * up, self.down_proj[e].t(), out=y_e)
            start += n
        return y

    def _grouped_mm_local(self, x: Tensor, offs: Tensor) -> Tensor:
        """Grouped rows x [n, H] (this rank's experts' rows first, ending at offs[-1]) -> [n, H]; rows past offs[-1]
        are not computed (their values are undefined)."""
        gate, up = _GMM(x, self.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        return _GMM(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offs)

    def _forward_fused(self, x: Tensor, ids: Tensor, weights: Tensor, capture: Tensor | None,
                       grouped: tuple[Tensor, Tensor, Tensor] | None = None) -> ExpertOutputs:
        """``_forward_grouped_mm`` with the bookkeeping in two kernels: ``route`` (the expert-grouped order,
        offsets, the capture copy; or ``grouped``, from the router's launch) before the grouped GEMMs and
        ``combine`` (weights, HF-order sum; ``ExpertOutputs.combine``, or the next norm's launch) after them."""
        routed = grouped if grouped is not None else routing_kernels.route(ids, self.num_experts, capture)
        pos, tok, offs = routed  # [T, K] grouped row of each pair, [K*T] token of each row, [E] row ends
        if self.fp8_block is not None:  # W8A8 block FP8 for every step size
            from ..kernels.fp8_moe import expert_mlp_fp8

            y = expert_mlp_fp8(x, self.gate_up_proj, self.gate_up_proj_scale_inv, self.down_proj,
                               self.down_proj_scale_inv, pos, tok, offs, self.fp8_block)  # [K*T, H]
        elif ids.numel() <= self.triton_gemm_max_pairs:  # only the hit experts' weights are read
            y = fused_moe.expert_mlp(x, self.gate_up_proj, self.down_proj, pos, tok, offs,
                                     deterministic=self.batch_invariant)  # [K*T, H]
        elif x.device.type == "cpu" and x.dtype == torch.float32:  # as the op-by-op path (_forward_grouped)
            counts = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()  # [E] rows per expert
            y = self._grouped_rows_cpu(x[tok], counts)  # [K*T, H]
        else:
            gate, up = _GMM(x[tok], self.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)  # [K*T, I] each
            y = _GMM(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offs)  # [K*T, H]
        return ExpertOutputs(y, ids, pos, weights)

    def _expert(self, e: int, rows: Tensor) -> Tensor:
        """Expert e on its rows [n, H] -> [n, H] (HF's per-expert loop body, before the routing weight)."""
        if self.fp8_block is not None:
            from ..fp8 import w8a8_linear_reference as w8a8

            gate, up = w8a8(rows, self.gate_up_proj[e], self.gate_up_proj_scale_inv[e], self.fp8_block).chunk(2, -1)
            return w8a8(F.silu(gate) * up, self.down_proj[e], self.down_proj_scale_inv[e], self.fp8_block)
        if self.batch_invariant:
            gate, up = inv.linear(rows, self.gate_up_proj[e], None, self.bi_kernels).chunk(2, dim=-1)
            return inv.linear(inv.silu(gate) * up, self.down_proj[e], None, self.bi_kernels)
        gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)  # [n, I] each
        return F.linear(F.silu(gate) * up, self.down_proj[e])  # [n, H]

    def _gathered(self, x: Tensor, ids: Tensor) -> Tensor:
        """All experts of each token from gathered weights: x [T, H], ids [T, K] -> [T, K, H]."""
        gate, up = torch.einsum("th,tkoh->tko", x, self.gate_up_proj[ids]).chunk(2, dim=-1)  # [T, K, I] each
        return torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, self.down_proj[ids])  # [T, K, H]

    def _forward_gather(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        return forward_gathered(self._gathered(x, ids), ids, weights, x.dtype)


def forward_grouped(expert, num_experts: int, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
    """The reference path: pairs grouped by expert in HF's order, ``expert(e, rows)`` on each expert's rows,
    weighted, summed in ascending expert order."""
    tok, slot = group_by_expert(ids)
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts).tolist()  # the one host sync of this layer
    outs = [expert(e, rows) for e, rows in enumerate(torch.split(x[tok], counts)) if rows.shape[0]]
    y = (torch.cat(outs) * weights[tok, slot, None]).to(x.dtype)  # [K*T, H]; fp32 weights promote (Mixtral)
    return sum_in_expert_order(y, ids, tok, slot)


def forward_local(
    expert, first: int, num_local: int, x: Tensor, ids: Tensor, weights: Tensor, grouped_mm=None
) -> Tensor:
    """Expert parallelism: this rank's share of the experts' output [T, H], from the pairs routed to experts
    [first, first + num_local) only (pairs grouped in HF's order, weighted, summed in ascending expert order with
    zeros for the other ranks' pairs, so adding the ranks' shares gives every pair once). ``expert(e, rows)`` takes
    a local expert index; ``grouped_mm(rows, offs)``, when given, runs all local experts in one grouped GEMM
    without a host sync."""
    local = ids - first
    mine = (local >= 0) & (local < num_local)  # [T, K]
    local = torch.where(mine, local, num_local)  # other ranks' pairs: one bin after the last local expert
    tok, slot = group_by_expert(local)  # this rank's pairs first, in HF's order
    w = weights[tok, slot, None]
    if grouped_mm is not None:
        counts = torch.zeros(num_local + 1, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, local.reshape(-1), torch.ones_like(tok))
        y = grouped_mm(x[tok], torch.cumsum(counts[:num_local], 0).to(torch.int32))
        y = torch.where(mine[tok, slot, None], y * w, 0).to(x.dtype)  # where: the uncomputed rows may be NaN
    else:
        counts = torch.bincount(local.reshape(-1), minlength=num_local + 1).tolist()  # this layer's host sync
        rows = torch.split(x[tok], counts)
        n = sum(counts[:num_local])
        outs = [expert(e, r) for e, r in enumerate(rows[:num_local]) if r.shape[0]]
        y = torch.zeros(tok.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        if outs:
            y[:n] = (torch.cat(outs) * w[:n]).to(x.dtype)
    return sum_in_expert_order(y, ids, tok, slot)


def forward_gathered(y: Tensor, ids: Tensor, weights: Tensor, dtype: torch.dtype) -> Tensor:
    """Per-token expert outputs y [T, K, H] (slot order) -> weighted, summed in ascending expert order."""
    y = (y * weights[..., None]).to(dtype)
    order = torch.argsort(ids, dim=-1)  # [T, K] slots in ascending expert order
    return sum_slots(y.gather(1, order[..., None].expand_as(y)))


class GptOssExperts(nn.Module):
    """GPT-OSS experts (HF ``GptOssExperts``): gate_up_proj [E, H, 2I] (transposed, gate/up interleaved: even
    columns gate, odd columns up), gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias [E, H];
    ``gate = gate.clamp(max=limit)``, ``up = up.clamp(-limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``.

    Fused path (CUDA, or the interpreter in tests): ``routing_kernels.route`` (grouping on the device, the capture
    copy) -> kernels/fused_moe_gpt_oss.py's two GEMMs (biases, interleaved gate/up, clamped SwiGLU; within rounding
    of the op-by-op path, same ids) -> ``routing_kernels.combine`` (bit-identical HF-order sum), no host sync, so
    decode and prefill steps replay CUDA graphs. Otherwise the reference (grouped) path, or gathered weights for
    small CUDA decode batches.

    MXFP4 (``keep_mxfp4``, mxfp4_load.py): the experts stay as the checkpoint stores them, ``gate_up_proj_blocks``
    uint8 [E, 2I, H/32, 16] + ``gate_up_proj_scales`` [E, 2I, H/32], ``down_proj_blocks`` [E, H, I/32, 16] +
    ``down_proj_scales`` [E, H, I/32] (the checkpoint's names: weight updates write them by name); the fused path
    runs the kernels' MXFP4 weight load for every step size, the reference path dequantises one expert at a time."""

    supports_fused = True  # MoEForCausalLM.use_fused_kernels switches ``fused`` on where Triton runs
    batch_invariant = False  # deterministic inference (see the module docstring): the reference path
    bi_kernels = False
    MXFP4_PARAMS = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")

    def __init__(self, spec: ExpertsSpec, hidden_size: int):
        super().__init__()
        E, H, I = spec.num_experts, hidden_size, spec.intermediate_size
        self.num_experts = E
        self.limit, self.alpha = spec.swiglu_limit, spec.swiglu_alpha
        self.fused = False
        # As Experts': steps of up to this many pairs run the Triton GEMMs; 0 (CPU, the bit-exactness tests): the
        # reference path even when ``fused`` (there is no torch grouped GEMM with GPT-OSS's biases to fall back on).
        self.triton_gemm_max_pairs = 0
        self.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * I), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * I), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, I, H), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(E, H), requires_grad=False)
        self.first_expert: int | None = None  # expert parallelism: this rank's first expert (sharding.py)
        self.mxfp4 = False  # keep_mxfp4: the expert weights as MXFP4 bytes and scales

    def keep_mxfp4(self) -> None:
        """Hold the expert weights as MXFP4 (see the class docstring) instead of gate_up_proj / down_proj. Called on
        the meta model before loading (mxfp4_load.prepare) or on a loaded one (its weights then need replacing)."""
        E, H, I2 = self.gate_up_proj.shape
        if H % 32 or I2 % 64:
            raise ValueError(f"MXFP4 experts need hidden ({H}) and intermediate ({I2 // 2}) sizes multiple of 32")
        device = self.gate_up_proj.device
        del self.gate_up_proj, self.down_proj
        shapes = {"gate_up_proj_blocks": (E, I2, H // 32, 16), "gate_up_proj_scales": (E, I2, H // 32),
                  "down_proj_blocks": (E, H, I2 // 64, 16), "down_proj_scales": (E, H, I2 // 64)}
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=torch.uint8, device=device),
                                             requires_grad=False))
        self.mxfp4 = True

    def _fused_on(self) -> bool:
        return (self.fused and (self.triton_gemm_max_pairs > 0 or self.mxfp4) and self.first_expert is None
                and not self.batch_invariant)

    def graph_unsafe_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        if self._fused_on() and (self.triton_gemm_max_pairs == sys.maxsize or self.mxfp4):
            return None
        return "GPT-OSS experts off the fused path group tokens by expert on the host"

    def takes_fused_path(self, x: Tensor, top_k: int) -> bool:
        """Whether ``forward`` runs the fused path for the tokens x [T, H]. MXFP4 experts: every step size (the
        reference path would dequantise every expert it runs, each step)."""
        T = x.shape[0]
        return bool(T and self._fused_on() and (self.mxfp4 or T * top_k <= self.triton_gemm_max_pairs))

    def expert_weights(self, e: int) -> tuple[Tensor, Tensor]:
        """Expert e's (gate_up [H, 2I], down [I, H]) in the model dtype (MXFP4: dequantised now, as at load)."""
        if not self.mxfp4:
            return self.gate_up_proj[e], self.down_proj[e]
        from ..checkpoint import dequantize_mxfp4

        dtype = self.gate_up_proj_bias.dtype
        return (dequantize_mxfp4(self.gate_up_proj_blocks[e : e + 1], self.gate_up_proj_scales[e : e + 1], dtype)[0],
                dequantize_mxfp4(self.down_proj_blocks[e : e + 1], self.down_proj_scales[e : e + 1], dtype)[0])

    def forward(
        self, x: Tensor, ids: Tensor, weights: Tensor, capture: Tensor | None = None,
        weights_capture: Tensor | None = None, grouped: tuple[Tensor, Tensor, Tensor] | None = None,
        defer_combine: bool = False,
    ) -> Tensor | ExpertOutputs:
        """As ``Experts.forward``; capture [T, K] receives exactly ``ids``, weights_capture ``weights``."""
        _capture_weights(weights_capture, weights)
        T, K = ids.shape
        if self.takes_fused_path(x, K):
            # [T, K], [K*T], [E]: from the router's launch (one token; it also wrote the capture) or route's
            pos, tok, offs = grouped if grouped is not None else routing_kernels.route(ids, self.num_experts, capture)
            if self.mxfp4:
                y = fused_moe_gpt_oss.expert_mlp(
                    x, self.gate_up_proj_blocks, self.gate_up_proj_bias, self.down_proj_blocks, self.down_proj_bias,
                    pos, tok, offs, self.limit, self.alpha, scales=(self.gate_up_proj_scales, self.down_proj_scales))
            else:  # y [K*T, H]
                y = fused_moe_gpt_oss.expert_mlp(x, self.gate_up_proj, self.gate_up_proj_bias, self.down_proj,
                                                 self.down_proj_bias, pos, tok, offs, self.limit, self.alpha)
            outputs = ExpertOutputs(y, ids, pos, weights)
            return outputs if defer_combine else outputs.combine(x.dtype)
        assert grouped is None, "grouped pairs are for the fused path"
        _capture(capture, ids)
        if T == 0:
            return torch.zeros_like(x)
        if self.batch_invariant:
            return forward_grouped(self._expert, self.num_experts, x, ids, weights)
        if self.first_expert is not None:
            return forward_local(self._expert, self.first_expert, self.num_experts, x, ids, weights)
        if self.mxfp4:  # (gathering would need every pair's expert dequantised)
            return forward_grouped(self._expert, self.num_experts, x, ids, weights)
        slot_bytes = self.gate_up_proj[0].nbytes + self.down_proj[0].nbytes
        if x.is_cuda and T * K <= GATHER_MAX_SLOTS and T * K * slot_bytes <= GATHER_MAX_BYTES:
            return forward_gathered(self._gathered(x, ids), ids, weights, x.dtype)
        return forward_grouped(self._expert, self.num_experts, x, ids, weights)

    def _act(self, gate_up: Tensor) -> Tensor:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        sigmoid = inv.sigmoid if self.batch_invariant else torch.sigmoid
        return (up + 1) * (gate * sigmoid(gate * self.alpha))

    def _expert(self, e: int, rows: Tensor) -> Tensor:
        w_gate_up, w_down = self.expert_weights(e)  # [H, 2I], [I, H]
        if self.batch_invariant:  # matmul, then bias: as HF
            gate_up = inv.linear(rows, w_gate_up.t(), None, self.bi_kernels) + self.gate_up_proj_bias[e]
            return inv.linear(self._act(gate_up), w_down.t(), None, self.bi_kernels) + self.down_proj_bias[e]
        gate_up = rows @ w_gate_up + self.gate_up_proj_bias[e]  # [n, 2I] (matmul, then bias: as HF)
        return self._act(gate_up) @ w_down + self.down_proj_bias[e]  # [n, H]

    def _gathered(self, x: Tensor, ids: Tensor) -> Tensor:
        gate_up = torch.einsum("th,tkho->tko", x, self.gate_up_proj[ids]) + self.gate_up_proj_bias[ids]
        return torch.einsum("tki,tkih->tkh", self._act(gate_up), self.down_proj[ids]) + self.down_proj_bias[ids]


class Relu2Experts(nn.Module):
    """Nemotron-H experts (HF ``NemotronHExperts``): ungated, up_proj [E, I, H], down_proj [E, H, I],
    ``down(relu(up(x)) ** 2)``; each output times its float32 routing weight is summed in float32 in ascending expert
    order (HF accumulates into float32 zeros with ``index_add_``), then cast to the model dtype. Runs torch's grouped
    GEMM where it has one (no host sync), else one matmul per expert; no Triton expert kernels."""

    supports_fused = False

    def __init__(self, spec: ExpertsSpec, hidden_size: int):
        super().__init__()
        E, H, I = spec.num_experts, hidden_size, spec.intermediate_size
        self.num_experts = E
        self.up_proj = nn.Parameter(torch.empty(E, I, H), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, H, I), requires_grad=False)
        self.first_expert: int | None = None

    def graph_unsafe_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        if not grouped_mm_capturable(device, dtype):
            return f"Nemotron-H experts need torch's grouped GEMM without a host sync ({dtype} on this GPU: use bfloat16)"
        return None

    def forward(self, x: Tensor, ids: Tensor, weights: Tensor, capture: Tensor | None = None,
                weights_capture: Tensor | None = None) -> Tensor:
        _capture(capture, ids)
        _capture_weights(weights_capture, weights)
        if ids.shape[0] == 0:
            return torch.zeros_like(x)
        tok, slot = group_by_expert(ids)
        if x.is_cuda and grouped_mm_works(x.device, x.dtype):
            flat = ids.reshape(-1)
            counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
            counts.scatter_add_(0, flat, torch.ones_like(flat))
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = _GMM(x[tok], self.up_proj.transpose(1, 2), offs=offs)
            y = _GMM(torch.square(F.relu(h)), self.down_proj.transpose(1, 2), offs=offs)
        else:
            counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts).tolist()  # host sync
            outs = [self._expert(e, rows) for e, rows in enumerate(torch.split(x[tok], counts)) if rows.shape[0]]
            y = torch.cat(outs)
        y = y * weights[tok, slot, None]  # float32
        return sum_in_expert_order(y, ids, tok, slot).to(x.dtype)

    def _expert(self, e: int, rows: Tensor) -> Tensor:
        return F.linear(torch.square(F.relu(F.linear(rows, self.up_proj[e]))), self.down_proj[e])
