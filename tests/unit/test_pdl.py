"""Programmatic dependent launch (moe_engine/pdl.py): what the kernels compile to on Hopper, and when it is on.

The interpreter never runs the PDL path (``PDL`` is False there) and CI has no GPU, so the contract is checked on
the compiled code: each kernel is compiled for sm_90 with Triton's compiler and ptxas from the wheel (no GPU
needed), and in its PTX ``griddepcontrol.wait`` must come before every global load and store, with
``griddepcontrol.launch_dependents`` after it; dense_gemm's only earlier memory instruction is its weights' L2
prefetch. ``MOE_TEST_DEVICE=cuda`` test files run the PDL launches themselves on a GPU (test_cuda_graphs.py:
graph-replayed decode equals eager decode).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_engine import pdl

HOPPER_COMPILE = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_engine import dense_gemm, fused_moe, kernels, paged_attention

def compile_ptx(fn, sig, consts, warps=4, stages=3):
    ck = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False})
    return ck.asm["ptx"]

def order(ptx):
    lines = [re.sub(r"^@!?%p\d+\s+", "", l.strip()) for l in ptx.splitlines()]  # without predicates
    first = lambda pat: next((i for i, l in enumerate(lines) if re.match(pat, l)), None)
    return {"wait": first(r"griddepcontrol\.wait"), "launch": first(r"griddepcontrol\.launch_dependents"),
            "memory": first(r"((ld|st|atom|red)\.global|cp\.async\.)"), "prefetch": first(r"prefetch\.global")}

out = {}
norm_sig = {"x_ptr": "*bf16", "d_ptr": "*bf16", "s_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32",
            "sx": "i32", "sd": "i32", "ss": "i32", "eps": "fp32", "BLOCK": "constexpr", "HAS_ADD": "constexpr",
            "DT": "constexpr", "FP32_WEIGHT": "constexpr", "PDL": "constexpr"}
for on in (True, False):
    out[f"rms_norm PDL={on}"] = order(compile_ptx(kernels._rms_norm_kernel, norm_sig,
        {"BLOCK": 2048, "HAS_ADD": True, "DT": 1, "FP32_WEIGHT": False, "PDL": on}))
dense_consts = {"HAS_BIAS": False, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 256, "EVEN_K": True, "DT": 1,
                "UPCAST": False, "PREC": "tf32", "LINE": 64, "LINES": 32, "PDL": True}
dense_sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16",
             **{n: "i32" for n in ("M", "N", "K", "s_x", "s_w", "s_y")}, **{n: "constexpr" for n in dense_consts}}
out["dense_gemm"] = order(compile_ptx(dense_gemm._dense_gemm_kernel, dense_sig, dense_consts, stages=4))
moe_consts = dict(GATE_UP=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, BLOCK_E=128, EVEN_K=True, DT=1,
                  UPCAST=False, PRECISE=True, PREC="tf32", PDL=True)
moe_sig = {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "tok_ptr": "*i64", "offs_ptr": "*i32",
           **{n: "i32" for n in ("E", "N", "K", "num_pid_m", "s_a", "s_we", "s_wn", "s_wk", "s_out")},
           **{n: "constexpr" for n in moe_consts}}
out["moe_gemm"] = order(compile_ptx(fused_moe._moe_gemm_kernel, moe_sig, moe_consts))
merge_consts = dict(Hq=32, SPLITS_PAD=4, DV=128, DV_PAD=128, HAS_SINKS=False, PDL=True)
merge_sig = {"out_ptr": "*bf16", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32",
             "sinks_ptr": "*fp32", "cu_ptr": "*i32", "s_ot": "i32", "s_oh": "i32", "num_splits": "i32",
             **{n: "constexpr" for n in merge_consts}}
out["merge_splits"] = order(compile_ptx(paged_attention._merge_splits_kernel, merge_sig, merge_consts))
print(json.dumps(out))
"""


def test_kernels_wait_for_the_previous_kernel_before_touching_memory(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(repo / "backends"), TRITON_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", HOPPER_COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    off = result.pop("rms_norm PDL=False")
    assert off["wait"] is None and off["launch"] is None  # PDL off: nothing compiled in
    for name, r in result.items():
        assert r["wait"] is not None and r["launch"] is not None, name
        assert r["memory"] is not None and r["wait"] < r["launch"] < r["memory"], (name, r)
    assert result["dense_gemm"]["prefetch"] < result["dense_gemm"]["wait"]  # weights fetched while waiting
    assert result["moe_gemm"]["prefetch"] is None  # its experts come from the route kernel: nothing to prefetch


def test_pdl_is_off_without_a_hopper_gpu_and_when_switched_off(monkeypatch):
    assert pdl.launch_options([torch.zeros(1)]) == {"PDL": False}  # a CPU tensor (the interpreter's case too)
    assert pdl.launch_options([3, "no tensor"]) == {"PDL": False}
    if torch.cuda.is_available() and not pdl._interpreting():
        hopper = torch.cuda.get_device_capability()[0] >= 9
        on = pdl.launch_options([torch.zeros(1, device="cuda")])
        assert on == ({"PDL": True, "launch_pdl": True} if hopper else {"PDL": False})
        monkeypatch.setattr(pdl, "ENABLED", False)
        assert pdl.launch_options([torch.zeros(1, device="cuda")]) == {"PDL": False}
