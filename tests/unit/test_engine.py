"""Engine serving core: batching invariance, capture semantics, abort, seeds, limits.

The engine runs synchronously here (``engine.step()``), so a test controls
exactly what shares a step.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from moe_engine.checkpoint import load_model
from moe_engine.config import load_config
from moe_engine.core.sampling import SamplingParams
from moe_engine.core.warmup import warm_prefill
from moe_engine.engine import Engine, EngineConfig, Request
from moe_engine.errors import EngineOverloadedError, InvalidRequestError
from moe_engine.models.decoder import reference_forward

from ..tolerances import approx_across_batches

# CPU in CI; `MOE_TEST_DEVICE=cuda` runs the same checks on a GPU.
DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    cfg = load_config(tiny_checkpoint)
    model = load_model(tiny_checkpoint, dtype="float32", device=DEVICE, progress=False)
    return cfg, model


def make_engine(tiny, **kw) -> Engine:
    cfg, model = tiny
    kw.setdefault("max_model_len", 256)
    if DEVICE != "cpu":  # not 90% of the GPU for each of the many engines a test module builds
        kw.setdefault("kv_cache_memory_bytes", 256 << 20)
    return Engine(model, cfg, EngineConfig(**kw))


class Collector:
    """Accumulates a request's outputs the way a client would."""

    def __init__(self):
        self.tokens: list[int] = []
        self.rows: list[np.ndarray] = []
        self.finish_reason = None
        self.error = None
        self.logprobs: list[float] = []
        self.done = threading.Event()
        self.num_outputs = 0

    def __call__(self, out):
        self.num_outputs += 1
        self.tokens.extend(out.new_token_ids)
        if out.routed_experts is not None:
            self.rows.append(out.routed_experts)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.finished:
            self.finish_reason, self.error = out.finish_reason, out.error
            self.done.set()

    @property
    def routing(self) -> np.ndarray:
        return np.concatenate(self.rows) if self.rows else None


def submit(engine, prompt, rid=None, routing=True, prompt_start=0, **sampling) -> Collector:
    c = Collector()
    sampling.setdefault("temperature", 0.0)
    engine.add_request(
        Request(
            request_id=rid or engine.new_request_id(),
            prompt_token_ids=list(prompt),
            sampling=SamplingParams(**sampling),
            return_routed_experts=routing,
            routed_experts_prompt_start=prompt_start,
            on_output=c,
        )
    )
    return c


def run_all(engine, collectors, max_steps=10_000):
    for _ in range(max_steps):
        if all(c.done.is_set() for c in collectors):
            return
        engine.step()
    raise AssertionError("requests did not finish")


def prompt_of(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def test_prompt_ids_are_validated_in_bulk_from_lists_and_integer_arrays(tiny):
    """Token ids come as a list (the engine API) or an integer array (the Triton backend's input tensor): both run
    the same; a non-integer, an id outside the vocabulary or beyond int64, or a 2-D array is refused by name."""
    cfg, _ = tiny
    engine = make_engine(tiny)
    p = prompt_of(40, 3)

    def request(ids, c=None):
        return Request(request_id=engine.new_request_id(), prompt_token_ids=ids, on_output=c,
                       sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))

    runs = [Collector() for _ in range(3)]
    for ids, c in zip((list(p), np.array(p, np.int64), np.array(p, np.int32)), runs):
        engine.add_request(request(ids, c))
    run_all(engine, runs)
    for c in runs[1:]:
        assert c.tokens == runs[0].tokens
        np.testing.assert_array_equal(c.routing, runs[0].routing)
    V = cfg.vocab_size
    for ids, message in (
        ([1, V], f"token id {V} is outside the vocabulary"),
        ([-1, 2], "token id -1 is outside the vocabulary"),
        ([1, 2**70], f"token id {2**70} is outside the vocabulary"),
        (np.array([1, V], np.int64), f"token id {V} is outside the vocabulary"),
        (np.array([1, 2**64 - 1], np.uint64), f"token id {2**64 - 1} is outside the vocabulary"),
        ([1, 2.5], "token id 2.5 is not an integer of the vocabulary"),
        ([1, "7"], "token id '7' is not an integer of the vocabulary"),
        (np.array([1.0, 2.0]), "token id 1.0 is not an integer of the vocabulary"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request(request(ids))
    with pytest.raises(InvalidRequestError, match="not an integer"):
        engine.add_request(request(np.array([[1, 2]])))
    assert engine.num_unfinished == 0


def test_rows_are_prompt_plus_output_minus_one_and_match_the_router(tiny):
    cfg, model = tiny
    engine = make_engine(tiny)
    prompt = prompt_of(9, 1)
    c = submit(engine, prompt, max_tokens=7, ignore_eos=True)
    run_all(engine, [c])
    assert c.finish_reason == "length" and len(c.tokens) == 7
    routing = c.routing
    assert routing.dtype == np.uint16
    assert routing.shape == (len(prompt) + len(c.tokens) - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    # Independently: the router's top-k over the same tokens in one reference forward.
    _, ref_ids = reference_forward(model, prompt + c.tokens[:-1])
    np.testing.assert_array_equal(routing, ref_ids.cpu().numpy().astype(np.uint16))
    assert int(routing.max()) < cfg.num_experts


def test_request_is_identical_alone_and_batched_with_seven_others(tiny):
    engine = make_engine(tiny, max_num_batched_tokens=64)
    target = prompt_of(23, 7)
    alone = submit(engine, target, max_tokens=12, ignore_eos=True)
    run_all(engine, [alone])

    engine = make_engine(tiny, max_num_batched_tokens=64)  # fresh cache; the others force chunking
    others = [submit(engine, prompt_of(5 + 9 * i, 100 + i), max_tokens=4 + i, ignore_eos=True) for i in range(4)]
    engine.step()  # the target joins a batch already decoding
    batched = submit(engine, target, max_tokens=12, ignore_eos=True)
    others += [submit(engine, prompt_of(3 + 17 * i, 200 + i), max_tokens=9, ignore_eos=True) for i in range(3)]
    run_all(engine, others + [batched])
    assert batched.tokens == alone.tokens
    np.testing.assert_array_equal(batched.routing, alone.routing)


def test_chunked_prefill_gives_the_same_rows_as_one_chunk(tiny):
    prompt = prompt_of(50, 3)
    whole = make_engine(tiny, max_num_batched_tokens=512)
    a = submit(whole, prompt, max_tokens=5, ignore_eos=True)
    run_all(whole, [a])
    chunked = make_engine(tiny, max_num_batched_tokens=16, max_num_seqs=4)
    b = submit(chunked, prompt, max_tokens=5, ignore_eos=True)
    run_all(chunked, [b])
    assert b.num_outputs > a.num_outputs  # the prompt really took several steps
    assert a.tokens == b.tokens
    np.testing.assert_array_equal(a.routing, b.routing)


def test_prompt_start_drops_leading_prompt_rows(tiny):
    engine = make_engine(tiny)
    prompt = prompt_of(12, 4)
    full = submit(engine, prompt, max_tokens=4, ignore_eos=True)
    cut = submit(engine, prompt, max_tokens=4, ignore_eos=True, prompt_start=5)
    run_all(engine, [full, cut])
    assert cut.routing.shape[0] == len(prompt) + 4 - 1 - 5
    np.testing.assert_array_equal(cut.routing, full.routing[5:])


def test_routing_opt_out_and_server_switch(tiny):
    engine = make_engine(tiny)
    c = submit(engine, prompt_of(6, 5), routing=False, max_tokens=3)
    run_all(engine, [c])
    assert c.routing is None and len(c.tokens) == 3

    off = make_engine(tiny, enable_routed_experts=False)
    assert off.runner.capture_buf is None  # no buffer, so no capture work in any step
    d = submit(off, prompt_of(6, 5), routing=True, max_tokens=3)
    run_all(off, [d])
    assert d.routing is None and d.tokens == c.tokens


def test_seed_reproduces_whatever_shares_the_batch(tiny):
    engine = make_engine(tiny)
    p = prompt_of(8, 6)
    a = submit(engine, p, temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    run_all(engine, [a])
    b = submit(engine, p, temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    noise = [submit(engine, prompt_of(4 + i, 50 + i), temperature=1.0, max_tokens=10) for i in range(5)]
    c = submit(engine, p, temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    run_all(engine, [b, c] + noise)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_abort_frees_the_blocks_for_the_next_request(tiny):
    engine = make_engine(tiny, max_num_seqs=1)
    long = submit(engine, prompt_of(5, 8), rid="long", max_tokens=200, ignore_eos=True)
    waiting = submit(engine, prompt_of(5, 9), rid="next", max_tokens=3)
    for _ in range(50):
        if len(long.tokens) >= 5:
            break
        engine.step()
    assert len(long.tokens) == 5 and not waiting.tokens  # max_num_seqs=1: the second waits
    engine.abort("long")
    run_all(engine, [long, waiting])
    assert long.finish_reason == "abort" and 5 <= len(long.tokens) < 200
    assert len(waiting.tokens) == 3
    stats = engine.stats()
    assert stats["free_blocks"] == stats["num_blocks"] and stats["running"] == 0  # every block came back


def test_limits_are_rejected_with_clear_errors(tiny):
    cfg, _ = tiny
    engine = make_engine(tiny, max_model_len=64, max_waiting=2)
    with pytest.raises(InvalidRequestError, match="maximum context length is 64"):
        submit(engine, prompt_of(60, 1), max_tokens=10)
    with pytest.raises(InvalidRequestError, match="empty"):
        submit(engine, [], max_tokens=1)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        submit(engine, [1, cfg.vocab_size], max_tokens=1)
    with pytest.raises(InvalidRequestError, match="temperature"):
        submit(engine, [1, 2], temperature=-1.0)
    with pytest.raises(InvalidRequestError, match="routed_experts_prompt_start"):
        submit(engine, [1, 2], prompt_start=2)
    submit(engine, [1, 2])
    submit(engine, [1, 2])
    with pytest.raises(EngineOverloadedError):
        submit(engine, [1, 2])


def test_stop_token_ids_and_logprobs(tiny):
    engine = make_engine(tiny)
    p = prompt_of(7, 11)
    free = submit(engine, p, max_tokens=8, ignore_eos=True, logprobs=3)
    run_all(engine, [free])
    assert len(free.logprobs) == 8 and all(lp <= 0 for lp in free.logprobs)
    stop_at = free.tokens[3]
    first = free.tokens.index(stop_at)
    stopped = submit(engine, p, max_tokens=8, ignore_eos=True, stop_token_ids=(stop_at,))
    run_all(engine, [stopped])
    assert stopped.finish_reason == "stop" and stopped.tokens == free.tokens[: first + 1]


def test_sixty_four_concurrent_requests_all_finish_on_the_engine_thread(tiny):
    engine = make_engine(tiny, max_num_seqs=16, max_num_batched_tokens=128)
    engine.start()
    try:
        prompts = [prompt_of(3 + i % 13, i) for i in range(64)]
        cs = [
            submit(engine, p, max_tokens=2 + i % 7, temperature=0.7 * (i % 2), seed=i)
            for i, p in enumerate(prompts)
        ]
        for c in cs:
            assert c.done.wait(120), "a request never finished"
        assert all(c.finish_reason in ("stop", "length") for c in cs)
        for p, c in zip(prompts, cs):
            assert c.routing.shape[0] == len(p) + len(c.tokens) - 1
    finally:
        engine.shutdown()
    stats = engine.stats()
    assert stats["free_blocks"] == stats["num_blocks"] and stats["running"] == 0


def overlap_workload(engine, stop_token: int | None = None) -> list[Collector]:
    """Requests that arrive while others decode, stop on a token, stop on length, opt out of routing, cut
    prompt rows and sample with a seed: every way the running batch changes between decode steps."""
    out = [
        submit(engine, prompt_of(9, 21), max_tokens=14, ignore_eos=True),
        submit(engine, prompt_of(17, 22), max_tokens=9, ignore_eos=True, routing=False),
    ]
    for _ in range(4):
        engine.step()
    out.append(submit(engine, prompt_of(5, 23), max_tokens=12, ignore_eos=True, prompt_start=3))
    out.append(submit(engine, prompt_of(11, 24), max_tokens=16, temperature=0.9, seed=7, ignore_eos=True))
    if stop_token is not None:
        out.append(submit(engine, prompt_of(9, 21), max_tokens=14, ignore_eos=True, stop_token_ids=(stop_token,)))
    for _ in range(3):
        engine.step()
    out.append(submit(engine, prompt_of(40, 25), max_tokens=24, ignore_eos=True))  # ends at max_model_len
    run_all(engine, out)
    return out


def test_overlapped_decode_hands_out_exactly_what_sequential_steps_do(tiny):
    """Overlapped decode (the CUDA default) launches step i+1 from step i's samples before step i's results
    are read; a sequence that stops meanwhile has one wasted row that must never reach its output."""
    plain = overlap_workload(make_engine(tiny, max_model_len=64, async_scheduling=False))
    stop_token = plain[0].tokens[6]
    plain = overlap_workload(make_engine(tiny, max_model_len=64, async_scheduling=False), stop_token)
    overlapped_engine = make_engine(tiny, max_model_len=64, async_scheduling=True)
    overlapped = overlap_workload(overlapped_engine, stop_token)
    assert plain[4].finish_reason == "stop" and len(plain[4].tokens) < 14  # stopped mid-batch
    assert plain[5].finish_reason == "length" and 40 + len(plain[5].tokens) == 64
    for a, b in zip(plain, overlapped):
        assert (b.finish_reason, b.tokens, b.num_outputs) == (a.finish_reason, a.tokens, a.num_outputs)
        if a.routing is None:
            assert b.routing is None
        else:
            np.testing.assert_array_equal(b.routing, a.routing)
    stats = overlapped_engine.stats()
    assert overlapped_engine._inflight is None and stats["free_blocks"] == stats["num_blocks"]


def test_overlapped_decode_abort_and_refill(tiny):
    engine = make_engine(tiny, max_num_seqs=2, async_scheduling=True)
    long = submit(engine, prompt_of(6, 31), rid="long", max_tokens=100, ignore_eos=True)
    other = submit(engine, prompt_of(8, 32), max_tokens=30, ignore_eos=True)
    while len(long.tokens) < 4:
        engine.step()
    assert engine._inflight is not None  # a decode step is in flight when the abort arrives
    engine.abort("long")
    after = submit(engine, prompt_of(7, 33), max_tokens=10, ignore_eos=True)  # takes the freed slot
    run_all(engine, [long, other, after])
    assert long.finish_reason == "abort" and len(long.tokens) < 100
    assert long.routing.shape[0] == 6 + len(long.tokens) - 1  # rows stay aligned with the tokens handed out

    ref = make_engine(tiny, async_scheduling=False)
    alone = [submit(ref, prompt_of(8, 32), max_tokens=30, ignore_eos=True),
             submit(ref, prompt_of(7, 33), max_tokens=10, ignore_eos=True)]
    run_all(ref, alone)
    for got, want in zip([other, after], alone):
        assert got.tokens == want.tokens
        np.testing.assert_array_equal(got.routing, want.routing)


def prefill_overlap_workload(engine, stop_token: int | None = None) -> list[Collector]:
    """Prompts longer than a step (chunked over several), requests arriving while others prefill and decode, two
    that share a prefix (prefix-cache hits), a stop token, a length limit, a seeded sample with logprobs and a
    one-token output: every way the step after a prefill or mixed step can differ from the one before."""
    shared = prompt_of(40, 41)
    out = [
        submit(engine, prompt_of(50, 42), max_tokens=12, ignore_eos=True),
        submit(engine, shared + prompt_of(5, 43), max_tokens=10, ignore_eos=True),
    ]
    for _ in range(2):
        engine.step()
    out.append(submit(engine, shared + prompt_of(9, 44), max_tokens=8, ignore_eos=True))  # the shared blocks
    out.append(submit(engine, prompt_of(33, 45), max_tokens=14, temperature=0.8, seed=5, ignore_eos=True,
                      logprobs=2))
    out.append(submit(engine, prompt_of(21, 46), max_tokens=1, ignore_eos=True))
    if stop_token is not None:
        out.append(submit(engine, prompt_of(50, 42), max_tokens=12, ignore_eos=True, stop_token_ids=(stop_token,)))
    for _ in range(3):
        engine.step()
    out.append(submit(engine, prompt_of(27, 47), max_tokens=37, ignore_eos=True))  # ends at max_model_len
    run_all(engine, out)
    return out


def test_overlapped_prefill_steps_hand_out_exactly_what_sequential_steps_do(tiny):
    """With overlapped steps the step after a prefill or mixed step is planned and launched before that step's
    results are read: its decodes take their tokens on the device, prompt chunks and admissions go on. Every
    request gets what sequential steps give it (tokens, logprobs, finish, routing rows), a sequence that stops on a token
    meanwhile never shows its wasted row, and no block is left behind."""
    kw = dict(max_model_len=64, max_num_batched_tokens=24, max_num_seqs=4)
    plain = prefill_overlap_workload(make_engine(tiny, async_scheduling=False, **kw))
    stop_token = plain[0].tokens[4]
    sequential = make_engine(tiny, async_scheduling=False, **kw)
    plain = prefill_overlap_workload(sequential, stop_token)
    engine = make_engine(tiny, async_scheduling=True, **kw)
    followed = []
    follow = engine.scheduler.follow
    engine.scheduler.follow = lambda plan: followed.append(follow(plan)) or followed[-1]
    overlapped = prefill_overlap_workload(engine, stop_token)
    assert plain[5].finish_reason == "stop" and len(plain[5].tokens) < 12  # stopped mid-batch
    assert plain[6].finish_reason == "length" and 27 + len(plain[6].tokens) == 64
    assert sequential.stats()["prefix_cache_hits"] >= 32  # the shared prompt blocks were hits
    for a, b in zip(plain, overlapped):
        assert (b.finish_reason, b.tokens) == (a.finish_reason, a.tokens)
        np.testing.assert_array_equal(b.routing, a.routing)
        assert b.logprobs == approx_across_batches(a.logprobs)  # logits rows of other batch shapes
    assert len(plain[3].logprobs) == 14  # one per token of the request that asked
    # The overlapped steps included prompt chunks beside decodes fed on the device, and admissions.
    plans = [p for p in followed if p is not None]
    assert any(p.fed and any(n > 1 for _, n in p.items) for p in plans)
    assert any(c == 0 for p in plans for c in p.context)
    stats = engine.stats()
    assert stats["prefix_cache_hits"] == sequential.stats()["prefix_cache_hits"]
    assert stats["overlapped_steps"] == len(plans) and stats["overlapped_steps"] > stats["steps"] // 2
    assert engine._inflight is None and stats["free_blocks"] == stats["num_blocks"]


def test_prefill_warm_up_leaves_cache_and_results_untouched(tiny):
    """The start-up prefill steps (``warmup.warm_prefill``, run on GPUs) write only the null block: cached
    prefixes, their routing rows and new requests give what they gave before it ran."""
    engine = make_engine(tiny, max_num_seqs=8, max_num_batched_tokens=96, enable_prefix_caching=True)
    prompts = [prompt_of(40, 7), prompt_of(23, 8)]
    first = [submit(engine, p, max_tokens=5, ignore_eos=True) for p in prompts]
    run_all(engine, first)
    warm_prefill(engine.runner, engine.settings.max_num_seqs)
    again = [submit(engine, p, max_tokens=5, ignore_eos=True) for p in prompts]
    run_all(engine, again)
    assert engine.stats()["prefix_cache_hits"] > 0
    for a, b in zip(first, again):
        assert b.tokens == a.tokens
        np.testing.assert_array_equal(b.routing, a.routing)


def _request(engine, prompt, rid=None, collector=None) -> Request:
    return Request(request_id=rid or engine.new_request_id(), prompt_token_ids=list(prompt),
                   sampling=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                   return_routed_experts=True, on_output=collector)


def test_add_requests_starts_a_batch_in_one_step(tiny):
    """A running engine given a batch through add_requests prefills all of it in its first step (one request
    after another lets the loop start with the first few); outputs equal those of requests sent alone."""
    engine = make_engine(tiny, max_num_seqs=16, max_num_batched_tokens=512)
    prompts = [prompt_of(11 + 3 * i, 40 + i) for i in range(12)]
    first_step: dict[int, int] = {}
    collectors = []
    for i in range(12):
        c = Collector()

        def on_output(out, c=c, i=i):
            if out.new_token_ids and i not in first_step:
                first_step[i] = engine.num_steps
            c(out)
        collectors.append((c, on_output))
    engine.start()
    try:
        engine.add_requests([_request(engine, p, collector=cb) for p, (_, cb) in zip(prompts, collectors)])
        assert all(c.done.wait(60) for c, _ in collectors)
    finally:
        engine.shutdown()
    assert set(first_step.values()) == {1}
    alone = make_engine(tiny)
    for p, (c, _) in zip(prompts, collectors):
        ref = submit(alone, p, max_tokens=3, ignore_eos=True)
        run_all(alone, [ref])
        assert c.tokens == ref.tokens
        np.testing.assert_array_equal(c.routing, ref.routing)


def test_add_requests_is_all_or_none(tiny):
    engine = make_engine(tiny, max_waiting=4)
    good = [prompt_of(9, 1), prompt_of(9, 2)]
    bad_token = [5, 6, 10**6]
    with pytest.raises(InvalidRequestError, match=r"requests\[1\]: input_ids: token id 1000000"):
        engine.add_requests([_request(engine, good[0]), _request(engine, bad_token), _request(engine, good[1])])
    with pytest.raises(InvalidRequestError, match=r"requests\[1\]: request id 'twice' is already in use"):
        engine.add_requests([_request(engine, good[0], "twice"), _request(engine, good[1], "twice")])
    with pytest.raises(EngineOverloadedError):
        engine.add_requests([_request(engine, good[i % 2]) for i in range(5)])
    assert engine.num_unfinished == 0 and not engine.step()  # nothing of the refused batches was queued
    c = [Collector() for _ in good]
    engine.add_requests([_request(engine, p, "twice" if i else None, c[i]) for i, p in enumerate(good)])
    run_all(engine, c)
    assert [len(x.tokens) for x in c] == [3, 3]
