"""CUDA graphs for decode-only steps.

A decode step of a MoE model is a few hundred short kernels; launched one by one from Python, the GPU waits on
the host. A CUDA graph records the whole forward, lm_head included, once per shape and replays it with a single
launch.

A graph needs fixed shapes and fixed addresses, so a decode step is padded to a *bucket*: B (sequences) rounded
up to the next size in ``batch_buckets`` and the longest context rounded up to the next size in
``kv_len_buckets`` (the block-table width the step reads: the reference attention gathers that many keys per
sequence; the paged kernels loop over each sequence's own length and use the bucket only to choose their split).
Inputs live in static device buffers (token ids, positions, cache slots, sequence lengths and the block tables at
fixed addresses), filled with one host-to-device copy per step from a pinned staging buffer. Padding rows decode
token 0 at position 0 into the cache's null block, which no sequence owns; their logits and routing rows are
dropped.

Per row, a padded step computes what an eager step computes: attention reads only a row's own blocks up to its
length, and every other op is row-wise.

The captured routing ids are written into the engine's step buffer, as in an eager step; graphs that capture
routing and graphs that do not are kept apart, so a step with no request asking for routing does no capture work.

With the paged attention kernels a graph depends on its key bucket only through the split count of its decode
attention (each sequence's key ranges come from its own length at run time): the key buckets of one batch bucket
that split alike share one graph, the longest one's (``graph_len``), so a batch of 40+ sequences (4 kv heads)
replays one graph at any context, and one sequence at most six. Every one of them is captured when the engine
starts (``capture_all``, largest batch first), with the routing capture and, where steps may run without it
(routed experts on, prefix cache off), also without: the first capture of a batch size compiles its kernels'
specialisations (1-3 s on an H200 at the Qwen3-30B-A3B shape), and any later one costs a step 70-175 ms there
(``loadtest/bench/bench_real_shape.py --step-trace``: one such capture in half of the 64 x (1024 + 256)
repetitions, -1.7% of their throughput, when the batch shrank at contexts no earlier step had reached). After a
release and resume of GPU memory (rl/lifecycle.py) the graphs are captured again when first needed. Without the kernels the
reference attention gathers a bucket's keys: one graph per key bucket, the shortest captured at start, the others
when first reached. Graphs that also hand out the routing weights are captured when a request first asks for them.
Graphs share one memory pool and write their logits into one buffer: they never run concurrently, and a step's
logits are sampled (on the same stream) before the next replay.
"""
from __future__ import annotations

import bisect
import collections
import gc
import logging
import time

import numpy as np
import torch

from ..kernels import paged_attention
from ..layers.attend import ForwardBatch
from ..layers.experts import StepRouting
from .kv_cache import KVCache

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 to 64, of 16 to 128, of 32 beyond: padding wastes at most ~25%."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, 129, 16), *range(160, max_batch + 32, 32)]
    return [b for b in sizes if b < max_batch] + [max_batch]


def kv_len_buckets(max_model_len: int) -> list[int]:
    """Powers of two from 128, and max_model_len itself: attention reads at most 2x the keys it needs."""
    sizes = []
    n = 128
    while n < max_model_len:
        sizes.append(n)
        n *= 2
    return sizes + [max_model_len]


def _round_up(sizes: list[int], n: int) -> int:
    return sizes[bisect.bisect_left(sizes, n)]


def capture_graph(forward, pool, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """Run ``forward()`` once eagerly, then capture it into a graph (memory from ``pool``), both on ``stream``.
    The warm-up run does the lazy kernel and workspace initialisation, which must not happen during a capture;
    it runs the staged inputs, so any KV it writes is what the replay writes again."""
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        forward()
        graph = torch.cuda.CUDAGraph()
        # No garbage collection while capturing: a collection that frees an unreachable older engine's graphs
        # resets them, which CUDA refuses during a capture ("operation not permitted when stream is
        # capturing"; seen when tests build engines one after another). torch.cuda.graph collects on entry.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                forward()
        finally:
            if gc_was_enabled:
                gc.enable()
    current.wait_stream(stream)
    return graph


class DecodeGraphs:
    """Captured decode forwards, keyed by (batch bucket, the key bucket ``graph_len`` gives, capture on/off, weights
    on/off)."""

    # Staging rows: token id, position, slot, sequence length, recurrent-state slot (hybrid models).
    _IDS, _POS, _SLOT, _LEN, _STATE = range(5)
    _ROWS = 5

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVCache,
        max_batch: int,
        max_model_len: int,
        capture_buf: torch.Tensor | None,
        weights_buf: torch.Tensor | None = None,
        use_kernels: bool = False,
        batch_invariant: bool = False,  # deterministic inference: kernels/batch_invariant.py's decode attention
    ):
        self.model = model
        self.batch_invariant = batch_invariant
        self.kv = kv
        self.block_size = bs = kv.block_size
        self.capture_buf = capture_buf  # [>= max_batch, L, K] int32, the engine's step buffer
        self.weights_buf = weights_buf  # [>= max_batch, L, K] float32: combine weights, when a request asks
        self.batch_sizes = batch_buckets(max_batch)
        self.kv_lens = kv_len_buckets(max_model_len)
        self.max_batch = max_batch
        self.max_blocks = -(-max_model_len // bs)
        self.use_kernels = use_kernels  # attention through paged_attention.py's kernels
        device = kv.device
        # Staged on the host, copied in one transfer: [5, B] scalars, then the block tables [B, max_blocks].
        # Two staging buffers, alternating: with overlapped decode the previous step's copy may not have run yet.
        R = self._ROWS
        width = R * max_batch + max_batch * self.max_blocks
        self._host = [torch.zeros(width, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self._host_np = [h.numpy() for h in self._host]
        self._parity = 0
        self._inputs = torch.zeros(width, dtype=torch.long, device=device)
        self._scalars = self._inputs[: R * max_batch].view(R, max_batch)
        self._tables = self._inputs[R * max_batch :].view(max_batch, self.max_blocks)
        self._arange = torch.arange(max_batch + 1, dtype=torch.long, device=device)
        self._zeros = torch.zeros(max_batch, dtype=torch.long, device=device)
        # Every graph writes its logits into this one buffer (a per-graph output would hold [B, V] float32
        # for each of up to hundreds of graphs: 150 MB each at B=256 and a 150k vocabulary).
        self.logits = torch.empty(max_batch, model.config.vocab_size, dtype=torch.float32, device=device)
        self._graphs: dict[tuple[int, int, bool, bool], torch.cuda.CUDAGraph] = {}
        self.replays: collections.Counter = collections.Counter()  # per graph key: steps that replayed it
        # distinct kv-head counts of the layers (MLA: head blocks of the absorbed decode; the split rule's programs)
        programs = getattr(model, "decode_attention_programs", None)
        self._kv_heads = (programs() if programs is not None else None) or sorted(
            {layer.k.shape[2] for layer in kv.kv_layers})
        self._graph_len = {(B, Lk): self._longest_alike(B, Lk) for B in self.batch_sizes for Lk in self.kv_lens}
        self.pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device=device)  # capture and warm-up run off the default stream

    def supports(self, num_seqs: int, max_seq_len: int) -> bool:
        return num_seqs <= self.max_batch and max_seq_len <= self.kv_lens[-1]

    @torch.inference_mode()
    def run(
        self, token_ids: list[int] | torch.Tensor, positions: list[int], tables: list[list[int]], capture: bool,
        capture_weights: bool = False, state_slots: list[int] | None = None,
    ) -> torch.Tensor:
        """One decode step of n sequences at ``positions`` with block ``tables``; returns their logits [n, V]
        float32 (a view of the buffer every graph writes, valid until the next replay). Routing rows land in
        capture_buf[:n] when capture. ``token_ids``: a list, or a device tensor [n] (overlapped decode: the
        previous step's samples, never seen by the host)."""
        n = len(positions)
        B = _round_up(self.batch_sizes, n)
        Lk = self.graph_len(B, _round_up(self.kv_lens, max(positions) + 1))
        nb = -(-Lk // self.block_size)
        bs, M, R = self.block_size, self.max_batch, self._ROWS
        self._parity ^= 1
        host = self._host_np[self._parity]  # numpy view of pinned staging memory (cheaper than torch indexing)
        scalars = host[: R * M].reshape(R, M)
        table_rows = host[R * M :].reshape(M, self.max_blocks)
        on_device = isinstance(token_ids, torch.Tensor)
        pos = np.asarray(positions, dtype=np.int64)
        scalars[self._IDS, :n] = 0 if on_device else token_ids
        scalars[self._POS, :n] = pos
        scalars[self._LEN, :n] = pos + 1
        scalars[self._STATE, :n] = 0 if state_slots is None else state_slots
        for i, table in enumerate(tables):
            w = min(len(table), nb)
            table_rows[i, :w] = table[:w]
        slot_blocks = table_rows[np.arange(n), pos // bs]
        scalars[self._SLOT, :n] = slot_blocks * bs + pos % bs
        self._pad(scalars, table_rows, n, B, nb)
        self._upload(B)
        if on_device:
            self._scalars[self._IDS, :n].copy_(token_ids)
        key = (B, Lk, capture, capture and capture_weights)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._capture(*key)
        g.replay()
        self.replays[key] += 1
        return self.logits[:n]

    @torch.inference_mode()
    def capture_all(self, capture: bool) -> None:
        """Capture every graph a decode step can replay (``graph_len``'s key buckets of every batch bucket; the
        shortest key bucket only without the attention kernels) now, largest batch first (the smaller graphs'
        memory comes out of the pool the largest one made), on rows that are all padding."""
        t0 = time.monotonic()
        log.info("capturing CUDA graphs for decode batches of up to %d sequences (%d sizes) ...", self.max_batch,
                 len(self.batch_sizes))
        lens = self.kv_lens if self.use_kernels else self.kv_lens[:1]
        n = 0
        for B in reversed(self.batch_sizes):
            for Lk in sorted({self.graph_len(B, L) for L in lens}, reverse=True):
                key = (B, Lk, capture, False)
                if key in self._graphs:
                    continue
                self._stage_padding(B, Lk)
                self._graphs[key] = self._capture(*key, level=logging.DEBUG)
                n += 1
        log.info("captured %d CUDA graphs for decode batches of %s sequences%s, routing %s, in %.1f s", n,
                 ", ".join(map(str, self.batch_sizes)),
                 " (each attention split count)" if self.use_kernels else f" up to {lens[-1]} keys",
                 "on" if capture else "off", time.monotonic() - t0)

    def graph_len(self, B: int, Lk: int) -> int:
        """The key bucket of the graph that replays decode steps of B sequences (a batch bucket) whose longest
        context rounds up to key bucket Lk."""
        return self._graph_len[B, Lk]

    def _longest_alike(self, B: int, Lk: int) -> int:
        """With the paged kernels: the longest key bucket whose steps of B sequences split their attention as Lk's
        do (the split count grows with the keys, so these buckets are consecutive; the longest one's block-table
        width covers them all). Without: Lk (the reference attention gathers exactly the bucket's keys)."""
        if not self.use_kernels:
            return Lk
        counts = self.split_counts(B, Lk)
        i = self.kv_lens.index(Lk)
        while i + 1 < len(self.kv_lens) and self.split_counts(B, self.kv_lens[i + 1]) == counts:
            i += 1
        return self.kv_lens[i]

    def split_counts(self, B: int, Lk: int) -> tuple[int, ...]:
        """The split-decode counts a graph of B sequences at Lk keys runs its layers' attention with (the paged
        kernels' rule, per distinct kv-head count of the layers; under deterministic inference the key ranges
        kernels/batch_invariant.py splits a decode step over)."""
        if self.batch_invariant:
            from ..kernels import batch_invariant as bi_kernels

            device = self.kv[0].k.device
            return tuple(bi_kernels.decode_ranges(B, h, Lk, device) for h in self._kv_heads)
        return tuple(paged_attention.choose_num_splits(B, h, Lk) for h in self._kv_heads)

    def _stage_padding(self, B: int, Lk: int) -> None:
        """Static inputs of B rows that are all padding, for a capture or a warm-up at Lk keys."""
        M, R = self.max_batch, self._ROWS
        self._parity ^= 1
        host = self._host_np[self._parity]
        self._pad(host[: R * M].reshape(R, M), host[R * M :].reshape(M, self.max_blocks), 0, B,
                  -(-Lk // self.block_size))
        self._upload(B)

    def _pad(self, scalars: np.ndarray, table_rows: np.ndarray, n: int, B: int, nb: int) -> None:
        """Rows n..B of the staging buffer as padding: token 0 at position 0 of the null block."""
        if B > n:
            scalars[self._IDS : self._POS + 1, n:B] = 0
            scalars[self._SLOT, n:B] = self.kv.null_block * self.block_size
            scalars[self._LEN, n:B] = 1
            scalars[self._STATE, n:B] = self.kv.null_state_slot
            table_rows[n:B, :nb] = self.kv.null_block

    def _upload(self, B: int) -> None:
        """The staged scalars and the first B table rows to the device. This staging buffer's previous copy (two
        steps ago) finished before that step's results were read."""
        n = self._ROWS * self.max_batch + B * self.max_blocks
        self._inputs[:n].copy_(self._host[self._parity][:n], non_blocking=True)

    def _forward(self, B: int, Lk: int, capture: bool, capture_weights: bool) -> None:
        ids, positions, slots, seq_lens, state_slots = (self._scalars[i, :B] for i in range(self._ROWS))
        nb = -(-Lk // self.block_size)
        batch = ForwardBatch(
            positions=positions,
            slot_mapping=slots,
            block_tables=self._tables[:B, :nb],
            seq_lens=seq_lens,
            cu_seqlens_q=self._arange[: B + 1],
            token_seq=self._arange[:B],
            token_qidx=self._zeros[:B],
            last_token_index=self._arange[:B],
            query_lens=[1] * B,
            max_query_len=1,
            max_seq_len=Lk,
            block_size=self.block_size,
            use_kernels=self.use_kernels,
            state_slots=state_slots,
        )
        routing = StepRouting(ids=self.capture_buf if capture else None,
                              weights=self.weights_buf if capture_weights else None)
        hidden = self.model(ids, batch, self.kv, routing=routing)  # [B, H]
        self.model.compute_logits(hidden, out=self.logits[:B])  # [B, V] float32

    def _capture(self, B: int, Lk: int, capture: bool, capture_weights: bool,
                 level: int = logging.INFO) -> torch.cuda.CUDAGraph:
        t0 = time.monotonic()
        graph = capture_graph(lambda: self._forward(B, Lk, capture, capture_weights), self.pool, self._stream)
        log.log(
            level, "captured a CUDA graph for decode steps of %d sequences, %d keys, routing %s%s (%.0f ms; %d graphs)",
            B, Lk, "on" if capture else "off", " with weights" if capture_weights else "",
            (time.monotonic() - t0) * 1e3, len(self._graphs) + 1,
        )
        return graph
