"""KV blocks: who owns which, which are free, and which hold a cached prefix (with its routing rows).

A sequence's ``block_table`` lists the blocks that hold its tokens' keys and values, in position order. Blocks are
handed out as a sequence grows (``allocate``) and taken back when it ends or is preempted (``free``). Nothing here
touches the device: the cache memory is kv_cache.py's, the block ids are plain ints.

Prefix caching (on by default, as vLLM): a block whose ``block_size`` tokens are all computed gets a hash of
(parent block's hash, its tokens, the sequence's cache key) and is registered; a later sequence whose tokens begin
with the same blocks takes them (reference counted) instead of computing them again. The hash is a chained
multilinear one over 64-bit words (``BlockHasher``), so that a prompt's hundreds of blocks are hashed, looked up and
checked in a few numpy operations: a multi-turn agent's turn admits 32 prompts of ~7,800 tokens before its first
step, and per-block Python work there was time the GPU waited. The cache key holds
everything else that changes the keys and values of those tokens (e.g. forced routing): sequences with different
keys never share blocks. A freed block keeps its hash and contents until it is handed out again: free blocks are
reused least-recently-freed first, so the most recently used prefixes stay longest. A hit is checked beyond the
hash: the block's tokens are the prompt's, and it follows the hit before it (each registered block records its
parent block and that block's generation, bumped whenever a block is handed out), so blocks are shared only
between equal token histories even where hashes collide.

Routing rows travel with the cached blocks: when a block is registered, its tokens' routed experts
[block_size, num_hidden_layers, top_k] are stored beside it (host memory, sized with the KV cache), so that a
request whose prompt hits the cache returns exactly the rows a cold run returns. A block's rows live and die with
its registration: an evicted (re-used) block loses its hash before anyone could read stale rows.
"""
from __future__ import annotations

import collections
import secrets
from dataclasses import dataclass, field

import numpy as np

_U64 = np.uint64


def _mix(v: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 words (wrapping arithmetic): every input bit reaches every output bit."""
    v = v ^ (v >> _U64(30))
    v = v * _U64(0xBF58476D1CE4E5B9)
    v = v ^ (v >> _U64(27))
    v = v * _U64(0x94D049BB133111EB)
    return v ^ (v >> _U64(31))


class BlockHasher:
    """Chained block hashes, all of a prompt's blocks at once.

    Definition (arithmetic modulo 2**64): a block's value is ``v = mix(sum_i tokens[i] * M[i])`` with random odd
    multipliers ``M`` (one per position in the block), and block j's hash is ``h_j = h_{j-1} * B + v_j``, starting
    from ``h_{-1}`` = the cache key's hash (every block's hash depends on the key and on every block before it). The
    recurrence unrolls to ``h_j = B**(j+1) * (h_{-1} + sum_{i<=j} v_i * B**-(i+1))`` (B odd: invertible modulo
    2**64), a cumulative sum: no Python loop over blocks. Parameters are drawn per process, so inputs cannot be
    crafted to collide without seeing them; a collision could only cost a cache miss anyway, since a hit is checked
    against the block's tokens and history (``BlockManager.match_prefix``).
    """

    MASK = 2**64 - 1
    # Up to this many blocks (a decode step filling one) in Python integers: ~20 numpy calls cost ~30 us whatever
    # the size, the recurrence ~3 us a block.
    SCALAR_BLOCKS = 4

    def __init__(self, block_size: int):
        rng = np.random.default_rng(secrets.randbits(128))
        self.mult = rng.integers(0, 2**64, size=block_size, dtype=np.uint64) | _U64(1)  # M
        self._mult = self.mult.tolist()
        self.base = int(rng.integers(0, 2**64, dtype=np.uint64)) | 1  # B
        self._inv = pow(self.base, -1, 2**64)
        self._pow: np.ndarray = np.zeros(0, np.uint64)  # B**(j+1), j = 0, 1, ... (grown on demand)
        self._inv_pow: np.ndarray = np.zeros(0, np.uint64)  # B**-(j+1)

    def _powers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self._pow) < n:
            m = max(n, 2 * len(self._pow), 64)
            self._pow = np.cumprod(np.full(m, self.base, np.uint64))
            self._inv_pow = np.cumprod(np.full(m, self._inv, np.uint64))
        return self._pow[:n], self._inv_pow[:n]

    def seed(self, key: object) -> int:
        return hash(key) & self.MASK

    def __call__(self, parent: int, blocks: np.ndarray) -> list[int]:
        """Hashes of ``blocks`` [n, block_size] (uint64 token ids) following a block whose hash is ``parent``
        (``seed(key)`` for a sequence's first block)."""
        n = len(blocks)
        if n <= self.SCALAR_BLOCKS:
            return self._recurrence(parent, blocks.tolist())
        v = _mix((blocks * self.mult).sum(axis=1, dtype=np.uint64))  # [n]
        pw, inv = self._powers(n)
        return (pw * (_U64(parent) + np.cumsum(v * inv, dtype=np.uint64))).tolist()

    def _recurrence(self, h: int, blocks: list[list[int]]) -> list[int]:
        """The definition block by block, in Python integers (the same values)."""
        mask, base, out = self.MASK, self.base, []
        for block in blocks:
            v = sum(map(int.__mul__, block, self._mult)) & mask
            v ^= v >> 30
            v = v * 0xBF58476D1CE4E5B9 & mask
            v ^= v >> 27
            v = v * 0x94D049BB133111EB & mask
            h = (h * base + (v ^ (v >> 31))) & mask
            out.append(h)
        return out


class NoFreeBlocks(Exception):
    """Raised inside the block manager when an allocation cannot be satisfied (callers get False)."""


@dataclass
class BlockTable:
    """A sequence's blocks and what of them is registered in the prefix cache."""

    blocks: list[int] = field(default_factory=list)
    cache_key: object = None  # sequences share cached blocks only with equal keys
    hashes: list[int] = field(default_factory=list)  # hash of each registered (full, computed) block, in order
    # BlockManager.block_hashes: the chained hashes of the full blocks of the sequence's tokens so far, under
    # memo_key (a sequence's full blocks never change; a new cache key starts the memo again), and those blocks'
    # tokens as hashed, uint64 rows [:len(memo)] of a buffer grown by doubling (what a hit's tokens are compared
    # with, and what registering stores; a decode step that fills a block adds a row, not a copy of the history)
    memo: list[int] = field(default_factory=list)
    memo_tokens: np.ndarray | None = None
    memo_key: object = None
    # The cached block that stands for the last registered block of this table, with its generation: what the
    # next block registers as its parent (None before the first block).
    link: tuple[int, int] | None = None
    # Hybrid models: the sequence's recurrent-state slot (kv_cache.py / layers/recurrent.py), held while it holds
    # blocks (handed out with its first blocks, released with them: at its end or preemption)
    state_slot: int | None = None


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        routing_shape: tuple[int, int] | None = None,  # (num_hidden_layers, top_k): store rows with cached blocks
        routing_dtype: type = np.uint16,
        watermark: float = 0.01,
        num_state_slots: int = 0,  # hybrid models: recurrent-state slots (one per running sequence)
    ):
        self.num_blocks = num_blocks
        self.num_state_slots = num_state_slots
        self.free_state_slots = list(range(num_state_slots - 1, -1, -1))  # popped from the end: lowest first
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks  # None: not registered
        self.hasher = BlockHasher(block_size)
        # A registered block's tokens (guards against hash collisions), with what it follows: its parent block and
        # the parent's generation then (-1 for a first block). A block's generation counts the times it was handed
        # out, so a prefix hit is taken only where every block follows the hit before it as that block was when they
        # were registered: blocks are shared only between equal token histories, whatever the hashes do. Keys,
        # values and routing rows of one prefix never reach a request with another. (A parent is not handed out
        # again while a child is cached: blocks are freed tail first and reused least recently freed first, so a
        # cached entry never goes stale this way.) Tokens and generations as arrays, so that a prompt's hits are
        # checked at once; the parents as a list, walked one by one.
        self.block_tokens = np.zeros((num_blocks, block_size), np.uint64)
        self.block_parent = [-1] * num_blocks
        self.parent_gen = np.zeros(num_blocks, np.int64)
        self.block_gen = [0] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id (registered blocks, in use or free)
        # Free blocks, least recently freed first (OrderedDict: O(1) removal when a cached free block is hit).
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict((b, None) for b in range(num_blocks))
        self.watermark_blocks = max(1, int(watermark * num_blocks)) if num_blocks > 8 else 0
        self.rows = None
        if enable_prefix_caching and routing_shape is not None:
            # Written now, not left to np.zeros' lazy pages: a first write faults its pages in, which made an 8k-token
            # prefill step's rows cost 1.9 ms instead of 0.7 until every page had been written once (and the
            # server's memory would creep up to this size under load instead of showing it at start).
            self.rows = np.empty((num_blocks, block_size, *routing_shape), dtype=routing_dtype)
            self.rows.fill(0)
        # Prefix-cache counters (tokens), for /metrics.
        self.query_tokens = 0
        self.hit_tokens = 0

    @classmethod
    def for_engine(cls, num_blocks: int, settings, cfg) -> "BlockManager":
        """An engine's block manager: ``settings`` (ResolvedConfig) gives the block size and whether cached blocks
        keep routing rows of ``cfg`` (MoEConfig), stored in the dtype the API sends them in."""
        shape = (cfg.num_hidden_layers, cfg.num_experts_per_tok) if settings.keep_routing_rows else None
        return cls(num_blocks, settings.block_size, settings.enable_prefix_caching, routing_shape=shape,
                   routing_dtype=np.dtype(cfg.routed_experts_dtype),
                   num_state_slots=settings.max_num_seqs if cfg.is_hybrid else 0)

    # ------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_cached(self) -> int:
        """Blocks holding a registered prefix (in use or free)."""
        return len(self.cached)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hashes(self, parent: int, blocks: np.ndarray) -> list[int]:
        return self.hasher(parent, blocks)

    def block_hashes(self, table: BlockTable, tokens: list[int], num_blocks: int,
                     prompt_ids: np.ndarray | None = None) -> list[int]:
        """Hashes of the first ``num_blocks`` full blocks of a sequence's ``tokens`` under its table's key, each
        chained to its parent's, computed once per block and kept on the table with the blocks' tokens: admitting a
        sequence looks its blocks up, checks whether another sequence is computing the next one and claims the
        rest, and registering reads them again. The new blocks are hashed together (``BlockHasher``): a
        7,800-token prompt's 487 blocks took ~0.3-0.5 ms as one tuple and one hash per block, and a multi-turn
        agent's turn admits 32 such prompts before its first step. ``prompt_ids``: the first tokens as an int64
        array (the engine's validation made it), read instead of the list where it reaches."""
        if table.memo_key != table.cache_key:
            table.memo.clear()
            table.memo_tokens = None
            table.memo_key = table.cache_key
        memo, bs = table.memo, self.block_size
        have = len(memo)
        if num_blocks > have:
            lo, hi = have * bs, num_blocks * bs
            new = (prompt_ids[lo:hi].astype(np.uint64) if prompt_ids is not None and hi <= len(prompt_ids)
                   else np.array(tokens[lo:hi], dtype=np.uint64)).reshape(-1, bs)
            memo.extend(self._hashes(memo[-1] if memo else self.hasher.seed(table.cache_key), new))
            buf = table.memo_tokens
            if buf is None or len(buf) < num_blocks:
                grown = np.empty((max(num_blocks, 2 * have), bs), np.uint64)
                if have:
                    grown[:have] = buf[:have]
                table.memo_tokens = buf = grown
            buf[have:num_blocks] = new
        return memo[:num_blocks]

    def match_prefix(self, table: BlockTable, tokens: list[int], prompt_ids: np.ndarray | None = None) -> list[int]:
        """The cached blocks that hold a prefix of ``tokens`` under ``table``'s key (whole blocks; at least one
        token is left to compute, so that the last token's logits come from a forward)."""
        if not self.enable_prefix_caching:
            return []
        full = (len(tokens) - 1) // self.block_size
        hashes = self.block_hashes(table, tokens, full, prompt_ids)
        # How many of the prompt's blocks are cached: a cached block's ancestors are cached too (blocks are freed
        # tail first and reused least recently freed first), so they are the first n, found by bisection; their
        # blocks are the n-th's ancestors, by its parent links (a list walk instead of n dictionary lookups: ~0.1 ms
        # less per 7,800-token prompt). Taken when all of them check out, else looked up one by one.
        cached, parent_of = self.cached, self.block_parent
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if hashes[mid] in cached else (lo, mid)
        if lo == 0:
            return []
        chain, b = [0] * lo, cached[hashes[lo - 1]]
        for j in range(lo - 1, 0, -1):
            chain[j] = b
            b = parent_of[b]
            if b < 0:  # a history shorter than the prompt's cached blocks (a collision): look them up
                return self._check_hits(table, list(map(cached.get, hashes)))
        chain[0] = b
        # each the block registered for its hash, the first one a first block (each follows the one before it)
        if parent_of[b] < 0 and list(map(self.block_hash.__getitem__, chain)) == hashes[:lo]:
            hits = self._check_hits(table, chain, linked=True)
            if len(hits) == lo:
                return hits
        return self._check_hits(table, list(map(cached.get, hashes)))

    def _check_hits(self, table: BlockTable, found: list[int | None], linked: bool = False) -> list[int]:
        """The blocks of ``found`` (cached blocks for the prompt's blocks, None where none is) that hold the
        prompt's tokens and follow the hit before them (the first follows nothing) as it was then (its generation):
        the same history. A collision would differ here; the hits end before the first block that does.
        ``linked``: found by the parent links, so each follows the one before it (its generation still checked)."""
        n = found.index(None) if None in found else len(found)
        if n == 0:
            return []
        c = np.array(found[:n], np.int64)
        ok = (self.block_tokens[c] == table.memo_tokens[:n]).all(axis=1)
        if not linked:
            ok &= np.fromiter(map(self.block_parent.__getitem__, found[:n]), np.int64, n) == np.concatenate(
                ([-1], c[:-1]))
        ok[1:] &= self.parent_gen[c[1:]] == np.fromiter(map(self.block_gen.__getitem__, found[: n - 1]), np.int64,
                                                         n - 1)
        return found[:n] if ok.all() else found[: int(ok.argmin())]

    def can_allocate(self, num_new_blocks: int, hits: list[int] = (), watermark: bool = False) -> bool:
        """Whether ``num_new_blocks`` fresh blocks (plus taking ``hits`` out of the free list) fit."""
        taken_free = list(map(self.ref_count.__getitem__, hits)).count(0)
        reserve = self.watermark_blocks if watermark else 0
        return self.num_free - taken_free - num_new_blocks >= reserve

    # ------------------------------------------------------------------ ownership

    def take_hits(self, table: BlockTable, hits: list[int], num_tokens: int) -> None:
        """Give a new (empty) table the cached blocks of its prefix (``num_tokens``: the tokens looked up, for
        the hit rate)."""
        assert not table.blocks
        self.query_tokens += num_tokens
        self.hit_tokens += len(hits) * self.block_size
        ref, free = self.ref_count, self.free
        for b in hits:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1
        table.blocks.extend(hits)
        table.hashes.extend(map(self.block_hash.__getitem__, hits))
        table.link = (hits[-1], self.block_gen[hits[-1]]) if hits else None

    def allocate(self, table: BlockTable, num_tokens: int) -> bool:
        """Grow ``table`` to cover ``num_tokens`` tokens; False (and nothing taken) if the blocks are not free."""
        need = self.blocks_for(num_tokens) - len(table.blocks)
        slot = self.num_state_slots and table.state_slot is None
        if slot and not self.free_state_slots:
            return False  # (not reached: the scheduler runs at most one sequence per slot)
        if need <= 0:
            if slot:
                table.state_slot = self.free_state_slots.pop()
            return True
        if need > self.num_free:
            return False
        if slot:
            table.state_slot = self.free_state_slots.pop()
        for _ in range(need):
            b, _ = self.free.popitem(last=False)  # least recently freed: the coldest cached prefix goes first
            self._evict(b)
            self.block_gen[b] += 1
            self.ref_count[b] = 1
            table.blocks.append(b)
        return True

    def free_table(self, table: BlockTable) -> None:
        """Release a table's blocks; registered ones stay cached until their block is handed out again.
        The tail is freed first, so that a prefix's first blocks are the last to be evicted."""
        for b in reversed(table.blocks):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free[b] = None
        table.blocks.clear()
        table.hashes.clear()
        table.link = None
        if table.state_slot is not None:
            self.free_state_slots.append(table.state_slot)
            table.state_slot = None

    def _evict(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None:
            if self.cached.get(h) == b:
                del self.cached[h]
            self.block_hash[b] = None

    # ------------------------------------------------------------------ prefix cache

    def register(self, table: BlockTable, tokens: list[int], num_computed: int, rows: np.ndarray | None = None,
                 rows_start: int = 0) -> None:
        """Register the table's blocks that ``num_computed`` tokens fill completely (and not yet registered).

        ``rows``: routing rows [n, L, K] of positions rows_start.. (at least up to the last full block) stored
        with each newly registered block, when the manager keeps rows."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(num_computed // bs, len(table.blocks))
        hashes = self.block_hashes(table, tokens, full)  # hashed at admission, most of the time
        row_blocks, row_starts = [], []  # blocks whose rows are stored, and where their rows start in ``rows``
        new_blocks, new_js, parents = [], [], []  # registered now: block, its index in the table, its parent
        for j in range(len(table.hashes), full):
            h = hashes[j]
            b = table.blocks[j]
            table.hashes.append(h)
            parent, table.link = table.link or (-1, 0), (b, self.block_gen[b])  # children follow b, unless ...
            c = self.cached.get(h)
            if c is not None:  # the same prefix was computed twice (two cold requests at once): keep the first
                if ((self.block_parent[c], int(self.parent_gen[c])) == parent
                        and np.array_equal(self.block_tokens[c], table.memo_tokens[j])):
                    table.link = (c, self.block_gen[c])  # ... the cached twin stands for it
                continue
            if self.rows is not None:
                lo = j * bs - rows_start
                if rows is None or lo < 0 or lo + bs > len(rows):
                    continue  # no rows for this block: do not cache it (a hit must return every row)
                row_blocks.append(b)
                row_starts.append(lo)
            self.cached[h] = b
            self.block_hash[b] = h
            new_blocks.append(b)
            new_js.append(j)
            parents.append(parent)
        if new_blocks:
            self.block_tokens[new_blocks] = table.memo_tokens[new_js]
            self.parent_gen[new_blocks] = [g for _, g in parents]
            for b, (p, _) in zip(new_blocks, parents):
                self.block_parent[b] = p
        if row_blocks:  # one copy (and cast) for all of them: half the time of a copy per block
            n, lo = len(row_blocks), row_starts[0]
            if row_starts[-1] - lo == (n - 1) * bs:  # consecutive (the usual case): a view, no gather
                src = rows[lo : lo + n * bs].reshape(n, bs, *rows.shape[1:])
            else:  # (defensive: skipped blocks only ever lead or trail, so the starts are consecutive)
                src = rows[np.asarray(row_starts)[:, None] + np.arange(bs)]
            self.rows[row_blocks] = src

    def cached_rows(self, blocks: list[int], skip: int = 0, out: np.ndarray | None = None) -> np.ndarray | None:
        """Routing rows [len(blocks) * block_size - skip, L, K] of cached blocks from the first block's row
        ``skip`` on: a copy, or written into ``out`` (in its dtype) and returned."""
        if self.rows is None or not blocks:
            return None
        rows = self.rows[blocks].reshape(len(blocks) * self.block_size, *self.rows.shape[2:])[skip:]
        if out is None:
            return rows
        out[...] = rows
        return out

    def flush(self) -> int:
        """Forget every cached prefix (e.g. after a weight update); blocks in use stay with their owners.
        Returns the number of blocks that were registered."""
        n = len(self.cached)
        for b in list(self.cached.values()):
            self.block_hash[b] = None
        self.cached.clear()
        return n
