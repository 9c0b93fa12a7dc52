#!/usr/bin/env python
"""Training-inference mismatch of moe-serve rollouts, with and without r3kit's routing replay, for every family.

For each family (a tiny checkpoint transformers writes, as in tests/unit/hf_checkpoints.py) and each serving dtype:
start ``moe-serve --dtype D``, run C multi-turn conversations at once (temperature 1, T turns each, later turns on
token ids with ``routed_experts_prompt_start``, prefix cache on), stitch them with r3kit, save them, stop the
server, and compare the server's logprobs of the generated tokens with the transformers model's (same checkpoint,
same dtype, the whole conversation in one forward, as a trainer computes them) without and with replay
(``r3kit.mismatch.measure_mismatch``). The ``float32 + forced`` setting has the float32 server score the same
conversations under another routing (``replay_routed_experts`` with a share of the (position, layer) cells changed,
as rollout and trainer engines disagree): routing is then the only difference.

    .venv/bin/python loadtest/bench/r3_mismatch.py --out loadtest/reports/r3_mismatch.md   # ~6 min on 2 CPU cores
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "backends"))

import numpy as np  # noqa: E402

import r3kit  # noqa: E402


def run_conversation(client, model: str, card, seed: int, turns: int, max_tokens: int, vocab: int):
    rng = np.random.default_rng(seed)
    conv = r3kit.Conversation(card)
    for t in range(turns):
        new = rng.integers(3, vocab, 24 if t == 0 else 8).tolist()
        r = client.completions.create(
            model=model, prompt=conv.next_prompt(new), max_tokens=max_tokens, temperature=1.0, seed=seed * 100 + t,
            logprobs=0, extra_body={"ignore_eos": True, **conv.request_fields()})
        conv.add(r, allow_truncated=True)  # tiny random models never stop on their own
    return conv


def forced_copy(client, model: str, conv: r3kit.Conversation, fraction: float, seed: int) -> r3kit.Conversation:
    """The conversation as the server scores it under another routing (a share of the cells changed)."""
    card = conv.card
    rng = np.random.default_rng(seed)
    forced = conv.routed_experts.astype(np.int64).copy()
    for p in range(len(forced)):
        for layer in card.moe_layers:
            if rng.random() < fraction:
                row = forced[p, layer]
                row[rng.integers(card.top_k)] = rng.choice([e for e in range(card.num_experts) if e not in row])
    r = client.completions.create(model=model, prompt=conv.tokens, max_tokens=1, temperature=0,
                                  extra_body={"replay_routed_experts": r3kit.encode_array(forced),
                                              "prompt_logprobs": 0, "return_token_ids": True})
    scored = r.choices[0].model_dump()
    d = conv.to_dict()
    n = len(conv.tokens)
    d["routed_experts"] = r3kit.encode_array(r3kit.decode_array(scored["routed_experts"])[: n - 1])
    d["logprobs"] = [scored["prompt_logprobs"][p][str(tok)]["logprob"] if gen else None
                     for p, (tok, gen) in enumerate(zip(conv.tokens, conv.generated_mask))]
    return r3kit.Conversation.from_dict(d)


def serve_and_roll_out(arch, ckpt, dtype, args, log_dir, forced_fraction):
    import openai

    from openai_frontend.server_process import start_server

    server = start_server(log_dir, ["--model", str(ckpt), "--served-model-name", arch, "--dtype", dtype,
                                    "--max-model-len", "256"], model_name=arch)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
        card = r3kit.ModelCard.fetch(server.base_url)
        vocab = json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"]
        with concurrent.futures.ThreadPoolExecutor(args.conversations) as pool:  # rollouts batch together
            convs = list(pool.map(lambda s: run_conversation(client, arch, card, s, args.turns, args.max_tokens, vocab),
                                  range(args.conversations)))
        forced = ([forced_copy(client, arch, c, forced_fraction, i) for i, c in enumerate(convs)]
                  if forced_fraction else None)
        return convs, forced
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="all", help="comma list of model types, or all")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--forced-fraction", type=float, default=0.1,
                    help="share of (position, MoE layer) cells changed in the float32 + forced setting (0: skip)")
    ap.add_argument("--out", default=None, help="write the markdown table here (and the numbers beside, .json)")
    ap.add_argument("--keep", default=None, help="directory to keep checkpoints and conversations in")
    args = ap.parse_args()

    import torch

    from r3kit.mismatch import load_model, measure_mismatch
    from tests.unit.hf_checkpoints import ARCHS, write_servable_checkpoint

    torch.set_num_threads(1)
    families = list(ARCHS) if args.families == "all" else args.families.split(",")
    work = Path(args.keep or tempfile.mkdtemp(prefix="r3_mismatch_"))
    rows = []
    for arch in families:
        ckpt = work / arch
        if not (ckpt / "config.json").exists():
            write_servable_checkpoint(arch, ckpt)
        for dtype in args.dtypes.split(","):
            t0 = time.time()
            fraction = args.forced_fraction if dtype == "float32" else 0.0
            convs, forced = serve_and_roll_out(arch, ckpt, dtype, args, work, fraction)
            for i, c in enumerate(convs):
                c.save(work / f"{arch}-{dtype}-{i}.json")
            model = load_model(str(ckpt), dtype)
            settings = [(dtype, convs)] + ([(f"{dtype} + {int(100 * fraction)}% forced", forced)] if forced else [])
            for name, cs in settings:
                report = measure_mismatch(model, r3kit.build_batch(cs))
                rows.append({"family": arch, "setting": name, **report})
                print(f"{arch:12s} {name:22s} {r3kit.mismatch.format_report(report)}  ({time.time() - t0:.0f} s)",
                      flush=True)
    table = format_table(rows, args)
    print(table)
    if args.out:
        Path(args.out).write_text(table)
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=2))


def format_table(rows, args) -> str:
    head = ("| family | rollout served in | router flips | positions with a flip | without replay: mean / max "
            "abs dlogp, KL k3 | with replay: mean / max abs dlogp, KL k3 |\n|---|---|---:|---:|---|---|\n")
    lines = []
    for r in rows:
        w, wr = r["without_replay"], r["with_replay"]
        lines.append(f"| {r['family']} | {r['setting']} | {100 * r['router_flips']:.2f}% | "
                     f"{100 * r['positions_with_flip']:.1f}% | {w['mean_abs']:.1e} / {w['max_abs']:.1e}, "
                     f"{w['kl_k3']:.1e} | {wr['mean_abs']:.1e} / {wr['max_abs']:.1e}, {wr['kl_k3']:.1e} |")
    n = rows[0]["generated_tokens"] if rows else 0
    return (head + "\n".join(lines) + f"\n\n{args.conversations} conversations x {args.turns} turns x "
            f"{args.max_tokens} sampled tokens ({n} generated tokens per setting), run at once against one server.\n")


if __name__ == "__main__":
    main()
