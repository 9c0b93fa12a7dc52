#!/usr/bin/env python
"""Weight update benchmark (issue 20): an in-place update of a running engine vs restarting moe-serve.

CPU mode (default; the medium load-test model, loadtest/bench/common.py): a real moe-serve on checkpoint A, and
  restart      launch to /health = 200, and SIGTERM to exit (what a restart costs, twice each)
  disk         POST /update_weights_from_disk, alternating B and A (B: A's tensors with noise, same shapes)
  broadcast    /init_weights_update_group + /update_weights_from_distributed with a trainer process (this script,
               --role trainer) broadcasting B's tensors over gloo, as slime / verl do with SGLang
  lifecycle    /flush_cache, /pause_generation + /continue_generation, /release + /resume_memory_occupation
After each update a greedy request checks the new weights serve (its weight_version is the one just set).

GPU mode (--device cuda; the real shape, Qwen3-30B-A3B: 48 layers, 128 experts top-8, 30.5 B parameters, random
bf16 weights built on the GPU as bench_real_shape.py does; no 61 GB checkpoint: the machine's disk is 64 GB)
drives the engine in-process (no server), through the same control channel the server uses:
  broadcast    update_weights_from_distributed of all 61 GB from a trainer process on a second GPU over NCCL
               (two rounds: the first includes NCCL's connection set-up), checked by checksums of a few tensors.
               NCCL cannot put two ranks on one GPU: with one GPU this part is skipped (run on nvidia-h200-x2).
  disk         a checkpoint of the real widths but --disk-layers layers (Hub layout: per-expert tensors, bf16),
               written to local disk, then read from the page cache into a model of that shape in place
               (check_checkpoint + load_checkpoint, what update_weights_from_disk runs); the 61 GB figure is
               extrapolated from the measured rate and said to be.
  release      release_memory_occupation (KV cache + weights to host memory) and resume, GPU memory before/after
  restart      not run (no checkpoint): estimated as loading 61 GB at the measured disk rate + engine set-up
               (measured: Engine() with its KV cache) + server start (the CPU mode's figure)
A short greedy generation before and after the updates shows the engine serves (CUDA graphs captured before an
in-place update stay valid: same addresses).

Usage:
    .venv/bin/python loadtest/bench/bench_weight_update.py                      # CPU, about 2 minutes
    python loadtest/bench/bench_weight_update.py --device cuda --out $OUT/wu    # H200 (x2 for NCCL), under 4 minutes
Results: a markdown table on stdout and results.json in --out (default loadtest/results/weight_update-<time>/).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backends"))
sys.path.insert(0, str(REPO))  # the repo root: loadtest.* when run by path
T0 = time.perf_counter()
GROUP = "weight_update_group"

QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B config.json (the fields the engine reads)
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}


# --simulate: the GPU mode's code path on the CPU (gloo), on a small model of the same architecture.
SIMULATED = {**QWEN3_30B_A3B, "bos_token_id": 1, "eos_token_id": 2, "head_dim": 64, "hidden_size": 256,
             "intermediate_size": 512, "moe_intermediate_size": 128, "num_attention_heads": 4, "num_experts": 16,
             "num_experts_per_tok": 4, "num_hidden_layers": 48, "num_key_value_heads": 2, "vocab_size": 1024}


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn, *a, **kw):
    t = time.perf_counter()
    out = fn(*a, **kw)
    return time.perf_counter() - t, out


def med(xs) -> float:
    return round(statistics.median(xs), 4)


# ----------------------------------------------------------------------------- trainer role (both modes)


def trainer(args) -> int:
    """Rank 0 of the update group: broadcast tensors (CPU: a checkpoint's, GPU: a random model's) --rounds times."""
    import torch
    import torch.distributed as dist

    from moe_engine.rl.weights import init_update_process_group

    if args.checkpoint:  # CPU: the checkpoint's tensors by their (Hub) names, over gloo, with the HTTP calls
        from safetensors.torch import load_file

        tensors: dict = {}
        for f in sorted(Path(args.checkpoint).glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        tensors = sorted(tensors.items())
        backend = "gloo"
    else:  # GPU: the real shape's parameters, random (seed 2), on --trainer-device
        device = torch.device(args.trainer_device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        model = build_model(SIMULATED if args.simulate else QWEN3_30B_A3B, device, seed=2)
        tensors = list(model.named_parameters())
        backend = "nccl" if device.type == "cuda" else "gloo"
    answers: list[dict] = []

    def call(path: str, body: dict) -> threading.Thread:  # the HTTP call runs while this rank joins / sends
        th = threading.Thread(target=lambda: answers.append(post(args.server, path, body)))
        th.start()
        return th

    http = None
    if args.server:
        http = call("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": args.port,
                                                   "rank_offset": 1, "world_size": 2, "group_name": GROUP,
                                                   "backend": backend})
    group = init_update_process_group(backend, "127.0.0.1", args.port, 0, 2, GROUP, timeout_s=300)
    if http is not None:
        http.join()
    for r in range(args.rounds):
        if args.server:
            http = call("/update_weights_from_distributed", {
                "names": [n for n, _ in tensors], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors], "group_name": GROUP, "weight_version": f"bcast-{r}"})
        t0 = time.perf_counter()
        for _, t in tensors:
            dist.broadcast(t.data, src=0, group=group)
        if not args.checkpoint and torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        if http is not None:
            http.join()
        print(json.dumps({"round": r, "broadcast_s": seconds}), flush=True)
    if not args.checkpoint:
        print(json.dumps({"checksums": checksums(dict(tensors))}), flush=True)
    dist.destroy_process_group(group)
    print(json.dumps({"answers": answers}), flush=True)
    return 0


def checksums(params: dict) -> dict:
    names = [n for n in params if n.endswith(("embed_tokens.weight", "layers.0.mlp.experts.gate_up_proj",
                                              "layers.47.mlp.experts.down_proj", "lm_head.weight"))]
    return {n: float(params[n].float().sum()) for n in names}


def post(url: str, path: str, body: dict | None = None) -> dict:
    from loadtest.bench.common import http_json

    t = time.perf_counter()
    out = http_json(url + path, body if body is not None else {}, timeout=600)
    return {**out, "seconds": time.perf_counter() - t}


# ----------------------------------------------------------------------------- CPU: a real server


def cpu_mode(args) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    from loadtest.bench.common import http_json, resolve_model
    from openai_frontend.server_process import start_server

    a_path, name = resolve_model("medium")
    b_path = Path(a_path).with_name(Path(a_path).name + "-B")
    if not (b_path / "config.json").exists():  # A's tensors plus noise: another policy of the same model
        b_path.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(7)
        for f in Path(a_path).iterdir():
            if f.suffix != ".safetensors":
                (b_path / f.name).write_bytes(f.read_bytes())
        for f in Path(a_path).glob("*.safetensors"):
            tensors = {k: v + 0.05 * v.float().std() * torch.randn(v.shape, generator=g).to(v.dtype)
                       for k, v in load_file(str(f)).items()}
            save_file(tensors, str(b_path / f.name), metadata={"format": "pt"})
    size = sum(f.stat().st_size for f in Path(a_path).glob("*.safetensors"))
    out_dir = Path(args.out)
    res: dict = {"model": name, "checkpoint_bytes": size, "restart_start_s": [], "restart_stop_s": []}
    flags = ["--model", a_path, "--max-model-len", "512"]

    def gen(root) -> dict:
        body = {"model": name, "token_ids": list(range(5, 45)), "sampling_params": {"max_tokens": 8,
                                                                                    "temperature": 0}}
        return http_json(root + "/inference/v1/generate", body)["choices"][0]

    for i in range(args.restarts):
        t, server = timed(start_server, out_dir, flags, model_name=name)
        gen(server.root_url)
        res["restart_start_s"].append(t)
        res["restart_stop_s"].append(timed(server.stop)[0])
        log(f"restart {i}: start {t:.1f} s")
    server = start_server(out_dir, flags, model_name=name)
    root = server.root_url
    try:
        disk = []
        for i in range(args.reps):
            ckpt = b_path if i % 2 == 0 else Path(a_path)
            answer = post(root, "/update_weights_from_disk", {"model_path": str(ckpt)})
            assert answer["success"], answer
            assert gen(root)["weight_version"] == ckpt.name
            disk.append(answer["seconds"])
        res["disk_update_s"] = disk
        log(f"disk update: median {med(disk)} s")
        port = free_port()
        proc = subprocess.run([sys.executable, __file__, "--role", "trainer", "--checkpoint", str(b_path),
                               "--port", str(port), "--server", root, "--rounds", str(args.reps)],
                              capture_output=True, text=True, timeout=600)
        lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
        answers = lines[-1]["answers"]
        assert proc.returncode == 0 and all(a["success"] for a in answers), proc.stderr[-2000:]
        res["broadcast_update_s"] = [a["seconds"] for a in answers if "received" in a["message"]]
        res["init_group_s"] = [a["seconds"] for a in answers if "joined" in a["message"]]
        assert gen(root)["weight_version"] == f"bcast-{args.reps - 1}"
        log(f"broadcast update: median {med(res['broadcast_update_s'])} s")
        for path, body in (("/flush_cache", {}), ("/pause_generation", {"mode": "retract"}),
                           ("/continue_generation", {}), ("/release_memory_occupation", {}),
                           ("/resume_memory_occupation", {})):
            res[path.strip("/") + "_s"] = med([post(root, path, body)["seconds"] for _ in range(3)])
        assert gen(root)["finish_reason"] == "length"
    finally:
        server.stop()
    res["summary"] = {
        "restart (start + stop), s": med([a + b for a, b in zip(res["restart_start_s"], res["restart_stop_s"])]),
        "update from disk, s": med(res["disk_update_s"]),
        "update by gloo broadcast, s": med(res["broadcast_update_s"]),
        "flush / pause / continue / release / resume, s": [res[k] for k in (
            "flush_cache_s", "pause_generation_s", "continue_generation_s", "release_memory_occupation_s",
            "resume_memory_occupation_s")],
    }
    return res


# ----------------------------------------------------------------------------- GPU: the real shape in-process


def build_model(raw: dict, device, seed: int, layers: int | None = None):
    """MoEForCausalLM of ``raw`` (optionally fewer layers) with random bf16 weights filled on ``device``."""
    import torch

    from moe_engine.config import config_from_dict
    from moe_engine.models.decoder import MoEForCausalLM

    cfg = config_from_dict({**raw, **({"num_hidden_layers": layers} if layers else {})})
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    model.to(torch.bfloat16).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 if "embed_tokens" in name else 0.02, generator=gen)
    model.init_buffers(device)
    return model.eval()


def hub_tensors(model) -> dict:
    """The Hub layout of a Qwen3-MoE model's parameters (per-expert tensors), on the host."""
    out = {}
    for name, p in model.named_parameters():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, I = name[: -len("gate_up_proj")], p.shape[1] // 2
            for e in range(p.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = p[e, :I].contiguous().cpu()
                out[f"{prefix}{e}.up_proj.weight"] = p[e, I:].contiguous().cpu()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(p.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = p[e].contiguous().cpu()
        else:
            out[name] = p.cpu()
    return out


def gpu_mode(args) -> dict:
    import tempfile

    import torch
    from safetensors.torch import save_file

    from moe_engine.config import config_from_dict
    from moe_engine.engine import Engine, EngineConfig, Request
    from moe_engine.core.sampling import SamplingParams
    from moe_engine.rl.weights import check_checkpoint, load_checkpoint

    raw = SIMULATED if args.simulate else QWEN3_30B_A3B
    dev = torch.device("cpu" if args.simulate else "cuda:0")
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def allocated() -> int:
        return torch.cuda.memory_allocated(dev) if cuda else 0

    cfg = config_from_dict(raw)
    t, model = timed(build_model, raw, dev, 1)
    nbytes = sum(p.nbytes for p in model.parameters())
    res: dict = {"model": "simulated (CPU, small)" if args.simulate else "qwen3-30b-a3b (random bf16)",
                 "weight_bytes": nbytes, "gpus": torch.cuda.device_count() if cuda else 0,
                 "gpu": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__,
                 "build_s": t}
    log(f"built {nbytes / 1e9:.1f} GB on {res['gpu']} in {t:.1f} s")
    # The generation checks only show that the engine serves before / after; the fused Triton kernels (their
    # first-use compilation) are left out unless asked for: what is measured here is the weight movement.
    ecfg = EngineConfig(kv_cache_memory_bytes=4 << 30, max_num_seqs=16, max_model_len=4096,
                        enable_prefix_caching=True, enforce_eager=args.eager, fused_kernels=args.fused)
    res["engine_init_s"], engine = timed(Engine, model, cfg, ecfg)
    engine.lifecycle.weight_version = "random-1"
    engine.start()

    def generate(tag: str) -> None:
        done, tokens = threading.Event(), []

        def on_output(out):
            tokens.extend(out.new_token_ids)
            if out.finished:
                res[f"generate_{tag}_finish"] = out.finish_reason
                done.set()
        try:
            engine.add_request(Request(f"check-{tag}", list(range(100, 164)),
                                       SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                                       on_output=on_output))
            ok = done.wait(300)
            res[f"generate_{tag}"] = tokens if ok else "timed out"
        except Exception as exc:  # report, go on: the updates are what is measured here
            res[f"generate_{tag}"] = f"failed: {exc!r}"
        log(f"generate ({tag}): {res[f'generate_{tag}']}")

    try:
        generate("before")
        if args.simulate or torch.cuda.device_count() >= 2:
            port = free_port()
            proc = subprocess.Popen([sys.executable, __file__, "--role", "trainer", "--port", str(port),
                                     "--rounds", "2", "--trainer-device", "cuda:1" if cuda else "cpu",
                                     *(["--simulate"] if args.simulate else [])], stdout=subprocess.PIPE,
                                    text=True)
            res["init_group_s"], _ = timed(lambda: engine.lifecycle.init_weights_update_group(
                "127.0.0.1", port, 1, 2, backend="nccl" if cuda else "gloo").result(600))
            names = [n for n, _ in model.named_parameters()]
            shapes = [list(p.shape) for _, p in model.named_parameters()]
            res["broadcast_update_s"] = []
            for r in range(2):
                t, out = timed(lambda: engine.lifecycle.update_weights_from_distributed(
                    names, ["bfloat16"] * len(names), shapes, weight_version=f"bcast-{r}").result(600))
                res["broadcast_update_s"].append(t)
                log(f"broadcast round {r}: {t:.2f} s ({out['message']})")
            lines = [json.loads(x) for x in proc.communicate(timeout=600)[0].splitlines() if x.startswith("{")]
            theirs = next(x["checksums"] for x in lines if "checksums" in x)
            ours = checksums(dict(model.named_parameters()))
            res["broadcast_checksums_equal"] = ours == theirs
            res["trainer_broadcast_s"] = [x["broadcast_s"] for x in lines if "round" in x]
            generate("after_broadcast")
        else:
            res["broadcast_update_s"] = "skipped: one GPU (NCCL cannot have two ranks on one device)"
        # From disk: a checkpoint of the real widths with --disk-layers layers, through the page cache.
        small = build_model(raw, dev, 3, layers=args.disk_layers)
        target = build_model(raw, dev, 4, layers=args.disk_layers)
        with tempfile.TemporaryDirectory(dir=args.disk_dir) as tmp:
            tensors = hub_tensors(small)
            res["disk_write_s"], _ = timed(save_file, tensors, str(Path(tmp) / "model.safetensors"),
                                           {"format": "pt"})
            del tensors
            (Path(tmp) / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": args.disk_layers}))
            res["disk_check_s"], root = timed(check_checkpoint, target, tmp)
            res["disk_load_s"], loaded = timed(load_checkpoint, target, root)
            sync()
        res["disk_bytes"] = loaded
        res["disk_equal"] = all(torch.equal(p, q) for p, q in zip(small.parameters(), target.parameters()))
        rate = loaded / (res["disk_check_s"] + res["disk_load_s"])
        res["disk_rate_GBps"] = rate / 1e9
        res["disk_update_61GB_extrapolated_s"] = nbytes / rate
        log(f"disk: {loaded / 1e9:.1f} GB in {res['disk_load_s']:.1f} s -> {nbytes / rate:.1f} s for the full model")
        del small, target
        if cuda:
            torch.cuda.empty_cache()
        # Release / resume (the trainer borrows the GPU).
        before = allocated()
        res["release_s"], _ = timed(lambda: engine.lifecycle.release_memory_occupation().result(600))
        res["gpu_bytes_released"] = before - allocated()
        res["resume_s"], _ = timed(lambda: engine.lifecycle.resume_memory_occupation().result(600))
        generate("after_resume")
        last = res.get("generate_after_broadcast", res.get("generate_before"))
        res["release_resume_kept_weights"] = res["generate_after_resume"] == last  # same tokens as before release
        res["flush_cache_s"], _ = timed(lambda: engine.lifecycle.flush_cache().result(60))
    finally:
        engine.shutdown()
    cpu_start = args.cpu_restart_s
    res["restart_estimate_s"] = {"load 61 GB at the measured disk rate": res["disk_update_61GB_extrapolated_s"],
                                 "engine set-up (measured)": res["engine_init_s"],
                                 "server start (CPU-mode figure, --cpu-restart-s)": cpu_start}
    res["summary"] = {
        "update by broadcast from a trainer process (NCCL; --simulate: gloo), s": (
            res["broadcast_update_s"][-1] if isinstance(res["broadcast_update_s"], list)
            else res["broadcast_update_s"]),
        "update from disk (page cache), s, extrapolated": round(res["disk_update_61GB_extrapolated_s"], 2),
        "restart, s, estimated (>=)": round(sum(v for v in res["restart_estimate_s"].values() if v), 2),
        "release / resume (KV + weights), s": [round(res["release_s"], 2), round(res["resume_s"], 2)],
    }
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=4, help="CPU: updates of each kind")
    ap.add_argument("--restarts", type=int, default=2, help="CPU: server restarts timed")
    ap.add_argument("--disk-layers", type=int, default=4, help="GPU: layers of the checkpoint written to disk")
    ap.add_argument("--disk-dir", default=None, help="GPU: where to write it (default: the temp dir)")
    ap.add_argument("--eager", action="store_true", help="GPU: no CUDA graphs in the generation checks")
    ap.add_argument("--fused", action="store_true", help="GPU: fused Triton kernels in the generation checks")
    ap.add_argument("--cpu-restart-s", type=float, default=None, help="GPU: a CPU-mode restart figure to add")
    ap.add_argument("--simulate", action="store_true", help="GPU mode's code on the CPU, small model (a check)")
    ap.add_argument("--role", default="bench", choices=["bench", "trainer"], help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--server", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--trainer-device", default="cuda:1", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "trainer":
        return trainer(args)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.out = args.out or str(REPO / "loadtest" / "results" / f"weight_update-{stamp}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    res = gpu_mode(args) if args.device == "cuda" or args.simulate else cpu_mode(args)
    res["wall_s"] = time.perf_counter() - T0
    (Path(args.out) / "results.json").write_text(json.dumps(res, indent=2, default=str))
    print(f"\n| {res['model']} | value |\n|---|---|")
    for k, v in res["summary"].items():
        print(f"| {k} | {v} |")
    print(f"\nresults: {Path(args.out) / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
