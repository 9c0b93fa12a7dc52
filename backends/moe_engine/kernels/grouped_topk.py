"""DeepSeek's routers in one launch per step (layers/routing.py's DeepseekV2Router / DeepseekV3Router, and the
routers built like V3's: GLM-4.5 / GLM-4.7-Flash, Nemotron-H), from the float32 router logits the op-by-op path
computes (``F.linear(x.float(), W)``, unchanged):

* V2 (``SIGMOID`` off): softmax; greedy top-k, or group-limited (``GROUPED``): the ``topk_group`` groups with the
  largest expert score, the top-k among their experts; weights = the chosen experts' softmax scores;
* V3 (``SIGMOID`` on): sigmoid scores; the choice on scores + ``e_score_correction_bias``: the ``topk_group`` groups
  with the largest sum of their two best biased scores, then the top-k biased scores among their experts; weights =
  the chosen experts' *unbiased* scores, divided by their sum + 1e-20 when ``RENORM`` (norm_topk_prob);

then both times ``routed_scaling_factor``; routing replay (``FORCED``): a forced token's given ids, weighted as
above. One program per token (a token's result never depends on the other tokens of its step: batch-invariant).
``GROUP`` (a step of one token): the same launch also writes what ``moe_routing.route`` writes for its K pairs
(their expert-grouped rows, their token, the experts' end rows) and, with ``CAPTURE``, the ids into the routing
capture row: the fused experts then skip the route launch (as ``moe_routing.softmax_topk_route`` for softmax
routers).

Numerics against the op-by-op router: the ids are the same, the weights equal within float32 rounding.
* V2 chooses on the logits, which order exactly as their softmax scores do (within a token the softmax is
  monotonic; a group's best score is its best logit's); the scores' sum runs in another order than torch's.
* V3's sigmoid is torch's formula, 1 / (1 + exp(-x)) in float32 with the CUDA math library's expf and an IEEE
  division on the GPU (torch's CUDA kernel: the same bits); under the interpreter numpy's exp. The bias add and the
  group score (two floats added) are torch's operations: the choice is made on the op-by-op values.
* Ties go to the lower expert id (and group id), where torch's top-k leaves the choice unspecified.
Slot order: descending choice value (HF's top-k is unsorted, sorted=False: it defines no slot order); the
captured ids are exactly the ids the experts use.
"""
from __future__ import annotations

import torch

from .support import _launch, _pow2, interpreting, pdl, triton

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    from .moe_routing import _select_top_k
    from .support import _await_inputs

    @triton.jit
    def _grouped_topk_kernel(
        logits_ptr, bias_ptr, ids_ptr, w_ptr, E, sl, scale, fmask_ptr, fids_ptr,
        pos_ptr, tok_ptr, offs_ptr, cap_ptr,  # GROUP: what moe_routing's route writes, for a one-token step
        K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SIGMOID: tl.constexpr,
        GROUPED: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
        RENORM: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISE: tl.constexpr, FORCED: tl.constexpr,
        GROUP: tl.constexpr, CAPTURE: tl.constexpr, PDL: tl.constexpr,
    ):
        """Token program_id(0): see the module docstring."""
        _await_inputs(PDL)
        t = tl.program_id(0)
        e = tl.arange(0, BLOCK_E)
        m = e < E
        x = tl.load(logits_ptr + t * sl + e, mask=m, other=float("-inf")).to(tl.float32)
        if SIGMOID:
            if PRECISE:
                s = tl.math.div_rn(tl.full([BLOCK_E], 1.0, tl.float32), 1.0 + libdevice.exp(-x))
            else:
                s = 1.0 / (1.0 + tl.exp(-x))
            choice = s
            if HAS_BIAS:
                choice = s + tl.load(bias_ptr + e, mask=m, other=0.0).to(tl.float32)
            choice = tl.where(m, choice, float("-inf"))
        else:
            ex = tl.exp(x - tl.max(x, axis=0))
            s = ex / tl.sum(ex, axis=0)
            choice = x  # the softmax orders as the logits do
        cand = choice
        if GROUPED:
            per = E // N_GROUP
            grp = e // per
            gi = tl.arange(0, BLOCK_G)
            gscore = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
            for g in tl.static_range(N_GROUP):
                in_g = (grp == g) & m
                c1 = tl.max(tl.where(in_g, choice, float("-inf")), axis=0)
                if SIGMOID:  # the sum of the group's two best biased scores (HF: topk(2) values, summed)
                    first = tl.min(tl.where(in_g & (choice == c1), e, BLOCK_E), axis=0)
                    c2 = tl.max(tl.where(in_g & (e != first), choice, float("-inf")), axis=0)
                    score = c1 + c2
                else:  # the group's best score
                    score = c1
                gscore = tl.where(gi == g, score, gscore)
            keep = e < 0
            for _ in tl.static_range(TOPK_GROUP):
                best = tl.max(gscore, axis=0)
                pick = tl.min(tl.where(gscore == best, gi, BLOCK_G), axis=0)
                keep = keep | (grp == pick)
                gscore = tl.where(gi == pick, float("-inf"), gscore)
            cand = tl.where(keep & m, choice, float("-inf"))
        kk = tl.arange(0, BLOCK_K)
        km = kk < K
        ids, w, ends = _select_top_k(cand, s, e, fmask_ptr, fids_ptr, t, E, K, BLOCK_E, BLOCK_K, FORCED, GROUP)
        if RENORM:
            w = w / (tl.sum(w, axis=0) + 1e-20)
        w = w * scale
        tl.store(ids_ptr + t * K + kk, ids, mask=km)
        tl.store(w_ptr + t * K + kk, w, mask=km)
        if GROUP:  # T = 1: pair i is slot i; its row = pairs with a smaller id, or the same id and a smaller i
            first = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (kk[None, :] < kk[:, None]))
            row = tl.sum((first & km[None, :]).to(tl.int32), axis=1)
            tl.store(pos_ptr + kk, row.to(tl.int64), mask=km)
            tl.store(tok_ptr + row, tl.zeros([BLOCK_K], dtype=tl.int64), mask=km)
            if CAPTURE:
                tl.store(cap_ptr + kk, ids.to(tl.int32), mask=km)
            tl.store(offs_ptr + e, ends, mask=m)


def grouped_topk(
    logits: torch.Tensor,  # [T, E] float32
    top_k: int,
    *,
    sigmoid: bool,  # V3 (sigmoid scores, biased choice) or V2 (softmax)
    n_group: int = 1,
    topk_group: int = 1,
    grouped: bool = False,  # choose among the topk_group best groups first (V2 group_limited_greedy; V3 always)
    renorm: bool = False,  # V3 norm_topk_prob
    scale: float = 1.0,  # routed_scaling_factor
    bias: torch.Tensor | None = None,  # [E] float32 e_score_correction_bias (V3)
    forced_mask: torch.Tensor | None = None,  # [T] bool: routing replay
    forced_ids: torch.Tensor | None = None,  # [T, K]
    capture: torch.Tensor | None = None,  # one-token steps with ``route``: [1, K] int32 capture row
    route: bool = False,  # a step of one token: also return moe_routing.route's outputs (pos, tok, offs)
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """(ids [T, K] int64 in descending choice order, weights [T, K] float32, route's outputs or None): the DeepSeek
    router's math after its logits, in one launch (module docstring)."""
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise ValueError(f"grouped_topk: float32 logits [T, E] expected, got {logits.dtype} {tuple(logits.shape)}")
    T, E = logits.shape
    if grouped and (E % n_group or not 0 < topk_group <= n_group):
        raise ValueError(f"grouped_topk: {E} experts in {n_group} groups, {topk_group} kept")
    if route and T != 1:
        raise ValueError("grouped_topk: route=True is for a step of one token")
    lr = logits if logits.stride(-1) == 1 else logits.contiguous()
    device = logits.device
    ids = torch.empty(T, top_k, dtype=torch.long, device=device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=device)
    forced = forced_mask is not None
    grouped_out = None
    if route:
        grouped_out = (torch.empty(1, top_k, dtype=torch.long, device=device),
                       torch.empty(top_k, dtype=torch.long, device=device),
                       torch.empty(E, dtype=torch.int32, device=device))
    if T:
        _launch(
            _grouped_topk_kernel, (T,), lr, bias if bias is not None else lr, ids, weights, E, lr.stride(0),
            float(scale), forced_mask.contiguous() if forced else lr, forced_ids.contiguous() if forced else ids,
            *(grouped_out or (ids, ids, ids)), ids if capture is None else capture,
            K=top_k, BLOCK_E=_pow2(E), BLOCK_K=_pow2(top_k), SIGMOID=sigmoid, GROUPED=grouped,
            N_GROUP=n_group if grouped else 1, TOPK_GROUP=topk_group if grouped else 1,
            BLOCK_G=max(2, _pow2(n_group if grouped else 1)), RENORM=renorm, HAS_BIAS=bias is not None,
            PRECISE=not interpreting(), FORCED=forced, GROUP=route, CAPTURE=capture is not None and route,
            PDL=pdl(device),
            num_warps=1,  # as moe_routing's softmax_topk: one token's ~K + groups serial reductions, no barriers
        )
    return ids, weights, grouped_out
