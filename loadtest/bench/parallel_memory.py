"""GPU memory per rank of a tensor-parallel split, computed by the engine's own sharding code.

Builds ``MoEForCausalLM`` on the ``meta`` device from a model's config.json (no weights), shards it for every rank
with ``moe_engine.sharding.shard_model`` exactly as ``--tensor-parallel-size N`` does, and reports each rank's
weight bytes (the largest rank) and its paged-KV bytes per token; then what is left of a GPU for the KV cache.

    .venv/bin/python loadtest/bench/parallel_memory.py                        # the README's table
    .venv/bin/python loadtest/bench/parallel_memory.py --config path/config.json --tp 2 4 8

Built-in configs: Qwen3-235B-A22B and DeepSeek-V3 (config.json values of the Hub releases; DeepSeek-V3 in bf16,
as its community bf16 conversion: under tensor parallelism the Hub's FP8 weights load dequantised), Qwen3-30B-A3B.
"""
from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch

from moe_engine.config import config_from_dict
from moe_engine.models.decoder import MoEForCausalLM
from moe_engine.distributed.sharding import shard_model

QWEN3_235B = {
    "model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
    "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288, "moe_intermediate_size": 1536,
    "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 151643,
    "eos_token_id": 151645,
}
QWEN3_30B = dict(QWEN3_235B, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                 intermediate_size=6144, moe_intermediate_size=768)
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "first_k_dense_replace": 3,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 129280, "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0,
    "eos_token_id": 1,
}
MODELS = {"Qwen3-30B-A3B": (QWEN3_30B, (1, 2)), "Qwen3-235B-A22B": (QWEN3_235B, (4, 8)),
          "DeepSeek-V3": (DEEPSEEK_V3, (8, 16))}


def rank_bytes(raw: dict, tp: int, rank: int, expert_parallel: bool, dtype=torch.bfloat16) -> tuple[int, int]:
    """(weight bytes, KV-cache bytes per token) of ``rank`` of ``tp``."""
    cfg = config_from_dict(raw)
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    if tp > 1:
        shard_model(model, SimpleNamespace(rank=rank, world_size=tp), expert_parallel)
    elem = torch.empty((), dtype=dtype).element_size()
    weights = sum(p.numel() * torch.empty((), dtype=model.param_dtype(n, dtype)).element_size()
                  for n, p in model.named_parameters())
    kv = sum(s.num_kv_heads * (s.k_dim + s.v_dim) for s in model.kv_layout()) * elem
    return weights, kv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", help="a config.json (default: the built-in models)")
    p.add_argument("--tp", type=int, nargs="*", help="tensor-parallel sizes (default: per model)")
    p.add_argument("--gpu-gib", type=float, default=139.8, help="usable GPU memory (H200: 139.8 GiB)")
    p.add_argument("--utilization", type=float, default=0.9, help="--gpu-memory-utilization")
    p.add_argument("--activations-gib", type=float, default=4.0,
                   help="reserved for a step's activations and the decode graphs (profiled at start-up; an estimate)")
    a = p.parse_args()
    models = {a.config: (json.load(open(a.config)), tuple(a.tp or (1, 2, 4, 8)))} if a.config else MODELS
    G = 2**30
    print("| model | --tensor-parallel-size | weights / rank (GiB, bf16) | KV / token / rank (KiB) "
          "| KV left / rank (GiB) | tokens in KV |")
    print("|---|---|---|---|---|---|")
    for name, (raw, sizes) in models.items():
        for tp in a.tp or sizes:
            worst = max(rank_bytes(raw, tp, r, expert_parallel=True) for r in {0, tp - 1})
            w, kv = worst
            left = a.gpu_gib * a.utilization - w / G - a.activations_gib
            tokens = f"{int(left * G / kv):,}" if left > 0 else "does not fit"
            print(f"| {name} | {tp}{' (+EP)' if tp > 1 else ''} | {w / G:.1f} | {kv / 1024:.1f} | "
                  f"{max(left, 0):.1f} | {tokens} |")


if __name__ == "__main__":
    main()
