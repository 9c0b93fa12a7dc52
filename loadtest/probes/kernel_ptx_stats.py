"""What the engine's small Triton kernels compile to on Hopper, without a GPU: barriers, shuffles, registers and
spills per program, for a choice of num_warps.

Decode steps are latency-bound: a kernel whose program runs a chain of reductions pays for every cross-warp
reduction with shared memory and a barrier, which no profile of a single run tells apart from "the kernel is
small". This compiles the kernels of ``backends/moe_engine/kernels/`` for sm_90 (Triton's own compiler and ptxas, both
in the triton wheel) at the real shape's sizes (Qwen3-30B-A3B: 128 experts top-8, 32/4 heads of 128, hidden 2048)
and counts, per num_warps:

    PYTHONPATH=backends:. python3 loadtest/probes/kernel_ptx_stats.py            # every kernel below, 1 and 4 warps
    PYTHONPATH=backends:. python3 loadtest/probes/kernel_ptx_stats.py --warps 1,2,4,8 --kernels softmax_topk

Counts, not times: time them on the GPU (`bench_real_shape.py --profile b`).

``--moe-bucket 2-8``: the expert GEMMs of that bucket as the tile table gives them (fused_moe.config_path(), so
$MOE_FUSED_MOE_CONFIGS selects a variant from ``tile_table_variant.py``): shared memory, registers, and how many
programs fit on one SM. Under programmatic dependent launch that footprint decides whether the next kernel's
programs can become resident (and start their loads) while this one runs.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for real (the tests' interpreter would not)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from moe_engine.kernels import moe_routing as routing_kernels  # noqa: E402
from moe_engine.kernels import norm as norm_kernels  # noqa: E402
from moe_engine.kernels import rotary as rotary_kernels  # noqa: E402
from moe_engine.kernels import small_linear as linear_kernels  # noqa: E402


E, TOPK, HQ, HK, D, HIDDEN = 128, 8, 32, 4, 128, 2048

KERNELS = {  # name: (kernel, signature, constexprs)
    "softmax_topk": (
        "_softmax_topk_kernel",
        {"logits_ptr": "*bf16", "ids_ptr": "*i64", "w_ptr": "*bf16", "E": "i32", "sl": "i32", "fmask_ptr": "*bf16",
         "fids_ptr": "*i64", "pos_ptr": "*i64", "tok_ptr": "*i64", "offs_ptr": "*i32", "cap_ptr": "*i32",
         "K": "constexpr", "BLOCK_E": "constexpr", "BLOCK_K": "constexpr", "RENORM": "constexpr",
         "DT": "constexpr", "FORCED": "constexpr", "GROUP": "constexpr", "CAPTURE": "constexpr", "PDL": "constexpr"},
        {"K": TOPK, "BLOCK_E": E, "BLOCK_K": TOPK, "RENORM": True, "DT": 1, "FORCED": False, "GROUP": False,
         "CAPTURE": False, "PDL": True},
    ),
    "route": (
        "_route_kernel",
        {"ids_ptr": "*i64", "pos_ptr": "*i64", "tok_ptr": "*i64", "offs_ptr": "*i32", "cap_ptr": "*i32",
         "cap_stride": "i32", "T": "i32", "K": "i32", "E": "i32", "PAIR_PROGRAMS": "i32", "BLOCK_I": "constexpr",
         "BLOCK_J": "constexpr", "BLOCK_E": "constexpr", "CAPTURE": "constexpr", "PDL": "constexpr"},
        {"BLOCK_I": 16, "BLOCK_J": 256, "BLOCK_E": 32, "CAPTURE": True, "PDL": True},
    ),
    "combine": (
        "_combine_kernel",
        {"y_ptr": "*bf16", "ids_ptr": "*i64", "pos_ptr": "*i64", "w_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32",
         "K": "constexpr", "BLOCK_K": "constexpr", "BLOCK": "constexpr", "DT": "constexpr", "PDL": "constexpr"},
        {"K": TOPK, "BLOCK_K": TOPK, "BLOCK": 256, "DT": 1, "PDL": True},
    ),
    "qk_norm_rope": (
        "_qk_norm_rope_kernel",
        {"q_ptr": "*bf16", "qvar_ptr": "*bf16", "qw_ptr": "*bf16", "qout_ptr": "*bf16", "sq": "i32", "Hq": "i32",
         "k_ptr": "*bf16", "kvar_ptr": "*bf16", "kw_ptr": "*bf16", "kout_ptr": "*bf16", "sk": "i32", "Hk": "i32",
         "cos_ptr": "*bf16", "sin_ptr": "*bf16", "eps": "fp32", "v_ptr": "*bf16", "sv": "i32", "ck_ptr": "*bf16",
         "cv_ptr": "*bf16", "slot_ptr": "*i64", "sck": "i32", "sck_h": "i32", "scv": "i32", "scv_h": "i32",
         "HEAD_NORM": "constexpr", "HAS_NORM": "constexpr", "D": "constexpr", "BLOCK_H": "constexpr",
         "BLOCK_D": "constexpr", "DT": "constexpr", "VAR_HERE": "constexpr", "STORE_KV": "constexpr", "PDL": "constexpr"},
        {"HEAD_NORM": True, "HAS_NORM": True, "D": D, "BLOCK_H": 4, "BLOCK_D": D, "DT": 1, "VAR_HERE": True,
         "STORE_KV": True, "PDL": True},
    ),
    "rms_norm": (
        "_rms_norm_kernel",
        {"x_ptr": "*bf16", "d_ptr": "*bf16", "s_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32",
         "sx": "i32", "sd": "i32", "ss": "i32", "eps": "fp32", "BLOCK": "constexpr", "HAS_ADD": "constexpr",
         "DT": "constexpr", "FP32_WEIGHT": "constexpr", "PDL": "constexpr"},
        {"BLOCK": HIDDEN, "HAS_ADD": True, "DT": 1, "FP32_WEIGHT": False, "PDL": True},
    ),
}


# a one-token step's router launch that also routes (kernels.softmax_topk_route): the same kernel, GROUP and CAPTURE on
KERNELS["softmax_topk_route"] = (KERNELS["softmax_topk"][0], KERNELS["softmax_topk"][1],
                                 {**KERNELS["softmax_topk"][2], "GROUP": True, "CAPTURE": True})

KERNEL_MODULES = (norm_kernels, rotary_kernels, routing_kernels, linear_kernels)


def stats(kernel_name: str, num_warps: int) -> dict:
    attr, signature, constexprs = KERNELS[kernel_name]
    src = ASTSource(fn=next(getattr(m, attr) for m in KERNEL_MODULES if hasattr(m, attr)), signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "enable_fp_fusion": False})
    ptx = compiled.asm["ptx"]
    out = {"bar.sync": len(re.findall(r"\b(bar|barrier)\.sync\b", ptx)), "shfl": len(re.findall(r"\bshfl\.", ptx)),
           "ld/st.shared": len(re.findall(r"\b(ld|st)\.shared", ptx))}
    out.update(ptxas_resources(ptx))
    return out


def ptxas_resources(ptx: str) -> dict:
    """ptxas -v (the Triton wheel's) on sm_90a: registers per thread and spill-store bytes."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        info = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                              capture_output=True, text=True)
    text = info.stdout + info.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill stores (bytes)": int(spill.group(1)) if spill else None}


def compile_moe_gemm(cfg, gate_up: bool, N: int = 768, K: int = HIDDEN):
    """fused_moe's expert GEMM compiled for sm_90 as the engine launches it (bf16, PDL, TMA where the config asks
    and the shape allows) for ``cfg`` (a fused_moe.TileConfig); gate_up: N = expert width, K = hidden (down: the
    other way round). -> (the compiled kernel, whether it loads through TMA)."""
    from moe_engine.kernels import fused_moe as FM

    tma = bool(cfg.tma) and N % cfg.BLOCK_N == 0
    consts = dict(s_wk=1, GATE_UP=gate_up, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                  GROUP_M=cfg.GROUP_M, BLOCK_E=E, EVEN_K=K % cfg.BLOCK_K == 0, DT=1, UPCAST=False, PRECISE=True,
                  PREC="tf32", PDL=True, TMA=tma)
    descs = {"w_desc": f"tensordesc<bf16[{cfg.BLOCK_N}, {cfg.BLOCK_K}]>" if tma else "constexpr",
             "a_desc": f"tensordesc<bf16[{cfg.BLOCK_M}, {cfg.BLOCK_K}]>" if tma and not gate_up else "constexpr"}
    consts.update({n: None for n, t in descs.items() if t == "constexpr"})
    sig = {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "tok_ptr": "*i64", "offs_ptr": "*i32", **descs,
           **{n: "i32" for n in ("E", "N", "K", "num_pid_m", "s_a", "s_we", "s_wn", "s_out")},
           **{n: "constexpr" for n in consts}}
    kernel = FM._moe_gemm_kernel
    aligned = ("a_ptr", "w_ptr", "out_ptr", "tok_ptr", "offs_ptr", "E", "N", "K", "s_a", "s_we", "s_wn", "s_out")
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                                       "enable_fp_fusion": False})
    return compiled, tma


def moe_footprints(bucket: str) -> None:
    """The bucket's gate_up and down launches at the real shape, compiled for sm_90 as the engine launches them."""
    import torch

    from moe_engine.kernels import fused_moe as FM

    table = FM._table("NVIDIA H200", E, HIDDEN, 768, torch.bfloat16, str(FM.config_path()))
    print(f"expert GEMMs of bucket {bucket} from {FM.config_path()} (sm_90: 227 KB shared memory, 64K registers, "
          "64 warps per SM)")
    print("| kernel | config | shared KB | registers | programs per SM |")
    print("|---|---|---:|---:|---:|")
    for gate_up, cfg in zip((True, False), table[bucket]):
        ck, _ = compile_moe_gemm(cfg, gate_up, *((768, HIDDEN) if gate_up else (HIDDEN, 768)))
        regs = ptxas_resources(ck.asm["ptx"])["registers"]
        shared = ck.metadata.shared
        fit = min(227 * 1024 // max(shared, 1), 65536 // (regs * 32 * cfg.num_warps) if regs else 32,
                  64 // cfg.num_warps, 32)
        print(f"| {'gate_up' if gate_up else 'down'} | {cfg} | {shared / 1024:.1f} | {regs} | {fit} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default=",".join(KERNELS), help=f"any of {', '.join(KERNELS)}")
    ap.add_argument("--warps", default="1,4", help="num_warps values")
    ap.add_argument("--moe-bucket", default=None, help="instead: the expert GEMMs' footprints for this bucket")
    args = ap.parse_args()
    if args.moe_bucket:
        moe_footprints(args.moe_bucket)
        return
    warps = [int(w) for w in args.warps.split(",")]
    cols = ["bar.sync", "shfl", "ld/st.shared", "registers", "spill stores (bytes)"]
    print("| kernel | num_warps | " + " | ".join(cols) + " |")
    print("|---|---:|" + "---:|" * len(cols))
    for name in args.kernels.split(","):
        if name not in KERNELS:
            sys.exit(f"unknown kernel {name!r}; choose from {', '.join(KERNELS)}")
        for w in warps:
            s = stats(name, w)
            print(f"| {name} | {w} | " + " | ".join(str(s[c]) for c in cols) + " |", flush=True)


if __name__ == "__main__":
    main()
