"""The training-inference mismatch of rollouts served by moe-serve, with and without routing replay.

For the generated tokens of each conversation: the server's logprob (what the rollout sampled under) against the
transformers model's logprob of the same token on the same tokens, once routing as its own routers choose and once
under :func:`r3kit.hf_replay.replay_routing`. Reported per token: mean and max ``|logprob difference|`` and the KL
estimate RL frameworks log (k3: ``exp(d) - 1 - d`` with ``d = logp_trainer - logp_rollout``, an unbiased estimate of
``KL(rollout || trainer)`` on the rollout's own samples), and how often the trainer's own routers choose another
expert set than the rollout did.

    python -m r3kit.mismatch --model CHECKPOINT_DIR --conversations conv1.json conv2.json [--dtype bfloat16]

(conversations saved with ``Conversation.save``; the checkpoint is the one the server serves.)
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from .batch import TrainerBatch, build_batch
from .conversation import Conversation
from .hf_replay import capture_routing, replay_routing


def sequence_logprobs(model, batch: TrainerBatch, *, replay: bool, on_missing: str = "live") -> torch.Tensor:
    """float32 ``[B, S]``: position s holds log p(token s | tokens before it); position 0 holds 0. Under
    ``replay`` the routers are forced to the batch's routes. Differentiable (call under ``torch.no_grad()`` to
    measure only)."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(batch.input_ids, device=device)
    mask = torch.as_tensor(batch.attention_mask, device=device)
    if replay:
        with replay_routing(model, batch, on_missing=on_missing):
            logits = model(input_ids=ids, attention_mask=mask).logits
    else:
        logits = model(input_ids=ids, attention_mask=mask).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(logp, (1, 0))


def _stats(d: np.ndarray) -> dict:
    if not d.size:
        return {"mean_abs": 0.0, "max_abs": 0.0, "kl_k3": 0.0}
    return {"mean_abs": float(np.abs(d).mean()), "max_abs": float(np.abs(d).max()),
            "kl_k3": float(np.mean(np.expm1(d) - d))}


@torch.no_grad()
def measure_mismatch(model, batch: TrainerBatch) -> dict:
    """Mismatch of ``batch``'s rollout logprobs against ``model``, without and with replay (see the module)."""
    with capture_routing(model) as own:
        free = sequence_logprobs(model, batch, replay=False).cpu().numpy()
    replayed = sequence_logprobs(model, batch, replay=True).cpu().numpy()
    gen = batch.loss_mask & ~np.isnan(batch.rollout_logprobs)
    rollout = batch.rollout_logprobs[gen].astype(np.float64)
    B, S = batch.input_ids.shape
    flips = np.zeros((B, S), dtype=np.int64)
    for i, layer in enumerate(batch.layers):
        if layer in batch.dense_layers:
            continue
        mine = np.sort(own.ids[layer].cpu().numpy().reshape(B, S, -1), -1)
        theirs = np.sort(batch.routed_experts[:, :, i].astype(np.int64), -1)
        flips += (mine != theirs).any(-1) & batch.route_mask
    n_moe = len(batch.layers) - len(batch.dense_layers)
    rows = int(batch.route_mask.sum())
    return {
        "sequences": int(B),
        "generated_tokens": int(gen.sum()),
        "routed_positions": rows,
        "router_flips": float(flips.sum() / max(1, rows * n_moe)),  # (position, MoE layer) pairs with another set
        "positions_with_flip": float((flips > 0).sum() / max(1, rows)),
        "without_replay": _stats(free[gen].astype(np.float64) - rollout),
        "with_replay": _stats(replayed[gen].astype(np.float64) - rollout),
    }


def load_conversations(paths) -> list[Conversation]:
    """Conversations from files: one saved conversation, a JSON list of them, or JSON lines."""
    out = []
    for path in paths:
        text = open(path).read().strip()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        out += [Conversation.from_dict(d) for d in (data if isinstance(data, list) else [data])]
    return out


def load_model(path: str, dtype: str = "auto", attn_implementation: str | None = None,
               experts_implementation: str | None = "eager"):
    """The transformers model of ``path`` in ``dtype`` (``auto``: the checkpoint's), eval mode."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype if dtype == "auto" else getattr(torch, dtype)}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if experts_implementation:
        kwargs["experts_implementation"] = experts_implementation
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def format_report(r: dict) -> str:
    w, wr = r["without_replay"], r["with_replay"]
    return (f"{r['sequences']} conversations, {r['generated_tokens']} generated tokens; trainer routers chose "
            f"another expert set in {100 * r['router_flips']:.2f}% of (position, MoE layer) pairs, "
            f"{100 * r['positions_with_flip']:.1f}% of positions\n"
            f"  without replay: mean |dlogp| {w['mean_abs']:.3g}, max {w['max_abs']:.3g}, KL(k3) {w['kl_k3']:.3g}\n"
            f"  with replay:    mean |dlogp| {wr['mean_abs']:.3g}, max {wr['max_abs']:.3g}, KL(k3) {wr['kl_k3']:.3g}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m r3kit.mismatch", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the checkpoint the server serves (Hugging Face directory)")
    p.add_argument("--conversations", nargs="+", required=True,
                   help="files from Conversation.save (one JSON object), or JSON lists / JSON lines of them")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16")
    p.add_argument("--attn-implementation", default=None, help="transformers' attention (default: its own)")
    p.add_argument("--json", default=None, help="also write the report to this file")
    args = p.parse_args(argv)
    convs = load_conversations(args.conversations)
    model = load_model(args.model, args.dtype, args.attn_implementation)
    report = measure_mismatch(model, build_batch(convs))
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
