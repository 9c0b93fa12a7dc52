#!/usr/bin/env python
"""A copy of the expert-GEMM tile table with one bucket's config replaced, for timing table variants end to end.

A tile that wins alone need not win in the forward (under programmatic dependent launch kernels overlap their
neighbours): the batch-1 tiles the tuner picked alone took 2.89-2.90 ms per decode step, the ones a sweep inside a
48-layer graph picked 2.81-2.82 (run 80). This writes the variant; the engine reads it through
$MOE_FUSED_MOE_CONFIGS, so ``ab_real_shape.py`` can alternate variants in one run:

    python3 loadtest/tune/tile_table_variant.py --bucket 2-8 --kernel down --config 16,128,64,1,4,3,1 \\
        --out /tmp/down128.json
    PYTHONPATH=backends:. python3 loadtest/bench/ab_real_shape.py --rounds 2 --variant table=. \\
        --variant down128=.,MOE_FUSED_MOE_CONFIGS=/tmp/down128.json -- --quick --cases a --reps 3

--config: BLOCK_M,BLOCK_N,BLOCK_K,GROUP_M,num_warps,num_stages[,tma]. The table is the one the engine would read
(fused_moe.config_path()); only the entry of --device/--experts/--hidden/--inter/--dtype is changed (the real
shape's on an H200 by default).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends"))

from moe_engine.kernels import fused_moe  # noqa: E402
from moe_engine.kernels.fused_moe import TileConfig  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bucket", required=True,
                   choices=[name for name, _ in fused_moe.BUCKETS] + [fused_moe.DETERMINISTIC],
                   help="a step-size bucket, or 'deterministic': the one config of --enable-deterministic-inference")
    p.add_argument("--kernel", required=True, choices=("gate_up", "down"))
    p.add_argument("--config", required=True, help="BLOCK_M,BLOCK_N,BLOCK_K,GROUP_M,num_warps,num_stages[,tma]")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="NVIDIA H200")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()
    values = [int(v) for v in a.config.split(",")]
    if len(values) not in (6, 7):
        p.error("--config takes 6 or 7 integers")
    cfg = TileConfig(*values)
    key = {"device": a.device, "E": a.experts, "H": a.hidden, "I": a.inter, "dtype": a.dtype}
    source = fused_moe.config_path()
    data = json.loads(source.read_text()) if source.is_file() else {"tables": []}
    entry = next((t for t in data["tables"] if {k: t.get(k) for k in key} == key), None)
    if entry is None:
        entry = dict(key, buckets={})
        data["tables"].append(entry)
    pair = entry["buckets"].get(a.bucket)
    if pair is None:  # the bucket was not tuned: start from the defaults' pair
        g, d = fused_moe.DEFAULT_CONFIGS.get(a.bucket) or fused_moe.DETERMINISTIC_CONFIGS
        pair = {"gate_up": asdict(g), "down": asdict(d)}
    pair[a.kernel] = asdict(cfg)
    entry["buckets"][a.bucket] = pair
    a.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{a.out}: {source} with bucket {a.bucket} {a.kernel} = {cfg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
