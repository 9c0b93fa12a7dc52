"""CUDA graphs for prefill and mixed steps of up to a few thousand tokens.

An eager step launches every kernel from Python: at the Qwen3-30B-A3B shape ~1,650 launches, 35-65 ms of host
time for a step of 128 to 2,000 new tokens whose GPU work is shorter (``loadtest/bench/bench_prefill_steps.py --host``).
Such steps are common in serving: a short prompt alone, a multi-turn agent's new turn after its cached history,
prompts admitted while other sequences decode (continuous batching: a step after sequences end). A step that
carries prompt tokens, at most ``max_tokens`` of them in all, replays a graph captured for its token bucket instead
(vLLM's full CUDA graphs for mixed batches); decode-only steps keep their own graphs (cuda_graphs.py).

A replayed step is padded to T_pad tokens (the next size in ``token_buckets``) and always ``max_seqs + 1``
sequences, so that a graph depends on nothing but T_pad: the attention kernel's grid is T_pad // BLOCK_Q + B and
its programs loop over each sequence's own keys; block tables are staged at their full width.

* sequences 0..n-1 are the step's, with its T tokens in order, as an eager step lays them out;
* sequence n is the padding: T_pad - T tokens of token 0 at rotary position 0, each writing its k/v at null-block
  slot i % block_size (the null block belongs to no sequence) and attending over those slots through a table row
  of null blocks (the kernel numbers them 0..T_pad - T - 1: the table is wide enough for that whatever
  max_model_len is). Real embeddings through every layer: the router and the experts see ordinary rows. Their
  logits and routing rows are dropped;
* sequences n+1.. have no tokens and no keys (their programs exit).

Inputs are static device buffers filled with one host-to-device copy per step from pinned staging memory (two
staging buffers, alternating, as the decode graphs). Logits come out for the first ``max_seqs`` sequences' last
tokens, into the buffer the decode graphs write (graphs never run concurrently, and a step's logits are sampled
on the same stream before the next replay).

A row's result is what an eager step of the same tokens computes up to the kernels' choices by step size: the
padded token count picks the fused experts' tiles and cuBLAS's algorithms for the projections, so the two agree
within bfloat16 rounding (the same expert ids and tokens on the tiny model's tests), not bit for bit.

Only steps that need nothing per token on the host qualify (``ModelRunner`` decides): no replayed routing rows,
no prompt logprobs (they read logits at every prompt position), the paged attention kernels (the reference path
reads host copies) and the fused experts in every MoE layer (``kernels.route`` groups a step's pairs on the device,
at any size). MLA models attend every row of a replayed step through the absorbed decode kernel, each token a
query of its own (their eager steps expand prompt rows with host-sized buffers), within a bound on the keys the
step reads (``MoEForCausalLM.prefill_graph_max_key_reads``).
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..layers.attend import ForwardBatch
from ..layers.experts import StepRouting
from .cuda_graphs import capture_graph
from .kv_cache import KVCache

log = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> list[int]:
    """Multiples of 16 to 128, of 32 to 256, of 64 to 512, of 128 to 1,024, of 256 beyond, and max_tokens: padding
    adds at most 25% (16 at the smallest)."""
    sizes = [*range(16, 129, 16), *range(160, 257, 32), *range(320, 513, 64), *range(640, 1025, 128),
             *range(1280, max_tokens + 256, 256)]
    return [t for t in sizes if t < max_tokens] + [max_tokens]


@dataclass(frozen=True)
class StagingLayout:
    """Where a replayed step's inputs sit in one flat int64 buffer (pinned staging and its device copy alike):
    per token [3, max_tokens] (ids, positions, cache slots), per sequence seq_lens [B], the last token's index [B]
    and cu_seqlens_q [B + 1], then the block tables [B, max_blocks]."""

    max_tokens: int
    num_seqs: int  # B: the step's sequences at most, plus the padding one
    max_blocks: int  # table width: a max_model_len sequence's blocks, and the padding sequence's (<= max_tokens)

    @classmethod
    def for_engine(cls, max_tokens: int, max_seqs: int, max_model_len: int, block_size: int) -> "StagingLayout":
        return cls(max_tokens, max_seqs + 1, -(-max(max_model_len, max_tokens) // block_size))

    @property
    def tables_at(self) -> int:
        return 3 * self.max_tokens + 3 * self.num_seqs + 1

    @property
    def size(self) -> int:
        return self.tables_at + self.num_seqs * self.max_blocks

    def views(self, buf):
        """(tokens [3, max_tokens], seq_lens [B], last [B], cu [B + 1], tables [B, max_blocks]) of a numpy array or
        a torch tensor of ``size`` elements."""
        M, B, a = self.max_tokens, self.num_seqs, 3 * self.max_tokens
        return (buf[:a].reshape(3, M), buf[a : a + B], buf[a + B : a + 2 * B], buf[a + 2 * B : a + 3 * B + 1],
                buf[self.tables_at :].reshape(B, self.max_blocks))


def stage_step(host: np.ndarray, layout: StagingLayout, token_ids, context: list[int], query_lens: list[int],
               tables: list[list[int]], padded_tokens: int, null_block: int, block_size: int) -> int:
    """Write a step's layout (module docstring) into ``host``: its n sequences' tokens, then the padding sequence
    of ``padded_tokens`` - T tokens over the null block, then sequences without tokens. ``token_ids``: a list, or
    None (ids copied on the device). Returns how many leading elements the step uses (the table rows past the
    padding one are never read)."""
    tok, seq_lens, last, cu, rows = layout.views(host)
    n, bs, Tp = len(query_lens), block_size, padded_tokens
    q = np.asarray(query_lens, dtype=np.int64)
    c = np.asarray(context, dtype=np.int64)
    cu[0] = 0
    np.cumsum(q, out=cu[1 : n + 1])
    T = int(cu[n])
    for i, table in enumerate(tables):
        rows[i, : len(table)] = table
    token_seq = np.repeat(np.arange(n), q)  # [T]
    pos = c[token_seq] + np.arange(T) - cu[token_seq]  # [T]
    if token_ids is not None:
        tok[0, :T] = token_ids
    tok[1, :T] = pos
    tok[2, :T] = rows[token_seq, pos // bs] * bs + pos % bs
    seq_lens[:n] = c + q
    last[:n] = cu[1 : n + 1] - 1
    P = Tp - T
    tok[0, T:Tp] = 0
    tok[1, T:Tp] = 0  # rotary position 0: the padding's positions may run past max_model_len (and the rotary table)
    tok[2, T:Tp] = null_block * bs + np.arange(P) % bs
    rows[n, : -(-P // bs)] = null_block
    seq_lens[n] = P
    seq_lens[n + 1 :] = 0
    last[n:] = 0
    cu[n + 1 :] = Tp
    return layout.tables_at + (n + 1) * layout.max_blocks


def replay_batch(inputs: torch.Tensor, layout: StagingLayout, Tp: int, max_model_len: int, block_size: int,
                 zeros: torch.Tensor | None = None) -> ForwardBatch:
    """The ForwardBatch of a replayed step of Tp tokens over the staged ``inputs`` (``layout.size`` int64 on the
    device): nothing in it is read on the host, so that one graph serves every step of the bucket."""
    tokens, seq_lens, last, cu, tables = layout.views(inputs)
    zeros = inputs.new_zeros(Tp) if zeros is None else zeros[:Tp]  # [Tp] (a graph passes a static buffer)
    B = layout.num_seqs
    return ForwardBatch(
        positions=tokens[1, :Tp],
        slot_mapping=tokens[2, :Tp],
        block_tables=tables,
        seq_lens=seq_lens,
        cu_seqlens_q=cu,
        token_seq=zeros,  # read by the reference attention only
        token_qidx=zeros,
        last_token_index=last,
        query_lens=[0] * B,  # host lengths: read by the reference path and the dense prefill only
        max_query_len=Tp,  # > 1: the 2-D kernel with the prefill tiles, as an eager step
        max_seq_len=max_model_len,
        block_size=block_size,
        dense_from=B,  # no dense prefill (one SDPA call per prompt from host lengths)
        use_kernels=True,
        host_lengths=False,  # MLA: every row through the absorbed kernel (layers/mla.py)
    )


class PrefillGraphs:
    """Captured forwards of steps that carry prompt tokens, keyed by (token bucket, capture, capture weights)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVCache,
        max_tokens: int,
        max_seqs: int,
        max_model_len: int,
        capture_buf: torch.Tensor | None,  # [>= max_tokens, L, K] int32, the engine's step buffer
        weights_buf: torch.Tensor | None,  # [>= max_tokens, L, K] float32
        logits: torch.Tensor,  # [>= max_seqs, V] float32, shared with the decode graphs
        pool,  # CUDA graph memory pool, shared with the decode graphs
    ):
        self.model, self.kv = model, kv
        self.block_size = kv.block_size
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.token_sizes = token_buckets(max_tokens)
        self.max_model_len = max_model_len
        self.capture_buf, self.weights_buf, self.logits = capture_buf, weights_buf, logits
        self._pool = pool
        self.layout = StagingLayout.for_engine(max_tokens, max_seqs, max_model_len, self.block_size)
        # two pinned staging buffers, alternating (as the decode graphs'), and their device copy
        self._host = [torch.zeros(self.layout.size, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self._host_np = [h.numpy() for h in self._host]
        self._parity = 0
        device = kv[0].k.device
        self._inputs = torch.zeros(self.layout.size, dtype=torch.long, device=device)
        tokens, self._seq_lens, self._last, self._cu, self._tables = self.layout.views(self._inputs)
        self._ids = tokens[0]
        self._zeros = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self._graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}
        self.replays = 0  # steps run through a graph
        self._stream = torch.cuda.Stream(device=device)

    def supports(self, num_tokens: int, num_seqs: int, max_seq_len: int) -> bool:
        return num_tokens <= self.max_tokens and num_seqs <= self.max_seqs and max_seq_len <= self.max_model_len

    @torch.inference_mode()
    def run(
        self, token_ids: list[int] | torch.Tensor, context: list[int], query_lens: list[int],
        tables: list[list[int]], capture: bool, capture_weights: bool = False,
    ) -> torch.Tensor:
        """One step of n sequences (``context`` tokens cached, ``query_lens`` forwarded, block ``tables``);
        returns the logits of each sequence's last token [n, V] float32 (a view of the shared buffer, valid until
        the next replay). Routing rows land in capture_buf[:T] when capture."""
        n, T = len(query_lens), sum(query_lens)
        Tp = self.token_sizes[bisect.bisect_left(self.token_sizes, T)]
        on_device = isinstance(token_ids, torch.Tensor)
        self._stage(None if on_device else token_ids, context, query_lens, tables, Tp)
        if on_device:
            self._ids[:T].copy_(token_ids)
        key = (Tp, capture, capture and capture_weights)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._capture(*key)
        g.replay()
        self.replays += 1
        return self.logits[:n]

    @torch.inference_mode()
    def capture_all(self, capture: bool) -> None:
        """Capture every token bucket's graph now (largest first: the smaller graphs' memory comes out of the pool
        the largest one made), on steps that are all padding."""
        t0 = time.monotonic()
        for Tp in reversed(self.token_sizes):
            key = (Tp, capture, False)
            if key not in self._graphs:
                self._stage([], [], [], [], Tp)
                self._graphs[key] = self._capture(*key, level=logging.DEBUG)
        log.info("captured CUDA graphs for prefill and mixed steps of %s tokens, routing %s, in %.1f s",
                 ", ".join(map(str, self.token_sizes)), "on" if capture else "off", time.monotonic() - t0)

    def _stage(self, token_ids, context: list[int], query_lens: list[int], tables: list[list[int]], Tp: int) -> None:
        """Stage the step in the next pinned buffer and copy what it uses to the device (the buffer's previous copy,
        two steps ago, finished before that step's results were read)."""
        self._parity ^= 1
        used = stage_step(self._host_np[self._parity], self.layout, token_ids, context, query_lens, tables, Tp,
                          self.kv.null_block, self.block_size)
        self._inputs[:used].copy_(self._host[self._parity][:used], non_blocking=True)

    def _forward(self, Tp: int, capture: bool, capture_weights: bool) -> None:
        batch = replay_batch(self._inputs, self.layout, Tp, self.max_model_len, self.block_size, self._zeros)
        routing = StepRouting(ids=self.capture_buf if capture else None,
                              weights=self.weights_buf if capture_weights else None)
        hidden = self.model(self._ids[:Tp], batch, self.kv, routing=routing)  # [Tp, H]
        S = self.max_seqs
        self.model.compute_logits(hidden[self._last[:S]], out=self.logits[:S])  # [S, V] float32

    def _capture(self, Tp: int, capture: bool, capture_weights: bool,
                 level: int = logging.INFO) -> torch.cuda.CUDAGraph:
        t0 = time.monotonic()
        graph = capture_graph(lambda: self._forward(Tp, capture, capture_weights), self._pool, self._stream)
        log.log(level, "captured a CUDA graph for prefill and mixed steps of %d tokens, routing %s%s (%.0f ms; %d "
                "graphs)", Tp, "on" if capture else "off", " with weights" if capture_weights else "",
                (time.monotonic() - t0) * 1e3, len(self._graphs) + 1)
        return graph
