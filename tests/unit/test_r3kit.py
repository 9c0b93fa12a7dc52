"""r3kit without a model: decoding every endpoint's responses (and streams), alignment, stitching, the trainer batch,
the Megatron export, and the clear errors (no routed experts, rows that do not match the tokens, dense layers,
n > 1, truncated or aborted choices, a history that is not the conversation's). Responses are built the way the
server writes them (its own codec); the server-backed and model-backed tests are test_r3kit_replay.py and
tests/integration/test_r3kit_server.py."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import r3kit
from openai_frontend.routing_codec import encode_npy_b64
from r3kit import (DENSE_LAYER, MISSING_ROUTE, AbortedChoiceError, Conversation, DenseLayerError,
                   MissingRoutedExpertsError, MissingTokenIdsError, ModelCard, MultipleChoicesError, R3Error,
                   RowMismatchError, StitchError, TruncatedChoiceError, build_batch, turn_from_response)

# A DeepSeek-like layout: layer 0 dense, layers 1-3 MoE, 16 experts, top-4.
L, K, E = 4, 4, 16
CARD = ModelCard(num_hidden_layers=L, moe_layers=(1, 2, 3), num_experts=E, top_k=K, id="m")
CARD_JSON = {"object": "list", "data": [{"id": "m", "object": "model", "num_hidden_layers": L, "moe_layers": [1, 2, 3],
                                         "num_experts": E, "num_experts_per_tok": K, "top_k": K,
                                         "weight_version": "w0"}]}


def routing(positions, seed=0) -> np.ndarray:
    """Rows of ``positions`` (distinct ids per row; dense layer 0 all zero), a pure function of the position, so
    that the routing of one conversation is the same whatever turn returns it."""
    out = np.zeros((len(positions), L, K), dtype=np.uint8)
    for i, p in enumerate(positions):
        for layer in CARD.moe_layers:
            out[i, layer] = np.random.default_rng([seed, p, layer]).permutation(E)[:K]
    return out


def choice(prompt, gen, ps=0, *, endpoint="completions", seed=0, finish="stop", **over) -> dict:
    rows = routing(range(ps, len(prompt) + len(gen) - 1), seed)
    lps = [-0.5 - 0.01 * i for i in range(len(gen))]
    c = {"index": 0, "finish_reason": finish, "token_ids": list(gen), "prompt_token_ids": list(prompt),
         "routed_experts": encode_npy_b64(rows), "weight_version": "w0"}
    if endpoint == "completions":
        c |= {"text": "x", "logprobs": {"tokens": ["x"] * len(gen), "token_logprobs": lps, "top_logprobs": None}}
    else:  # chat / generate: logprobs.content
        c |= {"logprobs": {"content": [{"token": "x", "logprob": v} for v in lps]}}
        if endpoint == "chat":
            c["message"] = {"role": "assistant", "content": "x"}
    return c | over


def response(*choices) -> dict:
    return {"id": "r", "object": "text_completion", "choices": [dict(c, index=i) for i, c in enumerate(choices)]}


# ----------------------------------------------------------------------------- decoding and alignment


def test_import_needs_numpy_only():
    code = "import sys, r3kit; r3kit.build_batch; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("endpoint", ["completions", "chat", "generate"])
def test_every_endpoint_decodes_and_aligns(endpoint):
    prompt, gen = list(range(10, 22)), [5, 6, 7, 8]
    turn = turn_from_response(response(choice(prompt, gen, endpoint=endpoint)), card=CARD)
    assert turn.tokens == prompt + gen
    assert turn.routed_experts.shape == (12 + 4 - 1, L, K) and turn.routed_experts.dtype == np.uint8
    assert turn.end_position == len(turn.tokens) - 1  # no row for the last sampled token
    np.testing.assert_array_equal(turn.routed_experts, routing(range(15)))
    assert turn.logprobs == pytest.approx([-0.5, -0.51, -0.52, -0.53])
    assert turn.moe_routed_experts().shape == (15, 3, K)
    assert turn.weight_version == "w0" and turn.finish_reason == "stop"


def test_sdk_objects_json_and_generate_prompt_from_the_request():
    openai = pytest.importorskip("openai")
    prompt, gen = list(range(10, 20)), [1, 2]
    sdk = openai.types.Completion.model_validate(response(choice(prompt, gen)) | {"created": 0, "model": "m"})
    assert turn_from_response(sdk).tokens == prompt + gen
    assert turn_from_response(json.dumps(response(choice(prompt, gen)))).tokens == prompt + gen
    gen_resp = response(choice(prompt, gen, endpoint="generate", prompt_token_ids=None))
    with pytest.raises(MissingTokenIdsError, match="return_token_ids"):
        turn_from_response(gen_resp)
    assert turn_from_response(gen_resp, prompt_token_ids=prompt).tokens == prompt + gen
    card = ModelCard.from_models_response(CARD_JSON)
    assert card == CARD and card.dense_layers == (0,) and card.weight_version == "w0"


@pytest.mark.parametrize("endpoint", ["completions", "chat", "generate"])
def test_streams_are_put_back_together(endpoint):
    prompt, gen = list(range(30, 40)), [7, 8, 9, 10, 11]
    full = choice(prompt, gen, endpoint=endpoint, finish="stop")
    chunks = []
    for i, t in enumerate(gen):  # one token per chunk; prompt ids on the first, routing and finish on the last
        c = {"index": 0, "token_ids": [t], "finish_reason": None}
        if endpoint == "completions":
            c |= {"text": "x", "logprobs": {"tokens": ["x"], "token_logprobs": [full["logprobs"]["token_logprobs"][i]]}}
        else:
            c |= {"logprobs": {"content": [full["logprobs"]["content"][i]]}}
            if endpoint == "chat":
                c["delta"] = {"content": "x"}
        if i == 0:
            c["prompt_token_ids"] = prompt
        if i == len(gen) - 1:
            c |= {"finish_reason": "stop", "routed_experts": full["routed_experts"], "weight_version": "w0"}
        chunks.append({"choices": [c]})
    lines = [f"data: {json.dumps(c)}" for c in chunks] + ["", "data: [DONE]"]
    for stream in (chunks, lines):
        turn = turn_from_response(r3kit.collect_stream(stream), card=CARD)
        assert turn.tokens == prompt + gen and len(turn.routed_experts) == 14
        assert turn.logprobs == pytest.approx(turn_from_response(response(full)).logprobs)
    with pytest.raises(AbortedChoiceError, match="stream ended"):  # cut before the last chunk
        turn_from_response(r3kit.collect_stream(chunks[:-1]))
    with pytest.raises(R3Error, match="arrived twice"):
        r3kit.collect_stream(chunks + chunks[-1:])
    with pytest.raises(R3Error, match="stream failed: boom"):
        r3kit.collect_stream(chunks[:2] + ['data: {"error": {"message": "boom"}}'])


# ----------------------------------------------------------------------------- clear errors


def test_a_response_without_routed_experts():
    c = choice([1, 2, 3], [4])
    with pytest.raises(MissingRoutedExpertsError, match="null: the server runs with routed experts off"):
        turn_from_response(response(c | {"routed_experts": None}))
    del c["routed_experts"]
    with pytest.raises(MissingRoutedExpertsError, match="absent"):
        turn_from_response(response(c))
    with pytest.raises(R3Error, match="error: bad model"):
        turn_from_response({"error": {"message": "bad model"}})


def test_rows_that_do_not_match_the_tokens():
    prompt, gen = list(range(20)), [1, 2, 3]
    c = choice(prompt, gen)
    with pytest.raises(MissingTokenIdsError, match="return_token_ids"):
        turn_from_response(response(c | {"token_ids": None}))
    # one row too many (a client counting the last sampled token), a truncated token list, the wrong start
    for bad in (c | {"routed_experts": encode_npy_b64(routing(range(23)))}, c | {"token_ids": gen[:2]}):
        with pytest.raises(RowMismatchError, match=r"need \d+ rows"):
            turn_from_response(response(bad))
    cut = choice(prompt, gen, ps=5)
    with pytest.raises(RowMismatchError, match="fit routed_experts_prompt_start=5"):
        turn_from_response(response(cut))
    assert turn_from_response(response(cut), prompt_start=5).first_position == 5
    with pytest.raises(RowMismatchError, match="must be in 0..19"):
        turn_from_response(response(c), prompt_start=20)
    with pytest.raises(RowMismatchError, match=r"needs \(rows, 5 layers, top_k 4\)"):
        turn_from_response(response(c), card=ModelCard(num_hidden_layers=5, moe_layers=(1,), num_experts=E, top_k=K))
    with pytest.raises(RowMismatchError, match="logprobs for 3 generated"):
        turn_from_response(response(c | {"logprobs": {"token_logprobs": [-1.0]}}))


def test_a_model_with_dense_layers():
    c = choice(list(range(8)), [1, 2])
    turn = turn_from_response(response(c))
    with pytest.raises(DenseLayerError, match="dense ones included"):
        turn.moe_routed_experts()  # no card: never guess which layers route
    conv = Conversation()
    conv.add(response(c))
    with pytest.raises(DenseLayerError, match="needs the model card"):
        build_batch([conv])
    # a card that says layer 1 is dense while the response routes there: another model's card
    wrong = ModelCard(num_hidden_layers=L, moe_layers=(2, 3), num_experts=E, top_k=K)
    with pytest.raises(DenseLayerError, match=r"layers \[1\], which the model card lists as dense"):
        turn_from_response(response(c), card=wrong)
    with pytest.raises(DenseLayerError, match="no MoE layers"):
        ModelCard(num_hidden_layers=2, moe_layers=(), num_experts=E, top_k=K)
    with pytest.raises(R3Error, match="not a moe-serve card"):
        ModelCard.from_dict({"id": "x", "num_hidden_layers": 2})


def test_n_greater_than_one():
    a, b = choice(list(range(8)), [1, 2]), choice(list(range(8)), [3, 4, 5], seed=1)
    resp = response(a, b)
    with pytest.raises(MultipleChoicesError, match="2 choices .n > 1"):
        turn_from_response(resp)
    with pytest.raises(MultipleChoicesError, match="2 choices"):
        Conversation(CARD).add(resp)
    turns = r3kit.turns_from_response(resp, card=CARD)
    assert [t.token_ids for t in turns] == [[1, 2], [3, 4, 5]]
    assert turn_from_response(resp, choice=1).token_ids == [3, 4, 5]
    conv = Conversation(CARD)
    conv.add(resp, choice=1)
    assert conv.tokens == list(range(8)) + [3, 4, 5]


def test_truncated_and_aborted_choices():
    c = choice(list(range(8)), [1, 2, 3])
    with pytest.raises(TruncatedChoiceError, match="finish_reason 'length'"):
        turn_from_response(response(c | {"finish_reason": "length"}))
    assert turn_from_response(response(c | {"finish_reason": "length"}), allow_truncated=True).finish_reason == "length"
    with pytest.raises(AbortedChoiceError, match="aborted"):
        turn_from_response(response(c | {"finish_reason": "abort"}))
    with pytest.raises(AbortedChoiceError, match="aborted"):
        Conversation(CARD).add(response(c | {"finish_reason": "abort"}))
    assert turn_from_response(response(c | {"finish_reason": "abort"}), allow_aborted=True).token_ids == [1, 2, 3]


# ----------------------------------------------------------------------------- stitching


def three_turns(conv: Conversation, seed=0, prompt_starts=None) -> list[int]:
    """Three turns, each prompt = the conversation + new tokens, each asking for the rows it lacks."""
    new = [list(range(100, 113)), [200, 201, 202], [210, 211]]
    gens = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
    for t in range(3):
        prompt = conv.next_prompt(new[t])
        ps = conv.prompt_start if prompt_starts is None else prompt_starts[t]
        if t:
            assert conv.request_fields() == {"routed_experts_prompt_start": conv.prompt_start, "return_token_ids": True}
        conv.add(response(choice(prompt, gens[t], ps, seed=seed, endpoint=("chat", "completions", "generate")[t])),
                 prompt_start=ps)
    return gens


def test_three_turns_stitch_to_the_whole_conversations_rows():
    conv = Conversation(CARD)
    gens = three_turns(conv)
    N = len(conv.tokens)
    assert N == 13 + 5 + 3 + 3 + 2 + 4
    np.testing.assert_array_equal(conv.routed_experts, routing(range(N - 1)))  # the whole conversation at once
    assert conv.prompt_start == N - 1
    # the boundary rows (each turn's last sampled token) came from the next turn's rows
    assert [t.prompt_start for t in conv.turns] == [0, 17, 23]
    gen_positions = np.flatnonzero(conv.generated_mask)
    assert [conv.tokens[p] for p in gen_positions] == sum(gens, [])
    assert np.isnan(conv.logprobs[~conv.generated_mask]).all() and not np.isnan(conv.logprobs[gen_positions]).any()
    # a turn that re-sends held rows (smaller prompt_start): held rows are kept, differences counted
    again = Conversation(CARD)
    three_turns(again, prompt_starts=[0, 10, 0])
    np.testing.assert_array_equal(again.routed_experts, conv.routed_experts)
    assert again.overlap_differences == [0, 0, 0]
    other = Conversation(CARD)
    prompt = other.next_prompt(list(range(100, 113)))
    other.add(response(choice(prompt, [1, 2, 3, 4, 5])))
    other.add(response(choice(other.next_prompt([200, 201]), [6], 4, seed=9)), prompt_start=4)
    assert other.overlap_differences == [0, 13]  # another forward's rows for 4..16: the held ones stay
    np.testing.assert_array_equal(other.routed_experts[:17], routing(range(17)))
    # save / load
    loaded = Conversation.from_dict(json.loads(json.dumps(conv.to_dict())))
    assert loaded.tokens == conv.tokens and loaded.card == CARD and loaded.weight_version == "w0"
    np.testing.assert_array_equal(loaded.routed_experts, conv.routed_experts)
    np.testing.assert_array_equal(loaded.logprobs, conv.logprobs)


def test_stitching_refuses_what_is_not_the_same_conversation():
    conv = Conversation(CARD)
    prompt = conv.next_prompt(list(range(100, 110)))
    conv.add(response(choice(prompt, [1, 2, 3])))
    # a history rendered again by a chat template (tokens differ inside it)
    bad_prompt = conv.tokens[:5] + [99] + conv.tokens[6:] + [300]
    with pytest.raises(StitchError, match="differs at position 5 of 13"):
        conv.add(response(choice(bad_prompt, [4], conv.prompt_start)))
    # a gap: the request skipped the boundary row (the previous turn's last token), as a stitcher that pads it
    nxt = conv.next_prompt([300])
    with pytest.raises(StitchError, match=r"positions 12..12 would have no routing"):
        conv.add(response(choice(nxt, [4], conv.prompt_start + 1)), prompt_start=conv.prompt_start + 1)
    # the rows of another prompt start than the conversation asked for
    with pytest.raises(RowMismatchError, match="fit routed_experts_prompt_start=0"):
        conv.add(response(choice(nxt, [4], 0)))
    # another policy's turn
    with pytest.raises(StitchError, match="served by weights 'w1'"):
        conv.add(response(choice(nxt, [4], conv.prompt_start) | {"weight_version": "w1"}))
    mixed = Conversation(CARD, allow_mixed_weight_versions=True)
    mixed.add(response(choice(prompt, [1, 2, 3])))
    mixed.add(response(choice(nxt, [4], mixed.prompt_start) | {"weight_version": "w1"}))
    assert len(conv.turns) == 1  # nothing was half-added by the refused turns
    assert conv.tokens == prompt + [1, 2, 3] and conv.prompt_start == 12


# ----------------------------------------------------------------------------- trainer batch, Megatron


def test_trainer_batch_sentinels_masks_and_dense_layers():
    long, short = Conversation(CARD), Conversation(CARD)
    three_turns(long)
    short.add(response(choice(list(range(50, 56)), [1, 2, 3], seed=3)))
    batch = build_batch([long, short], pad_token_id=0)
    N, n = len(long.tokens), len(short.tokens)
    assert batch.routed_experts.shape == (2, N, 3, K) and batch.routed_experts.dtype == np.int16
    assert batch.layers == (1, 2, 3) and batch.moe_layers == (1, 2, 3)
    np.testing.assert_array_equal(batch.routed_experts[0, : N - 1], long.routed_experts[:, 1:])
    assert (batch.routed_experts[0, N - 1] == MISSING_ROUTE).all()  # the last sampled token: no row
    assert (batch.routed_experts[1, n - 1 :] == MISSING_ROUTE).all()  # and the padding
    np.testing.assert_array_equal(batch.route_mask.sum(1), [N - 1, n - 1])
    np.testing.assert_array_equal(batch.attention_mask.sum(1), [N, n])
    np.testing.assert_array_equal(batch.loss_mask[0], long.generated_mask)
    assert batch.loss_mask[1].sum() == 3 and not batch.loss_mask[1, n:].any()
    np.testing.assert_allclose(batch.rollout_logprobs[1, n - 3 : n], [-0.5, -0.51, -0.52])
    assert (batch.input_ids[1, n:] == 0).all() and batch.input_ids[1, :n].tolist() == short.tokens
    np.testing.assert_array_equal(batch.layer_routes(2), batch.routed_experts[:, :, 1])
    with pytest.raises(DenseLayerError):
        batch.layer_routes(0)

    every = build_batch([long, short], layers="all", pad_to=N + 3)
    assert every.routed_experts.shape == (2, N + 3, L, K) and every.dense_layers == (0,)
    assert (every.routed_experts[:, :, 0] == DENSE_LAYER).all()  # never expert 0
    np.testing.assert_array_equal(every.routed_experts[:, :N, 1:], batch.routed_experts)
    with pytest.raises(R3Error, match="Conversation.truncate"):
        build_batch([long], pad_to=N - 1)
    cut = long.truncate(20)
    assert cut.tokens == long.tokens[:20] and len(cut.routed_experts) == 19
    np.testing.assert_array_equal(build_batch([cut]).routed_experts[0, :19], batch.routed_experts[0, :19])


def test_megatron_router_replay_export():
    a, b = Conversation(CARD), Conversation(CARD)
    three_turns(a)
    b.add(response(choice(list(range(50, 56)), [1, 2, 3], seed=3)))
    batch = build_batch([a, b])
    B, S = batch.input_ids.shape
    for layout in ("sbh", "bsh", "thd"):
        data = batch.megatron_replay_data(layout=layout)
        assert len(data) == 3  # one per MoE layer, dense layer 0 dropped
        for m, arr in enumerate(data):
            assert arr.dtype == np.int64 and arr.shape[1] == K
            assert ((arr >= 0) & (arr < E)).all()  # valid ids everywhere (stock RouterReplay gathers them)
            grid = batch.routed_experts[:, :, m]
            if layout == "sbh":  # Megatron's [s, b, h] flattening: token s * B + b
                assert arr.shape[0] == S * B
                np.testing.assert_array_equal(arr[3 * B + 1], grid[1, 3])
                np.testing.assert_array_equal(arr[(len(a.tokens) - 2) * B], grid[0, len(a.tokens) - 2])
            elif layout == "bsh":
                np.testing.assert_array_equal(arr.reshape(B, S, K)[batch.route_mask], grid[batch.route_mask])
            else:  # packed: each sequence's own tokens
                assert arr.shape[0] == len(a.tokens) + len(b.tokens)
                np.testing.assert_array_equal(arr[len(a.tokens) + 2], grid[1, 2])
            without_row = B if layout == "thd" else int((~batch.route_mask).sum())  # last tokens (and padding)
            assert (arr == np.arange(K)).all(-1).sum() >= without_row
    kept = batch.megatron_replay_data(layout="thd", fill_missing="keep")
    assert (kept[0][len(a.tokens) - 1] == MISSING_ROUTE).all()
    every = build_batch([a, b], layers="all")
    assert len(every.megatron_replay_data()) == 3  # dense layers never exported
    for x, y in zip(every.megatron_replay_data(), batch.megatron_replay_data()):
        np.testing.assert_array_equal(x, y)
