"""The device side of a step: inputs, CUDA graphs, forward, sampling, one transfer to the host.

``ModelRunner`` owns everything that lives on the device: the model, the paged KV cache (sized from the memory
left after the weights and a profiled peak step: kv_cache.py's budget), the step's output buffer and the CUDA
graphs (decode steps: cuda_graphs.py; prefill and mixed steps of up to ``max_cudagraph_capture_size`` tokens:
prefill_graphs.py). ``launch`` queues a step's forward, sampling and device->host copy and returns before the GPU
is done; ``results`` waits for that copy.

Routing capture: the model writes each MoE layer's top-k ids into a step buffer ``[step_tokens,
num_hidden_layers, top_k]`` (experts.py says where); the step's first T rows travel to the host in the step's
one transfer, together with the sampled tokens. With no request wanting routing in a step (and no prefix cache
keeping rows, and the expert load off), the model gets no buffer and does no capture work.

Expert load (expert_load.py): after the forward, two launches add the step's captured ids to a device counter of
tokens per (MoE layer, expert); its cumulative value goes to the host with the step's transfer when one is due.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from ..layers import invariant as inv
from ..layers.attend import ForwardBatch
from ..layers.experts import StepRouting
from .cuda_graphs import DecodeGraphs
from .expert_load import ExpertLoad
from ..engine_config import ResolvedConfig
from ..kernels import kv_fp8
from .kv_cache import KVCache, blocks_for_budget, kv_cache_budget, state_bytes
from .memory_plan import logits_chunk_rows
from .prefill_graphs import PrefillGraphs
from .sampling import Sampler
from .scheduler import StepPlan, StepResult
from .uploads import upload

log = logging.getLogger(__name__)


@dataclass
class Transfer:
    """A step's tokens and routing rows on their way to the host (CUDA: a pinned buffer + an event)."""

    n: int  # sampled tokens
    rows: int  # routing rows (0: none fetched)
    host: np.ndarray | None = None  # CUDA: [S + S*L*K] int32 view of the pinned buffer
    event: torch.cuda.Event | None = None
    tokens: list[int] | None = None  # CPU: the results themselves
    routing: np.ndarray | None = None
    weights: np.ndarray | None = None
    weight_rows: int = 0  # combine-weight rows fetched (0: none)
    load: object | None = None  # ExpertLoad's snapshot of its counts after this step, when one is due


@dataclass
class StepInputs:
    """Everything a step's forward depends on, on the host: what every rank of a tensor-parallel group needs to
    run the same forward (rank 0 builds it from the plan and broadcasts it, ranks.py). Batch layout from
    ``ForwardBatch.build``'s inputs (each rank builds the same batch)."""

    ids: list[int] | None  # [T] token ids; None: on rank 0's device (a step with rows fed by the step before)
    context: list[int]  # [B] tokens in cache before the step
    query_lens: list[int]  # [B] tokens forwarded
    tables: list[list[int]]  # [B] block tables (the same block ids on every rank)
    state_slots: list[int] | None = None  # [B] recurrent-state slots (hybrid models), else None
    want_routing: bool = False  # capture routed experts (rank 0)
    want_weights: bool = False  # ... and their combine weights
    forced: tuple[np.ndarray, np.ndarray] | None = None  # replay: (mask [T] bool, ids [T, L, K] int64)
    samplers: list[int] = field(default_factory=list)  # plan indices whose last token's logits are sampled
    score_rows: list[int] = field(default_factory=list)  # token rows whose logits prompt scoring reads
    graph: bool = False  # replay a decode CUDA graph
    prefill_graph: bool = False  # replay a prefill-step CUDA graph (prefill_graphs.py)


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued; ``results`` hands out what it produced."""

    plan: StepPlan
    samplers: list[int]  # plan indices that sample a token this step
    tokens: torch.Tensor | None  # [N] sampled tokens on the device (input of an overlapped next step)
    # (chosen [N], top ids [N, n], top values [N, n]) on the host, when asked: filled by the step's transfer (read
    # them after ``results``)
    logprobs: tuple | None
    transfer: Transfer
    prompt_logprobs: dict | None = None  # prompt scoring of this step (StepResult.prompt_logprobs)


class ReleasableMemory:
    """``ModelRunner``'s KV cache and CUDA graphs freed and allocated again (RL: release / resume memory while a
    trainer uses the GPU)."""

    def drop_graphs(self) -> None:
        """Drop the CUDA graphs (they replay the weights' and the KV cache's current addresses)."""
        self.graphs = self.prefill_graphs = None

    def reset_graphs(self) -> None:
        """Drop every captured graph; they are captured again lazily. Needed after the weights or the KV cache
        moved (release / resume); an in-place weight update keeps the addresses, and the graphs."""
        self.drop_graphs()
        if self.graphs_on and self.kv is not None:
            self.make_graphs()

    def release_kv(self) -> int:
        """Free the KV cache (and the graphs that hold its addresses); returns the bytes freed."""
        self.drop_graphs()
        self._kv_blocks, nbytes = self.kv.num_blocks, self.kv.nbytes
        self.kv = None
        return nbytes

    def allocate_kv(self) -> None:
        """The KV cache again, as it was sized at start (zeros); graphs follow with ``reset_graphs``."""
        self.kv = self._new_kv(self._kv_blocks)


def graphs_off_reason(model: torch.nn.Module, settings: ResolvedConfig) -> str | None:
    """Why steps run eagerly, or None when decode steps replay CUDA graphs."""
    if settings.device.split(":")[0] != "cuda":
        return "not on CUDA"
    if not settings.cuda_graphs:
        return "enforce_eager" if settings.max_cudagraph_capture_size else "max_cudagraph_capture_size=0"
    return model.graph_unsafe_reason()


def describe_kv_scales(model: torch.nn.Module) -> None:
    """Log where an FP8 KV cache's scales come from: the checkpoint's (checkpoint.py's ``read_kv_scales``) or 1.0
    (vLLM's default, uncalibrated: values beyond +-448 saturate)."""
    scales = model.kv_scales or []
    found = sum(pair is not None for pair in scales)
    attention = len(model.config.attention_layers)
    if found:
        log.info("FP8 KV cache: k/v scales from the checkpoint for %d of %d attention layers (1.0 for the rest)",
                 found, attention)
    else:
        log.info("FP8 KV cache: the checkpoint has no k_scale / v_scale; using uncalibrated scales of 1.0 (values "
                 "beyond +-448 saturate), as vLLM does")


def build_runner(model: torch.nn.Module, settings: ResolvedConfig, group=None) -> ModelRunner:
    """The runner of an engine, or of one rank of a tensor-parallel group (``group``: the same block count on every
    rank, the smallest): fused kernels switched as ``settings`` say, the KV cache sized by its budget
    (kv_cache.py), CUDA graphs unless ``settings`` or the model rule them out."""
    from .warmup import warm_dense_prefill

    model.use_fused_kernels(settings.fused_kernels, within_rounding=False if settings.exact_kernels else None)
    model.use_batch_invariant(settings.deterministic_inference)
    specs = model.kv_layout()
    dtype = next(model.parameters()).dtype
    kv_dtype = kv_fp8.storage_dtype(settings.kv_cache_dtype, dtype)
    if kv_dtype != dtype:
        describe_kv_scales(model)
    budget = kv_cache_budget(model, specs, settings)
    # hybrid models: every running sequence's recurrent states (and the null slot) first, the blocks from the rest
    states = state_bytes(specs, settings.max_num_seqs, dtype)
    if states:
        log.info("recurrent states: %.3f GiB for %d sequences (%d linear-attention / Mamba layers)", states / 2**30,
                 settings.max_num_seqs, len(model.config.recurrent_layers))
    num_blocks = blocks_for_budget(specs, settings.block_size, kv_dtype, budget - states)
    if group is not None:
        num_blocks = group.min_int(num_blocks)
    if (num_blocks - 1) * settings.block_size < settings.max_model_len:
        raise ValueError(
            f"the KV cache ({budget / 2**30:.2f} GiB, {num_blocks - 1} blocks of {settings.block_size} tokens"
            + (f" after {states / 2**30:.2f} GiB of recurrent states" if states else "") + ") cannot "
            f"hold one sequence of max_model_len={settings.max_model_len}; raise the KV budget or lower max_model_len"
        )
    tokens = (num_blocks - 1) * settings.block_size
    log.info("KV cache: %d tokens, %.2fx max_model_len (%d) at once", tokens, tokens / settings.max_model_len,
             settings.max_model_len)
    if states > budget / 2:  # e.g. Qwen3.5-35B-A3B on an 80 GB GPU: 64 sequences' states ate 3.9 of 4.0 GiB
        per_seq = states / (settings.max_num_seqs + 1)
        log.warning("recurrent states of %d sequences take %.2f of the %.2f GiB KV budget, leaving %d KV tokens: "
                    "each --max-num-seqs fewer gives the KV cache %.1f MiB more", settings.max_num_seqs,
                    states / 2**30, budget / 2**30, tokens, per_seq / 2**20)
    runner = ModelRunner(model, num_blocks, settings)
    if settings.attention_kernels and runner.dtype != torch.float32 and not settings.deterministic_inference:
        warm_dense_prefill(runner, settings.step_tokens)  # (deterministic inference keeps every prompt paged)
    return runner


class ModelRunner(ReleasableMemory):
    def __init__(self, model: torch.nn.Module, num_blocks: int, settings: ResolvedConfig):
        cfg, s = model.config, settings
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = s.block_size
        self.num_state_slots = s.max_num_seqs  # hybrid models: one recurrent-state slot per running sequence
        self.kv_dtype = kv_fp8.storage_dtype(s.kv_cache_dtype, self.dtype)  # float8 e4m3: --kv-cache-dtype fp8
        self.kv = self._new_kv(num_blocks)
        self.null_block = self.kv.null_block
        self.step_tokens = S = s.step_tokens
        # prompt scoring's logits rows at once ([rows, vocab] float32; memory_plan.py): 512 for vocabularies up to
        # 131,072 tokens, fewer for larger ones (333 at GPT-OSS's 201,088)
        self.score_chunk_rows = logits_chunk_rows(cfg.vocab_size)
        L, K = self.routing_shape = cfg.num_hidden_layers, cfg.num_experts_per_tok
        # The step's outputs in one int32 buffer: [S] sampled tokens, then the capture buffer [S, L, K] that each
        # MoE layer writes, then the combine weights [S, L, K] (float32 bits) written when a request asks for them.
        # Preallocated (a decode step allocates nothing; graphs capture its address). Dense layers' columns are
        # never written and stay 0. On CUDA a step's tokens and first T routing rows are one contiguous prefix,
        # fetched with a single copy into pinned memory (the weights' first T rows are a second copy).
        capture_numel = S * L * K if s.enable_routed_experts else 0
        self.step_out = torch.zeros(S + 2 * capture_numel, dtype=torch.int32, device=self.device)
        self.capture_buf = self.step_out[S : S + capture_numel].view(S, L, K) if capture_numel else None
        self.weights_buf = (
            self.step_out[S + capture_numel :].view(torch.float32).view(S, L, K) if capture_numel else None
        )
        cuda = self.device.type == "cuda"
        # Two pinned host copies (an overlapped step's transfer lands while the previous one is read), with
        # numpy views (slicing numpy costs a fraction of slicing torch) and an event each.
        self.step_out_host = (
            [torch.empty(S + 2 * capture_numel, dtype=torch.int32, pin_memory=True) for _ in range(2)] if cuda else None
        )
        self._host_np = [h.numpy() for h in self.step_out_host] if cuda else None
        self._events = [torch.cuda.Event() for _ in range(2)] if cuda else None
        # tokens per (MoE layer, expert), counted on the device from the capture buffer (rank 0: it has the buffer)
        self.expert_load = ExpertLoad(
            cfg.moe_layers, cfg.num_experts, K, S, self.device, window_s=s.expert_load_window,
            recorder_mode=s.expert_distribution_recorder_mode,
            recorder_buffer_size=s.expert_distribution_recorder_buffer_size,
        ) if s.expert_load and self.capture_buf is not None else None
        self._parity = 0
        self.overlap = s.async_scheduling
        # Batched sampling on the device: one host->device copy of the step's sampling parameters, no host sync.
        self.sampler = Sampler(cfg.vocab_size, self.device, max_rows=s.max_num_seqs,
                               batch_invariant=s.deterministic_inference)
        self.batch_invariant = s.deterministic_inference
        # Attention through paged_attention.py's kernels (they read only each sequence's own blocks; MLA: the
        # absorbed decode over the latent blocks, mla_attention.py) on CUDA with the fused kernels on; the reference
        # (gather + SDPA; MLA expands its latents) elsewhere.
        self.use_kernels = s.attention_kernels
        # Steps of up to max_cudagraph_capture_size tokens replay graphs: decode steps of that many sequences (at
        # most max_num_seqs), and prefill and mixed steps of that many tokens where the attention kernels read the
        # cache themselves and the fused experts in every MoE layer (which group the pairs without the host).
        self.graph_max_batch = min(s.max_num_seqs, s.max_cudagraph_capture_size)
        self.max_model_len = s.max_model_len
        self.max_prefill_graph_tokens = (
            min(s.max_cudagraph_capture_size, S)
            if s.attention_kernels and model.prefill_graph_unsafe_reason() is None else 0)
        # keys a prefill graph's step may read in all; None: no bound (MLA: its graphs attend every row absorbed)
        self.prefill_graph_max_key_reads = (model.prefill_graph_max_key_reads() if self.max_prefill_graph_tokens
                                            else None)
        self.graphs_off = graphs_off_reason(model, s)
        self.graphs_on = self.graphs_off is None
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        if self.graphs_on:
            self.make_graphs()
        # Tensor parallelism (ranks.py): ``publish(step, input_ids)`` sends each step to the other ranks before
        # rank 0 runs it; ``on_close`` stops them.
        self.publish = None
        self.on_close = None

    def _new_kv(self, num_blocks: int) -> KVCache:
        """A zeroed KV cache of ``num_blocks`` blocks; an FP8 one with the checkpoint's per-layer scales (or 1.0)."""
        return KVCache(self.model.kv_layout(), num_blocks, self.block_size, self.dtype, self.device,
                       num_state_slots=self.num_state_slots, kv_dtype=self.kv_dtype,
                       kv_scales=self.model.kv_scales)

    def describe_graphs(self) -> str:
        """The CUDA graphs for the start-up log line."""
        if not self.graphs_on:
            return f"off ({self.graphs_off})"
        return f"for decode batches up to {self.graph_max_batch}" + (
            f" and prefill steps up to {self.max_prefill_graph_tokens} tokens" if self.prefill_graphs is not None
            else "")

    def make_graphs(self) -> None:
        """The decode graphs, and the prefill-step graphs when steps of 16+ tokens may replay them (nothing is
        captured yet: ``capture_all`` at start, else each graph when first needed)."""
        self.graphs = DecodeGraphs(self.model, self.kv, max_batch=self.graph_max_batch,
                                   max_model_len=self.max_model_len, capture_buf=self.capture_buf,
                                   weights_buf=self.weights_buf, use_kernels=self.use_kernels,
                                   batch_invariant=self.batch_invariant)
        if self.max_prefill_graph_tokens >= 16:
            self.prefill_graphs = PrefillGraphs(
                self.model, self.kv, self.max_prefill_graph_tokens, self.graph_max_batch, self.max_model_len,
                self.capture_buf, self.weights_buf, logits=self.graphs.logits, pool=self.graphs.pool)


    def _prefill_graph_affordable(self, context: list[int], query_lens: list[int]) -> bool:
        """Whether a step's keys read in all (sum over its tokens of position + 1) stay within the model's bound for
        prefill graphs (MLA: its graphs attend every row absorbed)."""
        bound = self.prefill_graph_max_key_reads
        return bound is None or sum(n * c + n * (n + 1) // 2 for c, n in zip(context, query_lens)) <= bound

    @torch.inference_mode()
    def launch(
        self, plan: StepPlan, want_routing: bool, fed_from: torch.Tensor | None = None
    ) -> LaunchedStep:
        """Queue a step's forward, sampling and device->host transfer; returns before the GPU finishes.

        ``fed_from``: the samples [N] of the step before, on the device, when ``plan`` was planned before its
        results were read (``plan.fed`` says which rows take which sample as their input token)."""
        items, context = plan.items, plan.context
        T = plan.num_tokens
        ids: list[int] | None = []
        input_ids: torch.Tensor | None = None
        rows_fed: list[int] = []
        for i, ((seq, n), c) in enumerate(zip(items, context)):
            if i in plan.fed:  # its token is not on the host yet
                rows_fed.append(len(ids))
                ids.append(0)
            else:
                ids.extend(seq.tokens[c : c + n])
        if rows_fed:
            src = [plan.fed[i] for i in sorted(plan.fed)]
            if len(rows_fed) == T == len(fed_from) and src == list(range(T)):
                input_ids = fed_from  # a decode step of the same sequences: the samples as they are
            else:
                staged = upload(np.array(ids + rows_fed + src, dtype=np.int64), self.device)
                input_ids = staged[:T]
                input_ids[staged[T : T + len(rows_fed)]] = fed_from[staged[T + len(rows_fed) :]]
            ids = None
        want_routing = want_routing and self.capture_buf is not None
        load = self.expert_load
        capture = want_routing or load is not None  # the expert load counts from the capture: rows stay on the device
        want_weights = want_routing and any(s.req.return_routed_weights for s, _ in items)
        forced = self._forced_routing(plan)
        scoring = [i for i, ((s, n), c) in enumerate(zip(items, context))
                   if s.req.prompt_logprobs is not None and c + 1 < s.num_prompt]
        score = self._scoring_rows(plan, scoring) if scoring else None
        step = StepInputs(
            ids=ids, context=list(context), query_lens=[n for _, n in items],
            tables=[seq.table.blocks for seq, _ in items], want_routing=capture, want_weights=want_weights,
            state_slots=[seq.table.state_slot for seq, _ in items] if self.kv.num_state_slots else None,
            forced=forced, samplers=list(plan.samplers), score_rows=score[0] if score else [],
        )
        step.graph = (self.graphs is not None and T == len(items) and forced is None and not scoring
                      and self.graphs.supports(T, max(context) + 1))
        step.prefill_graph = (not step.graph and self.prefill_graphs is not None and forced is None and not scoring
                              and self.prefill_graphs.supports(T, len(items), max(c + n for c, (_, n) in
                                                                                 zip(context, items)))
                              and self._prefill_graph_affordable(context, step.query_lens))
        if self.publish is not None:  # tensor parallelism: the other ranks run the same forward (ranks.py)
            self.publish(step, input_ids)
        logits, hidden = self.forward(step, input_ids)

        samplers = plan.samplers
        tokens = None
        lp = None
        if samplers:
            states = [items[i][0].sampler for i in samplers]
            if all(st.params.greedy and st.params.logprobs is None for st in states):
                tokens = torch.argmax(logits, dim=-1)  # greedy: no parameters to stage (H200, 1 row: 35 vs 96 us)
            else:
                # Each draw is keyed by (seed, output index): a recomputed step after a preemption draws the same.
                draws = [context[i] + items[i][1] - items[i][0].num_prompt for i in samplers]
                batch_s = self.sampler.prepare(states, draws)
                tokens = self.sampler.sample(logits, batch_s)  # [N] long, on the device
                lps = self.sampler.logprobs(logits, tokens, batch_s)
                if lps is not None:
                    lp = tuple(self._to_host(t) if t is not None else None for t in lps)
        prompt_lp = self._prompt_logprobs(plan, score, hidden) if scoring else None
        snapshot = None
        if load is not None:  # queued before the transfer's event: complete when the transfer is
            load.count(self.capture_buf, T, len(samplers))
            snapshot = load.snapshot()
        transfer = self._transfer(tokens, T if want_routing else 0, T if want_weights else 0)
        transfer.load = snapshot
        return LaunchedStep(plan, samplers, tokens, lp, transfer, prompt_lp)

    @torch.inference_mode()
    def forward(self, step: "StepInputs", input_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A step's forward and the logits of its sampling rows: (logits [N, V] float32 or None, hidden [T, H] or
        None for a graph replay). Every rank of a tensor-parallel group runs this with the same ``step``;
        routing is captured where the runner has a capture buffer (rank 0 only)."""
        if step.graph:
            logits = self.graphs.run(step.ids if input_ids is None else input_ids, step.context, step.tables,
                                     step.want_routing, step.want_weights, step.state_slots)  # [T, V]
            return (logits if len(step.samplers) == len(step.context) else logits[step.samplers]), None
        if step.prefill_graph:
            logits = self.prefill_graphs.run(step.ids if input_ids is None else input_ids, step.context,
                                             step.query_lens, step.tables, step.want_routing, step.want_weights)
            return (logits if len(step.samplers) == len(step.context) else logits[step.samplers]), None
        batch = ForwardBatch.build(step.tables, step.context, step.query_lens, self.device, self.block_size,
                                   self.null_block, split_parts=not self.use_kernels,  # parts: reference path only
                                   state_slots=step.state_slots)
        batch.use_kernels = self.use_kernels
        if input_ids is None:
            input_ids = upload(np.array(step.ids, dtype=np.int64), self.device)
        forced = None
        if step.forced is not None:
            forced = tuple(upload(a, self.device) for a in step.forced)
        T = len(input_ids)
        # The sampling rows, picked before the forward is queued: indexing with a host list copies it to the device
        # synchronously, which after the forward made launch wait for the whole forward (the host work done while
        # a step runs, Scheduler.prepare_outputs, then ran after it instead).
        rows = None
        if step.samplers:
            rows = batch.last_token_index
            if len(step.samplers) != len(step.context):
                rows = rows[upload(np.array(step.samplers, dtype=np.int64), self.device)]
        want = self.capture_buf is not None
        routing = StepRouting(
            ids=self.capture_buf[:T] if want and step.want_routing else None,
            weights=self.weights_buf[:T] if want and step.want_weights else None,
            forced_mask=forced[0] if forced else None,
            forced_ids=forced[1] if forced else None,
        )
        hidden = self.model(input_ids, batch, self.kv, routing=routing)  # [T, H]
        logits = None if rows is None else self.model.compute_logits(hidden[rows])  # [N, V] float32
        return logits, hidden

    def score_logits(self, hidden: torch.Tensor, rows: list[int]):
        """Prompt scoring's logits, ``score_chunk_rows`` rows at a time: yields [m, V] float32 for ``rows`` of
        ``hidden`` in order (every rank of a tensor-parallel group runs the same chunks)."""
        rows_t = torch.tensor(rows, dtype=torch.long, device=self.device)
        for lo in range(0, len(rows), self.score_chunk_rows):
            yield self.model.compute_logits(hidden[rows_t[lo : lo + self.score_chunk_rows]])

    def _forced_routing(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray] | None:
        """(mask [T] bool, ids [T, L, K] int64) on the host for a step with replayed routing rows, else None."""
        spans = []
        offset = 0
        for (seq, n), c in zip(plan.items, plan.context):
            replay = seq.req.replay_routed_experts
            if replay is not None and c < len(replay):
                spans.append((offset, replay[c : min(c + n, len(replay))]))
            offset += n
        if not spans:
            return None
        (L, K), T = self.routing_shape, plan.num_tokens
        mask = np.zeros(T, dtype=bool)
        ids = np.zeros((T, L, K), dtype=np.int64)
        for lo, rows in spans:
            mask[lo : lo + len(rows)] = True
            ids[lo : lo + len(rows)] = rows
        return mask, ids

    @staticmethod
    def _scoring_rows(plan: StepPlan, scoring: list[int]) -> tuple[list[int], list[int], list, dict]:
        """Prompt scoring: the step's token rows p whose next token p + 1 is in the prompt, of each scoring
        sequence, with those target tokens, the (plan index, row count) owners and where each one's rows start."""
        rows, targets, owners = [], [], []
        offset = 0
        starts = {}
        for i, ((seq, n), c) in enumerate(zip(plan.items, plan.context)):
            if i in scoring:
                end = min(c + n, seq.num_prompt - 1)  # positions c..end-1 score tokens c+1..end
                starts[i] = len(rows)
                rows.extend(range(offset, offset + end - c))
                targets.extend(seq.tokens[c + 1 : end + 1])
                owners.append((i, end - c))
            offset += n
        return rows, targets, owners, starts

    def _prompt_logprobs(self, plan: StepPlan, score: tuple, hidden: torch.Tensor) -> dict:
        """Prompt scoring: for each scoring sequence's positions p in this step with p + 1 in the prompt, the
        logprob of prompt token p + 1 (and its rank, and the top N) from the logits at p, in chunks of rows so that
        a long prefill chunk never holds [T, vocab] float32 logits at once."""
        rows, targets, owners, starts = score
        top_n = max(plan.items[i][0].req.prompt_logprobs for i, _ in owners)
        targets_t = torch.tensor(targets, dtype=torch.long, device=self.device)
        chosen, ranks, top_ids, top_vals = [], [], [], []
        for lo, logits in zip(range(0, len(rows), self.score_chunk_rows), self.score_logits(hidden, rows)):
            tgt = targets_t[lo : lo + self.score_chunk_rows]
            lse = inv.logsumexp(logits) if self.batch_invariant else torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, tgt[:, None]).squeeze(1)
            chosen.append(picked - lse)
            ranks.append((logits > picked[:, None]).sum(-1) + 1)
            if top_n > 0:
                v, k = inv.top_n(logits, top_n) if self.batch_invariant else torch.topk(logits, top_n, dim=-1)
                top_vals.append(v - lse[:, None])
                top_ids.append(k)
        chosen_h = torch.cat(chosen).cpu().numpy()
        ranks_h = torch.cat(ranks).cpu().numpy()
        ids_h = torch.cat(top_ids).cpu().numpy() if top_n > 0 else None
        vals_h = torch.cat(top_vals).cpu().numpy() if top_n > 0 else None
        out = {}
        for i, m in owners:
            a = starts[i]
            out[i] = (chosen_h[a : a + m], ranks_h[a : a + m],
                      ids_h[a : a + m] if ids_h is not None else None,
                      vals_h[a : a + m] if vals_h is not None else None)
        return out

    def close(self, graceful: bool = True) -> None:
        """Stop what the runner drives (the other ranks of a tensor-parallel group; ``graceful``: no step is in
        flight, they may be told to stop); idempotent."""
        if self.on_close is not None:
            on_close, self.on_close = self.on_close, None
            on_close(graceful)

    def _transfer(self, tokens: torch.Tensor | None, rows: int, weight_rows: int) -> Transfer:
        """Queue the step's device->host transfer: sampled tokens [N] and the first ``rows`` routing rows
        [rows, L, K] (one copy into one of two pinned buffers), and ``weight_rows`` rows of combine weights."""
        n = 0 if tokens is None else tokens.shape[0]
        S, (L, K) = self.step_tokens, self.routing_shape
        routing_end = S + rows * L * K
        w0 = S + S * L * K  # where the weights region starts
        if self.step_out_host is None:  # CPU: done already; copy out before the next step reuses the buffer
            routing = self.step_out[S:routing_end].numpy().reshape(rows, L, K).astype(np.uint16) if rows else None
            weights = self.weights_buf[:weight_rows].numpy().copy() if weight_rows else None
            return Transfer(n, rows, tokens=tokens.tolist() if n else [], routing=routing, weights=weights,
                            weight_rows=weight_rows)
        self._parity ^= 1
        host, event = self.step_out_host[self._parity], self._events[self._parity]
        if n:
            self.step_out[:n].copy_(tokens)
        end = routing_end if rows else n
        if end:
            host[:end].copy_(self.step_out[:end], non_blocking=True)
        if weight_rows:
            w1 = w0 + weight_rows * L * K
            host[w0:w1].copy_(self.step_out[w0:w1], non_blocking=True)
        event.record()
        return Transfer(n, rows, host=self._host_np[self._parity], event=event, weight_rows=weight_rows)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` queued on the stream (CUDA: into pinned memory, without waiting; complete once the
        step's transfer event has fired, which is recorded after it)."""
        if t.device.type != "cuda":
            return t.cpu()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def results(self, step: LaunchedStep) -> StepResult:
        """Wait for a step's transfer and hand back what the step produced."""
        tr = step.transfer
        result = StepResult(step.plan, [], logprobs=step.logprobs, prompt_logprobs=step.prompt_logprobs)
        if tr.host is None:
            if tr.load is not None:
                self.expert_load.collect(tr.load)
            result.tokens, result.routing, result.weights = tr.tokens, tr.routing, tr.weights
            return result
        tr.event.synchronize()
        if tr.load is not None:
            self.expert_load.collect(tr.load)
        S, (L, K) = self.step_tokens, self.routing_shape
        # One conversion for the step, into a fresh array: requests get views of it (no per-request copy).
        if tr.rows:
            result.routing = tr.host[S : S + tr.rows * L * K].reshape(tr.rows, L, K).astype(np.uint16)
        if tr.weight_rows:
            w0 = S + S * L * K
            result.weights = tr.host[w0 : w0 + tr.weight_rows * L * K].view(np.float32).reshape(tr.weight_rows, L, K).copy()
        result.tokens = tr.host[: tr.n].tolist()
        return result
