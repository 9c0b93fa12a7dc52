"""Expert load (moe_engine/core/expert_load.py): the device counts equal a count of the routed experts the engine
returned, for a known workload, with prefix-cache hits (not forwarded: not counted), replay (the forced ids count),
dense layers absent and requests that ask for no routing; nothing of it when off; SGLang's recorder modes; the
per-layer balance figures; the window. CPU, the engine stepped synchronously."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from moe_engine.checkpoint import load_model
from moe_engine.config import load_config
from moe_engine.core import expert_load as el
from moe_engine.core.sampling import SamplingParams
from moe_engine.engine import Engine, EngineConfig, Request
from moe_engine.errors import InvalidRequestError

DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return load_config(tiny_checkpoint), load_model(tiny_checkpoint, dtype="float32", device=DEVICE, progress=False)


def make_engine(model_and_cfg, **kw) -> Engine:
    cfg, model = model_and_cfg
    kw.setdefault("max_model_len", 256)
    if DEVICE != "cpu":
        kw.setdefault("kv_cache_memory_bytes", 256 << 20)
    return Engine(model, cfg, EngineConfig(**kw))


class Out:
    def __init__(self):
        self.rows, self.tokens, self.done, self.cached = [], [], False, 0

    def __call__(self, o):
        if o.routed_experts is not None:
            self.rows.append(o.routed_experts)
        self.tokens += o.new_token_ids
        self.cached = o.num_cached_tokens
        self.done = o.finished

    @property
    def routing(self):
        return np.concatenate(self.rows)


def submit(engine, prompt, max_tokens=6, routing=True, **kw) -> Out:
    out = Out()
    engine.add_request(Request(request_id=engine.new_request_id(), prompt_token_ids=list(prompt),
                               sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                               return_routed_experts=routing, on_output=out, **kw))
    return out


def run(engine, outs):
    for _ in range(1000):
        if all(o.done for o in outs):
            engine.expert_load.flush()  # what the engine thread does when it runs out of work
            return
        engine.step()
    raise AssertionError("requests did not finish")


def counted(rows: np.ndarray, layers, E) -> np.ndarray:
    """What the returned routed experts say: per MoE layer, how often each expert was picked."""
    return np.stack([np.bincount(rows[:, layer].ravel().astype(np.int64), minlength=E) for layer in layers])


def device_counts(engine) -> np.ndarray:
    return np.array(engine.expert_load_summary()["total"]["counts"])


def prompt(n, seed):
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def test_counts_equal_the_returned_routed_experts_of_a_batched_workload(tiny):
    cfg, _ = tiny
    engine = make_engine(tiny, enable_prefix_caching=False, max_num_batched_tokens=64)  # chunked prompts too
    outs = [submit(engine, prompt(n, i), max_tokens=m) for i, (n, m) in enumerate([(5, 9), (100, 3), (37, 12)])]
    run(engine, outs)
    rows = np.concatenate([o.routing for o in outs])
    np.testing.assert_array_equal(device_counts(engine), counted(rows, cfg.moe_layers, cfg.num_experts))
    s = engine.expert_load_summary()
    assert s["total"]["tokens"] == len(rows) == engine.expert_load_gauges()["routed_tokens"]
    assert s["layers"] == list(cfg.moe_layers) and s["window"]["counts"] == s["total"]["counts"]
    assert s["total"]["sampled"] == sum(len(o.tokens) for o in outs)


def test_prefix_cache_hits_are_not_counted_again(tiny):
    """A prompt's cached blocks are not forwarded: their routing was counted when first computed, the rows the
    second request gets for them come from the cache."""
    cfg, _ = tiny
    engine = make_engine(tiny, enable_prefix_caching=True, block_size=16)
    shared = prompt(64, 7)
    first = submit(engine, shared + [11, 12])
    run(engine, [first])
    second = submit(engine, shared + [13, 14, 15])
    run(engine, [second])
    assert second.cached == 64
    np.testing.assert_array_equal(second.routing[:64], first.routing[:64])  # served from the cache
    expect = counted(first.routing, cfg.moe_layers, cfg.num_experts)
    expect += counted(second.routing[second.cached:], cfg.moe_layers, cfg.num_experts)
    np.testing.assert_array_equal(device_counts(engine), expect)


def test_replayed_ids_are_counted_as_used(tiny):
    cfg, _ = tiny
    L, K, E = cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.num_experts
    p = prompt(20, 3)
    forced = np.zeros((20, L, K), np.int64)
    forced[:, :, 0], forced[:, :, 1] = E - 1, E - 2  # every prompt token on the last two experts
    engine = make_engine(tiny, enable_prefix_caching=False)
    out = submit(engine, p, replay_routed_experts=forced)
    run(engine, [out])
    np.testing.assert_array_equal(out.routing[:20], forced.astype(np.uint16))
    counts = device_counts(engine)
    np.testing.assert_array_equal(counts, counted(out.routing, cfg.moe_layers, E))
    assert (counts[:, E - 2:] >= 20).all()


def test_requests_without_routing_are_counted_and_get_no_rows(tiny):
    """With the prefix cache off and no request asking for routing, a step still captures (for the count) and
    hands no rows to the host; the counts equal those of the same greedy request with routing on."""
    cfg, _ = tiny
    p = prompt(30, 5)
    engine = make_engine(tiny, enable_prefix_caching=False)
    off = submit(engine, p, routing=False)
    run(engine, [off])
    assert off.rows == []
    on_engine = make_engine(tiny, enable_prefix_caching=False)
    on = submit(on_engine, p)
    run(on_engine, [on])
    assert off.tokens == on.tokens
    np.testing.assert_array_equal(device_counts(engine), counted(on.routing, cfg.moe_layers, cfg.num_experts))


def test_off_costs_nothing_and_refuses_the_recorder(tiny, monkeypatch):
    """--disable-expert-load: no counter, and a step that no request asks routing of captures nothing."""
    engine = make_engine(tiny, enable_prefix_caching=False, expert_load=False)
    assert engine.expert_load is None and engine.runner.expert_load is None
    assert engine.expert_load_gauges() == {} and engine.expert_load_summary()["enabled"] is False
    steps = []
    forward = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda step, ids=None: (steps.append(step), forward(step, ids))[1])
    out = submit(engine, prompt(10, 1), routing=False)
    for _ in range(50):
        if out.done:
            break
        engine.step()
    assert steps and not any(s.want_routing for s in steps)
    with pytest.raises(InvalidRequestError, match="--disable-expert-load"):
        engine.start_expert_distribution_record().result()
    # routed experts off: no capture, so no counts either
    assert make_engine(tiny, enable_routed_experts=False).expert_load is None


def test_counting_queues_device_work_only():
    """The count reads nothing back: it runs on meta tensors, which hold no data (a .item(), .tolist() or
    bincount's read of the largest id would fail), and the contiguous and gathered (non-contiguous MoE layers)
    paths both do."""
    for layers in ((0, 1, 2, 3), (1, 3)):
        load = el.ExpertLoad(layers, num_experts=8, top_k=2, step_tokens=16, device="meta")
        load.count(torch.zeros(16, 4, 2, dtype=torch.int32, device="meta"), T=5, sampled=1)
        assert load.counts.device.type == "meta" and load.tokens == 5


def test_dense_layers_are_absent(tmp_path):
    """qwen3_moe with decoder_sparse_step=2: layers 1 and 3 route (not contiguous: their columns are gathered);
    the counts have those two rows, equal to the returned routing of those layers."""
    from .hf_checkpoints import write_servable_checkpoint

    ckpt = write_servable_checkpoint("qwen3_moe", tmp_path / "q", seed=3)
    cfg = load_config(ckpt)
    assert cfg.moe_layers == (1, 3)
    engine = make_engine((cfg, load_model(ckpt, dtype="float32", device=DEVICE, progress=False)),
                         enable_prefix_caching=False)
    out = submit(engine, prompt(25, 9))
    run(engine, [out])
    s = engine.expert_load_summary()
    assert s["layers"] == [1, 3] and len(s["total"]["counts"]) == 2
    np.testing.assert_array_equal(device_counts(engine), counted(out.routing, (1, 3), cfg.num_experts))


def _recorded(engine, fn):
    future = fn()
    engine.step()  # control operations run between steps
    return future.result(timeout=5)


@pytest.mark.parametrize("mode", ["stat", "per_pass"])
def test_recorder_records_between_start_and_stop(tiny, mode):
    cfg, _ = tiny
    engine = make_engine(tiny, enable_prefix_caching=False, expert_distribution_recorder_mode=mode)
    before = submit(engine, prompt(12, 1))  # before the start: not recorded
    run(engine, [before])
    assert "Start recording" in _recorded(engine, engine.start_expert_distribution_record)["message"]
    outs = [submit(engine, prompt(n, 20 + n)) for n in (8, 30)]
    run(engine, outs)
    _recorded(engine, engine.stop_expert_distribution_record)
    after = submit(engine, prompt(9, 2))  # after the stop: not recorded
    run(engine, [after])
    dump = _recorded(engine, engine.dump_expert_distribution_record)
    rows = np.concatenate([o.routing for o in outs])
    expect = counted(rows, cfg.moe_layers, cfg.num_experts)
    assert dump["layers"] == list(cfg.moe_layers) and dump["num_tokens"] == len(rows)
    if mode == "stat":
        assert dump["dims"] == ["layer", "expert"]
        np.testing.assert_array_equal(dump["logical_count"], expect)
    else:
        assert dump["dims"] == ["step", "layer", "expert"]
        per_step = dump["logical_count"]
        assert per_step.shape[0] == dump["num_steps"] == len(dump["steps"]) > 1
        np.testing.assert_array_equal(per_step.sum(0), expect)
        assert sum(dump["step_tokens"]) == len(rows)
        assert (per_step.sum(2) == np.array(dump["step_tokens"])[:, None] * cfg.num_experts_per_tok).all()
    assert _recorded(engine, engine.dump_expert_distribution_record)["num_steps"] == 0  # a dump clears the record


def test_recorder_keeps_the_last_buffer_size_steps(tiny):
    engine = make_engine(tiny, enable_prefix_caching=False, expert_distribution_recorder_mode="per_pass",
                         expert_distribution_recorder_buffer_size=2)
    _recorded(engine, engine.start_expert_distribution_record)
    run(engine, [submit(engine, prompt(10, 4), max_tokens=5)])
    dump = _recorded(engine, engine.dump_expert_distribution_record)
    assert dump["num_steps"] == 2 and dump["step_tokens"] == [1, 1]  # the last two decode steps


def test_layer_stats():
    E = 20
    uniform = el.layer_stats(np.full((1, E), 5))
    assert uniform == {"imbalance": [1.0], "entropy": [1.0], "top10_share": [0.1]}
    one_hot = el.layer_stats(np.eye(1, E) * 7)
    assert one_hot == {"imbalance": [float(E)], "entropy": [0.0], "top10_share": [1.0]}
    idle = el.layer_stats(np.zeros((2, E)))
    assert idle == {"imbalance": [0.0, 0.0], "entropy": [0.0, 0.0], "top10_share": [0.0, 0.0]}


def test_window_and_timeline_follow_the_clock(monkeypatch):
    """Ticks at most every interval; the window's counts are the newest minus those of the tick at now - window."""
    clock = {"t": 1000.0}

    class FakeTime:
        monotonic = staticmethod(lambda: clock["t"])
        time = staticmethod(lambda: clock["t"] + 1e9)

    monkeypatch.setattr(el, "time", FakeTime)
    load = el.ExpertLoad((0, 1), num_experts=4, top_k=1, step_tokens=8, device="cpu", window_s=10.0)
    load.probe = lambda: {"kv_cache_usage": 0.5}

    def step(ids):  # one step of len(ids) tokens, every layer routing token i to ids[i]
        capture = torch.tensor(ids, dtype=torch.int32).view(-1, 1, 1).expand(-1, 2, 1).contiguous()
        load.count(capture, len(ids), 1)
        load.collect(load.snapshot())

    step([0, 0, 1])
    clock["t"] += 1.0
    step([2])  # a tick: 1 s after the start
    assert [p["tokens"] for p in load.summary()["timeline"]] == [4]
    clock["t"] += 12.0
    step([3, 3])  # a tick; the window (10 s) now starts at the previous tick
    s = load.summary()
    assert s["window"]["counts"] == [[0, 0, 0, 2], [0, 0, 0, 2]] and s["window"]["tokens"] == 2
    assert s["total"]["counts"] == [[2, 1, 1, 2], [2, 1, 1, 2]] and s["total"]["tokens"] == 6
    assert [p["tokens"] for p in s["timeline"]] == [2] and s["timeline"][-1]["kv_cache_usage"] == 0.5  # the window
    assert s["timeline"][-1]["imbalance"] == [4.0, 4.0]
    clock["t"] += 30.0  # idle past the window: nothing in it
    assert load.gauges()["expert_load_window_tokens"] == 0 and load.gauges()["routed_tokens"] == 6


def test_recorder_stat_over_every_step_keeps_no_per_step_copies():
    """--expert-distribution-recorder-buffer-size -1 in stat mode: a running sum, however many steps."""
    rec = el.Recorder("stat", -1, (2, 3))
    rec.start()
    for step in range(5):
        rec.add(step, 2, np.array([[1, 0, 1], [0, 2, 0]]))
    assert len(rec.steps) == 0
    dump = rec.dump()
    np.testing.assert_array_equal(dump["logical_count"], [[5, 0, 5], [0, 10, 0]])
    assert (dump["num_steps"], dump["num_tokens"], dump["recording"]) == (5, 10, True)
    assert rec.dump()["num_steps"] == 0
    with pytest.raises(ValueError, match="per_token"):
        el.Recorder("per_token", 10, (2, 3))


def test_device_path_snapshots_at_most_every_interval_and_flushes_when_idle(monkeypatch):
    """The CUDA path's bookkeeping, on CPU tensors standing in for the pinned buffers: a snapshot rides with a step
    at most once per interval (every step while recording); what the steps between counted reaches the host at the
    idle flush."""
    clock = {"t": 50.0}

    class FakeTime:
        monotonic = staticmethod(lambda: clock["t"])
        time = staticmethod(lambda: clock["t"])

    monkeypatch.setattr(el, "time", FakeTime)
    load = el.ExpertLoad((0,), num_experts=4, top_k=1, step_tokens=4, device="cpu", window_s=60.0)
    load._pinned = [torch.zeros(4, dtype=torch.int64) for _ in range(2)]  # as on CUDA

    def step(expert):
        load.count(torch.full((1, 1, 1), expert, dtype=torch.int32), 1, 1)
        snap = load.snapshot()
        if snap is not None:
            load.collect(snap)
        return snap is not None

    assert step(0) and not step(1) and not step(1)  # the first is due, the next two within the interval
    assert load.summary()["total"]["counts"] == [[1, 0, 0, 0]] and load.stale
    load.flush()  # the engine ran out of work
    assert load.summary()["total"]["counts"] == [[1, 2, 0, 0]] and not load.stale
    load.start_record()
    assert step(2) and step(3)  # recording: every step
    assert load.dump_record()["logical_count"].tolist() == [[0, 0, 1, 1]]
    load.stop_record()
    assert not step(3)
    clock["t"] += 1.0
    assert step(3)  # an interval later: due again
