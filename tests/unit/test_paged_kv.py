"""Paged KV cache: long contexts sharing a small budget (preemption), prefix caching, block accounting.

What a user checks: every request ends with exactly the tokens and routing rows it would get alone on an idle
engine with memory to spare, whether it was preempted and recomputed, served from the prefix cache (fully or
partly), or recomputed after its cached blocks were evicted. The tiny model runs in float32, where a request's
tokens and routing do not depend on what shares its steps (test_engine.py checks that separately); its logprobs
do on a GPU within float32 rounding (a 4-row and a 100-row step take different GEMM kernels there), bit for bit on
the CPU.
"""
from __future__ import annotations

import numpy as np
import pytest

from moe_engine.core.block_manager import BlockManager, BlockTable

from ..tolerances import approx_across_batches
from .test_engine import make_engine, prompt_of, run_all, submit, tiny  # noqa: F401 (fixture)

BS = 16


def kv_bytes_for(tiny, tokens: int, block_size: int = BS) -> int:
    """KV budget that holds ``tokens`` tokens (plus the null block) for the tiny model."""
    from moe_engine.core.kv_cache import bytes_per_block

    cfg, model = tiny
    return (-(-tokens // block_size) + 1) * bytes_per_block(model.kv_layout(), block_size, model.dtype)


def results(collectors):
    return [(c.finish_reason, c.tokens, None if c.routing is None else c.routing.copy()) for c in collectors]


def assert_same(got, want):
    assert len(got) == len(want)
    for (r1, t1, x1), (r2, t2, x2) in zip(got, want):
        assert (r1, t1) == (r2, t2)
        if x2 is None:
            assert x1 is None
        else:
            np.testing.assert_array_equal(x1, x2)


# ----------------------------------------------------------------------------- preemption


SPECS = [(600, 120), (800, 90), (450, 160), (900, 70)]  # (prompt, output) tokens


def long_workload(engine, prompt_starts=(0, 0, 100, 0)):
    """Four sequences of 600-970 tokens (prompt + output), one with a prompt start, one sampling with a seed."""
    specs = SPECS
    out = []
    for i, ((p, n), ps) in enumerate(zip(specs, prompt_starts)):
        sampling = dict(max_tokens=n, ignore_eos=True)
        if i == 3:
            sampling.update(temperature=0.8, seed=42)
        out.append(submit(engine, prompt_of(p, 300 + i), prompt_start=ps, **sampling))
    run_all(engine, out, max_steps=100_000)
    return out


# overlapped: each step is planned and launched before the previous one's results are read (the CUDA default);
# where that plan would need a preemption the engine falls back to planning after the results.
@pytest.mark.parametrize("overlapped", [False, True], ids=["sequential", "overlapped"])
def test_preempted_requests_end_with_exactly_the_tokens_and_rows_of_an_unpreempted_run(tiny, overlapped):
    roomy = make_engine(tiny, max_model_len=1024, max_num_batched_tokens=256, enable_prefix_caching=False)
    want = results(long_workload(roomy))
    assert roomy.stats()["num_preemptions"] == 0

    # Room for about half of the 3,190 tokens the four sequences reach: running sequences grow into each
    # other's blocks and the newest is preempted (and recomputed) again and again.
    tight = make_engine(tiny, max_model_len=1024, max_num_batched_tokens=256, enable_prefix_caching=False,
                        kv_cache_memory_bytes=kv_bytes_for(tiny, 1600), async_scheduling=overlapped)
    got = results(long_workload(tight))
    stats = tight.stats()
    assert stats["num_preemptions"] >= 2, stats
    assert (stats["overlapped_steps"] > stats["steps"] // 2) == overlapped
    assert_same(got, want)
    for (_, tokens, rows), (p, n), ps in zip(got, SPECS, (0, 0, 100, 0)):
        assert len(tokens) == n and rows.shape[0] == p + n - 1 - ps  # no row lost, none repeated
    assert stats["free_blocks"] == stats["num_blocks"] and stats["running"] == stats["waiting"] == 0


@pytest.mark.parametrize("overlapped", [False, True], ids=["sequential", "overlapped"])
def test_preemption_with_the_prefix_cache_on_recomputes_from_cached_blocks(tiny, overlapped):
    roomy = make_engine(tiny, max_model_len=1024, max_num_batched_tokens=256)
    want = results(long_workload(roomy))
    tight = make_engine(tiny, max_model_len=1024, max_num_batched_tokens=256,
                        kv_cache_memory_bytes=kv_bytes_for(tiny, 1600), async_scheduling=overlapped)
    got = results(long_workload(tight))
    assert tight.stats()["num_preemptions"] >= 1
    assert_same(got, want)


# ----------------------------------------------------------------------------- prefix caching


@pytest.mark.parametrize("block_size", [BS, 64])  # 64: the default on Hopper GPUs
def test_prefix_cache_hit_returns_the_rows_and_tokens_of_a_cold_run(tiny, block_size):
    engine = make_engine(tiny, max_model_len=512, block_size=block_size)
    base = prompt_of(100, 11)  # 6 full blocks of 16 + 4 tokens; 1 block of 64 + 36
    cold = submit(engine, base, max_tokens=8, ignore_eos=True, logprobs=2)
    run_all(engine, [cold])
    before = engine.stats()
    assert before["block_size"] == block_size  # what /metrics reports (moe_engine_kv_block_size)
    warm = submit(engine, base, max_tokens=8, ignore_eos=True, logprobs=2)
    run_all(engine, [warm])
    after = engine.stats()
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert hits == 100 // block_size * block_size  # every full prompt block was reused
    assert warm.tokens == cold.tokens
    np.testing.assert_array_equal(warm.routing, cold.routing)
    assert warm.routing.shape[0] == 100 + 8 - 1  # no gap where the cached tokens were not forwarded
    assert warm.logprobs == approx_across_batches(cold.logprobs)  # the cached prefix changes the step's shape

    # Partly cached (a shared first 70 tokens, then a different tail), with a prompt start inside the cached
    # part and one beyond it; and a request that opts out of routing.
    tail = prompt_of(30, 12)
    partly = [submit(engine, base[:70] + tail, max_tokens=6, ignore_eos=True, prompt_start=ps) for ps in (0, 20, 90)]
    no_rows = submit(engine, base[:70] + tail, max_tokens=6, ignore_eos=True, routing=False)
    run_all(engine, partly + [no_rows])
    fresh = make_engine(tiny, max_model_len=512, enable_prefix_caching=False, block_size=block_size)
    ref = submit(fresh, base[:70] + tail, max_tokens=6, ignore_eos=True)
    run_all(fresh, [ref])
    for c, ps in zip(partly, (0, 20, 90)):
        assert c.tokens == ref.tokens
        np.testing.assert_array_equal(c.routing, ref.routing[ps:])
    assert no_rows.routing is None and no_rows.tokens == ref.tokens


def test_cached_rows_copied_while_the_step_runs_are_the_rows_copied_after_it(tiny, monkeypatch):
    """A cache hit's first output carries its history's rows: the engine copies them from the cache while the device
    computes the step (``Scheduler.prepare_outputs``), and the output equals, output by output, what copying them
    once the step's rows are back gives, for prompt starts before, inside and after the cached blocks."""
    base = prompt_of(100, 31)
    tail = prompt_of(30, 32)

    def run(prepare: bool):
        engine = make_engine(tiny, max_model_len=512)
        prepared = []
        if prepare:
            plain = engine.scheduler.prepare_outputs

            def counting(plan):
                plain(plan)
                prepared.extend(len(rows) for rows in plan.first_rows.values())

            monkeypatch.setattr(engine.scheduler, "prepare_outputs", counting)
        else:
            monkeypatch.setattr(engine.scheduler, "prepare_outputs", lambda plan: None)
        run_all(engine, [submit(engine, base, max_tokens=3, ignore_eos=True)])
        warm = [submit(engine, base[:70] + tail, max_tokens=5, ignore_eos=True, prompt_start=ps) for ps in (0, 20, 90)]
        run_all(engine, warm)
        return warm, prepared

    with_prepare, prepared = run(True)
    after_step, _ = run(False)
    # The first warm request: 64 cached tokens (4 blocks of the shared 70) + 36 forwarded, 100 rows. The other two
    # wait for it to compute blocks 4 and 5 (same prompt), then hit 96 tokens and forward 4: rows 20.. and 90..
    assert sorted(prepared) == [96 + 4 - 90, 96 + 4 - 20, 100]
    for a, b in zip(with_prepare, after_step):
        assert a.tokens == b.tokens and len(a.rows) == len(b.rows)
        for x, y in zip(a.rows, b.rows):
            assert x.dtype == y.dtype == np.uint16
            np.testing.assert_array_equal(x, y)


def test_exact_block_multiple_prompt_recomputes_its_last_block_for_the_logits(tiny):
    engine = make_engine(tiny, max_model_len=512)
    p = prompt_of(64, 13)  # exactly 4 blocks: the last token must be forwarded, so the last block is recomputed
    a = submit(engine, p, max_tokens=5, ignore_eos=True)
    run_all(engine, [a])
    hits = engine.stats()["prefix_cache_hits"]
    b = submit(engine, p, max_tokens=5, ignore_eos=True)
    run_all(engine, [b])
    assert engine.stats()["prefix_cache_hits"] - hits == 48
    assert b.tokens == a.tokens
    np.testing.assert_array_equal(b.routing, a.routing)


def test_evicted_prefix_is_recomputed_with_identical_results(tiny):
    # A cache of 40 blocks: a 100-token prompt registers 6 blocks, then 8 other requests cycle through the
    # free list and evict them.
    engine = make_engine(tiny, max_model_len=256, kv_cache_memory_bytes=kv_bytes_for(tiny, 40 * BS))
    p = prompt_of(100, 14)
    cold = submit(engine, p, max_tokens=6, ignore_eos=True)
    run_all(engine, [cold])
    others = [submit(engine, prompt_of(150, 500 + i), max_tokens=2, ignore_eos=True) for i in range(8)]
    run_all(engine, others)
    hits = engine.stats()["prefix_cache_hits"]
    again = submit(engine, p, max_tokens=6, ignore_eos=True)
    run_all(engine, [again])
    assert engine.stats()["prefix_cache_hits"] == hits  # nothing of it was left in the cache
    assert again.tokens == cold.tokens
    np.testing.assert_array_equal(again.routing, cold.routing)


@pytest.mark.parametrize("overlapped", [False, True], ids=["sequential", "overlapped"])
def test_choices_of_one_prompt_arriving_together_prefill_it_once(tiny, overlapped):
    engine = make_engine(tiny, max_model_len=512, async_scheduling=overlapped)
    p = prompt_of(200, 16)  # 12 full blocks
    choices = [submit(engine, p, max_tokens=6, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    run_all(engine, choices)
    stats = engine.stats()
    assert stats["prefix_cache_hits"] == 2 * 12 * BS  # the second and third choice took every full block
    alone = make_engine(tiny, max_model_len=512, enable_prefix_caching=False)
    refs = [submit(alone, p, max_tokens=6, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    run_all(alone, refs)
    for c, r in zip(choices, refs):
        assert c.tokens == r.tokens
        np.testing.assert_array_equal(c.routing, r.routing)


def test_prefix_cache_off_serves_nothing_from_the_cache(tiny):
    engine = make_engine(tiny, max_model_len=256, enable_prefix_caching=False)
    p = prompt_of(80, 15)
    cs = [submit(engine, p, max_tokens=3, ignore_eos=True) for _ in range(2)]
    run_all(engine, cs)
    assert engine.stats()["prefix_cache_hits"] == 0 and engine.stats()["cached_blocks"] == 0
    assert cs[0].tokens == cs[1].tokens


# ----------------------------------------------------------------------------- block manager


def chained_hashes(bm: BlockManager, tokens: list[int], key: object, num_blocks: int) -> list[int]:
    """The definition (BlockHasher), block by block in Python integers: block j's value v_j = mix(sum_i
    tokens[i] * M[i] mod 2**64) with splitmix64's finaliser, its hash h_j = h_{j-1} * B + v_j mod 2**64, from
    h_{-1} = hash(key) mod 2**64."""
    mask, bs = 2**64 - 1, bm.block_size
    mult, base = [int(m) for m in bm.hasher.mult], bm.hasher.base

    def mix(v):
        v ^= v >> 30
        v = v * 0xBF58476D1CE4E5B9 & mask
        v ^= v >> 27
        v = v * 0x94D049BB133111EB & mask
        return v ^ (v >> 31)

    out, h = [], hash(key) & mask
    for j in range(num_blocks):
        v = mix(sum(t * m for t, m in zip(tokens[j * bs : (j + 1) * bs], mult)) & mask)
        h = (h * base + v) & mask
        out.append(h)
    return out


def test_block_hashes_follow_their_definition_for_long_prompts_and_large_token_ids():
    """The vectorised hashes (a cumulative sum over B's powers) equal the block-by-block recurrence for a prompt
    of thousands of blocks (powers grown past their first size) and ids up to 2**31, and every block's hash
    depends on the tokens before it and on the key."""
    bm = BlockManager(num_blocks=4, block_size=16)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 2**31, size=16 * 1500 + 7).tolist()
    t = BlockTable()
    assert bm.block_hashes(t, tokens, 1500) == chained_hashes(bm, tokens, None, 1500)
    other = [tokens[0] + 1] + tokens[1:]
    assert all(a != b for a, b in zip(bm.block_hashes(BlockTable(), other, 50), chained_hashes(bm, tokens, None, 50)))
    salted = bm.block_hashes(BlockTable(cache_key=("salt", "x")), tokens, 50)
    assert all(a != b for a, b in zip(salted, chained_hashes(bm, tokens, None, 50)))


def test_block_hashes_are_computed_once_per_block_and_follow_the_cache_key(monkeypatch):
    """A sequence's chained block hashes, kept on its table (admission reads them three times, register once
    more): the definition's values, each block hashed once as the tokens grow, started again under a new key (a
    weight update re-keys waiting sequences), and what lookups and registrations use."""
    bm = BlockManager(num_blocks=16, block_size=4)
    calls = []
    plain = bm._hashes
    monkeypatch.setattr(bm, "_hashes", lambda parent, blocks: calls.append(len(blocks)) or plain(parent, blocks))
    tokens = list(range(100, 118))  # 4 full blocks + 2 tokens
    t = BlockTable()
    assert bm.block_hashes(t, tokens, 4) == chained_hashes(bm, tokens, None, 4)
    assert bm.block_hashes(t, tokens, 2) == chained_hashes(bm, tokens, None, 2)
    assert bm.block_hashes(t, tokens, 4) == chained_hashes(bm, tokens, None, 4)
    assert sum(calls) == 4  # each block once
    tokens += [1, 2]  # a decode step completes block 5
    assert bm.block_hashes(t, tokens, 5) == chained_hashes(bm, tokens, None, 5)
    assert sum(calls) == 5  # one new block hashed
    t.cache_key = ("epoch", 1)
    assert bm.block_hashes(t, tokens, 5) == chained_hashes(bm, tokens, ("epoch", 1), 5)
    assert chained_hashes(bm, tokens, ("epoch", 1), 5) != chained_hashes(bm, tokens, None, 5)
    # registering and matching read them
    a = BlockTable(cache_key=("epoch", 1))
    assert bm.allocate(a, len(tokens))
    bm.register(a, tokens, num_computed=len(tokens))
    assert a.hashes == chained_hashes(bm, tokens, ("epoch", 1), 5)
    # 20 tokens: 5 full blocks, of which a prompt may take 4 from the cache (its last token is computed)
    assert bm.match_prefix(t, tokens) == a.blocks[:4]
    assert bm.match_prefix(BlockTable(cache_key=("epoch", 1)), tokens) == a.blocks[:4]
    assert bm.match_prefix(BlockTable(), tokens) == []


def test_an_engine_without_prefix_caching_hashes_no_blocks(tiny, monkeypatch):
    engine = make_engine(tiny, enable_prefix_caching=False)
    calls = []
    monkeypatch.setattr(engine.blocks, "_hashes", lambda *a: calls.append(a) or [])
    out = [submit(engine, prompt_of(40, seed), max_tokens=3, ignore_eos=True) for seed in (1, 1, 2)]
    run_all(engine, out)
    assert all(len(c.tokens) == 3 for c in out) and calls == []


def test_block_manager_shares_reference_counted_blocks_and_evicts_least_recently_freed():
    bm = BlockManager(num_blocks=8, block_size=4, routing_shape=(2, 1), routing_dtype=np.uint8)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    a = BlockTable()
    assert bm.allocate(a, len(tokens))
    assert len(a.blocks) == 3 and bm.num_free == 5
    rows = np.arange(10 * 2, dtype=np.uint8).reshape(10, 2, 1)
    bm.register(a, tokens, num_computed=10, rows=rows, rows_start=0)
    assert bm.num_cached == 2  # the partial third block is not registered

    hits = bm.match_prefix(BlockTable(), tokens)
    assert hits == a.blocks[:2]
    b = BlockTable()
    bm.take_hits(b, hits, len(tokens))
    assert bm.ref_count[a.blocks[0]] == 2
    np.testing.assert_array_equal(bm.cached_rows(hits), rows[:8])
    assert bm.match_prefix(BlockTable(cache_key="forced"), tokens) == []  # another cache key never shares

    bm.free_table(a)
    bm.free_table(b)
    assert bm.num_free == 8 and bm.num_cached == 2  # freed, still cached
    # Handing out 6 blocks takes the never-used ones first, then the least recently freed.
    c = BlockTable()
    assert bm.allocate(c, 6 * 4)
    assert bm.num_cached == 2
    assert bm.allocate(c, 8 * 4) and bm.num_cached == 0 and bm.num_free == 0
    assert not bm.allocate(c, 9 * 4)  # nothing left: refused, nothing taken
    assert len(c.blocks) == 8


def test_cache_salt_isolates_cached_prefixes(tiny):
    engine = make_engine(tiny, max_model_len=256)
    p = prompt_of(100, 17)

    def run(salt):
        c = submit_salted(engine, p, salt)
        run_all(engine, [c])
        return c

    first = run("alice")
    hits = engine.stats()["prefix_cache_hits"]
    assert run("bob").tokens == first.tokens and engine.stats()["prefix_cache_hits"] == hits  # other salt: cold
    assert run(None).tokens == first.tokens and engine.stats()["prefix_cache_hits"] == hits  # no salt: cold too
    again = run("alice")
    assert engine.stats()["prefix_cache_hits"] - hits == 96  # same salt: every full prompt block
    np.testing.assert_array_equal(again.routing, first.routing)


def submit_salted(engine, prompt, salt):
    from moe_engine.core.sampling import SamplingParams
    from moe_engine.engine import Request

    from .test_engine import Collector

    c = Collector()
    engine.add_request(Request(request_id=engine.new_request_id(), prompt_token_ids=list(prompt),
                               sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                               cache_salt=salt, on_output=c))
    return c


def colliding_hash(parent, blocks):
    """Block hashes that ignore the parent (and so the key): equal blocks after different histories collide, as
    crafted inputs could make a weaker hash collide."""
    return [hash(tuple(block)) for block in blocks.tolist()]


def test_a_hash_collision_never_shares_a_block_across_different_histories(monkeypatch):
    """With hashes that collide, a prompt still takes only blocks whose whole history is its own: a block of
    another history with the same tokens and the same hash is not a hit (its keys, values and routing rows
    were computed after other tokens)."""
    bm = BlockManager(num_blocks=32, block_size=4)
    monkeypatch.setattr(bm, "_hashes", colliding_hash)
    a0, b0, x, y = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]
    tables = {}
    for name, tokens in (("a", a0 + x + [0]), ("c", b0 + y + [0])):  # cached: a0 | x and b0 | y
        t = tables[name] = BlockTable()
        assert bm.allocate(t, len(tokens))
        bm.register(t, tokens, num_computed=len(tokens))
    # b0 | x: block 0 is c's, block 1's tokens and (colliding) hash are a's, after a0 and not b0
    assert bm.match_prefix(BlockTable(), b0 + x + [0]) == tables["c"].blocks[:1]
    assert bm.match_prefix(BlockTable(), a0 + x + [0]) == tables["a"].blocks[:2]  # a's own history: both
    # blocks handed out again hold other contents: none of them is a hit any more
    for t in tables.values():
        bm.free_table(t)
    while bm.num_free:  # hand every block out again, a's and c's included
        assert bm.allocate(BlockTable(), 4)
    assert bm.match_prefix(BlockTable(), a0 + x + [0]) == []


def test_a_hash_collision_gives_the_tokens_and_rows_of_a_cold_run(tiny, monkeypatch):
    """End to end, with colliding block hashes: a prompt whose second block repeats another prompt's second block
    after a different first block gets exactly what a cold run gives (the other prompt's keys and values for
    those tokens would change its logits and routing)."""
    engine = make_engine(tiny, max_model_len=256)
    monkeypatch.setattr(engine.blocks, "_hashes", colliding_hash)
    a0, b0, x, y = (prompt_of(BS, seed) for seed in (21, 22, 23, 24))
    first = [submit(engine, p, max_tokens=4, ignore_eos=True) for p in (a0 + x + [7], b0 + y + [7])]
    run_all(engine, first)
    probe = b0 + x + [7]
    before = engine.stats()["prefix_cache_hits"]
    warm = submit(engine, probe, max_tokens=6, ignore_eos=True)
    run_all(engine, [warm])
    assert engine.stats()["prefix_cache_hits"] - before == BS  # b0 from the cache, x computed again
    fresh = make_engine(tiny, max_model_len=256, enable_prefix_caching=False)
    cold = submit(fresh, probe, max_tokens=6, ignore_eos=True)
    run_all(fresh, [cold])
    assert warm.tokens == cold.tokens
    np.testing.assert_array_equal(warm.routing, cold.routing)


def test_register_stores_each_new_blocks_rows_from_where_its_rows_start():
    """Rows arrive per step (rows_start = the step's first position); each newly registered block stores its own
    16 x L x K rows in the cache's dtype, and a block some other table registered first keeps that table's rows."""
    bm = BlockManager(num_blocks=16, block_size=4, routing_shape=(3, 2), routing_dtype=np.uint16)
    tokens = list(range(100, 122))  # 5 full blocks + 2 tokens
    t = BlockTable()
    assert bm.allocate(t, len(tokens))
    rows = np.arange(22 * 3 * 2, dtype=np.int32).reshape(22, 3, 2)
    bm.register(t, tokens, 6, rows[:6], 0)  # a first step: block 0 full, 2 tokens of block 1
    bm.register(t, tokens, 22, rows[4:22], 4)  # the step after, from position 4: blocks 1-4
    assert len(t.hashes) == 5 and bm.rows.dtype == np.uint16
    np.testing.assert_array_equal(bm.cached_rows(t.blocks[:5]), rows[:20])
    other = tokens[:8] + [7] * 12  # the same first two blocks, then its own
    u = BlockTable()
    assert bm.allocate(u, len(other))
    rows_u = rows[:20] + 1000
    bm.register(u, other, 20, rows_u, 0)
    np.testing.assert_array_equal(bm.cached_rows(u.blocks[2:5]), rows_u[8:20])
    np.testing.assert_array_equal(bm.cached_rows(t.blocks[:2]), rows[:8])
    assert bm.match_prefix(BlockTable(), other + [1]) == t.blocks[:2] + u.blocks[2:5]
