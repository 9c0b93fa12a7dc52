"""Engine settings: the CLI's engine flags come from EngineConfig's fields, and ``resolve`` decides every default."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_engine.config import load_config
from moe_engine.engine_config import EngineConfig, ResolvedConfig
from openai_frontend.cli import build_parser


def parse(*argv: str) -> EngineConfig:
    return EngineConfig.from_cli_args(build_parser().parse_args(list(argv)))


def test_every_engine_setting_has_its_flag_and_no_flag_means_the_defaults():
    assert parse() == EngineConfig()
    help_text = build_parser().format_help()
    for flag in ("--max-num-seqs", "--max-model-len", "--max-num-batched-tokens", "--block-size",
                 "--gpu-memory-utilization", "--kv-cache-memory", "--enable-prefix-caching", "--max-waiting",
                 "--disable-routed-experts", "--enforce-eager", "--max-cudagraph-capture-size", "--async-scheduling",
                 "--disable-fused-kernels", "--exact-kernels", "--tensor-parallel-size", "--enable-expert-parallel"):
        assert flag in help_text


def test_flags_set_their_fields_as_the_engine_reads_them(monkeypatch):
    got = parse("--max-num-seqs", "8", "--kv-cache-memory", "1.5", "--no-enable-prefix-caching",
                "--disable-routed-experts", "--disable-fused-kernels", "--no-async-scheduling", "--block-size", "32")
    assert got == EngineConfig(max_num_seqs=8, kv_cache_memory_bytes=int(1.5 * 2**30), enable_prefix_caching=False,
                               enable_routed_experts=False, fused_kernels=False, async_scheduling=False, block_size=32)
    monkeypatch.setenv("MOE_SERVE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("MOE_SERVE_EXACT_KERNELS", "1")
    assert parse() == EngineConfig(max_num_seqs=7, exact_kernels=True)
    with pytest.raises(SystemExit):
        parse("--block-size", "24")  # not a power of two the kernels take


def test_the_json_the_backend_receives_round_trips_and_takes_the_old_overlap_name():
    ec = EngineConfig(max_num_seqs=3, async_scheduling=True, kv_cache_memory_bytes=1 << 20)
    assert EngineConfig.from_json(ec.to_json()) == ec
    assert EngineConfig.from_json('{"overlap_decode": false}') == EngineConfig(async_scheduling=False)
    with pytest.raises(ValueError, match="unknown engine settings: max_num_seq"):
        EngineConfig.from_json('{"max_num_seq": 4}')


def test_resolve_decides_every_default_once_for_the_device(tiny_checkpoint):
    cfg = load_config(tiny_checkpoint)
    cpu = EngineConfig().resolve(cfg, "cpu", torch.float32)
    assert all(getattr(cpu, f.name) is not None for f in dataclasses.fields(ResolvedConfig))
    assert (cpu.max_num_seqs, cpu.step_tokens, cpu.block_size) == (64, 512, 16)
    assert cpu.max_model_len == cfg.max_position_embeddings
    assert not (cpu.async_scheduling or cpu.cuda_graphs or cpu.fused_kernels or cpu.attention_kernels)
    assert cpu.keep_routing_rows and cpu.max_cudagraph_capture_size == 2048
    # every running sequence can decode in one step; the user's settings win over the defaults
    small = EngineConfig(max_num_seqs=600, max_num_batched_tokens=256, max_model_len=100,
                         enable_prefix_caching=False).resolve(cfg, "cpu", torch.float32)
    assert (small.step_tokens, small.max_model_len, small.keep_routing_rows) == (600, 100, False)
    assert ResolvedConfig.from_json(cpu.to_json()) == cpu  # what rank 0 sends the other ranks
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        EngineConfig(max_cudagraph_capture_size=-1).resolve(cfg, "cpu", torch.float32)


def test_a_cpu_engine_holds_only_the_kv_cache_its_sequences_can_use(tiny_checkpoint):
    """On CPU the default KV budget is 2 GiB capped at what max_num_seqs full-length sequences need: a small
    engine allocates kilobytes, not 2 GiB; a budget given explicitly is taken as it is."""
    from moe_engine.checkpoint import load_model
    from moe_engine.engine import Engine

    cfg, model = load_config(tiny_checkpoint), load_model(tiny_checkpoint, dtype="float32", device="cpu",
                                                          progress=False)
    small = Engine(model, cfg, EngineConfig(max_num_seqs=2, max_model_len=64))
    assert small.runner.kv.num_blocks == 2 * 64 // small.settings.block_size + 1  # + the null block
    assert small.runner.kv.nbytes < 1 << 20
    given = Engine(model, cfg, EngineConfig(max_num_seqs=2, max_model_len=64, kv_cache_memory_bytes=8 << 20))
    assert 7 << 20 < given.runner.kv.nbytes <= 8 << 20
