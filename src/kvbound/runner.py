"""One engine step on the model: the flat batch, and attention for every sequence in it.

A step's rows are ordered in groups, and each group attends in one call per layer whatever its size:
  - "append": decodes of unbounded caches. The new token's K/V go to the next slot of each sequence (one
    scatter into the pool), then one paged decode attention over every sequence's slot table.
  - "evict": decodes of bounded caches in steady state (each head's spare slot is free) that share one
    policy. The new token is written into the spare slot, attention exports its scores into the
    sequences' stacked metadata (`StackedMeta`), and one batched victim choice picks each head's next
    spare slot: slot replacement for the whole batch, with no per-sequence work.
  - "fresh": first prefill pieces of unbounded caches, of one length: K/V into their slots, then one
    batched causal attention.
  - "chunk": later prefill pieces of one length of full bounded caches that share a policy: one batched
    attention with scores, one batched keep choice, kept tokens rewritten in place (`ChunkEvictAttention`).
  - everything else (later prefill pieces of unbounded caches, bounded caches still filling, policies
    without stacked metadata): each cache's own `attend`.
Paged decode attention is the Triton kernel on CUDA and its PyTorch reference elsewhere
(`attention.decode_attention`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import attend_batch, decode_attention, fused_sdpa
from .cache import attend_mode, fold_scores, kept_order, kernel_mode
from .policies import protected_prefix


class StackedMeta:
    """Positions, scores and spare slots of many bounded caches with one policy, one row per cache, so a
    batch of them is read and updated with one operation per layer. Caches hold views of their row."""

    def __init__(self, policy, layers: int, heads: int, rows: int, device):
        cap = policy.budget + policy.evict_every
        self.policy = policy
        self.pos = torch.full((rows + 1, layers, cap, heads), -1, dtype=torch.int32, device=device)
        self.score = torch.zeros((rows + 1, layers, cap, heads), device=device) if policy.score else None
        self.spare = torch.zeros((rows + 1, layers, heads), dtype=torch.long, device=device)
        self.scratch_row = rows  # the padding rows of a decode graph update this one
        self.free = list(range(rows - 1, -1, -1))

    def take(self):
        """(row, (pos, score, spare) views) or None when every row is in use."""
        if not self.free:
            return None
        r = self.free.pop()
        return r, (self.pos[r], None if self.score is None else self.score[r], self.spare[r])

    def give(self, row: int):
        self.free.append(row)


def batchable_policy(policy) -> bool:
    """Bounded policies whose steady-state decode the evict group runs (the kernel exports per-KV-head scores)."""
    return (policy.budget is not None and policy.evict_every == 1
            and (policy.score is None or policy.granularity == "kv-head"))


def fused_victim(policy):
    """(prefix, recent) when the policy's protected tokens are positions [0, prefix) plus the `recent`
    newest, which the fused evict kernel handles; None for pinned spans past the protected prefix."""
    prefix = protected_prefix(policy)
    if any(b > prefix for _, b in getattr(policy, "pinned", ())):
        return None
    return prefix, getattr(policy, "recent", 0)


def group_of(seq, t: int):
    cache = seq.cache
    if t != 1:
        # a whole first piece of an unbounded cache: one causal attention with the others of its length
        if not cache.bounded:
            return ("fresh", t) if cache.n[0] == 0 else None
        # a later prefill piece of a full bounded cache: evicts with the others of its policy and length
        if cache.meta_row is not None and cache.n[0] == cache.budget and not cache.has_spare[0]:
            return ("chunk", cache.meta_row[0], t)
        return None
    if not cache.bounded:
        return "append"
    if cache.meta_row is not None and cache.has_spare[0]:
        return cache.meta_row[0]  # the StackedMeta of its policy
    return None


class AppendAttention:
    """Decode rows whose caches only append: each new token's K/V go to slot `new[b]` of the pool, then
    one paged attention over `table[b, :lens[b]]`. Also the cache object of a captured decode graph."""

    def __init__(self, pool, new, lens, table):
        self.pool, self.new, self.lens, self.table = pool, new, lens, table

    def attend(self, layer, q, k, v, positions=None):
        kp, vp = self.pool.k[layer], self.pool.v[layer]
        kp[self.new] = k.to(kp.dtype)
        vp[self.new] = v.to(vp.dtype)
        return decode_attention(q, kp, vp, self.table, self.lens)


def append_rows(pool, seqs):
    """(new slots, context lengths, slot-table width in blocks) of append decodes, computed on the host."""
    bs = pool.block_size
    lens = [s.cache.n[0] + 1 for s in seqs]
    new = [s.cache.store.blocks[(n - 1) // bs] * bs + (n - 1) % bs for s, n in zip(seqs, lens)]
    return new, lens, -(-max(lens) // bs)


def appended(cache):
    """Bookkeeping after an append decode wrote and attended its token in every layer."""
    cache.n = [cache.n[0] + 1] * len(cache.n)  # every layer appended one token
    cache.advance(1)


def pool_rows(pool, seqs):
    """The sequences' rows in the pool's block tables, as a device tensor."""
    return torch.tensor([s.cache.store.row for s in seqs], device=pool.k.device)


def expand_table(pool, rows, width_blocks):
    """Slot tables [B, width_blocks * bs] (int32) from the pool's block tables of `rows`."""
    bs = pool.block_size
    return (pool.tables[rows, :width_blocks][:, :, None] * bs
            + torch.arange(bs, device=pool.tables.device, dtype=torch.int32)).flatten(1)


class EvictAttention:
    """Steady-state decodes of bounded caches sharing one policy (`StackedMeta`), rows `rows` of it: each
    head's new token goes into its spare slot, attention exports this step's scores into the stacked
    scores, and one batched victim choice frees each head's next spare slot. Nothing else moves."""

    def __init__(self, pool, meta, rows, table):
        self.pool, self.meta, self.rows, self.table = pool, meta, rows, table
        self.lens = torch.full((table.shape[0],), table.shape[1], dtype=torch.int32, device=table.device)
        self.fused = fused_victim(meta.policy)

    def attend(self, layer, q, k, v, positions):
        meta, rows, table, pol = self.meta, self.rows, self.table, self.meta.policy
        kp, vp = self.pool.k[layer], self.pool.v[layer]
        if q.is_cuda and self.fused is not None:  # the same steps in five kernels (kernels.evict_decode)
            from .kernels import evict_decode
            return evict_decode(q, k, v, kp, vp, table, self.lens, rows, positions, meta.pos[:, layer],
                                meta.spare[:, layer], None if meta.score is None else meta.score[:, layer],
                                kernel_mode(pol), getattr(pol, "ema_decay", 0.95), *self.fused)
        heads = torch.arange(k.shape[1], device=k.device)[None, :]
        r = rows[:, None]
        spare = meta.spare[rows, layer]  # [B, H] local slot each head writes
        dst = table.gather(1, spare).long()
        kp[dst, heads] = k.to(kp.dtype)
        vp[dst, heads] = v.to(vp.dtype)
        meta.pos[r, layer, spare, heads] = positions[:, None].to(torch.int32)
        score = None
        if meta.score is not None:  # (device scalars: a host scalar cannot be copied in during graph capture)
            meta.score[r, layer, spare, heads] = meta.score.new_zeros(())
            score = meta.score[rows, layer]
        out = decode_attention(q, kp, vp, table, self.lens, score=score, score_mode=kernel_mode(pol),
                               ema_decay=getattr(pol, "ema_decay", 0.95))
        if score is not None:
            meta.score[rows, layer] = score
        victim = pol.victim(meta.pos[rows, layer], score)
        meta.pos[r, layer, victim, heads] = meta.pos.new_full((), -1)
        meta.spare[rows, layer] = victim
        return out


class FreshAttention:
    """First pieces of t tokens of unbounded caches: K/V into their pool slots, one batched causal attention."""

    def __init__(self, pool, slots, t):
        self.pool, self.slots, self.t = pool, slots, t

    def attend(self, layer, q, k, v, positions=None):
        kp, vp = self.pool.k[layer], self.pool.v[layer]
        kp[self.slots] = k.to(kp.dtype)
        vp[self.slots] = v.to(vp.dtype)
        t, g = self.t, q.shape[1] // k.shape[1]
        qb = q.unflatten(0, (-1, t)).transpose(1, 2)  # [G, Hq, t, D]
        kb = k.to(q.dtype).unflatten(0, (-1, t)).repeat_interleave(g, 2).transpose(1, 2)
        vb = v.to(q.dtype).unflatten(0, (-1, t)).repeat_interleave(g, 2).transpose(1, 2)
        sdpa = fused_sdpa if q.is_cuda else F.scaled_dot_product_attention
        return sdpa(qb, kb, vb, is_causal=True).transpose(1, 2).flatten(0, 1)


class ChunkEvictAttention:
    """Prefill pieces of t tokens of bounded caches that share one policy and are full (budget tokens, no
    spare slot): `KVCache._keep_and_rewrite` for all of them at once. Each piece attends over its
    cache plus itself, the scores update, each head keeps `budget` of the budget + t candidates in stream
    order, and the kept tokens are written back to slots [P, budget) past the protected prefix."""

    def __init__(self, pool, meta, rows, table, t):
        self.pool, self.meta, self.rows, self.table, self.t = pool, meta, rows, table, t

    def attend(self, layer, q, k, v, positions):
        meta, rows, table, pol, t = self.meta, self.rows, self.table, self.meta.policy, self.t
        b = pol.budget
        kp, vp = self.pool.k[layer], self.pool.v[layer]
        q, k, v = q.unflatten(0, (-1, t)), k.unflatten(0, (-1, t)), v.unflatten(0, (-1, t))  # [B, t, H, D]
        cand_k = torch.cat([kp[table], k.to(kp.dtype)], 1)  # [B, b + t, H, D]
        cand_v = torch.cat([vp[table], v.to(vp.dtype)], 1)
        out, key_scores = attend_batch(q, cand_k, cand_v, attend_mode(pol))
        cand_pos = torch.cat([meta.pos[rows, layer, :b],
                              positions.view(-1, t, 1).expand(-1, -1, k.shape[2]).to(torch.int32)], 1)
        cand_score = None
        if key_scores is not None:
            cand_score = torch.cat(fold_scores(pol, meta.score[rows, layer, :b], key_scores, b), 1)
        order = kept_order(pol, cand_pos, cand_score)  # [B, b, H]
        first = protected_prefix(pol)
        idx = order[:, first:, :, None].expand(-1, -1, -1, cand_k.shape[3])
        kp[table[:, first:]] = cand_k.gather(1, idx)
        vp[table[:, first:]] = cand_v.gather(1, idx)
        meta.pos[rows, layer, :b] = cand_pos.gather(1, order)
        meta.pos[rows, layer, b:] = meta.pos.new_full((), -1)
        if cand_score is not None:
            meta.score[rows, layer, :b] = cand_score.gather(1, order)
        return out.flatten(0, 1)


def evict_table(pool, seqs, cap):
    """Slot tables [B, cap] of bounded caches: local slot j of row b -> its pool slot."""
    return expand_table(pool, pool_rows(pool, seqs), -(-cap // pool.block_size))[:, :cap].contiguous()


def after_decode(seq):
    """Bookkeeping of a decode that ran in a batched group (append or evict) or a graph of one."""
    if seq.cache.bounded:
        seq.cache.advance(1)
    else:
        appended(seq.cache)


class StepBatch:
    """The cache object the model sees for one step: `attend` splits the flat run by group."""

    def __init__(self, pool, batch):
        """batch: [(seq, t)] already ordered by `order`."""
        self.pool = pool
        self.batch = batch
        dev = pool.k.device
        bs = pool.block_size
        self.groups = []  # (kind, start, end, data)
        i = 0
        while i < len(batch):
            kind = group_of(*batch[i])
            j = i + 1
            while kind is not None and j < len(batch) and group_of(*batch[j]) == kind:
                j += 1
            seqs = [s for s, _ in batch[i:j]]
            if kind == "append":
                new, lens, width = append_rows(pool, seqs)
                data = AppendAttention(pool, torch.tensor(new, device=dev),
                                       torch.tensor(lens, device=dev, dtype=torch.int32),
                                       expand_table(pool, pool_rows(pool, seqs), width))
            elif isinstance(kind, tuple) and kind[0] == "fresh":
                t = kind[1]
                slots = expand_table(pool, pool_rows(pool, seqs), -(-t // bs))[:, :t].flatten().long()
                data = FreshAttention(pool, slots, t)
            elif isinstance(kind, tuple):
                meta, budget = kind[1], kind[1].policy.budget
                data = ChunkEvictAttention(pool, meta, torch.tensor([s.cache.meta_row[1] for s in seqs], device=dev),
                                           evict_table(pool, seqs, budget).long(), kind[2])
            elif kind is not None:
                data = EvictAttention(pool, kind, torch.tensor([s.cache.meta_row[1] for s in seqs], device=dev),
                                      evict_table(pool, seqs, kind.pos.shape[2]))
            else:
                data = None
            self.groups.append((kind, i, j, data))
            i = j
        self.starts = [0]
        for _, t in batch:
            self.starts.append(self.starts[-1] + t)

    @staticmethod
    def order(batch):
        """Rows of one group next to each other (groups in order of first appearance), the rest last."""
        rank = {}

        def key(st):
            g = group_of(*st)
            return 1 << 30 if g is None else rank.setdefault(g, len(rank))
        return sorted(batch, key=key)

    def positions(self) -> torch.Tensor:
        pos = [p for seq, t in self.batch for p in range(seq.cache.seen, seq.cache.seen + t)]
        return torch.tensor(pos, device=self.pool.k.device)

    def advance(self):
        for kind, i, j, _ in self.groups:
            for seq, t in self.batch[i:j]:
                if kind is not None and not isinstance(kind, tuple):
                    after_decode(seq)
                else:
                    if isinstance(kind, tuple) and kind[0] == "fresh":
                        seq.cache.n = [t] * len(seq.cache.n)
                    seq.cache.advance(t)  # a "chunk" cache stays at its budget

    def attend(self, layer, q, k, v, positions):
        outs = []
        for _, i, j, group in self.groups:
            a, b = self.starts[i], self.starts[j]
            if group is not None:  # one call for the whole group
                outs.append(group.attend(layer, q[a:b], k[a:b], v[a:b], positions[a:b]))
            else:
                for seq, t in self.batch[i:j]:
                    outs.append(seq.cache.attend(layer, q[a:a + t], k[a:a + t], v[a:a + t], positions[a:a + t]))
                    a += t
        return torch.cat(outs) if len(outs) > 1 else outs[0]


class DecodeGraphs:
    """CUDA graphs of whole decode steps, one per (group, batch size): steps whose rows all append
    (unbounded caches), captured at start-up, and steps whose rows all evict under one policy, captured
    when first seen. Batch sizes are 1, 2, 4, ... up to max_seqs; a step is padded to the next size with
    rows that write and read one scratch slot (and a scratch metadata row). Unbounded sequences longer
    than `max_len` tokens, and every other step, run eagerly."""

    def __init__(self, model, pool, max_seqs: int, max_len: int):
        self.model, self.pool = model, pool
        bs, dev = pool.block_size, pool.k.device
        self.width = -(-max_len // bs)  # append table width in blocks
        self.sizes = [1]
        while self.sizes[-1] < max_seqs:
            self.sizes.append(self.sizes[-1] * 2)
        top = self.sizes[-1]
        self.scratch = pool.reserve() * bs  # padding rows write here
        self.ids = torch.zeros(top, dtype=torch.long, device=dev)
        self.pos = torch.zeros(top, dtype=torch.long, device=dev)
        self.new = torch.full((top,), self.scratch, dtype=torch.long, device=dev)
        self.lens = torch.ones(top, dtype=torch.int32, device=dev)
        self.table = torch.full((top, self.width * bs), self.scratch, dtype=torch.int32, device=dev)
        self.evict_buffers = {}  # StackedMeta -> (rows, table)
        self.graphs, self.logits, self.attn = {}, {}, {}
        self.mempool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            self._capture("append", size)

    def _attention(self, kind, size):
        if kind == "append":
            return AppendAttention(self.pool, self.new[:size], self.lens[:size], self.table[:size])
        rows, table = self.evict_buffers[kind]
        return EvictAttention(self.pool, kind, rows[:size], table[:size])

    def _capture(self, kind, size):
        attn = self._attention(kind, size)
        self.attn[kind, size] = attn  # the graph reads its tensors (EvictAttention's lens): keep them alive
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile the kernels and settle the allocator outside the graph
                self.model(self.ids[:size], self.pos[:size], attn)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.mempool):
            self.logits[kind, size] = self.model(self.ids[:size], self.pos[:size], attn)
        self.graphs[kind, size] = g

    def capture_evict(self, meta, sizes=None):
        """Capture the evict graphs of one policy's stacked metadata (all batch sizes by default). Their
        warm-up runs execute, so the buffers point at the scratch row and slot while capturing."""
        dev = self.ids.device
        if meta not in self.evict_buffers:
            self.evict_buffers[meta] = (
                torch.full((self.sizes[-1],), meta.scratch_row, dtype=torch.long, device=dev),
                torch.full((self.sizes[-1], meta.pos.shape[2]), self.scratch, dtype=torch.int32, device=dev))
        rows, table = self.evict_buffers[meta]
        for size in sorted(sizes or self.sizes, reverse=True):
            rows[:size], table[:size] = meta.scratch_row, self.scratch
            self._capture(meta, size)

    def run(self, batch):
        """Logits [B, vocab] of a decode step that a graph covers, else None. The caller does the caches'
        bookkeeping (`after_decode`)."""
        kinds = {group_of(seq, t) for seq, t in batch}
        kind = kinds.pop() if len(kinds) == 1 else None
        b = len(batch)
        if kind is None or isinstance(kind, tuple) or b > self.sizes[-1]:
            return None
        seqs = [s for s, _ in batch]
        if kind == "append" and any(s.cache.n[0] >= self.width * self.pool.block_size for s in seqs):
            return None
        size = next(x for x in self.sizes if x >= b)
        dev = self.ids.device
        if kind != "append" and (kind, size) not in self.graphs:
            self.capture_evict(kind, [size])
        ids = [s.token_slice(s.cache.seen, s.cache.seen + 1)[0] for s in seqs]
        if kind == "append":
            new, lens, width = append_rows(self.pool, seqs)
            host = torch.tensor([ids, [s.cache.seen for s in seqs], new, lens]).to(dev, non_blocking=True)
            self.new[:b], self.lens[:b] = host[2], host[3].to(torch.int32)
            self.new[b:size], self.lens[b:size], self.table[b:size, 0] = self.scratch, 1, self.scratch
            self.table[:b, :width * self.pool.block_size] = expand_table(self.pool, pool_rows(self.pool, seqs), width)
        else:
            rows, table = self.evict_buffers[kind]
            host = torch.tensor([ids, [s.cache.seen for s in seqs], [s.cache.meta_row[1] for s in seqs]])
            host = host.to(dev, non_blocking=True)
            rows[:b], rows[b:size], table[b:size] = host[2], kind.scratch_row, self.scratch
            table[:b] = evict_table(self.pool, seqs, table.shape[1])
        self.ids[:b], self.pos[:b] = host[0], host[1]
        self.graphs[kind, size].replay()
        return self.logits[kind, size][:b]
