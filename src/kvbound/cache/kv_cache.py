"""KV cache of one sequence: per-layer slots, per-(slot, KV head) positions and scores, and a policy.

Layout: K/V of layer l live in `k[l]`, `v[l]` shaped [slots, kv_heads, head_dim]; the cache's tokens
are always slots [0, n). With kv-head granularity each KV head keeps its own tokens, so one slot holds
different tokens in different heads; attention does not care, because keys are stored rotated.

Eviction is slot replacement. The buffer holds budget + evict_every slots (`policy.capacity`). At evict_every = 1, once the
cache is full each head has one free slot: the last evicted token's. A decoded token is written into
it, attends over all budget + 1 slots in place (no gather, no concatenation), and the policy's victim's
slot becomes the next free one; nothing is moved. With evict_every = e the cache holds up to budget + e - 1 tokens, then evicts down to
budget. A prefill chunk longer than the spare room attends over the cache plus the chunk, and its
kept tokens are written straight into the evicted slots.

The attention steps themselves (steady-state eviction, prefill chunks over budget, decode over a slot
table) live in `steps.py` and are shared with the engine's batched row groups: a cache is a batch of one.
"""
from __future__ import annotations

from copy import copy

import torch

from ..errors import KvboundError
from .adaptive_cache import AdaptiveKVCache
from .policies import FullPolicy, refuse_prompt_scoring
from .reconstruct import check_scorable, prompt_kv
from .quant import QuantizedStore, RecentResiduals, check_mixed_policy
from .stacked import StackedMeta, release
from .merge import attention_bias
from .steps import (WindowRead, chunk_attend, evict_decode, evict_merged, fresh_scores, keep_and_rewrite,
                    merge_dropped, piece_attention, read_kv, rescored, table_attention)
from .store import DenseStore


def make_store(layers, slots, heads, head_dim, device, dtype, kv_bits=None, group_size=64,
               quantized_kv_start=0):
    """A sequence's own store: dense, or packed when `kv_bits` (one width) is given."""
    if kv_bits is None:
        return DenseStore(layers, slots, heads, head_dim, device, dtype)
    return QuantizedStore(layers, slots, heads, head_dim, device, dtype, kv_bits, group_size, quantized_kv_start)


def recent_residuals(config, policy, kv_bits, group_size, device, rows: int = 1) -> RecentResiduals | None:
    """Mixed widths (kv_bits heavy=4,recent=8): the residuals that keep the recent window at 8-bit precision
    over a 4-bit store, for `rows` caches. None for one width."""
    if not isinstance(kv_bits, dict):
        return None
    check_mixed_policy(policy)
    return RecentResiduals(rows, config.num_layers, config.num_kv_heads, config.head_dim, policy.sink, policy.recent,
                           group_size, device)


def sequence_cache(config, policy=None, **kw):
    """One sequence's own cache: a `KVCache`, or an `AdaptiveKVCache` for a policy whose heads or layers keep
    different numbers of tokens. kw: KVCache's."""
    if policy is not None and policy.adapts:
        return AdaptiveKVCache(config, policy, **kw)
    return KVCache(config, policy, **kw)


class KVCache:
    def __init__(self, config, policy=None, device="cpu", dtype=torch.float32, kv_bits=None,
                 kv_group_size: int = 64, quantized_kv_start: int = 0, initial_slots: int = 256, store=None,
                 stacked: tuple[StackedMeta, int] | None = None, rotate_keys=None):
        """dtype: the dtype unquantized K/V are stored in (bf16 for a realistic cache; the model's dtype
        for bit-exact comparisons). store: where K/V live (default: a store of this cache's own; the
        engine passes a PagedStore over its shared block pool, which grows only when `prepare` asks).
        stacked: (StackedMeta, row) whose row holds this bounded cache's positions, scores and spare slots,
        so that the engine updates a batch of such caches in one operation.
        rotate_keys: re-index RoPE positions within the cache, as StreamingLLM does (the model's `rerotate`):
        the kept tokens of each head sit at positions 0, 1, ... in stream order and the new tokens follow,
        so a bounded cache can run past the model's context. Keys are re-rotated when eviction shifts them,
        so they are kept in float32 in a dense store."""
        self.cfg = config
        self.policy = policy or FullPolicy()
        self.bounded = self.policy.bounded
        self.budget = self.policy.budget
        if self.policy.merge and rotate_keys is not None:
            raise KvboundError(f"merge={self.policy.merge}: merging needs stream positions (no re-indexed positions)")
        if self.policy.reconstructs and rotate_keys is not None:
            raise KvboundError(f"{self.policy.name} keeps a prompt's keys where they were read (no re-indexed "
                               "positions)")
        layers, h = config.num_layers, config.num_kv_heads
        cap = self.policy.capacity if self.bounded else initial_slots
        self.ring = None  # mixed widths' residuals: a one-row view (row 0 is this cache, as for pos and score)
        if isinstance(kv_bits, dict):
            if quantized_kv_start:
                raise KvboundError("--quantized-kv-start and mixed widths (--kv-bits heavy=4,recent=8): choose one")
            ring = stacked[0].ring if stacked is not None and self.bounded else None
            self.ring = (ring.row(stacked[1]) if ring is not None
                         else recent_residuals(config, self.policy, kv_bits, kv_group_size, device))
            kv_bits = kv_bits["heavy"]
        if store is not None:
            if kv_bits is not None and self.ring is None:
                raise KvboundError("the paged engine's pool packs K/V itself (kv_bits must be None, or mixed widths)")
            cap = cap if self.bounded else store.capacity
        self.store = store if store is not None else make_store(
            layers, cap, h, config.head_dim, device, dtype, kv_bits, kv_group_size, quantized_kv_start)
        self.stacked = stacked if self.bounded else None
        if self.stacked is not None:
            stacked[0].hold(stacked[1], self)
            self.pos.fill_(-1)
            if self.score is not None:
                self.score.zero_()
            if self.count is not None:
                self.count.fill_(1.0)
        else:
            self.pos = torch.full((layers, cap, h), -1, dtype=torch.int32, device=device)  # stream positions
            self.score = (torch.zeros((layers, cap, h), dtype=torch.float32, device=device) if self.policy.score
                          else None)
            self.spare = torch.zeros((layers, h), dtype=torch.long, device=device)
            # a merging policy's: the tokens each (slot, head) stands for (`merge`)
            self.count = torch.ones((layers, cap, h), device=device) if self.policy.merge else None
        self.n = [0] * layers  # live tokens per layer
        # per layer, once full: each head has a free slot, spare[layer, head] (the last victim's)
        self.has_spare = [False] * layers
        self.seen = 0  # tokens processed so far: the next token's position
        self.prompt_scored = False  # a policy that scores its prompt at once (KVzip) has done so (`keep_scored`)
        self.device = device
        self.one_row = torch.zeros(1, dtype=torch.long, device=device)  # this cache as a batch of one
        self.rotate_keys = rotate_keys
        if rotate_keys is not None and not (self.bounded and isinstance(self.store, DenseStore)
                                            and dtype == torch.float32):
            raise KvboundError("re-indexed positions need a bounded policy and float32 K/V in a dense store "
                               "(no --kv-bits): keys are re-rotated as eviction shifts them")

    @property
    def capacity(self) -> int:
        return self.pos.shape[1]

    def bind_stacked(self):
        """Point pos, score, spare (and mixed widths' residuals) at this cache's row of its stacked metadata (again
        when the rows grow)."""
        meta, row = self.stacked
        self.pos, self.score, self.spare, self.count = meta.views(row)
        if meta.ring is not None and self.ring is not None:
            self.ring = meta.ring.row(row)

    def __len__(self) -> int:
        return self.n[0]

    def next_positions(self, t: int) -> torch.Tensor:
        """Positions of the next t tokens for RoPE: the tokens processed so far, or with re-indexed
        positions the tokens held."""
        start = self.n[0] if self.rotate_keys is not None else self.seen
        return torch.arange(start, start + t, device=self.device)

    def advance(self, t: int):
        self.seen += t

    # --- used by the paged engine ---------------------------------------------------------------
    def step_kind(self, t: int) -> str | None:
        """Which batched step of the engine a step of t tokens of this cache can join: "prefill" (a prefill
        piece of an unbounded cache), "append" (an unbounded decode), "evict" (a steady bounded decode on
        stacked rows), "chunk" (a prefill piece past a bounded cache's room, which keeps `budget` of its tokens and
        the piece's, on stacked rows), "fill" (a prefill piece of a bounded cache with room for it, on stacked rows),
        or None (this cache's own `attend`). A cache that evicts every e steps decodes in the "evict" group while it
        has room (it evicts nothing there), and its decode that fills the room is a one-token "chunk"."""
        if not self.bounded:
            if t == 1:
                return "append"
            return "prefill"
        if self.stacked is None:
            return None
        if self.has_spare[0]:
            if t > 1:
                return None
            return "chunk" if self._decode_fills_room(self.n[0]) else "evict"
        if self.n[0] + t < self.policy.capacity:
            return "fill"
        # a piece that exactly fills the room is written, then evicts one (`attend`); a cache that evicts every e
        # steps then keeps its budget of all of them, as a longer piece does
        return "chunk" if self.n[0] + t > self.policy.capacity or self.policy.evict_every > 1 else None

    @property
    def table_row(self) -> int:
        """This cache's row in the block pool's tables (paged stores)."""
        return self.store.row

    def next_slot(self) -> int:
        """The pool slot an unbounded cache's next token goes to (paged stores)."""
        return self.store.pool_slot(self.n[0])

    def appended(self, t: int):
        """Bookkeeping after a batched step wrote and attended t new tokens in every layer of an unbounded cache."""
        self.n = [self.n[0] + t] * len(self.n)
        self.advance(t)

    def chunked(self, t: int):
        """Bookkeeping after a batched step kept `budget` of a bounded cache's tokens and a piece of t new ones."""
        self.n = [self.budget] * len(self.n)
        self.advance(t)

    def slots_needed(self, t: int, layer: int = 0) -> int:
        """Local slots that a step of t more tokens may touch."""
        used = self._slots_used(layer) + t
        return min(used, self.capacity) if self.bounded else used

    def prepare(self, t: int):
        """Before a step of t tokens in the paged engine: room for them, and private copies (copy-on-write)
        of the shared blocks they may write. A bounded cache never writes the slots of its protected prefix
        (sinks and pinned spans from position 0, e.g. a cached system prompt), so those blocks stay shared."""
        self._grow(self.slots_needed(t))
        self.store.make_private(self.writable_from() // self.store.pool.block_size)

    def take_spare(self):
        """Before a decode in the paged engine: a bounded cache with no spare slot yet (its prompt just ended, at its
        budget or below) takes the empty slot after its tokens as every head's spare, the slot its own `attend`
        would write into, so that its decodes join the batched "evict" group. Below the budget they evict nothing
        (`steps.evict_decode`) until the cache is full; a cache that evicts every e steps keeps its next free slot as
        the spare (`decoded`, `runner.ChunkGroup`)."""
        if self.stacked is not None and not self.has_spare[0]:
            self.spare.fill_(self.n[0])
            self.has_spare = [True] * len(self.has_spare)

    def decode_slots(self) -> int:
        """The local slots a decode attends over: those holding tokens and the new token's."""
        return self.n[0] + 1

    def decoded(self):
        """Bookkeeping after a batched "evict" step: the new token took the spare slot, and a cache below its
        budget (or with room, evicting every e steps) evicted nothing, so it holds one more."""
        self.n = [self._held_after_decode(self.n[0])] * len(self.n)
        self.advance(1)

    def _decode_fills_room(self, n: int) -> bool:
        """Whether a decode of a cache holding n tokens fills the room of one that evicts every e steps: it then
        keeps the budget as a one-token piece does (the engine's "chunk"), instead of taking the spare slot."""
        return self.policy.evict_every > 1 and n + 1 == self.policy.capacity

    def _held_after_decode(self, n: int) -> int:
        """Tokens held after a decode into the spare slot: at evict_every = 1 a full cache evicts one; a cache
        that evicts every e steps has room for it (its decode that fills the room is a chunk)."""
        return min(n + 1, self.budget) if self.policy.evict_every == 1 else n + 1

    def writable_from(self) -> int:
        """The first local slot the next step may write: past the protected prefix of a bounded cache,
        the next free slot of an unbounded one (it only appends)."""
        return self.policy.protected_prefix if self.bounded else self._slots_used(0)

    def release(self):
        """Give the store's blocks (and a stacked-metadata row) back; the cache is unusable afterwards."""
        release(self)

    def snapshot(self) -> dict:
        """This paged cache's whole state in host memory: its blocks' bytes and its metadata (a preempted
        bounded cache, swapped out; `restore` brings it back into a fresh cache)."""
        # copies: .cpu() of a CPU tensor is the tensor itself, here a view of a stacked row that its next owner
        # overwrites before this state comes back
        host = lambda t: t.to("cpu", copy=True)  # noqa: E731
        return dict(slots=self.store.capacity, bytes=self.store.pool.read_blocks(self.store.blocks),
                    pos=host(self.pos), score=None if self.score is None else host(self.score),
                    count=None if self.count is None else host(self.count),
                    spare=host(self.spare), n=list(self.n), has_spare=list(self.has_spare), seen=self.seen,
                    scored=self.prompt_scored,
                    ring=None if self.ring is None else [host(t) for t in self.ring.tensors()])

    def restore(self, state: dict):
        """Take a `snapshot`'s state: blocks from the pool, written back, and the metadata copied."""
        if self.seen:
            raise KvboundError("restore: the cache already holds tokens")
        self._grow(state["slots"])
        self.store.pool.write_blocks(self.store.blocks, state["bytes"])
        self.pos.copy_(state["pos"])
        if self.score is not None:
            self.score.copy_(state["score"])
        if self.count is not None:
            self.count.copy_(state["count"])
        self.spare.copy_(state["spare"])
        if self.ring is not None:
            for dst, src in zip(self.ring.tensors(), state["ring"]):
                dst.copy_(src)
        self.n, self.has_spare, self.seen = list(state["n"]), list(state["has_spare"]), state["seen"]
        self.prompt_scored = state["scored"]

    def adopt_prefix(self, t: int):
        """The store's first t slots already hold tokens [0, t) (a prefix-cache hit): take them as processed."""
        if self.seen:
            raise KvboundError("adopt_prefix: the cache already holds tokens")
        self._grow(t)
        self.pos[:, :t] = torch.arange(t, dtype=self.pos.dtype, device=self.pos.device)[None, :, None]
        self.n = [t] * len(self.n)
        self.seen = t

    def fork(self) -> "KVCache":
        """A copy that shares this cache's blocks (copy-on-write through the store's refcounts), with
        metadata of its own: a stacked row of the same policy when one is free (its steps then batch with the
        others'), else tensors of its own."""
        child = copy(self)
        child.store = self.store.fork()
        child.n, child.has_spare = list(self.n), list(self.has_spare)
        child.stacked = None
        if self.stacked is not None:
            self.stacked[0].fork(self.stacked[1], child)
        if child.stacked is None:
            child.pos = self.pos.clone()
            child.score = None if self.score is None else self.score.clone()
            child.spare = self.spare.clone()
            child.ring = None if self.ring is None else self.ring.clone()
            child.count = None if self.count is None else self.count.clone()
        return child

    # --- called by each attention layer -------------------------------------------------------
    def attend(self, layer: int, q, k, v, positions):
        """Attend the new tokens over the cache and themselves, then keep them (evicting if over budget)."""
        if self.policy.reconstructs and not self.prompt_scored:
            refuse_prompt_scoring(self.policy, "a model forward over the cache")
        t, n = k.shape[0], self.n[layer]
        if self.rotate_keys is not None:  # the model rotated by place in the cache; bookkeeping counts the stream
            positions = torch.arange(self.seen, self.seen + t, device=k.device)
            before = torch.cat([self.pos[layer, :self._slots_used(layer)], positions[:, None].expand(t, k.shape[1])
                                .to(self.pos.dtype)])
        self._grow(self.slots_needed(t, layer))
        if self.has_spare[layer] and t > 1:
            self._densify(layer)
        storage, meta, ring = self.store.storage, self._layer_meta(layer), self.ring
        if self.has_spare[layer] and not self._decode_fills_room(n):
            # a decode into the spare slot: the evicted token's, or the next free one
            table = self.store.slot_table(self.capacity)[None]
            lens = torch.full((1,), n + 1, dtype=torch.int32, device=q.device)
            out = evict_decode(q, k, v, storage, layer, table, lens, self.one_row, positions, *meta, self.policy,
                               ring=ring, count=self._count(layer))
            self.n[layer] = self._held_after_decode(n)
        elif n + t <= self.capacity:  # room: the new tokens take slots [n, n + t) in every head
            self.store.write_range(layer, n, k, v)
            self.pos[layer, n:n + t] = positions[:, None].to(self.pos.dtype)
            if self.count is not None:
                self.count[layer, n:n + t] = 1.0
            if ring is not None and t == 1:  # a decode step's token reads its residual in place
                ring.write(layer, self.one_row, positions[None], k[None], v[None])
            out = self._attend_new(layer, q, k, v, n + t)
            if ring is not None and t > 1:
                ring.write(layer, self.one_row, positions[None], k[None], v[None])
            self.n[layer] = n + t
            if self.bounded and n + t >= self.policy.capacity:  # over budget + evict_every - 1 tokens
                held = None if ring is None else WindowRead(ring, self.one_row, positions[-1:], self.pos[layer][None])
                if n + t == self.budget + 1:
                    evict_merged(storage, layer, self.store.slot_table(self.capacity)[None], self.one_row, *meta,
                                 self._count(layer), self.policy, ring=held)
                    self.has_spare[layer], self.n[layer] = True, self.budget
                else:
                    self._compact(layer, held)
                    if self.has_spare[layer]:  # evicting every e steps, the spare is the next free slot
                        self.spare[layer].fill_(self.budget)
        else:  # a prefill chunk longer than the room left
            table = self.store.slot_table(self.capacity)[None]
            pos, _, score = meta
            out, *cand = chunk_attend(q, k, v, storage, layer, table, n, self.one_row, positions, pos, score,
                                      self.policy, ring=ring, count=self._count(layer))
            if storage.exact:
                merged = keep_and_rewrite(storage, layer, table, n, self.one_row, pos, score, self.policy, *cand,
                                          count=self._count(layer))
            else:
                merged = self._evict_and_write(layer, k, v, *(None if c is None else c[0] for c in cand))
            if ring is not None:
                ring.write(layer, self.one_row, positions[None], k[None], v[None])
                if merged is not None:  # kept keys that took evicted ones, the new tokens' among them
                    ring.rewrite(layer, self.one_row, cand[2], *merged, positions[-1:])
            self.n[layer] = self.budget
        self.store.after_insert(layer, self._slots_used(layer), self.pos[layer], int(positions[-1]))
        if self.rotate_keys is not None:
            self._reindex(layer, before)
        return out

    def keep_scored(self, held, score: torch.Tensor):
        """A prompt scored at once (KVzip, `cache.reconstruct`): of the n tokens the unbounded cache `held` holds (n
        past this cache's room), each layer's heads keep the policy's choice by `score` [layers, n, H], in slots
        [0, budget) as a prefill piece past the room leaves them, quantized once on a packed store. The prompt then
        counts as processed."""
        n = check_scorable(self, held)
        pos = torch.arange(n, dtype=self.pos.dtype, device=self.device)[:, None].expand(n, self.pos.shape[2])
        table = self.store.slot_table(self.capacity)[None]
        for layer in range(len(self.n)):
            k, v = prompt_kv(held, layer)
            if self.store.storage.exact:
                p, _, sc = self._layer_meta(layer)
                keep_and_rewrite(self.store.storage, layer, table, 0, self.one_row, p, sc, self.policy, k[None],
                                 v[None], pos[None], score[layer][None])
                self.n[layer] = self.budget
            else:
                self._evict_and_write(layer, k, v, k, v, pos, score[layer], None)
            self.store.after_insert(layer, self._slots_used(layer), self.pos[layer], n - 1)
        self.advance(n)
        self.prompt_scored = True

    def _reindex(self, layer, before):
        """After a step of re-indexed positions: each kept key was rotated at its place among the step's
        candidates `before` [M, H] (stream positions, -1 none); rotate it on to its place among the kept."""
        pos = self.pos[layer, :self._slots_used(layer)]
        live = pos >= 0
        never = torch.iinfo(pos.dtype).max
        held = torch.where(live, pos, never).T.contiguous()  # [H, S]
        was = torch.searchsorted(torch.where(before >= 0, before, never).T.contiguous().sort(-1).values, held)
        now = torch.searchsorted(held.sort(-1).values, held)
        delta = (now - was).T
        slots, heads = (live & (delta != 0)).nonzero(as_tuple=True)
        if len(slots):
            self.store.rotate_keys(layer, slots, heads, delta[slots, heads], self.rotate_keys)

    def _layer_meta(self, layer):
        """This layer's (pos, spare, score) as one row of a batch: [1, cap, H], [1, H], [1, cap, H] or None."""
        return self.pos[layer][None], self.spare[layer][None], None if self.score is None else self.score[layer][None]

    def _count(self, layer):
        """This layer's merged-token counts as one row of a batch, [1, cap, H], or None (no merging)."""
        return None if self.count is None else self.count[layer][None]

    def _slots_used(self, layer):
        return self.n[layer] + self.has_spare[layer]

    def _attend_new(self, layer, q, k, v, total):
        """Attention of the T new queries (keys k, values v) over slots [0, total), all live, the new tokens the
        last T (causal mask); the new tokens' scores start at the policy's (`fresh_scores`), then every slot's
        score takes this step's probabilities."""
        t, ring, pos = q.shape[0], self.ring, self.pos[layer, :total][None]
        first = torch.full((1,), self.seen, device=q.device)
        read = None if ring is None else WindowRead(ring, self.one_row, first, self.pos[layer][None])
        score = None if self.score is None else self.score[layer, :total]
        table = self.store.slot_table(total)[None]
        count = None if self.count is None else self.count[layer, :total][None]
        if t == 1:
            if score is not None:
                score[total - t:] = fresh_scores(self.policy, k, score, ring or self.store.storage, layer)
            lens = torch.full((1,), total, dtype=torch.int32, device=q.device)
            out = table_attention(q, self.store.storage, layer, table, lens, self.policy,
                                  None if score is None else score[None], ring=read, count=count)
            if score is not None and self.policy.rescores:
                kc = read_kv(self.store.storage, layer, table.long(), read)[0]
                score.copy_(rescored(self.policy, score[None], kc, pos)[0])
            return out
        kc, vc = self.store.storage.gather(layer, table.long())
        if ring is not None:  # the cached tokens as the window holds them, the step's own at mixed precision
            kc, vc = ring.with_piece(layer, self.one_row, kc[:, :total - t], vc[:, :total - t], read.pos, first,
                                     k[None], v[None])
        out, scores = piece_attention(q[None], kc, vc, self.policy, None if score is None else score[None, :total - t],
                                      self.pos[layer, :total][None], attention_bias(count))
        if score is not None:
            score.copy_(scores[0])
        return out[0]

    def _move(self, layer, heads, src, dst):
        """Move kept tokens (src[i], heads[i]) -> (dst[i], heads[i]): packed K/V, position, score and count as is."""
        self.store.move(layer, heads, src, dst)
        for meta in (self.pos, self.score, self.count):
            if meta is not None:
                meta[layer, dst, heads] = meta[layer, src, heads]

    def _densify(self, layer):
        """Before a multi-token step: move each head's token in the last slot into its spare slot (a cache below
        its budget, or one that evicts every e steps, holds slots [0, n) already: its spare is the next free one)."""
        self.has_spare[layer] = False
        if self.n[layer] < self.budget or self.policy.evict_every > 1:
            return
        b, spare = self.budget, self.spare[layer]
        heads = torch.arange(spare.shape[0], device=spare.device)
        last = torch.full_like(spare, b)
        keep = spare != b
        self._move(layer, heads[keep], last[keep], spare[keep])
        self.pos[layer, b] = -1

    def _compact(self, layer, ring: WindowRead | None = None):
        """evict_every > 1: evict down to `budget` among slots [0, n), refilling holes from the tail; a merging
        policy's evicted tokens first merge into the kept ones (`merge`), whose new K/V are written once (and, with
        mixed widths read as the window `ring` holds them, their residuals)."""
        n, b = self.n[layer], self.budget
        keep = self.policy.keep_mask(self.pos[layer, :n], None if self.score is None else self.score[layer, :n])
        if self.count is not None:
            k, v = read_kv(self.store.storage, layer, self.store.slot_table(self.capacity)[None, :n].long(), ring)
            score = None if self.score is None else self.score[layer, :n][None]
            k, v, count, took = merge_dropped(self.policy, keep[None], k, v, self.pos[layer, :n][None], score,
                                              self.count[layer, :n][None])
            slot, head = took[0].nonzero().unbind(1)
            self.store.write(layer, slot[:, None], k[0, slot, head][:, None], v[0, slot, head][:, None], head[:, None])
            if ring is not None:
                ring.residuals.rewrite(layer, self.one_row, self.pos[layer, :n][None], k, v, took, ring.first)
            self.count[layer, :n] = count[0]
        for head in range(keep.shape[1]):
            movers = keep[b:, head].nonzero().flatten() + b
            self._move(layer, torch.full_like(movers, head), movers, (~keep[:b, head]).nonzero().flatten())
        self.pos[layer, b:] = -1
        self.n[layer] = b

    def _evict_and_write(self, layer, k, v, cand_k, cand_v, cand_pos, cand_score, cand_count):
        """`keep_and_rewrite` for packed stores, which must not requantize kept tokens: keep `budget` of the
        n cached + T new candidates, moving kept tokens into holes and quantizing only the new ones, and the kept
        ones that took evicted tokens (a merging policy's: new values, quantized once; returned as the candidates'
        K, V and which took tokens, [1, M, ...], for mixed widths' residuals)."""
        n, h, b = self.n[layer], k.shape[1], self.budget
        new_pos = cand_pos[n:]
        new_score = None
        if cand_score is not None:  # the cached tokens' scores after this chunk, then the new tokens'
            self.score[layer, :n], new_score = cand_score[:n], cand_score[n:]
        keep = self.policy.keep_mask(cand_pos, cand_score)
        if self.count is not None:
            merged = merge_dropped(self.policy, keep[None], cand_k[None], cand_v[None], cand_pos[None],
                                   None if cand_score is None else cand_score[None], cand_count[None])
            cand_k, cand_v, cand_count, took = (x[0] for x in merged)
            self.count[layer, :n] = cand_count[:n]
            k, v = (torch.where(took[n:, :, None], c[n:], x) for c, x in ((cand_k, k), (cand_v, v)))
        for head in range(h):
            kept_old = keep[:n, head]
            holes = (~kept_old[:b]).nonzero().flatten()
            if n < b:
                holes = torch.cat([holes, torch.arange(n, b, device=k.device)])
            movers = kept_old[b:].nonzero().flatten() + b
            fresh = keep[n:, head].nonzero().flatten()
            assert len(holes) == len(movers) + len(fresh), "policy kept a wrong number of tokens"
            dst_move, dst_new = holes[:len(movers)], holes[len(movers):]
            self._move(layer, torch.full_like(movers, head), movers, dst_move)
            if self.count is not None:  # kept old tokens that took evicted ones: in place, or moved
                stay = (kept_old[:b] & took[:min(n, b), head]).nonzero().flatten()
                moved = took[movers, head]
                src, dst = torch.cat([stay, movers[moved]]), torch.cat([stay, dst_move[moved]])
                self.store.write(layer, dst[:, None], cand_k[src, head][:, None], cand_v[src, head][:, None],
                                 torch.full_like(dst[:, None], head))
            if len(fresh):
                self.store.write(layer, dst_new[:, None], k[fresh, head][:, None], v[fresh, head][:, None],
                                 torch.full_like(dst_new[:, None], head))
                self.pos[layer, dst_new, head] = new_pos[fresh, head]
                if self.score is not None:
                    self.score[layer, dst_new, head] = new_score[fresh, head]
                if self.count is not None:
                    self.count[layer, dst_new, head] = cand_count[n + fresh, head]
        self.pos[layer, b:] = -1
        self.n[layer] = b
        return None if self.count is None else (cand_k[None], cand_v[None], took[None])

    def _grow(self, need: int):
        if need > self.store.capacity:
            self.store.grow(need)
        cap = self.capacity if self.bounded else self.store.capacity
        if cap <= self.capacity:
            return
        extra = cap - self.capacity
        more = lambda t, fill: torch.cat([t, t.new_full((t.shape[0], extra, t.shape[2]), fill)], 1)  # noqa: E731
        self.pos = more(self.pos, -1)
        self.score = None if self.score is None else more(self.score, 0.0)
        self.count = None if self.count is None else more(self.count, 1.0)

    # --- introspection ------------------------------------------------------------------------
    def positions_held(self, layer: int) -> torch.Tensor:
        """Stream positions in slots [0, slots used) of a layer, [slots, heads], -1 where free. An unbounded
        cache holds tokens [0, n) in slots [0, n) (the engine's batched decode does not write their
        positions), so they are derived, never written: the tensors may belong to inference mode."""
        used = self._slots_used(layer)
        if self.bounded:
            return self.pos[layer, :used]
        return torch.arange(used, dtype=self.pos.dtype, device=self.pos.device)[:, None].expand(used, self.pos.shape[2])

    def kept_positions(self, layer: int, head: int) -> list[int]:
        return sorted(p for p in self.positions_held(layer)[:, head].tolist() if p >= 0)

    def nbytes(self) -> dict:
        """KV bytes actually held for this sequence's tokens (data + scales/biases + scores + positions)."""
        total = 0
        for layer in range(len(self.n)):
            live = self.positions_held(layer) >= 0
            meta = 4 + 4 * ((self.score is not None) + (self.count is not None))  # position, score, count
            total += self.store.bytes_held(layer, live) + int(live.sum()) * meta
            if self.ring is not None:
                total += self.ring.bytes_held(self.positions_held(layer), self.seen)
        bf16 = 2 * 2 * self.cfg.num_kv_heads * self.cfg.head_dim * self.seen * len(self.n)
        return {"held_bytes": total, "tokens_held": len(self), "full_bf16_bytes": bf16,
                "bytes_per_token_layer": self.store.bytes_per_token(),
                "compression": bf16 / total if total else float("inf")}


class MultiCache:
    """Several sequences' caches behind one `attend`: the flat token run is split by `lengths`.

    Lets one forward pass serve several sequences (e.g. every strategy of an evaluation, fed the same
    tokens), so the weights are read once per step instead of once per sequence.
    """

    def __init__(self, caches: list[KVCache]):
        self.caches = caches
        self.lengths: list[int] = []

    def positions(self, lengths: list[int]) -> torch.Tensor:
        self.lengths = list(lengths)
        return torch.cat([c.next_positions(t) for c, t in zip(self.caches, lengths)])

    def advance(self):
        for c, t in zip(self.caches, self.lengths):
            c.advance(t)

    def attend(self, layer, q, k, v, positions):
        outs, i = [], 0
        for c, t in zip(self.caches, self.lengths):
            outs.append(c.attend(layer, q[i:i + t], k[i:i + t], v[i:i + t], positions[i:i + t]))
            i += t
        return torch.cat(outs)
