"""Sequences and the scheduler: waiting / running queues, admission by free KV blocks, preemption, step results.

A step's *plan* is a list of (sequence, tokens this step): every running sequence that decodes (one token) first,
then prefill chunks (of new prompts, of prompts too long for one step, and of preempted sequences being recomputed)
within the step's token budget. Admission is first come, first served and by free blocks: a waiting sequence
starts when its prefix-cache hits plus the blocks of its first chunk fit, leaving a small watermark for the
running sequences to grow into. When a running sequence needs a block and none is free, the newest running
sequence is preempted (vLLM V1's policy): its blocks are freed and it waits at the head of the queue to be
recomputed from its prompt and the tokens it already produced.

Nothing a client received is lost or repeated across preemption: tokens stay with the sequence, and routing rows
are handed out by absolute position (``rows_sent``), so a recomputed position whose row already went out is not
sent again. Rows of prefix-cache hits come from the block manager (stored when the blocks were registered).

``process`` turns a finished step's sampled tokens and routing rows into per-request outputs (new tokens, new rows,
stop conditions, finish reasons) and frees what finished sequences held.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .block_manager import BlockManager
from .sequence import OutputCallback, Request, RequestOutput, Sequence, Status

__all__ = ["OutputCallback", "Request", "RequestOutput", "Scheduler", "Sequence", "Status", "StepPlan", "StepResult"]


@dataclass(frozen=True)
class WeightsKey:
    """A prefix-cache key under weights epoch ``epoch`` (epoch 0, the weights loaded at start, keeps plain keys)."""

    epoch: int
    key: object = None  # the sequence's own key


@dataclass
class StepPlan:
    """What one step forwards: (sequence, new tokens) pairs, each one's context before the step, and which of
    them sample a token (those whose last known token is forwarded, and the ``fed`` rows of an overlapped step)."""

    items: list[tuple[Sequence, int]]
    context: list[int]
    samplers: list[int]
    # plan index -> index among the previous step's samples of this row's input token, for rows planned before
    # that step's results were read (``Scheduler.follow``: the token is on the device only)
    fed: dict[int, int] = field(default_factory=dict)
    # plan index -> the routing rows of that sequence's output from this step, the prefix-cache part already
    # filled in (Scheduler.prepare_outputs), the step's own rows still to come
    first_rows: dict[int, np.ndarray] = field(default_factory=dict)

    @classmethod
    def of(cls, items: list[tuple[Sequence, int]]) -> "StepPlan":
        context = [s.num_computed for s, _ in items]
        samplers = [i for i, ((s, n), c) in enumerate(zip(items, context)) if c + n == len(s.tokens)]
        return cls(items, context, samplers)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


@dataclass
class StepResult:
    """What a finished step produced, on the host."""

    plan: StepPlan
    tokens: list[int]  # one per plan.samplers entry
    routing: np.ndarray | None = None  # [T, L, K] uint16 routed experts of the step's tokens
    weights: np.ndarray | None = None  # [T, L, K] float32 combine weights (when a request asked)
    logprobs: tuple | None = None  # (chosen [N], top ids [N, n], top values [N, n]) of the sampled tokens
    # plan index -> (logprob [m] float32, rank [m] int64, top ids [m, N], top logprobs [m, N]) of the prompt
    # tokens after this step's positions (prompt scoring)
    prompt_logprobs: dict | None = None


class Scheduler:
    def __init__(self, blocks: BlockManager, settings, eos_ids: frozenset[int]):
        """``settings``: the engine's ResolvedConfig (sequences at once, tokens per step, max_model_len, whether
        routing rows are kept for the prefix cache)."""
        self.blocks = blocks
        self.max_num_seqs = settings.max_num_seqs
        self.step_tokens = settings.step_tokens
        self.max_model_len = settings.max_model_len
        self.eos_ids = eos_ids
        self.keep_rows = settings.keep_routing_rows  # every step captures routing: keep rows for the prefix cache
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # admission order (the newest last: preempted first)
        self.num_preemptions = 0
        self._computing: dict[int, Sequence] = {}  # prompt-block hash -> the running sequence computing it
        self._preempted_this_round = False  # no admissions in a step that had to preempt
        # Weights epoch (the engine bumps it at every weight update), part of the prefix-cache key of every sequence
        # added (``WeightsKey``): blocks and routing rows computed under other weights never match.
        self.cache_epoch = 0

    # ------------------------------------------------------------------ queues

    def add(self, seq: Sequence) -> None:
        self._key(seq)
        self.waiting.append(seq)

    def bump_cache_epoch(self) -> None:
        """After a weight update: a new weights epoch in the prefix-cache key of every sequence added from now on;
        waiting sequences that hold no blocks compute under the new weights, so they take the new key too (running
        ones keep theirs: their blocks were computed under the old weights)."""
        self.cache_epoch += 1
        for seq in self.waiting:
            if not seq.table.blocks:
                self._key(seq)

    def _key(self, seq: Sequence) -> None:
        key = seq.table.cache_key
        base = key.key if isinstance(key, WeightsKey) else key  # the sequence's own key (e.g. a routing replay)
        seq.table.cache_key = WeightsKey(self.cache_epoch, base) if self.cache_epoch else base

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        return next((s for s in self.waiting if s.request_id == request_id), None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ planning

    def schedule(self) -> StepPlan | None:
        """The next step's plan (None: nothing to run). Grows block tables; may preempt."""
        budget = self.step_tokens
        planned: list[tuple[Sequence, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_remaining, budget)
            if not self._grow(seq, n):
                continue  # seq itself was preempted (it was the newest); running[i] is the next one now
            planned.append((seq, n))
            budget -= n
            i += 1
        if not self._preempted_this_round:
            self._admit(planned, budget)
        self._preempted_this_round = False
        if not planned:
            return None
        # Decodes first, then prefill chunks (the reference attention splits the two; see ForwardBatch.parts).
        planned.sort(key=lambda p: p[1] != 1 or not p[0].is_decoding)
        return StepPlan.of(planned)

    def _grow(self, seq: Sequence, n: int) -> bool:
        """Blocks for seq's next n tokens, preempting the newest running sequences if needed. False if seq
        itself had to be preempted."""
        while not self.blocks.allocate(seq.table, seq.num_computed + n):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it waits at the head of the queue to be recomputed."""
        self.running.remove(seq)
        self.blocks.free_table(seq.table)
        self._release_claims(seq)
        seq.num_computed = 0
        seq.pending_rows, seq.pending_start = [], 0
        seq.prompt_lp = []
        seq.status = Status.PREEMPTED
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self._preempted_this_round = True

    def retract_all(self) -> int:
        """Preempt every running sequence (newest first, so they wait in admission order); returns how many."""
        n = len(self.running)
        while self.running:
            self.preempt(self.running[-1])
        self.num_preemptions -= n  # not memory pressure: neither counted nor holding admissions back
        self._preempted_this_round = False
        return n

    def _admit(self, planned: list[tuple[Sequence, int]], budget: int) -> None:
        """Start waiting sequences, first come first served, while blocks, slots and the token budget last. A
        sequence whose next prompt block another running sequence is computing right now waits for it (then
        takes it from the prefix cache): the choices of an n > 1 request prefill their prompt once."""
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            hits = [] if seq.req.needs_full_prompt else self.blocks.match_prefix(seq.table, seq.tokens, seq.prompt_ids)
            if self._being_computed(seq, len(hits)):
                i += 1
                continue
            cached = len(hits) * self.blocks.block_size
            n = min(len(seq.tokens) - cached, budget)
            new_blocks = self.blocks.blocks_for(cached + n) - len(hits)
            if not self.blocks.can_allocate(new_blocks, hits, watermark=bool(self.running)):
                break  # first come, first served: the head waits for blocks
            del self.waiting[i]
            self.blocks.take_hits(seq.table, hits, len(seq.tokens))
            ok = self.blocks.allocate(seq.table, cached + n)
            assert ok
            if seq.status is Status.WAITING:
                seq.num_cached = min(cached, seq.num_prompt)
            seq.num_computed = cached
            seq.pending_start = cached
            seq.status = Status.RUNNING
            self._claim(seq, len(hits))
            self.running.append(seq)
            planned.append((seq, n))
            budget -= n

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        return self.blocks.block_hashes(seq.table, seq.tokens, num_blocks, seq.prompt_ids)

    def _being_computed(self, seq: Sequence, num_hits: int) -> bool:
        if not self._computing or seq.req.needs_full_prompt or len(seq.tokens) - 1 < (num_hits + 1) * self.blocks.block_size:
            return False
        h = self._hashes(seq, num_hits + 1)[-1]
        owner = self._computing.get(h)
        return owner is not None and owner is not seq

    def _claim(self, seq: Sequence, num_hits: int) -> None:
        """Note the full blocks this sequence's prefill will register (hash -> sequence), until they are."""
        if not self.blocks.enable_prefix_caching:
            return
        full = (len(seq.tokens) - 1) // self.blocks.block_size
        for j, h in enumerate(self._hashes(seq, full)):
            if j >= num_hits and h not in self._computing:
                self._computing[h] = seq
                seq.claims.append(h)

    def _release_claims(self, seq: Sequence, registered_only: bool = False) -> None:
        keep = []
        for h in seq.claims:
            if registered_only and h not in self.blocks.cached:
                keep.append(h)
            elif self._computing.get(h) is seq:
                del self._computing[h]
        seq.claims = keep

    def follow(self, plan: StepPlan) -> StepPlan | None:
        """The step after ``plan``, planned before plan's results are read (overlapped steps): what ``schedule``
        would plan once they are in, but for the tokens plan samples, which stay on the device. Each of plan's
        sequences that samples a token decodes it next (``fed``: its input is plan's sample) unless that token
        ends it on length; its other sequences go on with their prompts, the other running ones as always, and
        waiting ones are admitted into the budget left. A sequence that stops on its token meanwhile forwards one
        row in vain, which ``process`` drops. None when a sequence needs blocks only preemption could free (the
        normal path decides that once the results are in)."""
        where = {id(seq): i for i, (seq, _) in enumerate(plan.items)}
        sampled = {i: j for j, i in enumerate(plan.samplers)}
        budget = self.step_tokens
        planned: list[tuple[Sequence, int]] = []
        contexts: list[int] = []
        fed: dict[int, int] = {}  # index into planned -> index of its input among plan's samples
        for seq in self.running:
            if budget <= 0:
                break
            i = where.get(id(seq))
            if i is None:  # not in plan: its state is final
                c, remaining, src = seq.num_computed, seq.num_remaining, None
            else:
                c, src = plan.context[i] + plan.items[i][1], sampled.get(i)
                if src is not None and self._length_ends(seq, c):
                    continue  # finishes when plan's results are read
                remaining = 1 if src is not None else len(seq.tokens) - c
            n = min(remaining, budget)
            if n <= 0:
                continue
            if not self.blocks.allocate(seq.table, c + n):
                return None
            if src is not None:
                fed[len(planned)] = src
            planned.append((seq, n))
            contexts.append(c)
            budget -= n
        num_running = len(planned)
        self._admit(planned, budget)
        contexts += [seq.num_computed for seq, _ in planned[num_running:]]  # admitted: cached prefix only
        if not planned:
            return None
        # Decodes first, then prefill chunks (as ``schedule``): a fed row decodes, so does a last known token.
        order = sorted(range(len(planned)), key=lambda k: planned[k][1] != 1 or not (
            k in fed or contexts[k] + 1 == len(planned[k][0].tokens)))
        items = [planned[k] for k in order]
        context = [contexts[k] for k in order]
        fed = {new: fed[k] for new, k in enumerate(order) if k in fed}
        samplers = [i for i, ((s, n), c) in enumerate(zip(items, context)) if i in fed or c + n == len(s.tokens)]
        return StepPlan(items, context, samplers, fed=fed)

    def _length_ends(self, seq: Sequence, position: int) -> bool:
        """Whether the token ``seq`` samples for ``position`` (not yet read) ends it on a length limit."""
        return seq.num_output + 1 >= seq.sampler.params.max_tokens or position + 1 >= self.max_model_len

    # ------------------------------------------------------------------ results

    def prepare_outputs(self, plan: StepPlan) -> None:
        """Output work of a launched step that needs none of its results, done while the device computes it: the
        routing rows a sequence's first output takes from the prefix cache, copied into that output's array. A
        multi-turn agent's turn sends each of 32 conversations its ~7,500-row history at its first token; copied
        after the step, the median conversation waited ~14 ms more for it (H200 host)."""
        if self.blocks.rows is None:  # no rows kept with the cache
            return
        for i, ((seq, n), c) in enumerate(zip(plan.items, plan.context)):
            # (a sequence of the step still in flight when ``follow`` planned this one has num_computed < c: its
            # rows before c go out with that step's results)
            if seq.num_computed == c and seq.rows_sent < c and seq.req.return_routed_experts:
                plan.first_rows[i] = self._rows_with_cached(seq, c, n)

    def _rows_with_cached(self, seq: Sequence, c: int, n: int) -> np.ndarray:
        """[c + n - rows_sent, L, K] rows for positions rows_sent .. c + n, those before c (served from the cache)
        copied from their blocks, the last n to be written from the step."""
        bs = self.blocks.block_size
        lo = seq.rows_sent // bs  # only the blocks holding unsent rows (a prompt start skips the rest)
        out = np.empty((c + n - seq.rows_sent, *self.blocks.rows.shape[2:]), np.uint16)
        self.blocks.cached_rows(seq.table.blocks[lo : c // bs], seq.rows_sent - lo * bs, out[: c - seq.rows_sent])
        return out

    def process(self, step: StepResult, emit: Callable[[Sequence, RequestOutput], None]) -> None:
        """Hand a finished step's results to its sequences: tokens, routing rows, stop conditions, outputs."""
        plan, routing, weights, logprobs = step.plan, step.routing, step.weights, step.logprobs
        # A step of one token per sequence (decode) hands out one row each: views made in one C-level pass.
        row_views = list(routing[:, None]) if routing is not None and len(routing) == len(plan.items) else None
        sampled = dict(zip(plan.samplers, range(len(plan.samplers))))
        offset = 0
        for i, (seq, n) in enumerate(plan.items):
            c = plan.context[i]
            offset += n
            if seq.status is not Status.RUNNING or seq.num_computed != c:
                continue  # finished, aborted or preempted while this overlapped step was in flight: dropped
            step_rows = step_weights = None
            if routing is not None:
                step_rows = row_views[i] if row_views is not None else routing[offset - n : offset]
            if weights is not None:
                step_weights = weights[offset - n : offset]
            seq.num_computed += n
            self._keep_rows(seq, step_rows, c)
            if seq.claims:
                self._release_claims(seq, registered_only=True)
            out = seq.output()
            self._rows_to_send(seq, out, step_rows, step_weights, c, n, plan.first_rows.get(i))
            if step.prompt_logprobs is not None and i in step.prompt_logprobs:
                seq.prompt_lp.append(step.prompt_logprobs[i])
            if i in sampled:
                j = sampled[i]
                t = step.tokens[j]
                out.new_token_ids.append(t)
                seq.tokens.append(t)
                seq.num_output += 1
                out.num_output_tokens = seq.num_output
                n_lp = seq.sampler.params.logprobs
                if logprobs is not None and n_lp is not None:
                    out.logprobs = [float(logprobs[0][j])]
                    if n_lp > 0:
                        out.top_logprob_ids = logprobs[1][j : j + 1, :n_lp].numpy()
                        out.top_logprobs = logprobs[2][j : j + 1, :n_lp].numpy()
                if seq.req.prompt_logprobs is not None and not seq.prompt_lp_sent:
                    self._attach_prompt_logprobs(seq, out)
                reason = self._stop_reason(seq, t)
                if reason is not None:
                    self.finish(seq, reason, emit, last=out)
                    continue
            emit(seq, out)

    def _rows_to_send(
        self, seq: Sequence, out: RequestOutput, step_rows: np.ndarray | None, step_weights: np.ndarray | None,
        c: int, n: int, prepared: np.ndarray | None = None,
    ) -> None:
        """The rows (and combine weights) of positions [c, c+n) this request has not been sent yet (none before
        its prompt start, none twice after a preemption), preceded at its first step by the rows of its prefix-
        cache hits (a request that asks for weights takes no hits): ``prepared`` by ``prepare_outputs``, or now."""
        if step_rows is None or not seq.req.return_routed_experts:
            return
        first = max(c, seq.rows_sent)
        rows = step_rows[first - c :] if first < c + n else step_rows[:0]
        if seq.rows_sent < c:  # positions before c were served from the cache: their stored rows go first
            full = prepared if prepared is not None else self._rows_with_cached(seq, c, n)
            full[c - seq.rows_sent :] = rows
            rows = full
        out.routed_experts = rows
        if seq.req.return_routed_weights and step_weights is not None:
            out.routed_weights = step_weights[first - c :] if first < c + n else step_weights[:0]
        seq.rows_sent = max(seq.rows_sent, c + n)

    def _attach_prompt_logprobs(self, seq: Sequence, out: RequestOutput) -> None:
        """All prompt logprobs, once, on the output that completes the prompt."""
        chunks = seq.prompt_lp
        seq.prompt_lp, seq.prompt_lp_sent = [], True
        if not chunks:  # a one-token prompt: nothing to score
            out.prompt_logprobs = np.zeros(0, np.float32)
            out.prompt_logprob_ranks = np.zeros(0, np.int64)
            return
        out.prompt_logprobs = np.concatenate([ch[0] for ch in chunks])
        out.prompt_logprob_ranks = np.concatenate([ch[1] for ch in chunks])
        if seq.req.prompt_logprobs:
            N = seq.req.prompt_logprobs
            out.prompt_top_logprob_ids = np.concatenate([ch[2][:, :N] for ch in chunks])
            out.prompt_top_logprobs = np.concatenate([ch[3][:, :N] for ch in chunks])

    def _keep_rows(self, seq: Sequence, step_rows: np.ndarray | None, c: int) -> None:
        """Register the blocks this step filled, with their rows when the prefix cache keeps rows."""
        if not self.blocks.enable_prefix_caching:
            return
        if self.blocks.rows is None:
            self.blocks.register(seq.table, seq.tokens, seq.num_computed)
            return
        if step_rows is None:
            return  # rows were not captured (capture off for this step): such blocks are not cached
        if c != seq.pending_start + sum(len(r) for r in seq.pending_rows):
            seq.pending_rows, seq.pending_start = [], c  # a gap (should not happen): restart at this step
        seq.pending_rows.append(step_rows)
        bs = self.blocks.block_size
        if seq.num_computed // bs > seq.pending_start // bs:  # a block filled up: register, keep the tail
            rows = np.concatenate(seq.pending_rows) if len(seq.pending_rows) > 1 else seq.pending_rows[0]
            self.blocks.register(seq.table, seq.tokens, seq.num_computed, rows, seq.pending_start)
            keep_from = (seq.num_computed // bs) * bs
            seq.pending_rows = [rows[keep_from - seq.pending_start :]]
            seq.pending_start = keep_from

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.sampler.params
        if seq.num_output >= p.min_tokens:
            if token in p.stop_token_ids:
                return "stop"
            if not p.ignore_eos and token in self.eos_ids:
                return "stop"
        if seq.num_output >= p.max_tokens or len(seq.tokens) >= self.max_model_len:
            return "length"
        return None

    def finish(
        self,
        seq: Sequence,
        reason: str,
        emit: Callable[[Sequence, RequestOutput], None],
        last: RequestOutput | None = None,
        error: str | None = None,
    ) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status in (Status.WAITING, Status.PREEMPTED) and seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_table(seq.table)
        self._release_claims(seq)
        seq.status = Status.FINISHED
        seq.pending_rows = []
        out = last or seq.output()
        out.finished, out.finish_reason, out.error = True, reason, error
        emit(seq, out)
