"""Weights asked into L2 while the GPU's memory bus idles: decode steps' latency-bound kernels.

A decode step alternates kernels that stream weights at the HBM's rate (the expert GEMMs, the dense projections)
with kernels that move kilobytes and are bound by latency (norms, the router's softmax / top-k / grouping, the
combine, short attention). During the latter the bus idles. This module asks L2 for the bytes the next
bandwidth-bound kernel will read, from a second stream forked inside the CUDA graph of the step, so that kernel
finds part of its weights on chip:

* ``after_qkv`` (in ``Attention``): the layer's o_proj weight, fetched while q/k norm + rotary and attention run;
* ``after_attention``: the first experts' gate_up weights, fetched while o_proj, the norm, the router and the
  grouping run (worth it only where a step hits most experts: many tokens);
* ``after_experts`` (in ``Experts``, between the down GEMM and the combine): the next layer's q/k/v weights,
  fetched while the combine and the next layer's input norm run.

The prefetch is a hint: no kernel waits for it and results do not depend on it (the same loads, from L2 or HBM).
A fork is a graph edge after the main stream's last kernel, so the fetch starts only once that kernel has
completed (it never competes with the GEMM before it); the branches join the main stream at the end of the step.

``plan(model, spec)`` sets what each module asks for; ``Prefetcher.during(tokens)`` arms the hooks for one
forward (the decode graphs' capture). MOE_L2_PREFETCH in the environment gives the spec, e.g. ``qkv,o,experts=32`` (or ``+`` between items)
(MB of experts), with ``experts_min_tokens=16``.
"""
from __future__ import annotations

import contextlib
import logging
import os

import torch

from .kernels import interpreting, triton

if triton is not None:
    import triton.language as tl

log = logging.getLogger(__name__)

ENV = "MOE_L2_PREFETCH"
CHUNK = 4096  # bytes per prefetch instruction (a 16-byte multiple; cp.async.bulk.prefetch takes any size)
BLOCK = 128  # chunks per program

if triton is not None:

    @triton.jit
    def _prefetch_l2_kernel(base_ptr, n_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr, BULK: tl.constexpr):
        """Chunk i of the bytes at base_ptr (uint8) asked into L2: one bulk prefetch per chunk (Hopper), or one
        ``prefetch.global.L2`` per 128-byte line. Lanes past the end repeat the last chunk (harmless)."""
        i = tl.minimum(tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), n_chunks - 1)
        ptrs = base_ptr + i.to(tl.int64) * CHUNK
        if BULK:
            tl.inline_asm_elementwise(f"cp.async.bulk.prefetch.L2.global [$1], {CHUNK}; // $0", "=r,l", [ptrs],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            for j in tl.static_range(CHUNK // 128):
                tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs + j * 128],
                                          dtype=tl.int32, is_pure=False, pack=1)


def prefetch(t: torch.Tensor, bulk: bool = True) -> None:
    """Ask L2 for the bytes of contiguous ``t`` (rounded down to whole chunks) on the current stream."""
    b = t.reshape(-1).view(torch.uint8)
    n = b.numel() // CHUNK
    if n:
        _prefetch_l2_kernel[(triton.cdiv(n, BLOCK),)](b, n, CHUNK=CHUNK, BLOCK=BLOCK, BULK=bulk, num_warps=4)


class Prefetcher:
    """One per model: the side stream and whether the hooks are armed (only inside ``during``)."""

    def __init__(self, device: torch.device, spec: dict):
        self.stream = torch.cuda.Stream(device=device)
        self.spec = spec
        self.tokens = 0
        self.armed = False
        self.forked = False
        self.bulk = spec.get("bulk", 1) != 0

    @contextlib.contextmanager
    def during(self, tokens: int):
        self.armed, self.tokens, self.forked = True, tokens, False
        try:
            yield
        finally:
            self.armed = False
            if self.forked:  # join: the step ends after every branch
                torch.cuda.current_stream().wait_stream(self.stream)
                self.forked = False

    def issue(self, point: str, tensors: tuple[torch.Tensor, ...]) -> None:
        if not (self.armed and tensors):
            return
        if point == "after_attention" and self.tokens < self.spec.get("experts_min_tokens", 16):
            return
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            for t in tensors:
                prefetch(t, self.bulk)
        self.forked = True


def parse_spec(text: str | None) -> dict:
    spec: dict = {}
    for item in (text or "").replace("+", ",").split(","):
        item = item.strip()
        if not item:
            continue
        key, eq, value = item.partition("=")
        spec[key] = float(value) if eq else 1
    return spec


def plan(model, spec: dict | None = None) -> Prefetcher | None:
    """Attach a Prefetcher to ``model`` and set each layer's prefetch lists from ``spec`` (MOE_L2_PREFETCH when
    None); None (and no hooks) when the spec is empty, the model is not on CUDA, or Triton is interpreting."""
    spec = parse_spec(os.environ.get(ENV)) if spec is None else spec
    if not spec or model.device.type != "cuda" or interpreting() or triton is None:
        return None
    pf = Prefetcher(model.device, spec)
    layers = list(model.model.layers)
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        attn.l2 = pf
        if spec.get("o"):
            attn.l2_after_qkv = (attn.o_proj.weight,)
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and spec.get("experts"):
            per_expert = experts.gate_up_proj[0].nbytes
            n = max(1, int(spec["experts"] * 2**20 // per_expert))
            attn.l2_after_attention = (experts.gate_up_proj[:n],)
        if experts is not None and spec.get("qkv") and i + 1 < len(layers):
            nxt = layers[i + 1].self_attn
            w = nxt._qkv_weight()
            experts.l2 = pf
            experts.l2_after_experts = (w[0],) if w is not None else (nxt.q_proj.weight, nxt.k_proj.weight,
                                                                        nxt.v_proj.weight)
    log.info("decode graphs ask L2 for weights during latency-bound kernels: %s", spec)
    return pf
