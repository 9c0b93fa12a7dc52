"""Triton kernels by family, each equal to its op-by-op reference in layers/ (tests run them under Triton's
interpreter on CPU): support (availability, launch, rounding), norm, rotary (with the KV write), moe_routing
(router top-k, grouping by expert, combine), small_linear, fused_moe (expert GEMMs and their tile table),
paged_attention, sampling."""
