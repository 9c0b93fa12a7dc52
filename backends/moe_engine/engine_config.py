"""Engine settings: every setting, its default and its help text, in one place, free of torch (the CLI imports it).

``EngineConfig`` is what a user sets (``None``: decided by the engine). ``moe-serve`` generates its engine flags
from its fields (``add_cli_args``, as vLLM's ``EngineArgs``), builds one from the parsed flags
(``from_cli_args``) and sends it to the Triton model as one JSON parameter (``engine_config``); the backend
rebuilds it with ``from_json``. ``resolve`` decides every default once, for a model on a device, into a frozen
``ResolvedConfig``: the engine, the scheduler, the block manager, the runner and every tensor-parallel rank take
that, and no other module has defaults of its own.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

# Renamed settings still accepted in an engine_config JSON (old name -> new name).
RENAMED = {"overlap_decode": "async_scheduling"}

# --kv-cache-dtype values (vLLM's names) this engine serves -> what the KV blocks hold ("auto": the model dtype).
# vLLM's fp8_e5m2 is refused (no scaled e5m2 path here; the format: kernels/kv_fp8.py).
KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3"}

# vLLM's switch for its batch-invariant mode, accepted as --enable-deterministic-inference (SGLang's flag).
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"


def batch_invariant_env() -> bool:
    """Whether the environment asks for deterministic inference (``VLLM_BATCH_INVARIANT=1``, as vLLM reads it)."""
    return os.environ.get(BATCH_INVARIANT_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def _setting(default: Any, help: str, **cli: Any) -> Any:
    """A field with its help text and how its flag differs from ``--<field-name>`` (``cli``: ``flag``, ``type``,
    ``choices``, ``to_field`` converting the flag's value, ``action``)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineConfig:
    """What the engine runs with. ``None``: decided by ``resolve`` (each field's help says how)."""

    max_num_seqs: int | None = _setting(None, "sequences running at once (default: 256 on CUDA, 64 on CPU)")
    max_model_len: int | None = _setting(
        None, "prompt + output tokens of one sequence (default: the model's max_position_embeddings)")
    max_num_batched_tokens: int | None = _setting(
        None, "tokens per engine step: decode tokens + prefill chunks (default: 8192 on CUDA, as vLLM: prefill GEMMs "
              "run near the tensor cores' peak; 512 on CPU, where a step's time grows with its tokens)")
    block_size: int | None = _setting(
        None, "tokens per KV-cache block (default: 64 on Hopper or later GPUs with the fused kernels, where the "
              "prefill attention loads whole blocks through TMA; 16 elsewhere)", choices=[8, 16, 32, 64, 128])
    gpu_memory_utilization: float = _setting(
        0.9, "CUDA: share of GPU memory for weights, activations and the KV cache (the KV cache gets the rest)")
    kv_cache_memory_bytes: int | None = _setting(
        None, "KV cache size in GiB (overrides --gpu-memory-utilization; default on CPU: 2 GiB)",
        flag="--kv-cache-memory", type=float, to_field=lambda gib: int(gib * 2**30) if gib else None)
    enable_prefix_caching: bool = _setting(
        True, "reuse the KV blocks and routed experts of shared prompt prefixes (--no-enable-prefix-caching: off)",
        action=argparse.BooleanOptionalAction)
    max_waiting: int = _setting(1024, "engine queue bound; beyond it requests get 503")
    enable_routed_experts: bool = _setting(
        True, "turn routed experts off server-wide (no capture work at all)", flag="--disable-routed-experts",
        action="store_true", to_field=lambda off: not off)
    expert_load: bool = _setting(
        True, "turn off the expert-load counts: tokens per MoE layer and expert, added up on the device each step "
              "(/metrics' per-layer balance, /dashboard, the expert-distribution recorder; they need routed experts "
              "on)", flag="--disable-expert-load", action="store_true", to_field=lambda off: not off)
    expert_load_window: float = _setting(
        60.0, "seconds of the sliding window over which /metrics' per-layer expert balance and /dashboard's heatmap "
              "count")
    expert_distribution_recorder_mode: str = _setting(
        "stat", "what /dump_expert_distribution_record returns (SGLang's modes): stat, the counts per layer and expert "
                "summed over the recorded steps; per_pass, one record per step", choices=["stat", "per_pass"])
    expert_distribution_recorder_buffer_size: int = _setting(
        1000, "the expert-distribution recorder keeps the last N steps (SGLang's default 1000); -1: every step")
    enforce_eager: bool = _setting(
        False, "CUDA: run every step eagerly instead of replaying CUDA graphs (debugging; saves the graphs' memory)",
        action="store_true")
    max_cudagraph_capture_size: int | None = _setting(
        None, "CUDA: steps of up to this many tokens replay CUDA graphs: decode batches of up to this many sequences "
              "(at most --max-num-seqs), prefill and mixed steps of up to this many tokens; default "
              "max(2048, --max-num-seqs); 0: every step eager")
    async_scheduling: bool | None = _setting(
        None, "plan and launch step i+1 before handing out step i's results, so the GPU computes while the host "
              "works (default: on CUDA; on CPU the forward runs on the host, nothing to overlap)",
        action=argparse.BooleanOptionalAction)
    fused_kernels: bool | None = _setting(
        None, "CUDA: op-by-op forward instead of the fused Triton kernels (same results; debugging)",
        flag="--disable-fused-kernels", action="store_true", to_field=lambda off: False if off else None)
    exact_kernels: bool = _setting(
        False, "CUDA: only the fused kernels that are bit-identical to the op-by-op forward (without it, also the "
               "one-pass norms, fused router and q/k/v GEMM: equal within rounding, same expert ids; faster)",
        action="store_true")
    quantization: str | None = _setting(
        None, "fp8: quantise a bf16/fp16/fp32 checkpoint's dense projections and routed experts to block-scaled FP8 "
              "(128 x 128 blocks) at load and serve them W8A8 (vLLM's flag; routers, norms, embeddings and lm_head "
              "stay in the model dtype). An FP8 checkpoint needs no flag: it is served in FP8 on GPUs with FP8 "
              "tensor cores and dequantised elsewhere", choices=["fp8"])
    kv_cache_dtype: str = _setting(
        "auto", "KV cache dtype (vLLM's flag): auto = the model dtype; fp8 / fp8_e4m3 = float8 e4m3 blocks, twice the "
                "tokens in the same memory, with per-layer k/v scales from the checkpoint (k_scale / v_scale / "
                "kv_scale) or 1.0 (MLA models: the latent and rope key). Not with tensor parallelism or "
                "deterministic inference",
        choices=list(KV_CACHE_DTYPES))
    deterministic_inference: bool = _setting(
        False, "batch-invariant forward: a request's tokens, logprobs, prompt logprobs, routed experts and routed "
               "weights are the same bits whatever shares its steps (chunking, prefix-cache hits and CUDA graphs "
               "included); every reduction runs in an order fixed per row (docs/design/determinism.md). "
               f"{BATCH_INVARIANT_ENV}=1 in the environment turns it on too. Not with tensor parallelism",
        flag="--enable-deterministic-inference", action="store_true",
        to_field=lambda on: bool(on) or batch_invariant_env())
    tensor_parallel_size: int = _setting(
        1, "split the model over this many GPUs (processes on CPU): attention heads, MLPs, vocabulary and experts; "
           "one engine, started by the Triton model instance")
    enable_expert_parallel: bool = _setting(
        False, "with --tensor-parallel-size N, each rank holds num_experts/N whole experts (instead of a slice of "
               "every expert)", action="store_true")

    # ------------------------------------------------------------------ serialisation and the command line

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "EngineConfig":
        raw = json.loads(text) if text else {}
        raw = {RENAMED.get(k, k): v for k, v in raw.items()}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown engine settings: {', '.join(unknown)}")
        return cls(**raw)

    @classmethod
    def add_cli_args(cls, add) -> None:
        """Add one flag per field through ``add(flag, **argparse_kwargs)`` (the CLI's adder: environment
        variables, help suffix)."""
        for f in fields(cls):
            meta = f.metadata
            kw = {"help": meta["help"]}
            if "action" in meta:
                kw["action"] = meta["action"]
                kw["default"] = False if meta["action"] == "store_true" else f.default
            else:
                kw["type"] = meta.get("type") or _scalar_type(f)
                kw["default"] = None if "to_field" in meta else f.default
            if "choices" in meta:
                kw["choices"] = meta["choices"]
            add(_flag(f), **kw)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        values = {}
        for f in fields(cls):
            value = getattr(args, _flag(f).lstrip("-").replace("-", "_"))
            convert = f.metadata.get("to_field")
            values[f.name] = convert(value) if convert else value
        return cls(**values)

    # ------------------------------------------------------------------ resolution

    def model_len(self, cfg) -> int:
        """max_model_len for ``cfg`` (a MoEConfig): as set, else the model's max_position_embeddings."""
        return self.max_model_len or cfg.max_position_embeddings

    def resolve(self, cfg, device, dtype) -> "ResolvedConfig":
        """Every default decided for ``cfg`` (a MoEConfig) running on ``device`` in ``dtype`` (torch objects)."""
        from .kernels import paged_attention
        from .kernels import support as kernel_support

        import torch

        device = torch.device(device)
        cuda = device.type == "cuda"
        max_num_seqs = self.max_num_seqs or (256 if cuda else 64)
        graph_tokens = max(2048, max_num_seqs) if self.max_cudagraph_capture_size is None \
            else self.max_cudagraph_capture_size
        if graph_tokens < 0:
            raise ValueError(f"max_cudagraph_capture_size must be >= 0, got {graph_tokens}")
        if not self.expert_load_window > 0:
            raise ValueError(f"expert_load_window must be > 0 seconds, got {self.expert_load_window}")
        if self.expert_distribution_recorder_buffer_size < -1:
            raise ValueError("expert_distribution_recorder_buffer_size must be >= 0, or -1 (every step), got "
                             f"{self.expert_distribution_recorder_buffer_size}")
        if self.expert_distribution_recorder_mode not in ("stat", "per_pass"):
            raise ValueError("expert_distribution_recorder_mode must be stat or per_pass, got "
                             f"{self.expert_distribution_recorder_mode!r}")
        fused = ((cuda if self.fused_kernels is None else self.fused_kernels)
                 and kernel_support.available(device) and kernel_support.supports(dtype))
        attention_kernels = fused and cuda and paged_attention.available(device)  # MLA: kernels/mla_attention.py too
        deterministic = bool(self.deterministic_inference) or batch_invariant_env()
        if deterministic:
            check_deterministic(self, cuda, bool(fused), cfg)
        kv_cache_dtype = resolve_kv_cache_dtype(self, deterministic)
        att = cfg.attention
        head_dims = (att.mla.kv_lora_rank, att.mla.qk_rope_head_dim) if att.mla is not None else (att.head_dim,)
        return ResolvedConfig(
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            max_num_seqs=max_num_seqs,
            max_model_len=self.model_len(cfg),
            # every running sequence can decode in one step
            step_tokens=max(self.max_num_batched_tokens or (8192 if cuda else 512), max_num_seqs),
            block_size=self.block_size or paged_attention.default_block_size(attention_kernels, device, dtype,
                                                                            head_dims),
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=int(self.kv_cache_memory_bytes or 0),
            # hybrid models keep one recurrent state per sequence, not per block: no prefix cache (the reason:
            # MoEConfig.prefix_caching_off_reason, in /v1/models)
            enable_prefix_caching=self.enable_prefix_caching and cfg.prefix_caching_off_reason is None,
            enable_routed_experts=self.enable_routed_experts,
            max_waiting=self.max_waiting,
            cuda_graphs=cuda and not self.enforce_eager and graph_tokens > 0,
            max_cudagraph_capture_size=graph_tokens,
            async_scheduling=cuda if self.async_scheduling is None else self.async_scheduling,
            fused_kernels=bool(fused),
            exact_kernels=self.exact_kernels,
            attention_kernels=bool(attention_kernels),
            tensor_parallel_size=self.tensor_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel,
            deterministic_inference=deterministic,
            kv_cache_dtype=kv_cache_dtype,
            # the counts read the routing capture: none without routed experts
            expert_load=bool(self.expert_load and self.enable_routed_experts),
            expert_load_window=float(self.expert_load_window),
            expert_distribution_recorder_mode=self.expert_distribution_recorder_mode,
            expert_distribution_recorder_buffer_size=int(self.expert_distribution_recorder_buffer_size),
        )


def _flag(f) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _scalar_type(f) -> type:
    name = f.type if isinstance(f.type, str) else f.type.__name__
    return {"int": int, "float": float, "str": str}[name.split("|")[0].strip()]


@dataclass(frozen=True)
class ResolvedConfig:
    """``EngineConfig.resolve``'s answer: every setting decided, nothing left to default. JSON-able (rank 0 sends
    it to the other ranks of a tensor-parallel group, which build the same runner from it)."""

    device: str
    dtype: str
    max_num_seqs: int
    max_model_len: int
    step_tokens: int  # per step, >= max_num_seqs
    block_size: int
    gpu_memory_utilization: float
    # KV-cache bytes; 0: kv_cache.py's budget (CUDA: what gpu_memory_utilization leaves after the weights and a
    # profiled peak step; CPU: 2 GiB, capped at what max_num_seqs full-length sequences need)
    kv_cache_memory_bytes: int
    enable_prefix_caching: bool
    enable_routed_experts: bool
    max_waiting: int
    cuda_graphs: bool  # CUDA and not enforce_eager (the model may still refuse: graph_unsafe_reason)
    max_cudagraph_capture_size: int
    async_scheduling: bool  # overlapped steps (engine.py)
    fused_kernels: bool  # the fused Triton kernels, where Triton runs for this device and dtype
    exact_kernels: bool
    attention_kernels: bool  # the paged attention kernels (CUDA, fused kernels on; MLA: absorbed decode too)
    tensor_parallel_size: int
    enable_expert_parallel: bool
    deterministic_inference: bool = False  # batch-invariant forward (docs/design/determinism.md)
    kv_cache_dtype: str = "auto"  # what the KV blocks hold: "auto" (the model dtype) or "fp8_e4m3"
    expert_load: bool = False  # tokens per (MoE layer, expert) counted on the device (core/expert_load.py)
    expert_load_window: float = 60.0  # seconds
    expert_distribution_recorder_mode: str = "stat"
    expert_distribution_recorder_buffer_size: int = 1000

    @property
    def keep_routing_rows(self) -> bool:
        """Routing rows kept with cached prefix blocks (so, with the prefix cache on, every step captures)."""
        return self.enable_prefix_caching and self.enable_routed_experts

    @property
    def captures_every_step(self) -> bool:
        """Every step writes the routing capture: the prefix cache keeps its rows, or the expert load counts them
        (a step in which no request asks for routing still captures, and hands no rows to the host)."""
        return self.keep_routing_rows or self.expert_load

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ResolvedConfig":
        return cls(**json.loads(text))


def check_deterministic(engine: EngineConfig, cuda: bool, fused: bool, cfg) -> None:
    """Raise ValueError for a setting that deterministic inference cannot honour: tensor parallelism (its all-reduce
    sums the ranks' partial sums in an order that follows the message size), ``--exact-kernels`` (its norms take
    torch's mean, whose CUDA reduction is split by the row count), a CUDA forward without the Triton kernels (the
    batch-invariant GEMMs and attention are Triton kernels there) and hybrid models (``cfg``, a MoEConfig: their
    Gated DeltaNet and Mamba-2 layers have no batch-invariant variant yet)."""
    flag = "--enable-deterministic-inference"
    if cfg.is_hybrid:
        raise ValueError(f"{flag} does not cover hybrid models yet ({cfg.architecture}: its linear-attention / SSM "
                         "layers have no batch-invariant variant); serve it without the flag")
    if engine.tensor_parallel_size > 1:
        raise ValueError(f"{flag} does not cover tensor parallelism (its all-reduce order depends on the message "
                         "size); use --tensor-parallel-size 1")
    if cuda and engine.exact_kernels:
        raise ValueError(f"{flag} replaces --exact-kernels' norms by per-row kernels; drop --exact-kernels")
    if cuda and not fused:
        raise ValueError(f"{flag} on CUDA needs the fused Triton kernels (Triton installed, no "
                         "--disable-fused-kernels)")


def resolve_kv_cache_dtype(engine: EngineConfig, deterministic: bool) -> str:
    """``engine.kv_cache_dtype`` as the blocks hold it ("auto" or "fp8_e4m3"); ValueError for a value this engine
    does not serve or an FP8 cache it cannot combine: tensor parallelism and deterministic inference (their
    attention paths have no FP8 read yet). MLA models cache their latent and rope key in FP8 (layers/mla.py)."""
    value = (engine.kv_cache_dtype or "auto").strip().lower()
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {engine.kv_cache_dtype!r} is not supported (supported: "
                         f"{', '.join(KV_CACHE_DTYPES)}" + ("; fp8_e5m2 is not implemented, use fp8 (e4m3)"
                                                            if value == "fp8_e5m2" else "") + ")")
    resolved = KV_CACHE_DTYPES[value]
    if resolved == "auto":
        return resolved
    flag = f"--kv-cache-dtype {value}"
    if engine.tensor_parallel_size > 1:
        raise ValueError(f"{flag} is not supported with tensor parallelism yet; use --tensor-parallel-size 1 or "
                         "--kv-cache-dtype auto")
    if deterministic:
        raise ValueError(f"{flag} is not supported with --enable-deterministic-inference (the batch-invariant "
                         "attention reads the model dtype); drop one of the two")
    return resolved


def check_parallel(cfg, tensor_parallel_size: int, expert_parallel: bool) -> None:
    """Raise ValueError naming the size that a tensor-parallel split of ``cfg`` (a MoEConfig) cannot divide
    (the same rules as sharding.py, checked before anything loads)."""
    N = tensor_parallel_size
    if N < 1:
        raise ValueError(f"the tensor-parallel size must be >= 1, got {N}")
    if N == 1:
        return
    if cfg.is_hybrid:
        raise ValueError(f"{cfg.architecture}: tensor parallelism is not supported for hybrid models (linear-attention "
                         f"/ Mamba layers are not sharded); use --tensor-parallel-size 1")
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
