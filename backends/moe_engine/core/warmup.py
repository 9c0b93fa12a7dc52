"""The engine's start-up work: the kernels compiled and the CUDA graphs captured before the first request, and a
warning for any kernel variant compiled later (inside a step, where the GPU waits for it).

``warm_up(runner, settings)`` is what an engine runs after building its runner (tensor-parallel ranks skip it: their
collectives run in lockstep, lazily): cuDNN's plans for dense prefill attention, one prefill step per kernel size
class (``prefill_warm_shapes``), every decode and prefill graph, then ``log_late_compiles``.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time

import torch

from ..kernels import fused_moe
from ..layers import attend

log = logging.getLogger(__name__)


def warm_up(runner, settings) -> None:
    """Compile now what the first requests would compile (CUDA with the fused kernels), capture every graph."""
    triton_kernels = runner.device.type == "cuda" and settings.fused_kernels
    with starting_up():
        if settings.attention_kernels and runner.dtype != torch.float32 and not settings.deterministic_inference:
            warm_dense_prefill(runner, settings.step_tokens)  # (deterministic inference keeps every prompt paged)
        if triton_kernels:
            warm_prefill(runner, settings.max_num_seqs)
        if runner.graphs is not None:
            # Routing on, the prefix cache and the expert load off: a step in which no request asks for routing
            # replays graphs without the capture, whose kernels are other variants (the router's and route's
            # CAPTURE=False): captured now too, or the first such step would compile them (about a second at real
            # shapes).
            routing = runner.capture_buf is not None
            for capture in (True, False) if routing and not settings.captures_every_step else (routing,):
                runner.graphs.capture_all(capture=capture)
                if runner.prefill_graphs is not None:
                    runner.prefill_graphs.capture_all(capture=capture)
    if triton_kernels:
        log_late_compiles()


def warm_dense_prefill(runner, max_tokens: int) -> None:
    """cuDNN's attention plans for the prompt-length buckets of attend.dense_causal, made now (70 ms to a
    second each on an H200) rather than by the first request of each length."""
    shapes = {s for m in runner.model.modules() if (s := getattr(m, "dense_prefill_shape", None)) is not None}
    if not shapes or max_tokens < attend.DENSE_PREFILL_MIN_TOKENS:
        return
    t = time.perf_counter()
    with torch.inference_mode():
        calls = attend.warm_dense_prefill(shapes, runner.device, runner.dtype, max_tokens)
    log.info("dense prefill attention: %d plans warmed for prompts of %d-%d tokens in %.1f s", calls,
             attend.DENSE_PREFILL_MIN_TOKENS, max_tokens, time.perf_counter() - t)


@torch.inference_mode()
def warm_prefill(runner, max_num_seqs: int) -> None:
    """Run the prefill steps of ``prefill_warm_shapes`` on throwaway inputs, so that their kernels compile now
    and not inside the first requests of each shape (on an H200 0.9-1.2 s per new class at the real shape,
    ``loadtest/bench/bench_multiturn.py --step-trace``). Each step is sequences of one token and one longer chunk last, all from
    position 0, reading and writing only the null block; routing is captured as a serving step would."""
    from .runner import StepInputs  # (the runner module builds runners through this one)

    K = runner.routing_shape[1]
    shapes = prefill_warm_shapes(runner.step_tokens, K, max_num_seqs)
    log.info("warming prefill kernels: %d step shapes of %d-%d tokens ...", len(shapes),
             min(t for t, _ in shapes), max(t for t, _ in shapes))
    t0 = time.perf_counter()
    for T, B in shapes:
        lens = [1] * (B - 1) + [T - (B - 1)]
        step = StepInputs(
            ids=[i % runner.model.config.vocab_size for i in range(T)], context=[0] * B, query_lens=lens,
            tables=[[runner.null_block] * -(-n // runner.block_size) for n in lens],
            want_routing=runner.capture_buf is not None, samplers=list(range(B)),
        )
        logits, _ = runner.forward(step)
        torch.argmax(logits, dim=-1)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    log.info("warmed prefill kernels for steps of %s tokens in %.1f s",
             ", ".join(f"{T} ({B} seqs)" for T, B in shapes), time.perf_counter() - t0)


def prefill_warm_shapes(step_tokens: int, top_k: int, max_num_seqs: int) -> list[tuple[int, int]]:
    """(tokens, sequences) of the prefill steps ``warm_prefill`` runs at start.

    Triton compiles a kernel once per class of its integer arguments (1, a multiple of 16, anything else), and the
    fused MoE picks its tiles by the step's (token, slot) pairs (``fused_moe.BUCKETS``). So per pair bucket that a
    step of 2..step_tokens tokens can land in, the largest token count of each (tokens, pairs) class found there
    (both multiples of 16; only the pairs; neither). Their sequence counts cycle through 1, 16 and 3 (the classes of
    the sampling kernels' row count; the attention kernels do not specialise on sequence counts or block-table
    widths), at most max_num_seqs and the step's tokens. Steps of one token are the decode graphs' work,
    captured separately."""
    shapes: list[tuple[int, int]] = []
    prev = 0
    for _, top in fused_moe.BUCKETS:
        lo = max(prev // top_k + 1, 2)
        hi = step_tokens if top is None else min(top // top_k, step_tokens)
        prev = top if top is not None else prev
        seen: set[tuple[bool, bool]] = set()
        for tokens in range(hi, lo - 1, -1):
            cls = (tokens % 16 == 0, tokens * top_k % 16 == 0)
            if cls not in seen:
                seen.add(cls)
                seqs = (1, 16, 3)[len(shapes) % 3]
                shapes.append((tokens, max(1, min(seqs, tokens, max_num_seqs))))
            if len(seen) == 3:
                break
    return shapes


def _variant_of(fn, compile: dict, fallback: str) -> str:
    """One line naming a Triton kernel variant by what selects it: ``kernel[num_warps, num_stages](...)`` with
    ``name=value`` for its constants (declared constexprs and integers specialised to 1), ``name%16`` for
    integers compiled as multiples of 16 and ``name`` for other integers: the classes a warm-up has to reach.
    (Triton 3.6's own ``repr`` pairs the names with the characters of the cache key.) ``fallback`` where the
    hook's data has another form."""
    try:
        signature = compile["signature"]  # {name: type}: "i32", "*bf16", "fp32", "constexpr", ...
        names = list(signature)
        constants = {names[path[0]]: value for path, value in compile["constants"].items() if len(path) == 1}
        aligned = {names[path[0]] for path, attrs in compile["configs"][0].items() if len(path) == 1 and attrs}
        args = []
        for name, kind in signature.items():
            if name in constants:
                args.append(f"{name}={constants[name]}")
            elif kind[:1] in ("i", "u"):
                args.append(f"{name}%16" if name in aligned else name)
        return f"{fn.name}[num_warps={compile['num_warps']}, num_stages={compile['num_stages']}]({', '.join(args)})"
    except (KeyError, IndexError, TypeError, AttributeError):
        return fallback


def freeze_start_up_objects() -> int:
    """Take every object alive now (torch's and Triton's modules, the model, the engine: ~300k at the tiny model's
    start) out of Python's cyclic garbage collector, and return how many. A full collection walks every tracked
    object holding the GIL: ~170 ms on the 2-core CPU with the tiny model loaded, 0.0 ms after this. Python runs
    one when the objects that survived the younger collections reach a quarter of the long-lived ones: rarely in
    serving (none in 16 turns of 32 multi-turn conversations, a CPU probe), but each one stops the step loop that
    long. Frozen objects that become garbage are still freed by reference counting (cycles among them would
    stay). For a process that hosts its engine (or a tensor-parallel rank) for its lifetime, once after start-up,
    as vLLM's engine core does."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


_starting = [0]  # engines of this process between their first kernel warm-up and the end of their start-up

_starting_lock = threading.Lock()


@contextlib.contextmanager
def starting_up():
    """An engine's start-up (its warm-up and graph captures): the kernels it compiles are not late. The late-compile
    hook is process-wide, so without this a second engine started in a process (a benchmark comparing two, a
    test suite) would have its start-up compiles logged by the first engine's hook as stalls inside a step.
    Compiles of another engine's steps during that window are not logged either."""
    with _starting_lock:
        _starting[0] += 1
    try:
        yield
    finally:
        with _starting_lock:
            _starting[0] -= 1


def log_late_compiles() -> bool:
    """From now on, log a warning whenever a Triton kernel variant is first needed in this process (compiled, or
    loaded from Triton's disk cache): after the start-up warm-up and graph capture, that happens inside a step,
    which then waits (about a second at real shapes), and the line names the kernel and its argument classes, so
    that the warm-up can be taught the shape. Process-wide (Triton's ``jit_cache_hook``); False where this Triton
    has no such hook. Idempotent."""
    try:
        import triton
        knobs = triton.knobs.runtime
    except (ImportError, AttributeError):
        return False
    if getattr(knobs.jit_cache_hook, "_moe_late_compiles", False):
        return True
    previous = knobs.jit_cache_hook

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        if not already_compiled and not _starting[0]:
            log.warning("kernel variant first used after start-up, inside a step: %s", _variant_of(fn, compile, repr))
        return previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                        already_compiled=already_compiled) if previous is not None else None

    hook._moe_late_compiles = True
    knobs.jit_cache_hook = hook
    return True
