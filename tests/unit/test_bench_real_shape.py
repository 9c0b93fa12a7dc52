"""loadtest/bench/bench_real_shape.py on the CPU: the whole script on the tiny shape (every case, the profile, the
report files), and the parts of real_shape_model.py its numbers rest on (weight bytes per token, identical
random weights in the engine and in transformers, routing of the random inits, the profile's busy time).

The script run is a subprocess (about 20-40 s here), marked slow."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from loadtest.bench import real_shape_model as rsm  # noqa: E402


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("real_shape")
    cmd = [sys.executable, str(REPO / "loadtest" / "bench" / "bench_real_shape.py"), "--shape", "tiny",
           "--device", "cpu", "--scale", "0.05", "--quick", "--reps", "2", "--warmup-tokens", "4", "--d-stall-s", "5",
           "--cases", "a,b,c,d,e,hf", "--profile", "b", "--step-trace", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, json.loads((out / "results.json").read_text()), proc.stdout


@pytest.mark.slow
def test_every_case_runs_through_the_engine_and_reports_sane_numbers(tiny_run):
    out, res, stdout = tiny_run
    cases, sizes = res["cases"], res["sizes"]
    assert {k: c["status"] for k, c in cases.items()} == dict.fromkeys(
        ("a", "b", "e", "hf_engine", "c", "d", "profile", "hf"), "ok")
    for name in ("a", "b", "c"):
        c, (n, p, o) = cases[name], sizes[name]
        assert len(c["reps"]) >= 1
        for rep in c["reps"]:  # every request ran to its length; Batch.check verified tokens and routing rows
            assert rep["complete"] and rep["output_tokens"] == n * o
            assert rep["tok_s"] > 0 and rep["itl_p50_s"] > 0
            assert 0 < rep["ttft_p50_s"] <= rep["ttft_max_s"] <= rep["wall_s"]
        assert c["tok_s"] > 0 and c["itl_p50_s"] > 0 and c["ttft_p50_s"] <= c["wall_s"]
    assert 0 < cases["a"]["pct_of_roofline"] and cases["a"]["roofline_s"] > 0
    assert 0 < cases["b"]["pct_of_roofline"] and cases["c"]["step_roofline_s"] > 0
    n, p, _ = sizes["b"]
    load = cases["b"]["routing_load"]  # the warm-up's rows: prompt + 4 outputs - 1 per request
    assert load["rows"] == n * (p + 4 - 1) and 1 <= load["distinct_per_step"] <= res["shape"]["config"]["num_experts"]
    for rep in cases["b"]["reps"]:  # --step-trace: the steps account for the rep's wall time
        tr, (_, _, o) = rep["step_trace"], sizes["b"]
        pre, dec = tr["prefill"], tr["decode"]
        assert pre["tokens"] >= n * p and len(pre["each"]) == pre["n"] and pre["n"] + dec["n"] >= o
        assert pre["wall_s"] + dec["wall_s"] + tr["last_done_to_end_s"] == pytest.approx(rep["wall_s"], rel=1e-6)
        assert 0 <= tr["submit_to_first_launch_s"] <= pre["each"][0]["wall_s"]
        assert 0 < pre["launch_s"] <= pre["wall_s"] and 0 < dec["launch_s"] <= dec["wall_s"]
    assert "b: rep 1 steps: prefill:" in stdout
    pairs = cases["e"]["pairs"]
    assert len(pairs) == 2 and all(pr["on"]["tok_s"] > 0 and pr["off"]["tok_s"] > 0 for pr in pairs)
    assert min(pr["tok_s_ratio"] for pr in pairs) <= cases["e"]["tok_s_ratio_median"] <= max(pr["tok_s_ratio"] for pr in pairs)
    d = cases["d"]
    assert 1 <= d["peak_running"] <= d["requests"] and d["stop_reason"]
    hf = cases["hf"]
    for key in ("hf1", "hf64"):
        assert hf[key]["tok_s"] > 0 and hf[key]["engine_over_hf"] > 0
    # float32, same seed: the engine and transformers hold the same weights and agree on every greedy token
    assert hf["hf1"]["greedy_common_prefix_vs_engine"] == sizes["hf1"][2]
    prof = cases["profile"]
    assert prof["steps"] >= 1 and prof["wall_per_step_ms"] > 0
    assert json.loads(gzip.open(out / prof["trace"]).read())["traceEvents"]
    report = (out / "report.md").read_text()
    for row in ("| a | decode ITL p50", "| b | output tok/s", "| e | capture on/off", "| c | TTFT p50",
                "| d | peak running", "| hf | engine / HF"):
        assert row in report, row
    assert res["environment"]["torch"] == torch.__version__ and res["bandwidth"]["bytes_per_s"] > 0
    # the code measured: the commit, and whether files differed from it (a remote copy of the tree carries an older
    # .git: the report must not pass its files off as that commit)
    env = res["environment"]
    assert f"git {env['git_commit']}" in report
    assert ("files changed or added since" in report) == bool(env["git_uncommitted"])


def test_weight_bytes_per_token_of_the_real_shape_is_the_issues_6_1_gb():
    from moe_engine.config import config_from_dict

    cfg = config_from_dict(rsm.QWEN3_30B_A3B)
    per_token = rsm.weight_bytes_per_token(cfg, elem=2)
    assert abs(sum(per_token.values()) / 1e9 - 6.1) < 0.05  # issue 17: 6.1 GB -> 1.42 ms at 4.3 TB/s
    assert per_token["lm_head"] == 151936 * 2048 * 2
    step = rsm.decode_step_bytes(cfg, 2, batch=1, mean_context=0)
    assert step["total"] == pytest.approx(sum(per_token.values()))


def test_engine_and_transformers_models_get_identical_weights():
    model, _ = rsm.build_engine_model(rsm.TINY, torch.device("cpu"), torch.float32, seed=3)
    hf = rsm.build_hf_model(rsm.TINY, torch.device("cpu"), torch.float32, seed=3)
    mine, theirs = dict(model.named_parameters()), dict(hf.named_parameters())
    assert set(mine) == set(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert torch.equal(hf.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    other, _ = rsm.build_engine_model(rsm.TINY, torch.device("cpu"), torch.float32, seed=4)
    assert not torch.equal(other.lm_head.weight, model.lm_head.weight)


def test_balanced_init_routes_near_uniformly_where_plain_init_collapses():
    from moe_engine.models.decoder import reference_forward

    ids = torch.randint(3, rsm.TINY["vocab_size"], (512,), generator=torch.Generator().manual_seed(0)).tolist()
    stats = {}
    for init in rsm.INITS:
        model, cfg = rsm.build_engine_model(rsm.TINY, torch.device("cpu"), torch.float32, 0, init)
        stats[init] = rsm.routing_stats(reference_forward(model, ids)[1].numpy(), cfg, batch=8)
    assert stats["balanced"]["max_over_mean"] < 1.5
    assert stats["balanced"]["distinct_per_step"] == pytest.approx(stats["balanced"]["distinct_uniform"], rel=0.05)
    assert stats["std0.02"]["max_over_mean"] > 2.5


def test_profile_busy_time_is_the_union_of_kernel_intervals():
    events = [
        {"ph": "X", "cat": "kernel", "name": "nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "_route_kernel", "ts": 5, "dur": 10},  # overlaps the first
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 30, "dur": 4},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},  # host side: not device time
    ]
    s = rsm.summarize_trace(events, steps=2, wall_s=100e-6, lm_head_min_us=None)
    assert s["busy_per_step_ms"] == pytest.approx((15 + 4) / 2 / 1e3)
    assert s["kernel_time_per_step_ms"] == pytest.approx((10 + 10 + 4) / 2 / 1e3)
    assert s["classes_ms_per_step"] == pytest.approx({"dense GEMMs": 5e-3, "routing": 5e-3, "copies": 2e-3})
    # idle: 15 us between the router kernel (the later end of the overlapping pair) and the copy
    assert s["idle_per_step_ms"] == pytest.approx({"< 10 us": 0.0, "10-100 us": 7.5e-3, "0.1-1 ms": 0.0,
                                                   ">= 1 ms": 0.0})
    assert s["top_idle"] == [{"before": "_route_kernel", "after": "Memcpy DtoH (Device -> Pinned)", "count": 1,
                              "idle_us": 15.0, "per_step_us": 7.5}]


def test_profile_divides_device_time_by_the_decode_steps_the_trace_holds():
    # The engine counted 3 steps in the window, but one was launched before the profiler started: only two
    # lm_head GEMMs (one per decode step) and their layers' kernels are in the trace.
    events = []
    for step in range(2):
        t = 100 * step
        events += [{"ph": "X", "cat": "kernel", "name": "_moe_gemm_kernel", "ts": t, "dur": 30},
                   {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_384x8_64x4_2x1_v_bz_TNT", "ts": t + 40,
                    "dur": 20}]
    s = rsm.summarize_trace(events, steps=3, wall_s=300e-6, lm_head_min_us=15)
    assert (s["steps"], s["trace_steps"]) == (3, 2)
    assert s["wall_per_step_ms"] == pytest.approx(0.1)
    assert s["busy_per_step_ms"] == pytest.approx(50e-3)
    assert s["classes_ms_per_step"] == pytest.approx({"expert GEMMs": 30e-3, "lm_head": 20e-3})


def test_hybrid_real_shapes_and_their_rooflines():
    """The issue's GPU shapes: Qwen3.5-35B-A3B's text model (transformers' defaults) and Nemotron-3-Nano-30B-A3B, with
    the bytes a decode reads: weights (per layer kind), and per sequence the recurrent states read and written."""
    from moe_engine.config import config_from_dict

    q = config_from_dict(rsm.QWEN3_5_35B_A3B)
    assert (q.hidden_size, q.num_hidden_layers, len(q.recurrent_layers), q.num_experts, q.num_experts_per_tok,
            q.experts.intermediate_size, q.vocab_size) == (2048, 40, 30, 256, 8, 512, 248320)
    per = rsm.weight_bytes_per_token(q, 2)
    assert per["experts (8 of 256 per layer, gate_up + down)"] == 40 * 8 * 3 * 512 * 2048 * 2
    assert per["shared experts"] == 40 * (3 * 512 * 2048 + 2048) * 2
    # a GDN layer's state: 32 value heads x 128 x 128 float32, conv 8192 channels x 4 in bf16
    assert rsm.state_bytes_per_sequence(q, 2) == 30 * (32 * 128 * 128 * 4 + 8192 * 4 * 2)
    step = rsm.decode_step_bytes(q, 2, batch=4, mean_context=100)
    assert step["recurrent_states"] == 2 * 4 * rsm.state_bytes_per_sequence(q, 2)
    assert step["kv_cache"] == 4 * 100 * 10 * 2 * 2 * 256 * 2  # 10 attention layers, 2 kv heads of 256
    n = config_from_dict(rsm.NEMOTRON_3_NANO_30B_A3B)
    assert (len(n.moe_layers), len(n.recurrent_layers), len(n.attention_layers)) == (23, 23, 6)
    per = rsm.weight_bytes_per_token(n, 2)
    assert per["experts (6 of 128 per layer, up + down)"] == 23 * 6 * 2 * 1856 * 2688 * 2
    assert rsm.prefill_matmul_flops(n, 16, 1)["recurrent"] == 23 * 4.0 * 64 * 64 * 128 * 16


@pytest.mark.parametrize("shape", ["tiny-qwen3.5", "tiny-nemotron-h"])
def test_hybrid_engine_and_transformers_models_get_identical_weights(shape):
    from moe_engine.models.decoder import reference_forward

    raw = rsm.SHAPES[shape]
    model, cfg = rsm.build_engine_model(raw, torch.device("cpu"), torch.float32, seed=3)
    hf = rsm.build_hf_model(raw, torch.device("cpu"), torch.float32, seed=3, attn_implementation="eager",
                            experts_implementation="eager")
    bias = [(n, b) for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")]  # HF: a buffer
    mine, theirs = dict(model.named_parameters()), dict(list(hf.named_parameters()) + bias)
    assert set(mine) == set(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    ids = list(range(3, 40))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(reference_forward(model, ids)[0], ref, atol=1e-4, rtol=1e-4)


def test_gpt_oss_real_shape_and_its_roofline():
    """Issue 49's shape: GPT-OSS-120B cut to 8 of 36 layers (~53 GB in bf16); a decode token reads 4 of 128 experts per
    layer and lm_head's 201,088 rows, and the sliding-window layers read at most 128 tokens of KV."""
    from moe_engine.config import config_from_dict
    from moe_engine.models.decoder import MoEForCausalLM

    g = config_from_dict(rsm.GPT_OSS_120B_8L)
    assert (g.hidden_size, g.num_hidden_layers, g.num_experts, g.num_experts_per_tok, g.experts.intermediate_size,
            g.vocab_size, g.attention.num_heads, g.attention.num_kv_heads, g.attention.head_dim) == (
            2880, 8, 128, 4, 2880, 201088, 64, 8, 64)
    assert g.attention.sliding_windows == (128, None) * 4 and g.attention.sinks
    per = rsm.weight_bytes_per_token(g, 2)
    assert per["experts (4 of 128 per layer, gate_up + down)"] == 8 * 4 * 3 * 2880 * 2880 * 2
    assert per["lm_head"] == 201088 * 2880 * 2
    with torch.device("meta"):  # one layer's parameters, counted without memory
        one_layer = MoEForCausalLM(config_from_dict({**rsm.GPT_OSS_120B_8L, "num_hidden_layers": 1,
                                                     "layer_types": ["full_attention"]}))
    total = sum(p.numel() for p in one_layer.parameters())
    layer_free = 2 * 201088 * 2880 + 2880  # embedding, lm_head, final norm
    weights_gb = ((total - layer_free) * 8 + layer_free) * 2 / 1e9
    assert 52 < weights_gb < 55, weights_gb
    per_layer = 2 * 8 * 64 * 2  # K and V of one token in one layer, bf16
    assert rsm.kv_bytes_read(g, 2, 8192) == 4 * 8192 * per_layer + 4 * 128 * per_layer
    assert rsm.decode_step_bytes(g, 2, batch=16, mean_context=8192)["kv_cache"] == 16 * rsm.kv_bytes_read(g, 2, 8192)


def test_gpt_oss_engine_and_transformers_models_get_identical_weights():
    from moe_engine.models.decoder import reference_forward

    raw = rsm.TINY_GPT_OSS
    model, _ = rsm.build_engine_model(raw, torch.device("cpu"), torch.float32, seed=3)
    hf = rsm.build_hf_model(raw, torch.device("cpu"), torch.float32, seed=3, attn_implementation="eager")
    mine, theirs = dict(model.named_parameters()), dict(hf.named_parameters())
    assert set(mine) == set(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    ids = list(range(3, 60))  # longer than the sliding window (32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(reference_forward(model, ids)[0], ref, atol=1e-4, rtol=1e-4)


def test_mxfp4_build_packs_layer_by_layer_to_the_weights_packing_the_bf16_build_gives():
    """The full GPT-OSS-120B (36 layers, 234 GB of bf16 experts) is built packed one layer at a time; the result
    must be the model a bf16 build packed afterwards is, parameter for parameter."""
    from moe_engine import mxfp4_load
    from moe_engine.config import config_from_dict

    raw = rsm.TINY_GPT_OSS
    whole, _ = rsm.build_engine_model(raw, torch.device("cpu"), torch.bfloat16, seed=5)
    mxfp4_load.pack_in_memory(whole)
    layered, _ = rsm.build_engine_model(raw, torch.device("cpu"), torch.bfloat16, seed=5, mxfp4=True)
    a, b = whole.state_dict(), layered.state_dict()
    assert a.keys() == b.keys() and any(k.endswith("gate_up_proj_blocks") for k in b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="GPT-OSS experts"):
        rsm.build_engine_model(rsm.TINY, torch.device("cpu"), torch.float32, seed=0, mxfp4=True)

    g = config_from_dict(rsm.GPT_OSS_120B)
    assert g.num_hidden_layers == 36 and g.attention.sliding_windows == (128, None) * 18


def test_moonlight_shape_and_its_rooflines():
    """--shape moonlight: Moonlight-16B-A3B as issue 48 gives it, its MLA weights in the batch-1 bytes, the latent KV
    (576 values per layer) in the step rooflines, DeepSeek's float32 router."""
    from moe_engine.config import config_from_dict

    cfg = config_from_dict(rsm.SHAPES["moonlight"])
    att, mla = cfg.attention, cfg.attention.mla
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (2048, 27, 163840)
    assert cfg.moe_layers == tuple(range(1, 27)) and (cfg.num_experts, cfg.num_experts_per_tok) == (64, 6)
    assert cfg.experts.intermediate_size == 1408 and cfg.experts.shared_intermediate_size == 2 * 1408
    assert (mla.kv_lora_rank, mla.q_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        512, None, 128, 64, 128) and att.num_heads == 16
    assert cfg.router.kind == "deepseek_v3" and cfg.router.routed_scaling_factor == 2.446 and cfg.router.fp32
    per_token = rsm.weight_bytes_per_token(cfg, elem=2)
    mla_bytes = 27 * (2048 * 16 * 192 + 2048 * 576 + 512 + 512 * 16 * 256 + 16 * 128 * 2048) * 2
    assert per_token["MLA q / kv_a / kv_b / o projections (+ their norms)"] == mla_bytes
    assert per_token["routers"] == 26 * 64 * 2048 * 4  # float32 gate weights
    assert per_token["shared experts"] == 26 * 3 * 2816 * 2048 * 2
    assert abs(sum(per_token.values()) / 1e9 - 5.17) < 0.01
    assert rsm.kv_bytes_per_token(cfg, 2) == 27 * 576 * 2
    assert rsm.expanded_kv_bytes_per_token(cfg, 2) == 27 * 16 * (192 + 128) * 2
    step = rsm.decode_step_bytes(cfg, 2, batch=64, mean_context=1152)
    assert step["kv_cache"] == 64 * 1152 * 27 * 576 * 2
