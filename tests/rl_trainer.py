"""A stand-in RL trainer for the weight-update tests: it pushes a checkpoint's tensors into a serving engine over a
torch.distributed broadcast, the way slime / verl push theirs into SGLang (trainer = rank 0, gloo on CPU).

Run as a process of its own (the engine needs a peer in another process):

    python -m tests.rl_trainer --checkpoint DIR --port P [--server URL --api-key KEY] [--wrong-shape NAME]

Without ``--server`` it only joins the group and broadcasts ``checkpoint_tensors(DIR)`` in order (the test that
starts it drives the engine itself); with ``--server`` it also makes the two HTTP calls a trainer makes
(/init_weights_update_group while joining, /update_weights_from_distributed while broadcasting) and prints
their JSON answers, one per line.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

GROUP = "weight_update_group"


def checkpoint_tensors(path) -> list:
    """Every tensor of a safetensors checkpoint directory as sorted (name, tensor) pairs: the trainer's payload,
    in its order."""
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return sorted(out.items())


def announce(tensors, wrong_shape: str | None = None) -> dict:
    """The names / dtypes / shapes body of update_weights_from_distributed (optionally lying about one shape)."""
    shapes = [list(t.shape) if n != wrong_shape else [s + 1 for s in t.shape] for n, t in tensors]
    return {"names": [n for n, _ in tensors], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": shapes}


def post(url: str, path: str, body: dict, api_key: str | None) -> dict:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return {"status": r.status, **json.loads(r.read())}
    except urllib.error.HTTPError as e:
        return {"status": e.code, **json.loads(e.read())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--server", default=None, help="moe-serve root URL: also make the HTTP calls")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--wrong-shape", default=None, help="announce this tensor with a wrong shape")
    ap.add_argument("--weight-version", default=None)
    args = ap.parse_args(argv)

    import torch.distributed as dist

    from moe_engine.rl.weights import init_update_process_group

    tensors = checkpoint_tensors(args.checkpoint)
    answers: list[dict] = []

    def call(path, body):
        answers.append(post(args.server, path, body, args.api_key))

    http = None
    if args.server:
        body = {"master_address": "127.0.0.1", "master_port": args.port, "rank_offset": 1, "world_size": 2,
                "group_name": GROUP, "backend": "gloo"}
        http = threading.Thread(target=call, args=("/init_weights_update_group", body))
        http.start()
    group = init_update_process_group("gloo", "127.0.0.1", args.port, 0, 2, GROUP, timeout_s=120)
    if http is not None:
        http.join()
        body = {**announce(tensors, args.wrong_shape), "group_name": GROUP, "weight_version": args.weight_version}
        http = threading.Thread(target=call, args=("/update_weights_from_distributed", body))
        http.start()
    for _, t in tensors:
        dist.broadcast(t.contiguous(), src=0, group=group)
    if http is not None:
        http.join()
    for a in answers:
        print(json.dumps(a), flush=True)
    dist.destroy_process_group(group)  # a gloo group left to interpreter shutdown can abort the process
    return 0


if __name__ == "__main__":
    sys.exit(main())
