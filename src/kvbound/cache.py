"""KV cache of one sequence: per-layer slots, per-(slot, KV head) positions and scores, and a policy.

Layout: K/V of layer l live in `k[l]`, `v[l]` shaped [slots, kv_heads, head_dim]; the cache's tokens
are always slots [0, n). With kv-head granularity each KV head keeps its own tokens, so one slot holds
different tokens in different heads; attention does not care, because keys are stored rotated.

Eviction is slot replacement. The buffer holds budget + evict_every slots. At evict_every = 1, once the
cache is full each head has one free slot: the last evicted token's. A decoded token is written into
it, attends over all budget + 1 slots in place (no gather, no concatenation), and the policy's victim's
slot becomes the next free one; nothing is moved. With evict_every = e the cache holds up to budget + e - 1 tokens, then evicts down to
budget. A prefill chunk longer than the spare room attends over the cache plus the chunk, and its
kept tokens are written straight into the evicted slots.
"""
from __future__ import annotations

import torch

from .attention import attend, decode_attention
from .config import KvboundError
from .policies import FullPolicy, protected_prefix
from .kv_store import make_store


def attend_mode(policy):
    """What `attention.attend` must return for this policy's scores: None, "sum" or "normalized"."""
    if not policy.score:
        return None
    return "normalized" if policy.score == "normalized" else "sum"


def kernel_mode(policy):
    """The decode kernel's score export for this policy: None, "sum", "normalized" or "ema"."""
    return None if not policy.score else policy.score.replace("cumulative", "sum")


def fold_scores(policy, old, step, n):
    """This step's attention `step` [..., n + T, H] folded into the n cached tokens' scores `old`
    [..., n, H]: returns (the cached tokens' new scores, the T new tokens' scores). Also used batched."""
    if policy.granularity == "layer":
        step = step.sum(-1, keepdim=True).expand_as(step)
    cached, new = step.narrow(-2, 0, n), step.narrow(-2, n, step.shape[-2] - n)
    if policy.score == "ema":
        a = policy.ema_decay
        return old.mul(a).add(cached, alpha=1 - a), new * (1 - a)
    return old.add(cached), new


def kept_order(policy, cand_pos, cand_score):
    """The candidates each head keeps, as indices in stream order: [..., budget, H] of [..., M, H]."""
    keep = policy.keep_mask(cand_pos, cand_score)
    order = torch.sort(keep.to(torch.int8), dim=-2, descending=True, stable=True).indices
    return order.narrow(-2, 0, policy.budget)


class KVCache:
    def __init__(self, config, policy=None, device="cpu", dtype=torch.float32, kv_bits=None,
                 kv_group_size: int = 64, quantized_kv_start: int = 0, initial_slots: int = 256, store=None,
                 meta=None):
        """dtype: the dtype unquantized K/V are stored in (bf16 for a realistic cache; the model's dtype
        for bit-exact comparisons). store: where K/V live (default: a store of this cache's own; the
        engine passes a PagedStore over its shared block pool, which grows only when `prepare` asks).
        meta: (pos, score, spare) tensors to use for a bounded cache's metadata, e.g. views of one row of
        the engine's stacked metadata, so that a batch of such caches can be updated in one operation."""
        self.cfg = config
        self.policy = policy or FullPolicy()
        self.bounded = self.policy.budget is not None
        self.budget = self.policy.budget
        layers, h = config.num_layers, config.num_kv_heads
        cap = self.budget + self.policy.evict_every if self.bounded else initial_slots
        if store is not None:
            if kv_bits is not None:
                raise KvboundError("the paged engine stores K/V unquantized (kv_bits must be None)")
            cap = cap if self.bounded else store.capacity
        self.store = store if store is not None else make_store(
            layers, cap, h, config.head_dim, device, dtype, kv_bits, kv_group_size, quantized_kv_start, self.policy)
        if meta is not None and self.bounded:
            self.pos, self.score, self.spare = meta
            self.pos.fill_(-1)
            if self.score is not None:
                self.score.zero_()
        else:
            self.pos = torch.full((layers, cap, h), -1, dtype=torch.int32, device=device)  # stream positions
            self.score = (torch.zeros((layers, cap, h), dtype=torch.float32, device=device) if self.policy.score
                          else None)
            self.spare = torch.zeros((layers, h), dtype=torch.long, device=device)
        self.n = [0] * layers  # live tokens per layer
        self.meta_row = None  # (StackedMeta, row) when `meta` is a row of the engine's stacked metadata
        # per layer, once full: each head has a free slot, spare[layer, head] (the last victim's)
        self.has_spare = [False] * layers
        self.seen = 0  # tokens processed so far: the next token's position
        self.device = device

    @property
    def capacity(self) -> int:
        return self.pos.shape[1]

    def __len__(self) -> int:
        return self.n[0]

    def next_positions(self, t: int) -> torch.Tensor:
        return torch.arange(self.seen, self.seen + t, device=self.device)

    def advance(self, t: int):
        self.seen += t

    # --- used by the paged engine ---------------------------------------------------------------
    def slots_needed(self, t: int, layer: int = 0) -> int:
        """Local slots that a step of t more tokens may touch."""
        used = self._slots_used(layer) + t
        return min(used, self.capacity) if self.bounded else used

    def prepare(self, t: int):
        """Before a step of t tokens: room for them, and private copies (copy-on-write) of the shared
        blocks they may write. A bounded cache never writes the slots of its protected prefix (sinks and
        pinned spans from position 0, e.g. a cached system prompt), so those blocks stay shared."""
        self._grow(self.slots_needed(t))
        if hasattr(self.store, "make_private"):
            self.store.make_private(self.writable_from() // self.store.pool.block_size)

    def writable_from(self) -> int:
        """The first local slot the next step may write: past the protected prefix of a bounded cache,
        the next free slot of an unbounded one (it only appends)."""
        return protected_prefix(self.policy) if self.bounded else self._slots_used(0)

    def release(self):
        """Give the store's blocks (and a stacked-metadata row) back; the cache is unusable afterwards."""
        if hasattr(self.store, "release"):
            self.store.release()
        if self.meta_row is not None:
            self.meta_row[0].give(self.meta_row[1])
            self.meta_row = None

    def adopt_prefix(self, t: int):
        """The store's first t slots already hold tokens [0, t) (a prefix-cache hit): take them as processed."""
        if self.seen:
            raise KvboundError("adopt_prefix: the cache already holds tokens")
        self._grow(t)
        self.pos[:, :t] = torch.arange(t, dtype=self.pos.dtype, device=self.pos.device)[None, :, None]
        self.n = [t] * len(self.n)
        self.seen = t

    def fork(self) -> "KVCache":
        """A copy that shares this cache's blocks (copy-on-write through the store's refcounts)."""
        from copy import copy
        child = copy(self)
        child.store = type(self.store)(self.store.pool, self.store.blocks)
        self.store.private = False
        for b in self.store.blocks:
            self.store.pool.incref(b)
        child.pos = self.pos.clone()
        child.score = None if self.score is None else self.score.clone()
        child.spare = self.spare.clone()
        child.meta_row = None
        child.n, child.has_spare = list(self.n), list(self.has_spare)
        return child

    # --- called by each attention layer -------------------------------------------------------
    def attend(self, layer: int, q, k, v, positions):
        """Attend the new tokens over the cache and themselves, then keep them (evicting if over budget)."""
        t, n, h = k.shape[0], self.n[layer], k.shape[1]
        self._grow(self.slots_needed(t, layer))
        new_pos = positions[:, None].expand(t, h).to(self.pos.dtype)
        spare = self.spare[layer] if self.has_spare[layer] else None
        if spare is not None and t > 1:
            self._densify(layer)
            spare = None
        if spare is not None:  # steady-state decode: the new token takes the evicted token's slot
            heads = torch.arange(h, device=k.device)
            self.store.write(layer, spare[None], heads[None], k, v)
            self.pos[layer, spare, heads] = new_pos[0]
            out = self._attend_pool(layer, q, n + 1, spare[None], heads[None])
            self._evict_one(layer, n + 1)
        elif n + t <= self.capacity:  # room: the new tokens take slots [n, n + t) in every head
            self.store.write_range(layer, n, k, v)
            self.pos[layer, n:n + t] = new_pos
            out = self._attend_pool(layer, q, n + t, slice(n, n + t), slice(None))
            self.n[layer] = n + t
            if self.bounded and n + t > self.budget + self.policy.evict_every - 1:
                if n + t == self.budget + 1:
                    self._evict_one(layer, n + t)
                else:
                    self._compact(layer)
        else:  # a prefill chunk longer than the room left
            kc, vc = self.store.read(layer, n)
            k_in, v_in = self.store.roundtrip(layer, k), self.store.roundtrip(layer, v)
            cand_k, cand_v = torch.cat([kc, k_in.to(kc.dtype)]), torch.cat([vc, v_in.to(vc.dtype)])
            out, key_scores = attend(q, cand_k, cand_v, attend_mode(self.policy))
            new_score = self._update_scores(layer, n, key_scores)
            if getattr(self.store, "exact", False):
                self._keep_and_rewrite(layer, cand_k, cand_v, new_pos, new_score)
            else:
                self._evict_and_write(layer, k, v, new_pos, new_score)
        if hasattr(self.store, "after_insert"):
            self.store.after_insert(layer, self._slots_used(layer), self.pos[layer], int(positions[-1]))
        return out

    def _slots_used(self, layer):
        return self.n[layer] + self.has_spare[layer]

    def _attend_pool(self, layer, q, total, new_slots, new_heads):
        """Attention of the new queries over slots [0, total), all live, the new tokens among them at
        (new_slots, new_heads); every slot's score gets this step's probabilities (new ones start at 0).
        With several new tokens they must be the last slots (causal mask)."""
        if self.score is not None:
            self.score[layer, new_slots, new_heads] = 0
        pow2 = q.shape[-1] & (q.shape[-1] - 1) == 0  # the kernel's tiles; other head sizes take the fallback
        if q.shape[0] == 1 and q.is_cuda and pow2 and (self.score is None or self.policy.granularity == "kv-head"):
            kernel_args = self.store.kernel_args(layer)
            if kernel_args is not None:
                k_pool, v_pool, quant = kernel_args
                table = self.store.slot_table(total)[None]
                lens = torch.tensor([total], device=q.device, dtype=torch.int32)
                score = None if self.score is None else self.score[layer][None]
                return decode_attention(q, k_pool, v_pool, table, lens, score=score, quant=quant,
                                        score_mode=kernel_mode(self.policy),
                                        ema_decay=getattr(self.policy, "ema_decay", 0.95))
        kc, vc = self.store.read(layer, total)
        out, key_scores = attend(q, kc, vc, attend_mode(self.policy))
        self._update_scores(layer, total, key_scores)
        return out

    def _evict_one(self, layer, total):
        """Slots [0, total = budget + 1) are all live: pick one victim per head; its slot becomes the spare
        that the next decoded token is written into. Nothing moves."""
        pos = self.pos[layer, :total]
        victim = self.policy.victim(pos, None if self.score is None else self.score[layer, :total])
        self.pos[layer, victim, torch.arange(victim.shape[0], device=victim.device)] = -1
        self.spare[layer] = victim
        self.has_spare[layer] = True
        self.n[layer] = self.budget

    def _densify(self, layer):
        """Before a multi-token step: move each head's token in the last slot into its spare slot."""
        b, spare = self.budget, self.spare[layer]
        heads = torch.arange(spare.shape[0], device=spare.device)
        last = torch.full_like(spare, b)
        keep = spare != b
        self._move(layer, heads[keep], last[keep], spare[keep])
        self.pos[layer, b] = -1
        self.has_spare[layer] = False

    def _update_scores(self, layer, n, key_scores):
        """Add this step's attention to the n cached tokens' scores; return the new tokens' scores."""
        if key_scores is None:
            return None
        self.score[layer, :n], new = fold_scores(self.policy, self.score[layer, :n], key_scores, n)
        return new

    def _move(self, layer, heads, src, dst):
        """Move kept tokens (src[i], heads[i]) -> (dst[i], heads[i]): packed K/V, position and score as is."""
        self.store.move(layer, heads, src, dst)
        self.pos[layer, dst, heads] = self.pos[layer, src, heads]
        if self.score is not None:
            self.score[layer, dst, heads] = self.score[layer, src, heads]

    def _compact(self, layer):
        """evict_every > 1: evict down to `budget` among slots [0, n), refilling holes from the tail."""
        n, b = self.n[layer], self.budget
        keep = self.policy.keep_mask(self.pos[layer, :n], None if self.score is None else self.score[layer, :n])
        for head in range(keep.shape[1]):
            movers = keep[b:, head].nonzero().flatten() + b
            self._move(layer, torch.full_like(movers, head), movers, (~keep[:b, head]).nonzero().flatten())
        self.pos[layer, b:] = -1
        self.n[layer] = b

    def _keep_and_rewrite(self, layer, cand_k, cand_v, new_pos, new_score):
        """The same choice as `_evict_and_write` for stores that read back exactly what was written (dense,
        paged): each head's kept candidates, in stream order, are gathered and written to slots [0, budget)
        in a few whole-tensor operations (no per-head loop, no host sync). The protected prefix [0, P) is
        its own gather, so those slots (possibly shared blocks) are not written."""
        n, b = self.n[layer], self.budget
        cand_pos = torch.cat([self.pos[layer, :n], new_pos])
        cand_score = None if self.score is None else torch.cat([self.score[layer, :n], new_score])
        order = kept_order(self.policy, cand_pos, cand_score)  # [b, H]
        first = min(protected_prefix(self.policy), n)
        idx = order[first:, :, None].expand(-1, -1, cand_k.shape[2])
        self.store.write_range(layer, first, cand_k.gather(0, idx), cand_v.gather(0, idx))
        self.pos[layer, :b] = cand_pos.gather(0, order)
        if self.score is not None:
            self.score[layer, :b] = cand_score.gather(0, order)
        self.pos[layer, b:] = -1
        self.n[layer] = b

    def _evict_and_write(self, layer, k, v, new_pos, new_score):
        """General path: keep `budget` of the n cached + T new tokens; fill slots [0, budget) densely."""
        n, h, b = self.n[layer], k.shape[1], self.budget
        cand_pos = torch.cat([self.pos[layer, :n], new_pos])
        cand_score = None if self.score is None else torch.cat([self.score[layer, :n], new_score])
        keep = self.policy.keep_mask(cand_pos, cand_score)
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
            if len(fresh):
                self.store.write(layer, dst_new[:, None], torch.full_like(dst_new[:, None], head),
                                 k[fresh, head][:, None], v[fresh, head][:, None])
                self.pos[layer, dst_new, head] = new_pos[fresh, head]
                if self.score is not None:
                    self.score[layer, dst_new, head] = new_score[fresh, head]
        self.pos[layer, b:] = -1
        self.n[layer] = b

    def _grow(self, need: int):
        if need > self.store.capacity:
            self.store.grow(need)
        cap = self.capacity if self.bounded else self.store.capacity
        if cap <= self.capacity:
            return
        extra = cap - self.capacity
        self.pos = torch.cat([self.pos, self.pos.new_full((self.pos.shape[0], extra, self.pos.shape[2]), -1)], 1)
        if self.score is not None:
            self.score = torch.cat([self.score, self.score.new_zeros(self.score.shape[0], extra, self.score.shape[2])], 1)

    # --- introspection ------------------------------------------------------------------------
    def _sync_full_positions(self):
        """An unbounded cache holds tokens [0, n) in slots [0, n); the engine's batched decode does not
        write their positions one by one, so introspection fills them in."""
        if not self.bounded:
            for layer, n in enumerate(self.n):
                self.pos[layer, :n] = torch.arange(n, dtype=self.pos.dtype, device=self.pos.device)[:, None]

    def kept_positions(self, layer: int, head: int) -> list[int]:
        self._sync_full_positions()
        return sorted(p for p in self.pos[layer, :self._slots_used(layer), head].tolist() if p >= 0)

    def nbytes(self) -> dict:
        """KV bytes actually held for this sequence's tokens (data + scales/biases + scores + positions)."""
        self._sync_full_positions()
        total = 0
        for layer in range(len(self.n)):
            live = self.pos[layer, :self._slots_used(layer)] >= 0
            total += self.store.bytes_held(layer, live) + int(live.sum()) * (4 + (4 if self.score is not None else 0))
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
