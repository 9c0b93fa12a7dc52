"""Deterministic inference (``--enable-deterministic-inference``, issue 52): a request's tokens, logprobs, prompt
logprobs, routed experts and routed weights are the same bits whatever shares its steps.

For every architecture the same requests run alone on a fresh engine (the reference), then among 1, 7, 63 and 255
others of mixed lengths and sampling settings, each time with another step size (so the prompt is chunked
differently and shares steps with other prompts' chunks and with decodes), and once more after those runs, when the
prompt is in the prefix cache. Two of the requests ask for everything (logprobs with their top ids, prompt logprobs
with ranks and top ids, routed experts and their weights), one greedy and one sampled with a seed (top-k and top-p);
a third asks for tokens, logprobs and routed experts only, so that it may take its prompt from the prefix cache.
Everything is compared with ``==``.

CPU in CI (the op-by-op forward through layers/invariant.py); ``MOE_TEST_DEVICE=cuda`` runs the same on a GPU, where
the references run eagerly and the batches replay CUDA graphs (decode and prefill steps), through the Triton kernels
of kernels/batch_invariant.py.
"""
from __future__ import annotations

import os
import random
import threading

import numpy as np
import pytest
import torch

from moe_engine.checkpoint import load_model
from moe_engine.config import load_config
from moe_engine.core.sampling import SamplingParams
from moe_engine.engine import Engine, EngineConfig, Request
from moe_engine.engine_config import BATCH_INVARIANT_ENV
from moe_engine.models.decoder import reference_forward

from .hf_checkpoints import ARCHS, HYBRID_ARCHS, make_hf_model, save_hf_checkpoint

DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")
GPU = DEVICE != "cpu"
VOCAB = 256  # hf_checkpoints' tiny configs
MAX_LEN = 128


class Record:
    """Everything a request's outputs carry, accumulated as a client would."""

    FIELDS = ("tokens", "logprobs", "top_ids", "top_logprobs", "routed_experts", "routed_weights", "prompt_logprobs",
              "prompt_ranks", "prompt_top_ids", "prompt_top_logprobs")

    def __init__(self):
        self.parts: dict[str, list] = {f: [] for f in self.FIELDS}
        self.cached = 0
        self.finish = None
        self.done = threading.Event()

    def __call__(self, out) -> None:
        p = self.parts
        p["tokens"].append(np.asarray(out.new_token_ids, np.int64))
        for name, value in (("logprobs", out.logprobs), ("top_ids", out.top_logprob_ids),
                            ("top_logprobs", out.top_logprobs), ("routed_experts", out.routed_experts),
                            ("routed_weights", out.routed_weights), ("prompt_logprobs", out.prompt_logprobs),
                            ("prompt_ranks", out.prompt_logprob_ranks), ("prompt_top_ids", out.prompt_top_logprob_ids),
                            ("prompt_top_logprobs", out.prompt_top_logprobs)):
            if value is not None:
                p[name].append(np.asarray(value))
        self.cached = max(self.cached, out.num_cached_tokens)
        if out.finished:
            self.finish = (out.finish_reason, out.error)
            self.done.set()

    def result(self) -> dict[str, np.ndarray | None]:
        return {f: (np.concatenate(v) if v else None) for f, v in self.parts.items()}


def assert_same_bits(got: dict, want: dict, what: str) -> None:
    for field in Record.FIELDS:
        a, b = got[field], want[field]
        assert (a is None) == (b is None), f"{what}: {field} present in one run only"
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, \
                f"{what}: {field} {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
            # bit patterns: NaN == NaN, -0.0 != 0.0
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{what}: {field} differs"


PROMPT = random.Random(52).choices(range(3, VOCAB - 3), k=70)  # > a 64-token block, > the windows (16, 8)

TARGETS = {  # name -> (request options, sampling)
    "greedy": (dict(return_routed_weights=True, prompt_logprobs=2),
               dict(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)),
    "seeded": (dict(return_routed_weights=True, prompt_logprobs=0),
               dict(max_tokens=6, temperature=0.9, top_k=40, top_p=0.9, seed=1234, logprobs=2, ignore_eos=True)),
    "plain": (dict(), dict(max_tokens=5, temperature=0.0, logprobs=1, ignore_eos=True)),  # may hit the prefix cache
}


def submit(engine: Engine, name: str, prompt=PROMPT) -> Record:
    options, sampling = TARGETS[name]
    rec = Record()
    engine.add_request(Request(request_id=engine.new_request_id(), prompt_token_ids=list(prompt),
                               sampling=SamplingParams(**sampling), return_routed_experts=True, on_output=rec,
                               **options))
    return rec


def submit_others(engine: Engine, n: int, seed: int) -> list[Record]:
    """n requests of mixed lengths (1-48 prompt tokens, 1-8 output tokens) and settings (greedy or seeded, logprobs,
    prompt logprobs, routing on or off)."""
    rng = random.Random(seed)
    recs = []
    for i in range(n):
        prompt = rng.choices(range(3, VOCAB - 3), k=rng.randint(1, 48))
        sampled = rng.random() < 0.5
        sampling = SamplingParams(max_tokens=rng.randint(1, 8), temperature=0.8 if sampled else 0.0,
                                  seed=rng.randrange(1 << 30) if sampled else None, ignore_eos=True,
                                  logprobs=rng.choice([None, 0, 2]))
        rec = Record()
        engine.add_request(Request(request_id=engine.new_request_id(), prompt_token_ids=prompt, sampling=sampling,
                                   return_routed_experts=rng.random() < 0.8, on_output=rec,
                                   prompt_logprobs=1 if rng.random() < 0.1 else None))
        recs.append(rec)
    return recs


def run(engine: Engine, recs: list[Record]) -> None:
    for _ in range(20_000):
        if all(r.done.is_set() for r in recs):
            for r in recs:
                assert r.finish[1] is None, r.finish
            return
        engine.step()
    raise AssertionError("requests did not finish")


def make_engine(model, cfg, **kw) -> Engine:
    kw.setdefault("max_model_len", MAX_LEN)
    if GPU:  # not 90% of the GPU per engine; graphs for every step of these tests (up to 512 tokens or sequences)
        kw.setdefault("kv_cache_memory_bytes", 512 << 20)
        kw.setdefault("max_cudagraph_capture_size", 512)
    return Engine(model, cfg, EngineConfig(deterministic_inference=True, **kw))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out, cache = tmp_path_factory.mktemp("deterministic"), {}

    def get(arch: str, dtype: torch.dtype):
        if (arch, dtype) not in cache:
            cache[arch, dtype] = save_hf_checkpoint(make_hf_model(arch, seed=5, dtype=dtype), out / f"{arch}-{dtype}")
        return cache[arch, dtype]

    return get


# (others, step size): the targets' 70-token prompt in 5 or 2 chunks, or whole beside other prompts' chunks
BATCHES = ((1, 16), (7, 40), (63, 128), (255, 512))


# Hybrid models (Gated DeltaNet, Mamba-2 layers) are refused by the mode: test_hybrid_models_are_refused.
COVERED = tuple(a for a in ARCHS if a not in HYBRID_ARCHS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", COVERED)
def test_a_request_gives_the_same_bits_alone_batched_chunked_and_cached(arch, dtype, checkpoints):
    path = checkpoints(arch, dtype)
    cfg = load_config(path)
    model = load_model(path, dtype=dtype, device=DEVICE, progress=False)

    # References: each target alone on a fresh engine (cold cache), the whole prompt in one step, eager.
    ref = {}
    for name in TARGETS:
        engine = make_engine(model, cfg, enforce_eager=True)
        rec = submit(engine, name)
        run(engine, [rec])
        ref[name] = rec.result()
        assert rec.cached == 0
    assert ref["greedy"]["prompt_logprobs"].shape == (len(PROMPT) - 1,)
    assert ref["greedy"]["routed_weights"].shape == ref["greedy"]["routed_experts"].shape
    assert ref["greedy"]["routed_experts"].shape[0] == len(PROMPT) + 6 - 1

    for i, (n, step) in enumerate(BATCHES):
        engine = make_engine(model, cfg, max_num_batched_tokens=step, max_num_seqs=n + 3)
        others = submit_others(engine, n // 2, seed=100 * i)
        engine.step()  # the targets join steps that already decode and prefill others
        targets = {name: submit(engine, name) for name in ("greedy", "seeded")}
        others += submit_others(engine, n - n // 2, seed=100 * i + 1)
        run(engine, others + list(targets.values()))
        for name, rec in targets.items():
            assert_same_bits(rec.result(), ref[name], f"{arch} {name} among {n} others, {step}-token steps")
        # The prompt is now in the prefix cache (its blocks and routing rows, from the batched run): the plain
        # request takes them and forwards only its last block's tokens, beside new requests.
        rec = submit(engine, "plain")
        more = submit_others(engine, min(n, 7), seed=100 * i + 2)
        run(engine, more + [rec])
        assert rec.cached >= len(PROMPT) // engine.settings.block_size * engine.settings.block_size - 1 > 0
        assert_same_bits(rec.result(), ref["plain"], f"{arch} plain after a prefix-cache hit, {step}-token steps")


def test_the_switch_is_on_from_the_flag_or_vllms_variable_and_off_by_default(monkeypatch, tiny_checkpoint):
    """``--enable-deterministic-inference`` or VLLM_BATCH_INVARIANT=1; /v1/models reports it (get_engine_info);
    tensor parallelism is refused. Off, the model keeps its torch Linear modules and its default paths."""
    from openai_frontend.cli import build_parser

    def flags(*argv: str) -> bool:
        return EngineConfig.from_cli_args(build_parser().parse_args(list(argv))).deterministic_inference

    cfg = load_config(tiny_checkpoint)
    monkeypatch.delenv(BATCH_INVARIANT_ENV, raising=False)
    assert flags("--enable-deterministic-inference") and not flags()
    monkeypatch.setenv("MOE_SERVE_ENABLE_DETERMINISTIC_INFERENCE", "1")
    assert flags()
    monkeypatch.delenv("MOE_SERVE_ENABLE_DETERMINISTIC_INFERENCE")
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    assert flags()
    monkeypatch.delenv(BATCH_INVARIANT_ENV)
    assert not EngineConfig().resolve(cfg, "cpu", torch.float32).deterministic_inference
    assert EngineConfig(deterministic_inference=True).resolve(cfg, "cpu", torch.float32).deterministic_inference
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    assert EngineConfig().resolve(cfg, "cpu", torch.float32).deterministic_inference
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(tensor_parallel_size=2).resolve(cfg, "cpu", torch.float32)
    monkeypatch.delenv(BATCH_INVARIANT_ENV)

    model = load_model(tiny_checkpoint, dtype=torch.float32, device=DEVICE, progress=False)
    ids = random.Random(0).choices(range(3, 400), k=20)
    small = dict(max_model_len=64, **({"kv_cache_memory_bytes": 256 << 20, "enforce_eager": True} if GPU else {}))
    Engine(model, cfg, EngineConfig(**small))
    before = reference_forward(model, ids)  # as a default engine left the model
    engine = Engine(model, cfg, EngineConfig(deterministic_inference=True, **small))
    assert engine.lifecycle.get_engine_info().result()["deterministic_inference"] is True
    assert type(model.lm_head).__name__ == "InvariantLinear"
    engine = Engine(model, cfg, EngineConfig(**small))
    assert engine.lifecycle.get_engine_info().result()["deterministic_inference"] is False
    assert type(model.lm_head) is torch.nn.Linear
    assert not any(getattr(m, "batch_invariant", False) for m in model.modules())
    after = reference_forward(model, ids)  # the default forward's numbers, to the bit
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("arch", ("qwen3_next", "nemotron_h"))
def test_hybrid_models_are_refused_with_the_reason(arch, checkpoints):
    """A hybrid model's recurrent layers have no batch-invariant variant: the mode refuses it at start (it would
    otherwise serve bits that depend on the batch while promising they do not)."""
    path = checkpoints(arch, torch.float32)
    cfg = load_config(path)
    model = load_model(path, dtype=torch.float32, device=DEVICE, progress=False)
    with pytest.raises(ValueError, match="does not cover hybrid models"):
        make_engine(model, cfg)
