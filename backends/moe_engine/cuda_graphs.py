"""CUDA graphs for decode-only steps.

A decode step of a small MoE model is a few hundred short kernels; launched one by
one from Python, the GPU waits on the host (the H200 profile of the engine benchmark
spent most of a step in launch overhead). A CUDA graph records the whole forward,
lm_head included, once per shape and replays it with a single launch.

A graph needs fixed shapes and fixed addresses, so a decode step is padded to a
*bucket*: B (sequences) rounded up to the next size in ``batch_buckets`` and the
attended key length rounded up to the next size in ``kv_len_buckets``. Inputs live
in static device buffers, filled with one host-to-device copy per step from a pinned
staging buffer. Padding rows decode token 0 at position 0 of a spare cache slot that
no sequence owns; their logits and routing rows are dropped.

Per row, a padded step computes what an eager step computes: attention masks hide
keys past each row's own length, and every other op is row-wise. When the step's
slots are exactly 0..n-1 (the engine hands out the lowest free slot, so a full or
fresh batch has them), a separate graph reads the cache as a view of the first B
slots instead of gathering each row's slot (padding rows then read, never write,
slots they do not own; their outputs are dropped).

The captured routing ids are written into the engine's step buffer, as in an eager
step; graphs that capture routing and graphs that do not are kept apart, so a step
with no request asking for routing still does no capture work.

Graphs are captured lazily, the first time a bucket is needed, share one memory
pool and write their logits into one buffer: they never run concurrently, and a
step's logits are sampled (on the same stream) before the next replay.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from .attention import ForwardBatch
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


class DecodeGraphs:
    """Captured decode forwards, keyed by (batch bucket, kv-length bucket, capture on/off, slots 0..n-1)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVCache,
        pad_slot: int,
        max_batch: int,
        max_model_len: int,
        capture_buf: torch.Tensor | None,
    ):
        self.model = model
        self.kv = kv
        self.pad_slot = pad_slot
        self.capture_buf = capture_buf  # [>= max_batch, L, K] int32, the engine's step buffer
        self.batch_sizes = batch_buckets(max_batch)
        self.kv_lens = kv_len_buckets(max_model_len)
        self.max_batch = max_batch
        device = kv[0].k.device
        # Rows: token id, position, slot, kv length. Staged on the host, copied in one transfer. Two staging
        # buffers, alternating: with overlapped decode the previous step's copy may not have run yet.
        self._host = [torch.zeros(4, max_batch, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self._host_np = [h.numpy() for h in self._host]
        self._parity = 0
        self._inputs = torch.zeros(4, max_batch, dtype=torch.long, device=device)
        self._arange = torch.arange(max_batch, dtype=torch.long, device=device)
        self._zeros = torch.zeros(max_batch, dtype=torch.long, device=device)
        # Every graph writes its logits into this one buffer (a per-graph output would hold [B, V] float32
        # for each of up to hundreds of graphs: 150 MB each at B=256 and a 150k vocabulary).
        self.logits = torch.empty(max_batch, model.config.vocab_size, dtype=torch.float32, device=device)
        self._graphs: dict[tuple[int, int, bool, bool], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device=device)  # capture and warm-up run off the default stream

    def supports(self, num_seqs: int, max_kv_len: int) -> bool:
        return num_seqs <= self.max_batch and max_kv_len <= self.kv_lens[-1]

    @torch.inference_mode()
    def run(
        self, token_ids: list[int] | torch.Tensor, positions: list[int], slots: list[int], capture: bool
    ) -> torch.Tensor:
        """One decode step of n sequences; returns their logits [n, V] float32 (a view of the buffer every
        graph writes, valid until the next replay). Routing rows land in capture_buf[:n] when capture. ``token_ids``: a list,
        or a device tensor [n] (overlapped decode: the previous step's samples, never seen by the host)."""
        n = len(positions)
        B = _round_up(self.batch_sizes, n)
        Lk = _round_up(self.kv_lens, max(positions) + 1)
        self._parity ^= 1
        host = self._host_np[self._parity]  # numpy view of pinned staging memory (cheaper than torch indexing)
        on_device = isinstance(token_ids, torch.Tensor)
        host[0, :n] = 0 if on_device else token_ids
        host[1, :n] = positions
        host[2, :n] = slots
        host[3, :n] = host[1, :n] + 1
        if B > n:  # padding rows: token 0 at position 0 of the spare slot
            host[0:2, n:B] = 0
            host[2, n:B] = self.pad_slot
            host[3, n:B] = 1
        # This buffer's previous copy (two steps ago) finished before that step's results were read.
        self._inputs.copy_(self._host[self._parity], non_blocking=True)
        if on_device:
            self._inputs[0, :n].copy_(token_ids)
        from_zero = slots == list(range(n))
        key = (B, Lk, capture, from_zero)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._capture(*key)
        g.replay()
        return self.logits[:n]

    def _forward(self, B: int, Lk: int, capture: bool, from_zero: bool) -> None:
        ids, positions, slots, kv_lens = (self._inputs[i, :B] for i in range(4))
        batch = ForwardBatch(
            slot_ids=slots,
            positions=positions,
            token_seq=self._arange[:B],
            token_qidx=self._zeros[:B],
            kv_lens=kv_lens,
            query_lens=[1] * B,
            max_query_len=1,
            max_kv_len=Lk,
            last_token_index=self._arange[:B],
            slot_start=0 if from_zero else None,  # attention reads cache[0:B] as a view, no gather
        )
        buf = self.capture_buf if capture else None
        hidden = self.model(ids, batch, self.kv, buf)  # [B, H]
        self.model.compute_logits(hidden, out=self.logits[:B])  # [B, V] float32

    def _capture(self, B: int, Lk: int, capture: bool, from_zero: bool) -> torch.cuda.CUDAGraph:
        t0 = time.monotonic()
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            # Warm-up run (lazy kernel and workspace initialisation must not happen during capture). It runs
            # the real step's inputs: the KV it writes is what the replay writes again.
            self._forward(B, Lk, capture, from_zero)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                self._forward(B, Lk, capture, from_zero)
        current.wait_stream(self._stream)
        log.info(
            "captured a CUDA graph for decode steps of %d sequences, %d keys, routing %s, %s (%.0f ms; %d graphs)",
            B,
            Lk,
            "on" if capture else "off",
            "slots 0..n-1" if from_zero else "any slots",
            (time.monotonic() - t0) * 1e3,
            len(self._graphs) + 1,
        )
        return graph
