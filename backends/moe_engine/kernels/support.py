"""Fused Triton kernels for the GPU forward: bit-identical to the op-by-op path in layers/, or (the second
table) equal to it within float32 summation order.

A decode step of a small MoE model is a few hundred tiny kernels (an RMSNorm alone is eight: cast,
square, mean, add, rsqrt, multiply, cast, weight), so on a GPU its time is the kernel count, not the
arithmetic. These kernels merge runs of elementwise ops without changing a single rounding:

* every intermediate that torch rounds to the model dtype is rounded here too, to nearest even
  (``_round``), and products are never contracted into FMAs (``enable_fp_fusion=False``);
* reductions stay torch's: a norm's mean of squares is ``torch.mean`` of the very float32 squares the
  op-by-op path builds, so its summation order is unchanged;
* the routed experts' outputs are weighted and summed one by one in ascending expert order, as HF's
  per-expert ``index_add_`` loop does.

So the fused path returns the same bits as the op-by-op one (tests/unit/test_kernels.py compares them), and
the op-by-op path is what agrees with Hugging Face transformers. What is merged:

==========================  =================================================================  ==========
kernel                      replaces                                                           launches
==========================  =================================================================  ==========
``add_square``              residual add, cast to float32, square (for one or two tensors)     3 -> 1
``rms_norm_tail``           + eps, rsqrt, scale, cast, weight (after torch's mean)             5 -> 1
``qk_norm_rope``            q/k norm tails + rotary (``x*cos + rotate_half(x)*sin``) of q and k  ~20 -> 1
``route``                   stable sort of (token, slot) pairs by expert, counts, offsets,     ~12 -> 1
                            and the copy of the ids into the routing capture buffer
``combine``                 routing weight x expert output, HF-order sum over the k experts    ~14 -> 1
``store_kv``                the step's k and v written into the paged cache at their slots      ~4 -> 1
``combine`` with ``add``    DeepSeek: + the shared experts' output after the routed sum        2 -> 1
``mla_rope_store``          MLA (kernel path): rotary of q's and k's rope parts and the cache  ~20 -> 1
                            write of latent + rope key (V2's complex product: within an ulp)
==========================  =================================================================  ==========

With only the kernels above, a batch-1 decode step at real model widths is ~23 launches per layer, most of them
latency-bound (a few microseconds each for kilobytes of data; ``loadtest/bench/bench_real_shape.py --profile a``).
The kernels below sum inside the kernel, in their own order, so their results equal the op-by-op path's within float32 rounding instead of bit for bit; the expert ids
they choose are the same (a router chooses on its logits, whose order rounding does not change). The model uses
them on GPUs unless ``--exact-kernels`` asks for the bit-identical set only (``MoEForCausalLM.use_fused_kernels``):

==========================  =================================================================  ==========
kernel                      replaces                                                           launches
==========================  =================================================================  ==========
``rms_norm``                residual add, squares, torch's mean, the tail                      3 -> 1
``qk_norm_rope`` (no var)   q/k squares, torch's means, the tail and rotary                    3 -> 1
``softmax_topk``            router softmax, top-k (sort + gather), sum, divide, cast           ~7 -> 1
``softmax_topk_route``      one token: ``softmax_topk`` and ``route`` (with the capture copy)    2 -> 1
``small_linear``            cuBLAS for the router logits (up to 4 tokens), o_proj and q/k/v    2 -> 1 (o)
                            (1 token)
``grouped_topk``            DeepSeek V2 / V3 routers after the float32 logits (softmax or      ~15 -> 1
                            sigmoid + bias, group scores, group and expert top-k, renormalise,
                            scale; one token: with ``route``); slots in descending order
shared experts (fused_moe)  DeepSeek's shared-expert MLP as one expert over all tokens (<= 64)   5 -> 2
MLA q + kv_a                one GEMM over views of one weight (small_linear at one token)        2 -> 1
``topk_softmax``            GPT-OSS's router after its biased logits: top-k, softmax over the  ~4 -> 1
                            k, cast (one token: with ``route``); ``softmax_topk``'s launch
==========================  =================================================================  ==========

GPT-OSS's experts run fused_moe_gpt_oss.py's GEMMs (biases, interleaved gate/up, clamped SwiGLU) with the fused
MoE kernels, whenever fused kernels are on: within the model dtype's GEMM rounding, the same ids.

MLA's attention kernels (kernels/mla_attention.py: the absorbed decode; the expanded prefill through
paged_attention.py) run with the attention kernels, like the paged GQA kernels: within rounding.

Triton ships with CUDA builds of torch. Without it (CPU wheels) ``available()`` is False and the model
keeps the op-by-op path. Tests run the kernels on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``), which truncates float32 -> bfloat16 casts: there ``_round`` rounds with integer ops
(round to nearest even on the bits); on the GPU it is the hardware's conversion (``cvt.rn.bf16.f32``, the same
rounding: the same bits), two instructions instead of four, which matters where a kernel's elements are many and
its rounds per element are several (``combine`` rounds 16 times per output, ``qk_norm_rope`` 7).
"""
from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU wheels of torch do not bring Triton
    triton = None

# dtype codes passed to the kernels (a constexpr int is simpler to branch on than a Triton dtype)
_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device | str) -> bool:
    """Whether the fused kernels can run on tensors of this device: Triton importable, and a CUDA device (or
    any device under the interpreter, which tests use)."""
    if triton is None:
        return False
    return interpreting() or torch.device(device).type == "cuda"


def supports(dtype: torch.dtype) -> bool:
    return dtype in _DT



# Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start while the kernel
# before it in the stream is still finishing; it waits (``_await_inputs``) before touching anything an earlier
# kernel writes or reads, so results are unchanged, but its launch, its programs' start and any reads of
# constant data (small_linear's weights) overlap the previous kernel's tail. A batch-1 decode step is ~12
# launches per layer of a few microseconds each (``loadtest/bench/bench_real_shape.py --profile a``), which is
# what it shortens. MOE_PDL=0 in the environment turns it off (read at import).
PDL_ENV = "MOE_PDL"
_PDL_ON = os.environ.get(PDL_ENV, "1") != "0"


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with programmatic dependent launch (their ``PDL`` constexpr)."""
    if not _PDL_ON or triton is None or interpreting() or device.type != "cuda":
        return False
    return _pdl_capable(device.index if device.index is not None else torch.cuda.current_device())


def _launch(kernel, grid, *args, **meta):
    # enable_fp_fusion=False: torch computes a*b + c as two roundings; an FMA would round once.
    if interpreting():
        return kernel[grid](*args, **meta)
    if meta.get("PDL"):
        meta["launch_pdl"] = True
    return kernel[grid](*args, enable_fp_fusion=False, **meta)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


if triton is not None:

    @triton.jit
    def _await_inputs(PDL: tl.constexpr):
        """Under programmatic dependent launch: let the next kernel in the stream launch (it waits for this one in
        turn), then wait until the kernel before this one has completed and its writes are visible. Every program
        of a PDL kernel calls it before it reads what an earlier kernel wrote or writes anything (an earlier kernel
        may still read it), and before returning early (so that the kernel completes after its predecessor)."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()

    @triton.jit
    def _grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
        """Program pid of a 1-D GEMM grid -> (row tile, column tile), in groups of GROUP_M row tiles that take
        every column tile in turn: a weight column tile is read by GROUP_M programs while it is in L2."""
        per_group = GROUP_M * num_pid_n
        first_m = (pid // per_group) * GROUP_M
        group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
        return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m

    # Whether _round may use the bfloat16 cast (read when a kernel compiles; the interpreter truncates the cast).
    _BF16_CAST = tl.constexpr(not interpreting())

    @triton.jit
    def _round(x, DT: tl.constexpr):
        """float32 -> the nearest value of the model dtype (ties to even, as torch's casts), kept in float32."""
        if DT == 1 and _BF16_CAST:  # the GPU's conversion rounds to nearest even
            return x.to(tl.bfloat16).to(tl.float32)
        elif DT == 1:  # bfloat16 by hand: keep the top 16 bits, rounding on the 17th
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        elif DT == 2:
            return x.to(tl.float16).to(tl.float32)
        else:
            return x
