"""The layers every model family is built from: norms, rotary, attention (grouped-query with sinks and windows,
DeepSeek's latent attention) over the paged cache, routers, experts (where routing capture is written) and the
MoE blocks. Each follows Hugging Face transformers operation by operation; the fused kernels are in kernels/."""
