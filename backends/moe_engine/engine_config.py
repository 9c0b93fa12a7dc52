"""Engine settings: every setting and its default, in one place, free of torch (the CLI imports it).

``moe-serve`` builds an ``EngineConfig`` from its flags and sends it to the Triton model as one JSON parameter
(``engine_config``); the backend rebuilds it with ``EngineConfig.from_json`` (as Triton's vllm_backend takes its
engine args). No other layer has defaults of its own.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields


@dataclass
class EngineConfig:
    """What the engine runs with (see each field)."""

    max_num_seqs: int | None = None  # sequences running at once; None: 256 on CUDA, 64 on CPU
    max_model_len: int | None = None  # prompt + output tokens of one sequence; None: max_position_embeddings
    # Per step: decode tokens + prefill chunk tokens. None: 8192 on CUDA (as vLLM; prefill GEMMs run closer to
    # the tensor cores' peak, and fewer steps cost less host time), 512 on CPU (a step's time grows with its
    # tokens, and running requests wait for it).
    max_num_batched_tokens: int | None = None
    # Tokens per KV block. None: 64 where the prefill attention kernel loads whole blocks through TMA (CUDA on
    # Hopper or later with the fused kernels, bf16/fp16), else 16 (paged_attention.default_block_size).
    block_size: int | None = None
    gpu_memory_utilization: float = 0.9  # CUDA: share of GPU memory for weights + activations + KV cache
    kv_cache_memory_bytes: int | None = None  # KV cache size; None: from gpu_memory_utilization (CPU: 2 GiB)
    enable_prefix_caching: bool = True  # reuse computed KV blocks (and their routing rows) across requests
    max_waiting: int = 1024  # waiting-queue bound; beyond it add_request raises EngineOverloadedError
    enable_routed_experts: bool = True  # server-wide switch; off = never any capture work
    enforce_eager: bool = False  # CUDA: no CUDA graphs (debugging, or to save their memory)
    # CUDA: steps of up to this many tokens replay CUDA graphs (vLLM's compilation-config field of that name):
    # decode steps of up to this many sequences (at most max_num_seqs), prefill and mixed steps of up to this many
    # tokens (with the paged attention kernels and the fused experts). None: max(2048, max_num_seqs); 0: every step
    # eager.
    max_cudagraph_capture_size: int | None = None
    # Plan and launch step i+1 (decode, prefill or mixed: engine.py's overlapped steps, vLLM's async scheduling)
    # before handing out step i's results (None: on CUDA, where the GPU then works while the host does; on CPU the
    # forward runs on the host, so there is nothing to overlap). The name predates prefill steps taking part.
    overlap_decode: bool | None = None
    # Fused Triton kernels for norms, rotary, expert bookkeeping and the KV write (kernels.py): same results bit
    # for bit, a third of the kernel launches. None: on CUDA when Triton is installed (CUDA builds of torch).
    # The switch is the model's: engines sharing a model share it.
    fused_kernels: bool | None = None
    # Only the fused kernels that are bit-identical to the op-by-op path: without it, GPUs also use the fusions
    # equal to it within rounding, with the same expert ids (one-pass norms, fused router, one q/k/v GEMM).
    exact_kernels: bool = False
    # Tensor parallelism (vLLM's --tensor-parallel-size): the model split over this many ranks, one process (one
    # GPU) each; this process is rank 0 and starts the others (ranks.py, sharding.py).
    tensor_parallel_size: int = 1
    # With tensor parallelism, each rank holds num_experts / N whole experts (vLLM's --enable-expert-parallel)
    # instead of a slice of every expert.
    enable_expert_parallel: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "EngineConfig":
        raw = json.loads(text) if text else {}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown engine settings: {', '.join(unknown)}")
        return cls(**raw)


def check_parallel(cfg, tensor_parallel_size: int, expert_parallel: bool) -> None:
    """Raise ValueError naming the size that a tensor-parallel split of ``cfg`` (a MoEConfig) cannot divide
    (the same rules as sharding.py, checked before anything loads)."""
    N = tensor_parallel_size
    if N < 1:
        raise ValueError(f"the tensor-parallel size must be >= 1, got {N}")
    if N == 1:
        return
    att = cfg.attention
    if att.num_heads % N:
        raise ValueError(f"num_attention_heads ({att.num_heads}) is not divisible by the tensor-parallel size {N}")
    checks = []
    if att.mla is None and att.num_kv_heads >= N:
        checks.append(("num_key_value_heads", att.num_kv_heads))
    elif att.mla is None and N % att.num_kv_heads:
        raise ValueError(f"the tensor-parallel size {N} must be a multiple of num_key_value_heads "
                         f"({att.num_kv_heads}) when it exceeds it")
    if cfg.dense_layers:
        checks.append(("intermediate_size", cfg.intermediate_size))
    if cfg.experts.shared_intermediate_size:
        checks.append(("the shared experts' intermediate size", cfg.experts.shared_intermediate_size))
    checks.append(("the number of experts", cfg.num_experts) if expert_parallel
                  else ("moe_intermediate_size", cfg.experts.intermediate_size))
    for what, n in checks:
        if n % N:
            raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {N}")
