"""CPU cost of the engine at two revisions, as CPU seconds per trial (less sensitive to a loaded machine than wall
time): by default the OLMoE-like bench_engine checkpoint, 1 thread, C requests of 128 prompt + 64 greedy output
tokens, prefix cache off (a third argument ``cache``: on, the engine's default, every request's blocks hashed and
registered); the median of 3 trials after a warm-up.

    git archive <rev> backends | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/backends .venv/bin/python loadtest/bench/cpu_engine_ab.py 16 old [cache]
    PYTHONPATH=backends .venv/bin/python loadtest/bench/cpu_engine_ab.py 16 new [cache]

(run ``loadtest/bench/bench_engine.py`` once first: it writes the checkpoint.) ``MOE_AB_MODEL=DIR`` runs another
checkpoint instead, with bench_vs_vllm_cpu.py's requests: prompts of 64-192 tokens, 64 greedy output tokens,
max_num_seqs 64 and max_model_len 1024 as its server (e.g. its transformers-written Mixtral,
loadtest/results/checkpoints/mixtral-hf-l4-h512-i1024-e8k2). Alternate the two revisions over several runs
(old new new old ...) and compare medians: on a shared 2-core machine one run's number alone is noise.
"""
import dataclasses
import glob
import os
import sys
import time

import numpy as np
import torch

torch.set_num_threads(1)
from moe_engine.checkpoint import load_model
from moe_engine.config import load_config
from moe_engine.engine import Engine, EngineConfig, Request
from moe_engine.core.sampling import SamplingParams

model_dir = os.environ.get("MOE_AB_MODEL")
if model_dir:
    path, kw = model_dir, dict(max_num_seqs=64, max_model_len=1024)
else:
    path = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "results", "checkpoints", "olmoe-*")))[0]
    kw = dict(max_num_seqs=16, max_model_len=256)
cfg = load_config(path); model = load_model(path, dtype="float32", progress=False)
if "enable_prefix_caching" in {f.name for f in dataclasses.fields(EngineConfig)} and sys.argv[3:4] != ["cache"]:
    kw["enable_prefix_caching"] = False
eng = Engine(model, cfg, EngineConfig(**kw))
C = int(sys.argv[1])


def prompt(seed: int, i: int) -> list[int]:
    if model_dir:  # bench_vs_vllm_cpu.py's lengths
        rng = np.random.default_rng(seed * 100 + i)
        return rng.integers(3, cfg.vocab_size, int(rng.integers(64, 193))).tolist()
    g = torch.Generator().manual_seed(seed * 100 + i)
    return torch.randint(3, 5000, (128,), generator=g).tolist()


def trial(seed):
    done = []
    for i in range(C):
        eng.add_request(Request(f"r{seed}-{i}", prompt(seed, i),
                                SamplingParams(max_tokens=64, temperature=0, ignore_eos=True),
                                on_output=lambda o: done.append(1) if o.finished else None))
    while len(done) < C:
        eng.step()


trial(0)
cpu = []
for r in range(3):
    t0 = time.process_time(); trial(r + 1); cpu.append(time.process_time() - t0)
print(sys.argv[2], C, "cpu s/trial", sorted(cpu)[1], "tok/cpu-s", C * 64 / sorted(cpu)[1])
