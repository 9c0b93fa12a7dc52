"""MoE decoder-only transformer (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GPT-OSS), gpt-fast style.

One forward step runs the tokens of all scheduled sequences flattened into one
dimension T; ``ForwardBatch`` (layers/attend.py) says which sequence and position each
token has, and ``attend`` handles the per-sequence causal attention over the
paged KV cache. Shapes are given in comments: T tokens, H hidden size,
Hq/Hkv query/kv heads, D head dim, E experts, K experts per token, I expert width.

Numerics follow Hugging Face transformers 5.24 operation by operation (norm in
float32 then cast, RoPE tables cast to the model dtype, router logits in the model
dtype, per-expert weights applied before the cast, expert outputs summed in
ascending expert order), so that float32 runs agree with HF to rounding and bf16
runs route the same experts for all but near-tied tokens.

Module and parameter names equal HF's in-memory (v5, fused experts) names, so
checkpoint keys map one to one (checkpoint.py).

Tensor parallelism: sharding.py shrinks the modules to one rank's heads / widths / experts / vocabulary rows
before the weights load; each decoder layer then all-reduces its attention and MLP outputs (partial sums).

Architecture differences come from the config's specs, never from the name, and each
module is built from its spec alone: the router (``cfg.router``, layers/routing.py), the
attention (``cfg.attention``: grouped-query, or with ``attention.mla`` DeepSeek's
multi-head latent attention whose cache holds the compressed latent and the rotated
shared key, expanded by ``kv_b_proj`` every step as HF does), the MoE block layout
(``cfg.experts.block``: default / DeepSeek shared experts / GPT-OSS biased clamped
experts), rope style and yarn (``cfg.rope``, layers/rotary.py), sinks and per-layer sliding
windows. The experts and the ways to run them are layers/experts.py's (which also says where
routing capture is written). Dense layers (DeepSeek's first_k_dense_replace, Qwen's
mlp_only_layers) are part of the layer dimension; their capture rows are never written.
"""
from __future__ import annotations

import sys

import torch
from torch import Tensor, nn

from ..config import MoEConfig
from ..core.kv_cache import KVCache, KVSpec
from ..core.memory_plan import logits_chunk_rows
from ..kernels import mla_attention as mla_kernels
from ..kernels import moe_routing as routing_kernels
from ..kernels import support as kernel_support
from ..layers import invariant as inv
from ..layers.attend import ForwardBatch, LayerKV
from ..layers.attention import Attention
from ..layers.experts import (NO_ROUTING, TRITON_GEMM_MAX_PAIRS, ExpertOutputs, Experts, GptOssExperts, LayerRouting,
                              StepRouting)
from ..layers.linear_attention import GatedDeltaNet
from ..layers.mamba import Mamba2Mixer
from ..layers.mla import GRAPH_MAX_KEY_READS, MLAttention
from ..layers.moe import MLP, DeepseekMoE, GptOssMoE, MoEBlock, NemotronHMoE
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from ..layers.routing import Router

MOE_BLOCKS: dict[str, type[nn.Module]] = {"default": MoEBlock, "deepseek": DeepseekMoE, "gpt_oss": GptOssMoE,
                                          "nemotron_h": NemotronHMoE}


ATTENTIONS: dict[str, type[nn.Module]] = {"gqa": Attention, "mla": MLAttention}


class DecoderLayer(nn.Module):
    """input_layernorm -> token mixer (``self_attn``, or Gated DeltaNet ``linear_attn`` in a hybrid's linear-attention
    layers) -> post_attention_layernorm -> MLP or MoE block (``mlp``)."""

    batch_invariant = False  # deterministic inference: the combine never moves into the next norm's launch

    def __init__(self, cfg: MoEConfig, layer_idx: int):
        super().__init__()
        self.is_moe = layer_idx in cfg.moe_layers
        self.kind = cfg.layer_type(layer_idx)
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg.linear_attention, cfg.hidden_size, cfg.rms_norm_eps)
        else:
            attention = ATTENTIONS[cfg.attention.kind]
            self.self_attn = attention(cfg.attention, cfg.rope, cfg.hidden_size, cfg.rms_norm_eps, layer_idx)
        if self.is_moe:
            self.mlp = MOE_BLOCKS[cfg.experts.block](cfg.router, cfg.experts, cfg.hidden_size)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_fp32_weight, cfg.norm_offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_fp32_weight,
                                                cfg.norm_offset)
        self.tp = None  # tensor parallelism (sharding.py): attention and MLP outputs are this rank's partial sums

    def cache_spec(self):
        """This layer's kv_layout entry: KV heads and dims, or a recurrent layer's ``StateSpec``."""
        if self.kind == "linear_attention":
            return self.linear_attn.state_spec()
        a = self.self_attn
        return KVSpec(a.num_kv_heads, a.head_dim, a.head_dim)

    def _mix(self, normed: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch, cache) -> Tensor:
        if self.kind == "linear_attention":
            return self.linear_attn(normed, batch, cache)
        return self.self_attn(normed, cos, sin, batch, cache)

    def _reduce(self, partial: Tensor) -> Tensor:
        return partial if self.tp is None else self.tp.all_reduce(partial.contiguous())

    def forward(
        self,
        x: Tensor,  # [T, H] residual stream
        delta: Tensor | None,  # [T, H] previous layer's output, not yet added to x (None before layer 0)
        cos: Tensor,
        sin: Tensor,
        batch: ForwardBatch,
        cache: LayerKV,
        routing: LayerRouting,
    ) -> tuple[Tensor, Tensor | ExpertOutputs]:  # (residual stream, this layer's MLP output to add to it)
        # x + delta and x + attention are each added right before the norm that reads them (same values as
        # HF's adds at the end of a layer; the fused norm does the add in its first kernel). A MoE layer's
        # output reaches the next norm (the next layer's, or the final one: RMSNorms share their kernel
        # settings) as ExpertOutputs when that norm's one-pass kernel can also do the combine.
        x, normed = self.input_layernorm.add_forward(x, delta)
        attn = self._reduce(self._mix(normed, cos, sin, batch, cache))
        h, normed = self.post_attention_layernorm.add_forward(x, attn)
        if not self.is_moe:
            return h, self._reduce(self.mlp(normed))
        if isinstance(self.mlp, (MoEBlock, DeepseekMoE, GptOssMoE)) and self.tp is None:
            norm = self.post_attention_layernorm
            defer = (norm.fused and norm.within_rounding and not self.batch_invariant
                     and normed.shape[0] >= routing_kernels.COMBINE_NORM_MIN_TOKENS)
            return h, self.mlp(normed, routing, defer_combine=defer)
        return h, self._reduce(self.mlp(normed, routing))


class SingleBlock(nn.Module):
    """A Nemotron-H block (HF ``NemotronHBlock``): ``norm`` -> one sublayer ``mixer`` (Mamba-2, attention, an MLP or
    an MoE block) -> the residual add."""

    def __init__(self, cfg: MoEConfig, layer_idx: int):
        super().__init__()
        self.is_moe = layer_idx in cfg.moe_layers
        self.kind = cfg.layer_type(layer_idx)
        H = cfg.hidden_size
        self.norm = RMSNorm(H, cfg.rms_norm_eps, cfg.norm_fp32_weight, cfg.norm_offset)
        if self.kind == "mamba":
            self.mixer = Mamba2Mixer(cfg.mamba, H, cfg.rms_norm_eps)
        elif self.kind == "attention":
            self.mixer = ATTENTIONS[cfg.attention.kind](cfg.attention, cfg.rope, H, cfg.rms_norm_eps, layer_idx)
        elif self.is_moe:
            self.mixer = MOE_BLOCKS[cfg.experts.block](cfg.router, cfg.experts, H)
        else:
            self.mixer = MLP(H, cfg.intermediate_size, bias=cfg.mlp_bias, act=cfg.hidden_act)
        self.tp = None

    @property
    def mlp(self) -> nn.Module | None:
        """The MLP or MoE block (what a two-sublayer layer calls ``mlp``), None for a Mamba or attention block."""
        return self.mixer if self.kind == "none" else None

    @property
    def self_attn(self) -> nn.Module | None:
        """The attention (what a two-sublayer layer calls ``self_attn``), None for another block."""
        return self.mixer if self.kind == "attention" else None

    def cache_spec(self):
        if self.kind == "mamba":
            return self.mixer.state_spec()
        if self.kind == "attention":
            a = self.mixer
            return KVSpec(a.num_kv_heads, a.head_dim, a.head_dim)
        return None  # no cache

    def forward(self, x: Tensor, delta, cos: Tensor, sin: Tensor, batch: ForwardBatch, cache,
                routing: LayerRouting) -> tuple[Tensor, Tensor]:
        x, normed = self.norm.add_forward(x, delta)
        if self.kind == "mamba":
            return x, self.mixer(normed, batch, cache)
        if self.kind == "attention":
            return x, self.mixer(normed, cos, sin, batch, cache)
        if self.is_moe:
            return x, self.mixer(normed, routing)
        return x, self.mixer(normed)


class MoEModel(nn.Module):
    """Embedding, layers, final norm. Module names as HF's: ``embed_tokens`` / ``norm``; Nemotron-H's
    (``block_style`` "single") ``embeddings`` / ``norm_f``."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.names = ("embeddings", "norm_f") if cfg.block_style == "single" else ("embed_tokens", "norm")
        setattr(self, self.names[0], nn.Embedding(cfg.vocab_size, cfg.hidden_size))
        layer = SingleBlock if cfg.block_style == "single" else DecoderLayer
        self.layers = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_hidden_layers))
        setattr(self, self.names[1], RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_fp32_weight, cfg.norm_offset))
        self.rotary_emb = RotaryEmbedding(cfg.rope)

    def embedding(self) -> nn.Module:
        return getattr(self, self.names[0])

    def set_embedding(self, module: nn.Module) -> None:
        setattr(self, self.names[0], module)

    def final_norm(self) -> RMSNorm:
        return getattr(self, self.names[1])


class MoEForCausalLM(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.config = cfg
        self.model = MoEModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # per layer (k_scale, v_scale) of an FP8 KV cache, as the checkpoint gives them (checkpoint.read_kv_scales);
        # None: 1.0 everywhere
        self.kv_scales: list[tuple[float, float] | None] | None = None
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embedding().weight
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embedding().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embedding().weight.device

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)compute non-persistent buffers, e.g. after building on the meta device."""
        rot = self.model.rotary_emb
        rot.inv_freq = rot.compute_inv_freq(device or self.device)

    def kv_layout(self) -> list[KVSpec]:
        cfg, attn = self.config, self.config.attention
        if attn.mla is not None:  # compressed latent ("k") + shared rotated rope key ("v"), one "head"
            return [KVSpec(1, attn.mla.kv_lora_rank, attn.mla.qk_rope_head_dim) for _ in range(cfg.num_hidden_layers)]
        # this rank's key/value heads (all of them unless sharded); hybrid models' recurrent layers: their states
        return [layer.cache_spec() for layer in self.model.layers]

    def use_fused_kernels(self, enabled: bool, within_rounding: bool | None = None) -> bool:
        """Switch the fused Triton kernels (kernels/, bit for bit the op-by-op results; on a GPU also the expert
        GEMMs of fused_moe.py, equal within bf16 GEMM rounding) on or off for every module that has them.
        ``within_rounding`` (default: on a GPU) adds the fusions equal to the op-by-op path within rounding, with
        the same expert ids: one-pass norms, the fused softmax router, one GEMM for q/k/v (kernels/support.py's second
        table). Returns whether fused kernels are on: only where Triton runs for this model's device and dtype."""
        enabled = enabled and kernel_support.available(self.device) and kernel_support.supports(self.dtype)
        on_gpu = enabled and self.device.type == "cuda" and not kernel_support.interpreting()
        within_rounding = enabled and (on_gpu if within_rounding is None else within_rounding)
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention)) or getattr(m, "supports_fused", False):
                m.fused = enabled
            if isinstance(m, (RMSNorm, Attention, Router, GatedDeltaNet, Mamba2Mixer, MLAttention)):
                m.within_rounding = within_rounding
            if isinstance(m, Attention) and within_rounding:
                m.fuse_qkv()
            if isinstance(m, MLAttention) and within_rounding:
                m.fuse_projections()
            if isinstance(m, GatedDeltaNet) and within_rounding:
                m.fuse_projections()
            if isinstance(m, (Experts, GptOssExperts)):
                m.triton_gemm_max_pairs = TRITON_GEMM_MAX_PAIRS if on_gpu else 0
            if isinstance(m, DeepseekMoE):  # shared experts through the fused expert kernels (within rounding)
                m.fused_shared = within_rounding
                if within_rounding:
                    m.fuse_shared()
        return enabled

    def use_batch_invariant(self, enabled: bool) -> bool:
        """Deterministic inference on (or off): every module computes a row's result independently of the rows that
        share its step (layers/invariant.py, kernels/batch_invariant.py; docs/design/determinism.md). With the fused
        kernels on (call ``use_fused_kernels`` first) the per-row fusions are kept, with their one-pass norms and
        router (each token one program of a fixed launch), the GEMMs and attention become the Triton batch-invariant
        ones and the expert GEMMs take fused_moe.py's single tile config; without them the op-by-op path computes
        through layers/invariant.py. Linear modules switch class (``InvariantLinear``), keeping their parameters.
        Returns ``enabled``."""
        kernels = bool(enabled) and any(getattr(m, "fused", False) for m in self.modules())
        if enabled and kernels:
            for m in self.modules():
                if isinstance(m, (RMSNorm, Attention, Router)):
                    m.within_rounding = True  # the per-row kernels (the exact set takes torch's batch-split mean)
                if isinstance(m, Attention):
                    m.fuse_qkv()
                if isinstance(m, Experts):
                    m.triton_gemm_max_pairs = sys.maxsize  # never torch's grouped GEMM
        for m in self.modules():
            if type(m) in (nn.Linear, inv.InvariantLinear):
                m.__class__ = inv.InvariantLinear if enabled else nn.Linear
            if hasattr(type(m), "batch_invariant"):
                m.batch_invariant = bool(enabled)
            if hasattr(type(m), "bi_kernels"):
                m.bi_kernels = kernels
        return bool(enabled)

    def graph_unsafe_reason(self) -> str | None:
        """Why a decode step of this model cannot be captured in a CUDA graph (a host sync inside), or None."""
        for layer in self.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            reason = experts.graph_unsafe_reason(self.device, self.dtype) if experts is not None else None
            if reason is not None:
                return reason
        return None

    def prefill_graph_unsafe_reason(self) -> str | None:
        """Why a step carrying prompt tokens cannot replay a CUDA graph where a decode step can (prefill_graphs.py),
        or None: every MoE layer must take the fused path, whose grouping of a step's pairs waits for nothing (off
        it, expert parallelism and the op-by-op forward count each expert's rows on the host). Hybrid models: the
        recurrent layers' prompt chunks run one sequence at a time from host-side lengths."""
        if self.config.is_hybrid:
            return "a hybrid model's linear-attention / Mamba layers prefill each sequence from host-side lengths"
        for layer in self.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is not None and not (getattr(experts, "fused", False) and experts.first_expert is None
                                            and experts.graph_unsafe_reason(self.device, self.dtype) is None):
                return "an MoE layer is off the fused path (expert parallelism, or the op-by-op forward)"
        return None

    def prefill_graph_max_key_reads(self) -> int | None:
        """The most keys a step may read in all (sum over its tokens of position + 1) to replay a prefill graph, or
        None (no bound): MLA's graphs attend every row through the absorbed kernel, whose work grows with tokens x
        keys (layers/mla.py); longer steps run eagerly, their prompt rows expanded."""
        return GRAPH_MAX_KEY_READS if self.config.attention.mla is not None else None

    def decode_attention_programs(self) -> list[int]:
        """Per attention layer kind, the programs a decode token's attention runs per split (paged_attention.py's
        split rule counts them): GQA its kv heads, MLA its query heads in blocks of the absorbed kernel's rows."""
        out = set()
        for layer in self.model.layers:
            a = getattr(layer, "self_attn", None)
            if isinstance(a, MLAttention):
                out.add(mla_kernels.head_blocks(a.num_heads, a.decode_config))
            elif a is not None:
                out.add(a.num_kv_heads)
        return sorted(out)

    def param_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """dtype a parameter is loaded in when the model runs in ``dtype`` (HF's keep-in-fp32 rules):
        DeepSeek's router weight and e_score_correction_bias always float32 (``_keep_in_fp32_modules_strict``);
        GPT-OSS norms float32 when the model runs in float16 (``_keep_in_fp32_modules``)."""
        cfg = self.config
        if cfg.router.fp32 and name.endswith((".mlp.gate.weight", ".mixer.gate.weight", ".e_score_correction_bias")):
            return torch.float32
        if cfg.norm_fp32_weight and dtype == torch.float16 and name.endswith("norm.weight"):
            return torch.float32
        return dtype

    def forward(
        self,
        input_ids: Tensor,  # [T] long, tokens of all sequences flattened
        batch: ForwardBatch,  # attention layout for this step
        kv: KVCache | list[LayerKV],  # kv[layer] -> LayerKV
        routing: StepRouting | None = None,  # capture buffers and forced routing (layers/experts.py)
    ) -> Tensor:  # [T, H] final hidden states (after the final norm)
        T = input_ids.shape[0]
        routing = routing or StepRouting()
        x = self.model.embedding()(input_ids)  # [T, H]
        cos, sin = self.model.rotary_emb(batch.positions, x.dtype)  # [T, R] each (complex style: [T, R/2], None)
        delta = None
        for i, layer in enumerate(self.model.layers):
            layer_routing = routing.layer(i, T) if layer.is_moe else NO_ROUTING
            x, delta = layer(x, delta, cos, sin, batch, kv[i], layer_routing)
        return self.model.final_norm().add_forward(x, delta)[1]

    def compute_logits(self, hidden: Tensor, out: Tensor | None = None) -> Tensor:
        """[N, H] -> [N, V] float32 (the matmul runs in the model dtype, as HF), into ``out`` when given. Rows in
        chunks of ``logits_chunk_rows(V)`` (core/memory_plan.py): with a large vocabulary one GEMM's model-dtype
        output never exceeds a chunk (a row's logits do not depend on the other rows of its chunk on the CPU;
        on a GPU the GEMM's algorithm may change with the row count: within rounding)."""
        N, rows = hidden.shape[0], logits_chunk_rows(self.config.vocab_size)
        if N <= rows:
            logits = self.lm_head(hidden)
            return logits.float() if out is None else out.copy_(logits)
        if out is None:
            out = torch.empty(N, self.config.vocab_size, dtype=torch.float32, device=hidden.device)
        for lo in range(0, N, rows):
            out[lo : lo + rows].copy_(self.lm_head(hidden[lo : lo + rows]))
        return out


@torch.inference_mode()
def reference_forward(model: MoEForCausalLM, token_ids: list[int]) -> tuple[Tensor, Tensor]:
    """Whole sequence in one step on a fresh cache: (logits [T, V] float32, routed ids [T, L, K] int32)."""
    cfg, device, T = model.config, model.device, len(token_ids)
    cache = KVCache.for_sequences(model.kv_layout(), num_seqs=1, max_len=T, dtype=model.dtype, device=device)
    batch = ForwardBatch.build([cache.sequence_blocks(0)], [0], [T], device, cache.block_size)
    capture = torch.zeros(T, cfg.num_hidden_layers, cfg.num_experts_per_tok, dtype=torch.int32, device=device)
    hidden = model(torch.tensor(token_ids, dtype=torch.long, device=device), batch, cache, StepRouting(ids=capture))
    return model.compute_logits(hidden), capture
