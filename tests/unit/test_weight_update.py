"""RL rollout lifecycle in the engine: in-place weight updates (disk, gloo broadcast), the prefix cache across them,
pause / continue, release / resume. Checkpoints A and B are written by transformers (one architecture, two seeds);
"what B computes" is always an engine started on B, never numbers copied from this implementation."""
from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_engine.checkpoint import load_model
from moe_engine.config import load_config
from moe_engine.core.sampling import SamplingParams
from moe_engine.engine import Engine, EngineConfig, Request
from moe_engine.errors import EngineStoppedError
from moe_engine.rl.weights import WeightUpdateError, check_checkpoint, check_tensors, load_checkpoint

from ..rl_trainer import announce, checkpoint_tensors
from .hf_checkpoints import (ARCHS, make_hf_model, save_fp8_checkpoint, save_gpt_oss_mxfp4, save_hf_checkpoint,
                             write_servable_checkpoint)
from .test_engine import Collector, prompt_of, run_all

ARCH = "qwen3_moe"  # q/k norms, a dense and a MoE layer type, top-4 of 16 experts
DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")  # `MOE_TEST_DEVICE=cuda`: the same checks on a GPU
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    a = write_servable_checkpoint(ARCH, root / "A", seed=1)
    b = write_servable_checkpoint(ARCH, root / "B", seed=2)
    other = write_servable_checkpoint(ARCH, root / "wider", seed=3, moe_intermediate_size=24)
    # A's config.json with one tensor of another shape: the checkpoint's own config cannot catch it.
    bad = root / "bad_tensor"
    bad.mkdir()
    for f in a.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(bad / "model.safetensors"))
    good_shape = list(tensors["model.layers.1.self_attn.o_proj.weight"].shape)
    tensors["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(good_shape[0], good_shape[1] + 4)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    return {"A": a, "B": b, "wider": other, "bad": bad, "bad_shapes": (good_shape, [good_shape[0], good_shape[1] + 4])}


class Outputs(Collector):
    """A client's view of one request, plus the weight version of each output and the cached prompt tokens."""

    def __init__(self):
        super().__init__()
        self.weight_versions: set[str] = set()
        self.num_cached = 0

    def __call__(self, out):
        self.weight_versions.add(out.weight_version)
        self.num_cached = out.num_cached_tokens
        super().__call__(out)


def submit(engine, prompt, **sampling) -> Outputs:
    c = Outputs()
    engine.add_request(Request(request_id=engine.new_request_id(), prompt_token_ids=list(prompt),
                               sampling=SamplingParams(temperature=0.0, **sampling), on_output=c))
    return c


def engine_on(path, **kw) -> Engine:
    kw.setdefault("max_model_len", 256)
    kw.setdefault("kv_cache_memory_bytes", 32 << 20)  # plenty for these requests, and bounded on a GPU
    engine = Engine(load_model(path, dtype="float32", device=DEVICE, progress=False), load_config(path),
                    EngineConfig(**kw))
    engine.lifecycle.weight_version = Path(path).name
    return engine


def generate(engine, prompt, threaded=False, **sampling):
    sampling.setdefault("max_tokens", 10)
    c = submit(engine, prompt, ignore_eos=True, **sampling)
    if threaded:
        assert c.done.wait(60), "request did not finish"
    else:
        run_all(engine, [c])
    return c


def settle(engine, future):
    """Run a control operation on a synchronously stepped engine."""
    for _ in range(1000):
        if future.done():
            return future.result()
        engine.step()
    raise AssertionError("control operation did not run")


def params_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def assert_same_weights(model, expected: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().cpu(), expected[name]), name


P = prompt_of(21, 5)
LONG = prompt_of(40, 9)  # two full KV blocks of 16: cached by the first run


@pytest.fixture(scope="module")
def on_b(ckpts):
    """What an engine started on B returns for P and LONG (cold)."""
    engine = engine_on(ckpts["B"], enable_prefix_caching=False)
    return {"P": generate(engine, P), "LONG": generate(engine, LONG)}


def test_update_from_disk_serves_exactly_what_an_engine_started_on_b_serves(ckpts, on_b):
    engine = engine_on(ckpts["A"])
    before = generate(engine, P)
    params_before = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    result = settle(engine, engine.lifecycle.update_weights_from_disk(str(ckpts["B"])))
    assert result["num_bytes"] > 0 and engine.lifecycle.weight_version == "B"
    # In place: the same tensors hold B's values, exactly as loading B does.
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == params_before
    assert_same_weights(engine.model, params_of(load_model(ckpts["B"], dtype="float32", progress=False)))
    after = generate(engine, P)
    assert after.tokens == on_b["P"].tokens and before.tokens != after.tokens
    np.testing.assert_array_equal(after.routing, on_b["P"].routing)
    assert after.weight_versions == {"B"} and before.weight_versions == {"A"}


@pytest.mark.parametrize("flush_cache", [True, False])
def test_prompt_cached_under_a_is_computed_again_under_b(ckpts, on_b, flush_cache):
    engine = engine_on(ckpts["A"])
    cold_a = generate(engine, LONG)
    warm_a = generate(engine, LONG)
    assert warm_a.num_cached == 32  # the cache works: A's two blocks (and their routing rows) were reused
    assert not np.array_equal(cold_a.routing[:32], on_b["LONG"].routing[:32])  # A's rows are not B's
    settle(engine, engine.lifecycle.update_weights_from_disk(str(ckpts["B"]), flush_cache=flush_cache))
    # Whether or not the cache was flushed, A's blocks cannot match: the weights epoch is in the key.
    cold_b = generate(engine, LONG)
    assert cold_b.num_cached == 0
    assert cold_b.tokens == on_b["LONG"].tokens
    np.testing.assert_array_equal(cold_b.routing, on_b["LONG"].routing)
    warm_b = generate(engine, LONG)  # and B's own blocks are cached from then on
    assert warm_b.num_cached == 32 and warm_b.tokens == cold_b.tokens
    np.testing.assert_array_equal(warm_b.routing, cold_b.routing)


@pytest.mark.parametrize("abort", [False, True])
def test_requests_before_an_update_finish_on_a_or_abort_and_later_ones_get_b(ckpts, on_b, abort):
    reference_a = generate(engine_on(ckpts["A"]), P, max_tokens=100)
    engine = engine_on(ckpts["A"])
    engine.start()
    try:
        first = submit(engine, P, max_tokens=100, ignore_eos=True)
        update = engine.lifecycle.update_weights_from_disk(str(ckpts["B"]), abort_all_requests=abort)
        later = submit(engine, P, max_tokens=10, ignore_eos=True)
        update.result(60)
        assert first.done.wait(60) and later.done.wait(60)
    finally:
        engine.shutdown()
    if abort:
        assert first.finish_reason == "abort" and len(first.tokens) < 100
    else:  # finished first, entirely on A
        assert first.finish_reason == "length" and first.tokens == reference_a.tokens
        assert first.weight_versions == {"A"}
    assert later.tokens == on_b["P"].tokens and later.weight_versions == {"B"}


def test_refused_checkpoints_name_the_problem_and_keep_the_old_weights(ckpts):
    engine = engine_on(ckpts["A"])
    before, params = generate(engine, P), params_of(engine.model)
    cases = {
        "wider": "experts.intermediate_size",  # config.json describes another model
        "bad": "model.layers.1.self_attn.o_proj.weight",  # the tensor, with both shapes
        "missing": "is not a directory",
    }
    for name, expected in cases.items():
        future = engine.lifecycle.update_weights_from_disk(str(ckpts.get(name, ckpts["A"] / "missing")))
        with pytest.raises(WeightUpdateError, match=expected.replace(".", r"\.")) as info:
            settle(engine, future)
        if name == "bad":
            good, wrong = ckpts["bad_shapes"]
            assert f"has shape {wrong}, the model's is {good}" in str(info.value)
    assert_same_weights(engine.model, params)
    assert engine.lifecycle.weight_version == "A" and engine.scheduler.cache_epoch == 0
    assert generate(engine, P).tokens == before.tokens


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
def test_update_from_disk_reaches_every_tensor_parallel_rank(ckpts, on_b, expert_parallel):
    """Two ranks (gloo, one process each): a checkpoint of another shape is refused with its tensor named and
    nothing changes; B is then read by every rank (its own slices) and the pair serves what one engine started on
    B serves: the same greedy tokens and routed experts."""
    from moe_engine.distributed.ranks import build_parallel_engine

    cfg = load_config(ckpts["A"])
    engine = build_parallel_engine(ckpts["A"], "float32", "cpu", cfg, EngineConfig(
        max_model_len=256, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
        enable_prefix_caching=False))
    try:
        before = generate(engine, P)
        with pytest.raises(WeightUpdateError, match="o_proj"):
            settle(engine, engine.lifecycle.update_weights_from_disk(str(ckpts["bad"])))
        assert generate(engine, P).tokens == before.tokens
        result = settle(engine, engine.lifecycle.update_weights_from_disk(str(ckpts["B"])))
        assert result["num_bytes"] > 0 and engine.lifecycle.weight_version == "B"
        after = generate(engine, P)
    finally:
        engine.shutdown()
    assert after.tokens == on_b["P"].tokens != before.tokens
    np.testing.assert_array_equal(after.routing, on_b["P"].routing)


def test_a_tensor_parallel_update_that_fails_while_loading_stops_the_engine(ckpts, tmp_path):
    """The checkpoint passes the check, then its file is emptied before the engine gets to load it: the ranks'
    weights may now differ, so the update answers EngineStoppedError (503) and the engine stops (the watchdog
    restarts the backend); no rank process is left behind."""
    from moe_engine.distributed.ranks import build_parallel_engine

    vanishing = tmp_path / "B"
    vanishing.mkdir()
    for f in ckpts["B"].iterdir():
        (vanishing / f.name).write_bytes(f.read_bytes())
    cfg = load_config(ckpts["A"])
    engine = build_parallel_engine(ckpts["A"], "float32", "cpu", cfg,
                                   EngineConfig(max_model_len=256, tensor_parallel_size=2))
    try:
        future = engine.lifecycle.update_weights_from_disk(str(vanishing))  # checked now: fine
        (vanishing / "model.safetensors").write_bytes(b"")
        with pytest.raises(EngineStoppedError, match="tensor-parallel rank"):
            settle(engine, future)
        assert engine.dead is not None
    finally:
        engine.shutdown()
    for p in engine.parallel.procs:
        p.wait(15)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer(checkpoint, port) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.rl_trainer", "--checkpoint", str(checkpoint),
                             "--port", str(port)], cwd=REPO)


def test_distributed_update_over_gloo_equals_the_disk_update(ckpts, on_b):
    engine = engine_on(ckpts["A"])
    disk = engine_on(ckpts["A"])
    settle(disk, disk.lifecycle.update_weights_from_disk(str(ckpts["B"])))
    engine.start()
    try:
        port = free_port()
        proc = trainer(ckpts["B"], port)
        engine.lifecycle.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo").result(60)
        tensors = checkpoint_tensors(ckpts["B"])  # the Hub's per-expert names, as a trainer exports them
        update = engine.lifecycle.update_weights_from_distributed(**announce(tensors), weight_version="step-1")
        result = update.result(60)
        assert proc.wait(60) == 0 and result["num_bytes"] > 0
        assert engine.lifecycle.weight_version == "step-1"
        assert_same_weights(engine.model, params_of(disk.model))
        assert generate(engine, P, threaded=True).tokens == on_b["P"].tokens

        # A wrong announcement is refused, the old weights stay, and the trainer's broadcasts still complete.
        params = params_of(engine.model)
        wrong = "model.layers.1.mlp.experts.3.up_proj.weight"
        port = free_port()
        proc = trainer(ckpts["A"], port)
        engine.lifecycle.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo").result(60)
        refused = engine.lifecycle.update_weights_from_distributed(**announce(checkpoint_tensors(ckpts["A"]),
                                                                              wrong))
        with pytest.raises(WeightUpdateError, match=wrong.replace(".", r"\.")):
            refused.result(60)
        assert proc.wait(60) == 0
        assert_same_weights(engine.model, params)
        assert engine.lifecycle.weight_version == "step-1"
    finally:
        engine.shutdown()


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
def test_distributed_update_reaches_every_tensor_parallel_rank(ckpts, on_b, expert_parallel):
    """Two ranks (gloo): the trainer broadcasts B's whole tensors (per-expert names) to rank 0, which forwards
    each to rank 1; every rank keeps its own part, and the pair then serves what one engine started on B
    serves. A wrong announcement is refused and the trainer's broadcasts still complete."""
    from moe_engine.distributed.ranks import build_parallel_engine

    engine = build_parallel_engine(ckpts["A"], "float32", "cpu", load_config(ckpts["A"]), EngineConfig(
        max_model_len=256, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
        enable_prefix_caching=False))
    engine.start()
    try:
        port = free_port()
        proc = trainer(ckpts["B"], port)
        engine.lifecycle.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo").result(60)
        update = engine.lifecycle.update_weights_from_distributed(**announce(checkpoint_tensors(ckpts["B"])),
                                                                  weight_version="step-1")
        assert update.result(60)["num_bytes"] > 0 and proc.wait(60) == 0
        got = generate(engine, P, threaded=True)
        wrong = "model.layers.1.mlp.experts.3.up_proj.weight"
        port = free_port()
        proc = trainer(ckpts["A"], port)
        engine.lifecycle.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo").result(60)
        refused = engine.lifecycle.update_weights_from_distributed(**announce(checkpoint_tensors(ckpts["A"]), wrong))
        with pytest.raises(WeightUpdateError, match=wrong.replace(".", r"\.")):
            refused.result(60)
        assert proc.wait(60) == 0
        assert generate(engine, P, threaded=True).tokens == got.tokens  # still B
    finally:
        engine.shutdown()
    assert engine.lifecycle.weight_version == "step-1"
    assert got.tokens == on_b["P"].tokens
    np.testing.assert_array_equal(got.routing, on_b["P"].routing)


def test_nccl_group_is_refused_on_cpu_and_unknown_groups_are_named(ckpts):
    engine = engine_on(ckpts["A"])
    if DEVICE == "cpu":
        with pytest.raises(WeightUpdateError, match="gloo"):
            engine.lifecycle.init_weights_update_group("127.0.0.1", free_port(), 1, 2, backend="nccl").result(10)
    with pytest.raises(WeightUpdateError, match="no weight update group 'g'"):
        engine.lifecycle.update_weights_from_distributed(["x"], ["float32"], [[1]], group_name="g").result(10)


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_names_map_onto_the_parameters_load_model_fills(arch, tmp_path):
    """Every tensor of a transformers checkpoint (per-expert Hub layout), sent by name, lands where load_model puts
    it (the broadcast path's name mapping); the fused layout and GPT-OSS MXFP4 load in place from disk."""
    hf = make_hf_model(arch, seed=4)
    per_expert = save_hf_checkpoint(hf, tmp_path / "hub")
    expected = params_of(load_model(per_expert, dtype="float32", progress=False))
    model = load_model(per_expert, dtype="float32", progress=False)
    for p in model.parameters():
        p.data.zero_()
    tensors = checkpoint_tensors(per_expert)
    plan = check_tensors(model, **announce(tensors))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for inc, (_, t) in zip(plan, tensors):
            if inc.target is not None:
                inc.target.view(params).copy_(t)
    assert_same_weights(model, expected)
    if arch == "gpt_oss":
        other = save_gpt_oss_mxfp4(hf, tmp_path / "mxfp4")
    else:
        other = save_hf_checkpoint(hf, tmp_path / "fused", fused=True)
    for p in model.parameters():
        p.data.zero_()
    load_checkpoint(model, check_checkpoint(model, str(other)))
    assert_same_weights(model, params_of(load_model(other, dtype="float32", progress=False)))


def test_an_fp8_checkpoint_as_an_update_is_refused_naming_the_way_out(tmp_path):
    """Block-FP8 checkpoints load at start (dequantised or served in FP8), but an in-place update reads float
    tensors only: an FP8 checkpoint of the served model is refused with a message saying so, the weights untouched."""
    served = save_hf_checkpoint(make_hf_model(ARCH, seed=5), tmp_path / "bf16")
    fp8 = save_fp8_checkpoint(make_hf_model(ARCH, seed=6), tmp_path / "fp8", block=(32, 32))
    model = load_model(served, dtype="float32", progress=False)
    before = params_of(model)
    with pytest.raises(WeightUpdateError, match="updates from FP8 checkpoints are not supported.*bf16") as e:
        check_checkpoint(model, str(fp8))
    assert e.value.param == "model_path"
    assert_same_weights(model, before)


def test_unknown_names_and_non_float_dtypes_are_refused(ckpts):
    model = load_model(ckpts["A"], dtype="float32", progress=False)
    with pytest.raises(WeightUpdateError, match="'model.layers.9.mlp.gate.weight' is not a parameter"):
        check_tensors(model, ["model.layers.9.mlp.gate.weight"], ["float32"], [[16, 64]])
    with pytest.raises(WeightUpdateError, match="'int8' is not a float dtype"):
        check_tensors(model, ["model.norm.weight"], ["int8"], [[64]])


# ------------------------------------------------------------------------------------------ pause / release


@functools.lru_cache(maxsize=None)
def _reference(path, prompts: tuple[tuple[int, ...], ...], max_tokens: int) -> list[list[int]]:
    engine = engine_on(path)
    return [generate(engine, p, max_tokens=max_tokens).tokens for p in prompts]


def reference(ckpts, prompts, max_tokens):
    """A's greedy tokens for each prompt, uninterrupted (computed once per set)."""
    return _reference(ckpts["A"], tuple(tuple(p) for p in prompts), max_tokens)


def wait_for_steps(engine, n, timeout=30):
    deadline = time.monotonic() + timeout
    while engine.num_steps < n:
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_and_continue_end_every_request(ckpts, mode):
    prompts = [prompt_of(9 + 7 * i, 20 + i) for i in range(3)]
    expected = reference(ckpts, prompts + [P], 100)
    engine = engine_on(ckpts["A"])
    engine.start()
    try:
        running = [submit(engine, p, max_tokens=100, ignore_eos=True) for p in prompts]
        wait_for_steps(engine, 3)
        engine.lifecycle.pause_generation(mode).result(30)
        late = submit(engine, P, max_tokens=100, ignore_eos=True)  # submitted while paused: waits
        steps = engine.num_steps
        time.sleep(0.3)
        assert engine.num_steps == steps and not late.done.is_set()  # nothing runs while paused
        if mode == "abort":
            assert all(c.done.is_set() and c.finish_reason == "abort" for c in running)
        else:
            assert not any(c.done.is_set() for c in running)
        engine.lifecycle.continue_generation().result(30)
        for c in running + [late]:
            assert c.done.wait(60)
    finally:
        engine.shutdown()
    if mode != "abort":  # retracted (recomputed) or kept in place: the same tokens as an uninterrupted run
        assert [c.tokens for c in running] == expected[:3]
    assert late.tokens == expected[3]


def test_update_while_paused_in_place_runs_at_once_and_the_request_continues(ckpts):
    engine = engine_on(ckpts["A"])
    engine.start()
    try:
        c = submit(engine, P, max_tokens=100, ignore_eos=True)
        wait_for_steps(engine, 3)
        engine.lifecycle.pause_generation("in_place").result(30)
        engine.lifecycle.update_weights_from_disk(str(ckpts["B"])).result(30)  # no waiting for the paused one
        assert not c.done.is_set()
        engine.lifecycle.continue_generation().result(30)
        assert c.done.wait(60) and c.finish_reason == "length" and len(c.tokens) == 100
        assert "B" in c.weight_versions  # its last tokens came from B
    finally:
        engine.shutdown()


def test_release_and_resume_memory_keep_every_request(ckpts):
    prompts = [prompt_of(11 + 5 * i, 40 + i) for i in range(3)]
    expected = reference(ckpts, prompts + [P], 100)
    engine = engine_on(ckpts["A"])
    engine.start()
    try:
        running = [submit(engine, p, max_tokens=100, ignore_eos=True) for p in prompts]
        wait_for_steps(engine, 3)
        assert engine.lifecycle.is_sleeping().result(1)["is_sleeping"] is False
        result = engine.lifecycle.release_memory_occupation().result(30)
        assert "KV cache" in result["message"] and engine.runner.kv is None
        assert engine.lifecycle.is_sleeping().result(1)["is_sleeping"] is True
        again = engine.lifecycle.release_memory_occupation(["kv_cache"]).result(30)
        assert again["message"].startswith("released nothing")
        late = submit(engine, P, max_tokens=100, ignore_eos=True)
        time.sleep(0.3)
        assert not late.done.is_set() and not any(c.done.is_set() for c in running)
        engine.lifecycle.resume_memory_occupation().result(30)
        assert engine.runner.kv is not None and engine.lifecycle.is_sleeping().result(1)["is_sleeping"] is False
        for c in running + [late]:
            assert c.done.wait(60) and c.finish_reason == "length"
    finally:
        engine.shutdown()
    assert [c.tokens for c in running + [late]] == expected
    with pytest.raises(Exception, match="unknown memory tags"):
        engine.lifecycle.release_memory_occupation(["gpu"]).result(1)


def test_release_and_resume_reach_every_tensor_parallel_rank(ckpts):
    """Two ranks: release frees every rank's KV cache while requests run (they are retracted), resume gives it
    back and the requests end with exactly what an engine that never released returns."""
    from moe_engine.distributed.ranks import build_parallel_engine

    prompts = [prompt_of(11 + 5 * i, 40 + i) for i in range(3)]
    expected = reference(ckpts, prompts, 60)
    engine = build_parallel_engine(ckpts["A"], "float32", "cpu", load_config(ckpts["A"]),
                                   EngineConfig(max_model_len=256, tensor_parallel_size=2))
    engine.start()
    try:
        running = [submit(engine, p, max_tokens=60, ignore_eos=True) for p in prompts]
        wait_for_steps(engine, 3)
        result = engine.lifecycle.release_memory_occupation(["kv_cache"]).result(30)
        assert "KV cache" in result["message"] and engine.runner.kv is None
        time.sleep(0.3)
        assert not any(c.done.is_set() for c in running)
        engine.lifecycle.resume_memory_occupation().result(30)
        for c in running:
            assert c.done.wait(60) and c.finish_reason == "length"
    finally:
        engine.shutdown()
    assert [c.tokens for c in running] == expected
    for p in engine.parallel.procs:
        assert p.wait(15) == 0


def test_shutdown_fails_pending_controls_and_later_ones(ckpts):
    engine = engine_on(ckpts["A"])
    engine.start()
    c = submit(engine, P, max_tokens=200, ignore_eos=True)
    update = engine.lifecycle.update_weights_from_disk(str(ckpts["B"]))  # waits for c to finish first
    wait_for_steps(engine, 2)
    engine.shutdown()
    with pytest.raises(EngineStoppedError):
        update.result(10)
    assert c.done.is_set() and c.finish_reason == "error"
    with pytest.raises(EngineStoppedError):
        engine.lifecycle.flush_cache().result(1)
    assert engine.lifecycle.weight_version == "A"
