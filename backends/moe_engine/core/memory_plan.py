"""How a GPU's memory is divided at start, and what a step's activations should take.

``kv_cache.kv_cache_budget`` measures a step's peak (``profile_peak_activation``: one step of ``step_tokens`` prompt
tokens, the logits of the rows a step samples) and gives the KV cache what ``gpu_memory_utilization`` leaves after the
weights, the CUDA context and twice that peak (the step and the CUDA graphs' pool). Two rules keep that peak what a
step really holds, not the worst case:

- logits only for the rows that are sampled or asked for (the last token of each sequence; prompt scoring's rows),
  and never more than ``LOGITS_CHUNK_BYTES`` of float32 logits from one GEMM: ``logits_chunk_rows`` rows at a time
  (``MoEForCausalLM.compute_logits``; prompt scoring in the runner). With a 201,088-token vocabulary (GPT-OSS) 512
  rows of float32 logits are 412 MB, and the log-softmax of prompt scoring makes temporaries of the same size;
- no dense score matrix of a long prompt: attention runs through the paged kernels (sinks and windows included), and
  GPT-OSS's experts through the fused GEMMs (layers/experts.py), whose buffers grow with the step's tokens only.

``estimate_step_activations`` is the analytic size of such a step (tests bound it on CPU; the start-up log prints it
beside the measured peak, so a path that holds more than it should shows there). ``MemoryDivision`` is the start-up
log's account of where the memory went.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# One GEMM's float32 logits at most this large; prompt scoring holds about three such tensors (logits, their
# exp in logsumexp, the comparison for ranks), the bf16 GEMM output beside them is half of one.
LOGITS_CHUNK_BYTES = 256 << 20
MAX_LOGITS_CHUNK_ROWS = 512  # a small vocabulary: rows enough that a long prompt's scoring takes few launches
MIN_LOGITS_CHUNK_ROWS = 16


def logits_chunk_rows(vocab_size: int) -> int:
    """Rows of float32 logits computed (and scored) at once: 512 for vocabularies up to 131,072 tokens, 441 for
    Qwen3's 151,936, 333 for GPT-OSS's 201,088."""
    rows = LOGITS_CHUNK_BYTES // (4 * max(int(vocab_size), 1))
    return max(MIN_LOGITS_CHUNK_ROWS, min(MAX_LOGITS_CHUNK_ROWS, rows))


def estimate_step_activations(cfg, step_tokens: int, logits_rows: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes one step of ``step_tokens`` tokens holds at its peak beyond weights and KV cache, by part, on the
    kernel path: the residual stream and its neighbours, one layer's attention and MLP / MoE buffers (layers run
    one after the other, so one layer's temporaries at a time), the router, and the logits of ``logits_rows``
    sampled rows (in chunks) with the sampler's softmax. An estimate of the same step ``profile_peak_activation``
    runs, within the caching allocator's rounding; the sum is under "total"."""
    elem = torch.empty((), dtype=dtype).element_size()
    T, H = step_tokens, cfg.hidden_size
    att = cfg.attention
    hq, hkv = att.num_heads, att.num_kv_heads
    d = att.head_dim
    if att.mla is not None:  # the latent expanded to per-head keys and values each step (k_b / v_b projections)
        m = att.mla
        attn = T * hq * (m.qk_nope_head_dim + m.qk_rope_head_dim) * 3 + T * hq * m.v_head_dim
    else:  # q / k / v of the step (one GEMM), the attention output, o_proj's output
        attn = T * (hq * d * (2 if att.output_gate else 1) + 2 * hkv * d) + T * hq * d + T * H
    K, E = cfg.num_experts_per_tok, cfg.num_experts
    width = cfg.experts.intermediate_size
    # grouped rows: the expert GEMMs' h [T*K, I] and y [T*K, H], the combine's [T, H]; router logits [T, E] and the
    # top-k ids / weights / grouping ([T, K] each, 8-byte ids)
    moe = T * K * (width + H) * elem + T * H * elem + T * E * (elem + 4) + T * K * 32 if cfg.moe_layers else 0
    shared = T * 3 * cfg.experts.shared_intermediate_size * elem
    dense = 3 * T * cfg.intermediate_size * elem if len(cfg.moe_layers) < cfg.num_hidden_layers else 0
    chunk = min(logits_rows, logits_chunk_rows(cfg.vocab_size))
    parts = {
        "residual stream, norms, layer outputs": 4 * T * H * elem,
        "attention (one layer)": attn * elem,
        "experts (one layer)": max(moe + shared, dense),
        # float32 logits of the sampled rows, one chunk's GEMM output in the model dtype, the sampler's softmax
        "logits": logits_rows * cfg.vocab_size * 8 + chunk * cfg.vocab_size * elem,
        "routing capture and step buffers": T * cfg.num_hidden_layers * K * 8 + T * 16,
    }
    parts["total"] = sum(parts.values())
    return parts


@dataclass(frozen=True)
class MemoryDivision:
    """Where a GPU's memory went at start (bytes): the weights, the rest in use before the KV cache (CUDA context,
    this process's other buffers, other processes), the activations reserved (twice the profiled peak: the step and
    the CUDA graphs' pool), the KV cache, and what ``gpu_memory_utilization`` keeps back."""

    total: int
    utilization: float
    weights: int
    other_in_use: int
    peak_activations: int
    estimated_activations: int
    kv_cache: int
    quantized_weights: int = 0  # of ``weights``: those stored packed / quantized (MXFP4 experts, FP8), scales included

    @property
    def kept_back(self) -> int:
        return self.total - int(self.total * self.utilization)

    def describe(self) -> str:
        g = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
        quantized = f" ({g(self.quantized_weights)} of it MXFP4 / FP8)" if self.quantized_weights else ""
        return (f"GPU memory {g(self.total)}: weights {g(self.weights)}{quantized}, CUDA context and other buffers "
                f"{g(self.other_in_use)}, step activations 2 x {self.peak_activations / 2**30:.2f} GiB (profiled peak, "
                f"reserved for the step and the CUDA graphs; estimate {self.estimated_activations / 2**30:.2f} GiB), "
                f"KV cache {g(self.kv_cache)}, kept free {g(self.kept_back)} (gpu_memory_utilization "
                f"{self.utilization:.2f})")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers on its device (a tied weight counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    return total


_QUANTIZED_DTYPES = (torch.uint8, torch.float8_e4m3fn)  # MXFP4 bytes and e8m0 scales; FP8 weights


def quantized_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters held quantized (MXFP4 experts' bytes and scales, FP8 weights and their float32
    ``*_scale_inv``): the part of ``weight_bytes`` a packed format saves on."""
    return sum(p.nbytes for n, p in model.named_parameters()
               if p.dtype in _QUANTIZED_DTYPES or n.endswith("_scale_inv"))
