"""Hugging Face config.json -> one normalised MoE config for every architecture.

No torch import here: the CLI and the frontend use this module to compute
metadata (which layers are MoE, expert count, top-k) without loading PyTorch.

``MoEConfig`` holds what every architecture has (vocabulary, hidden size,
layers, which of them are MoE, dtype, special tokens, norms, the dense MLP)
and one frozen spec per concern, each read by the module that implements it:

- ``rope: RopeSpec``            layers/rotary.py (``RotaryEmbedding``; yarn values derived there)
- ``attention: AttentionSpec``  layers/attention.py's ``Attention``; with ``mla: MLASpec`` layers/mla.py's
                                ``MLAttention``
- ``router: RouterSpec``        layers/routing.py (``make_router``)
- ``experts: ExpertsSpec``      layers/moe.py's MoE blocks, layers/experts.py; checkpoint.py (expert key layout)

Architecture differences the model needs are plain spec fields (router kind,
q/k norm, shared expert sizes, per-layer sliding windows, ...), so that the
decoder (models/decoder.py) never branches on the architecture's name.

Each supported ``model_type`` has a parser in ``models/`` (one file per family)
that reads that architecture's keys, with the defaults of transformers 5.24's
config class, and returns the keyword arguments of ``MoEConfig`` and its specs as
nested dicts; ``config_from_dict`` builds and checks the dataclasses. (The parsers
return dicts so that ``models/`` never imports this module: no import cycle.)

Adding an architecture (docs/design/adding_a_model.md): write ``models/<family>.py``
(its ``parse(raw)``), register it in ``models/__init__.py``'s ``PARSERS``, add its
router to layers/routing.py if none fits, its MoE block to layers/moe.py and
models/decoder.py's ``MOE_BLOCKS``, and its key layout to checkpoint.py. DeepSeek-V2/V3 (MLA attention, grouped routers, dense first layers)
and GPT-OSS (sinks, alternating sliding windows, biased clamped experts, MXFP4)
show every option.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .models import PARSERS
from .models.common import DTYPE_ALIASES, UnsupportedModelError, int_list

__all__ = [
    "DTYPE_ALIASES", "SUPPORTED_ARCHITECTURES", "AttentionSpec", "ExpertsSpec", "LinearAttentionSpec", "MLASpec",
    "MambaSpec", "MoEConfig", "RopeSpec", "RouterSpec", "UnsupportedModelError", "config_from_dict", "load_config",
]



def routed_experts_dtype(num_experts: int) -> str:
    """The dtype of expert ids everywhere they are stored or sent (the block manager's cached rows, the wire):
    uint8 when every id fits in a byte (<= 256 experts), else uint16 (as vLLM)."""
    if num_experts <= 0:
        raise ValueError("num_experts must be positive")
    if num_experts > 65536:
        raise ValueError(f"num_experts={num_experts} does not fit in uint16")
    return "uint8" if num_experts <= 256 else "uint16"

@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding as config.json states it (transformers' defaults filled in). rope.py derives
    inv_freq, the yarn correction range, the attention factor and DeepSeek's softmax-scale multiplier."""

    dim: int  # rotary dims per head: head_dim (MLA: qk_rope_head_dim)
    theta: float = 10000.0
    type: str = "default"  # "default" | "linear" | "yarn"
    factor: float = 1.0  # linear / yarn scaling factor (1 for "default")
    # How q/k are rotated (all three follow HF op by op):
    #   "half": rotate_half on cos/sin tables in the model dtype (Llama style; Mixtral, Qwen, OLMoE, GPT-OSS);
    #   "interleave": pairs (x0, x1), (x2, x3) rotated on even/odd slices, output de-interleaved (DeepSeek-V3);
    #   "complex": pairs as complex numbers in float32 (DeepSeek-V2's view_as_complex).
    style: str = "half"
    # yarn inputs (transformers' _compute_yarn_parameters); mscale / mscale_all_dim are kept for every type
    # because DeepSeek's softmax scale reads mscale_all_dim whenever the type is not "default"
    original_max_position_embeddings: float = 4096
    attention_factor: float | None = None  # as given; None = derived from mscale / mscale_all_dim
    mscale: float | None = None
    mscale_all_dim: float | None = None
    beta_fast: float = 32
    beta_slow: float = 1
    truncate: bool = True  # floor / ceil the correction range


@dataclass(frozen=True)
class MLASpec:
    """DeepSeek-V2/V3 multi-head latent attention; the attention's head_dim is qk_nope + qk_rope."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5; transformers ``*GatedDeltaNet``): a short causal convolution over
    q/k/v, then the gated delta rule over a per-sequence matrix state [num_v_heads, head_k_dim, head_v_dim], a
    gated RMSNorm and out_proj."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    # "qkvz": Qwen3-Next's in_proj_qkvz + in_proj_ba (q, k, v, z and b, a grouped per key head); "split": Qwen3.5's
    # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    projections: str = "split"

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


@dataclass(frozen=True)
class MambaSpec:
    """Mamba-2 layers (Nemotron-H; transformers ``NemotronHMamba2Mixer``): in_proj -> (gate, x B C, dt), a short
    causal convolution over x B C, the selective scan over a per-sequence state [num_heads, head_dim, state_size],
    a grouped gated RMSNorm and out_proj."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int = 4
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj / out_proj biases (use_bias)
    chunk_size: int = 128
    time_step_min: float = 0.0  # dt is clamped to [time_step_min, inf) (HF's time_step_limit)

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int  # MLA: equal to num_heads (the latent is expanded to one key/value head per query head)
    head_dim: int
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    qkv_bias: bool = False  # bias on q/k/v projections
    o_bias: bool = False  # bias on the output projection
    qk_norm: str = "none"  # "none" | "head" (RMSNorm per head, Qwen3) | "full" (over all heads, OLMoE)
    clip_qkv: float | None = None  # OLMoE: clamp q, k, v to [-clip, clip]
    sinks: bool = False  # GPT-OSS: a learned per-head logit joins each softmax
    mla: MLASpec | None = None  # set: DeepSeek multi-head latent attention instead of grouped-query
    # Qwen3-Next / Qwen3.5: q_proj also yields a per-head gate; the attention output is multiplied by its sigmoid
    # before o_proj
    output_gate: bool = False
    rotary: bool = True  # False: no position embedding (Nemotron-H's attention layers)
    norm_offset: bool = False  # q/k norms compute x_normed * (1 + weight) in float32 (Qwen3-Next / Qwen3.5)

    @property
    def kind(self) -> str:
        """models/decoder.py's ``ATTENTIONS`` key: "gqa" (grouped-query) or "mla"."""
        return "gqa" if self.mla is None else "mla"


@dataclass(frozen=True)
class RouterSpec:
    kind: str  # layers/routing.py ROUTERS key
    num_experts: int
    top_k: int
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum to 1
    weights_fp32: bool = False  # Mixtral keeps top-k weights fp32; Qwen/OLMoE cast to the logits' dtype
    bias: bool = False  # GPT-OSS router has a bias
    fp32: bool = False  # DeepSeek: gate weight (and e_score_correction_bias) kept fp32, logits in fp32
    topk_method: str = "greedy"  # DeepSeek-V2: "greedy" | "group_limited_greedy"; DeepSeek-V3: "noaux_tc"
    n_group: int = 1  # DeepSeek expert groups
    topk_group: int = 1  # groups kept per token
    routed_scaling_factor: float = 1.0  # DeepSeek: routed-expert weights multiplied by this


@dataclass(frozen=True)
class ExpertsSpec:
    num_experts: int
    intermediate_size: int  # per routed expert
    # MoE block layout (module names as HF): "default" (mlp.gate, mlp.experts, mlp.shared_expert[_gate]),
    # "deepseek" (mlp.gate, mlp.experts, mlp.shared_experts), "gpt_oss" (mlp.router, mlp.experts with biases,
    # transposed [E, H, 2I] / [E, I, H], interleaved gate/up, clamped SwiGLU)
    block: str = "default"
    # "silu": SwiGLU experts (gate_up_proj [E, 2I, H]); "relu2": Nemotron-H's ungated experts, relu(x)^2
    # (up_proj [E, I, H]), whose outputs are summed in float32 (HF's NemotronHExperts)
    activation: str = "silu"
    latent_size: int = 0  # Nemotron-H moe_latent_size: the experts run in this width (fc1/fc2_latent_proj); 0 = none
    shared_intermediate_size: int = 0  # 0 = no shared expert
    shared_gate: bool = False  # Qwen2-MoE: sigmoid(Linear(H, 1)) scales the shared expert
    shared_bias: bool = False  # DeepSeek-V2 mlp_bias: biases on the shared experts
    swiglu_limit: float = 7.0  # GPT-OSS clamp
    swiglu_alpha: float = 1.702  # GPT-OSS sigmoid gain
    quant: str = "none"  # "none" | "mxfp4" (GPT-OSS *_blocks/*_scales: kept packed or dequantised, mxfp4_load.py)


@dataclass(frozen=True)
class QuantSpec:
    """How the checkpoint's weights are stored (config.json's ``quantization_config``). The loader dequantises
    every format into the model dtype (the reference path); "fp8": e4m3 ``weight`` + float32 ``weight_scale_inv``
    per ``weight_block_size`` block (rows, columns; None: one scale per tensor), as DeepSeek-V3 / Qwen3-FP8 /
    GLM-FP8 publish; "mxfp4": GPT-OSS experts (``ExpertsSpec.quant``)."""
    method: str = "none"  # "none" | "fp8" | "mxfp4"
    weight_block_size: tuple[int, int] | None = None


@dataclass(frozen=True)
class MoEConfig:
    architecture: str  # HF model_type, e.g. "mixtral"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    moe_layers: tuple[int, ...]  # global indices of MoE layers (dense layers excluded)
    max_position_embeddings: int
    torch_dtype: str  # checkpoint dtype from config ("bfloat16", "float32", ...)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    tie_word_embeddings: bool
    rope: RopeSpec
    attention: AttentionSpec
    router: RouterSpec
    experts: ExpertsSpec
    rms_norm_eps: float = 1e-6  # decoder norms and the q/k norms
    norm_fp32_weight: bool = False  # GPT-OSS RMSNorm: (weight * x_fp32).to(dtype) instead of weight * x.to(dtype)
    hidden_act: str = "silu"
    intermediate_size: int = 0  # dense (non-MoE) layers' MLP
    mlp_bias: bool = False  # DeepSeek-V2 mlp_bias: biases on the dense MLPs
    # Hybrid models. ``layer_types``: per layer its token mixer, "attention" (the default for every layer when
    # empty), "linear_attention" (Gated DeltaNet, ``linear_attention``), "mamba" (Mamba-2, ``mamba``) or "none"
    # (a Nemotron-H block that is only an MLP or MoE). ``block_style`` "pair": every layer is input_layernorm ->
    # mixer, post_attention_layernorm -> MLP or MoE; "single" (Nemotron-H): every layer is one norm and one
    # sublayer (its mixer, or for "none" its MLP / MoE).
    layer_types: tuple[str, ...] = ()
    block_style: str = "pair"
    linear_attention: LinearAttentionSpec | None = None
    mamba: MambaSpec | None = None
    norm_offset: bool = False  # Qwen3-Next / Qwen3.5 RMSNorm: x_normed * (1 + weight), in float32
    quantization: QuantSpec = QuantSpec()  # the checkpoint's weight format (dequantised at load)
    # Checkpoint keys: (our prefix, the checkpoint's) alternatives, e.g. Nemotron-H's "backbone." for "model.", a
    # Qwen3.5 checkpoint with a vision tower's "model.language_model."; and regexes of keys HF ignores too (MTP
    # layers, the vision tower)
    key_prefixes: tuple[tuple[str, str], ...] = ()
    ignored_keys: tuple[str, ...] = ()

    def __post_init__(self):
        if self.router.num_experts != self.experts.num_experts:
            raise ValueError(f"router has {self.router.num_experts} experts, experts spec {self.experts.num_experts}")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"{len(self.layer_types)} layer_types for {self.num_hidden_layers} layers")
        for kind, spec in (("linear_attention", self.linear_attention), ("mamba", self.mamba)):
            if kind in self.layer_types and spec is None:
                raise ValueError(f"{kind} layers without a {kind} spec")

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    @property
    def num_experts_per_tok(self) -> int:
        return self.router.top_k

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if i not in set(self.moe_layers))

    @property
    def routed_experts_dtype(self) -> str:
        return routed_experts_dtype(self.num_experts)

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "attention"

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Layers with a KV cache."""
        return tuple(i for i in range(self.num_hidden_layers) if self.layer_type(i) == "attention")

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """Layers that keep a fixed-size state per sequence (linear attention, Mamba) instead of a KV cache."""
        return tuple(i for i in range(self.num_hidden_layers) if self.layer_type(i) in ("linear_attention", "mamba"))

    @property
    def is_hybrid(self) -> bool:
        return bool(self.recurrent_layers)

    def has_mlp(self, i: int) -> bool:
        """Whether layer i has an MLP or MoE sublayer (every layer of a "pair" model; Nemotron-H's "none" blocks)."""
        return self.block_style == "pair" or self.layer_type(i) == "none"

    @property
    def prefix_caching_off_reason(self) -> str | None:
        """Why this model cannot use the prefix cache (None: it can)."""
        if self.is_hybrid:
            kinds = sorted({self.layer_type(i) for i in self.recurrent_layers})
            return (f"hybrid model: its {' and '.join(k.replace('_', ' ') for k in kinds)} layers keep one recurrent "
                    "state per sequence, not per KV block, so a cached prefix cannot be resumed; prefix caching is "
                    "off for this model")
        return None

    def metadata(self) -> dict:
        """What a client needs to interpret routed experts arrays (JSON-able)."""
        return {
            "architecture": self.architecture,
            "num_hidden_layers": self.num_hidden_layers,
            "moe_layers": list(self.moe_layers),
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "routed_experts_dtype": self.routed_experts_dtype,
            "quantization": self.quantization.method,
            **({"layer_types": list(self.layer_types)} if self.layer_types else {}),
        }

    def to_dict(self) -> dict:
        return asdict(self)


SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(PARSERS))

# Dense model types people point the server at by mistake; named so the error can say "not MoE".
_DENSE_TYPES = {
    "llama", "mistral", "qwen2", "qwen3", "olmo", "olmo2", "gemma", "gemma2", "gemma3", "gemma3_text",
    "phi", "phi3", "gpt2", "gpt_neox", "falcon", "starcoder2", "deepseek", "granite", "cohere", "opt",
}


def _build(fields: dict) -> MoEConfig:
    """A parser's nested dicts -> MoEConfig with its specs."""
    attention = dict(fields["attention"])
    mla = attention.pop("mla", None)
    linear, mamba = fields.get("linear_attention"), fields.get("mamba")
    return MoEConfig(**{
        **fields,
        "rope": RopeSpec(**fields["rope"]),
        "attention": AttentionSpec(**attention, mla=MLASpec(**mla) if mla is not None else None),
        "router": RouterSpec(**fields["router"]),
        "experts": ExpertsSpec(**fields["experts"]),
        "linear_attention": LinearAttentionSpec(**linear) if linear is not None else None,
        "mamba": MambaSpec(**mamba) if mamba is not None else None,
        "quantization": QuantSpec(**fields.get("quantization", {})),
    })


def config_from_dict(raw: dict) -> MoEConfig:
    """Normalise a parsed config.json (dict) into a MoEConfig."""
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    model_type = raw.get("model_type")
    if not model_type:
        raise UnsupportedModelError(f"config.json has no model_type; supported MoE architectures: {supported}")
    if model_type not in PARSERS:
        if model_type in _DENSE_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not a Mixture-of-Experts model; supported MoE architectures: {supported}"
            )
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported; supported MoE architectures: {supported}")
    cfg = _build(PARSERS[model_type](raw))
    if cfg.num_experts <= 0 or not cfg.moe_layers:
        raise UnsupportedModelError(
            f"{model_type} config has no MoE layers (num_experts={cfg.num_experts}); "
            f"this is not a Mixture-of-Experts model"
        )
    if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        raise UnsupportedModelError(
            f"{model_type}: num_experts_per_tok={cfg.num_experts_per_tok} must be in 1..{cfg.num_experts}"
        )
    if cfg.attention.num_heads % cfg.attention.num_kv_heads:
        raise UnsupportedModelError(f"{model_type}: num_attention_heads must be a multiple of num_key_value_heads")
    if cfg.num_experts > 65535:
        raise UnsupportedModelError(f"{model_type}: {cfg.num_experts} experts do not fit routed_experts uint16")
    return cfg


def load_config(path: str | os.PathLike) -> MoEConfig:
    """Read ``<path>/config.json`` (and generation_config.json's extra eos ids)."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {root}")
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint directory {root}")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise UnsupportedModelError(f"{cfg_file} is not valid JSON: {e}") from None
    cfg = config_from_dict(raw)
    # generate() stops at generation_config's eos ids too (chat models often list several there).
    gen_file = root / "generation_config.json"
    if gen_file.is_file():
        try:
            gen_eos = int_list(json.loads(gen_file.read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, TypeError, ValueError):
            gen_eos = ()
        merged = tuple(dict.fromkeys(cfg.eos_token_ids + gen_eos))
        if merged != cfg.eos_token_ids:
            cfg = replace(cfg, eos_token_ids=merged)
    return cfg
