"""One engine step on the model: the flat batch, and attention for every sequence in it.

A step's rows are ordered in groups (`GroupKey`), and each group attends in one call per layer whatever its
size, through the same steps a single cache runs (`cache.steps`), over the shared block pool:
  - "append": decodes of unbounded caches. The new token's K/V go to the next slot of each sequence (one
    scatter into the pool), then one paged decode attention over every sequence's slot table.
  - "evict": decodes of bounded caches that share one policy, each head's spare slot free (`KVCache.take_spare`).
    The new token is written into the spare slot, attention exports its scores into the sequences' stacked
    metadata (`cache.stacked.StackedMeta`), and one batched victim choice picks each head's next spare slot:
    slot replacement for the whole batch, with no per-sequence work. A cache still below its budget (or with room,
    evicting every e steps) attends over the slots it holds and takes its next free slot as the spare instead of
    evicting.
  - "prefill": prefill pieces of unbounded caches, first or later, of any lengths: K/V into their slots, then
    one varlen causal attention over every piece (FlashAttention on CUDA), each after its cached tokens.
  - "chunk": prefill pieces of one length past the room of bounded caches that hold as many tokens and share a
    policy (a full cache's later pieces, or an empty one's first; the decode that fills the room of a cache
    evicting every e steps): one batched attention with scores, one batched keep choice, kept tokens rewritten in
    place.
  - "fill": prefill pieces of bounded caches that still have room for them (nothing is evicted), of one
    length after as many held tokens, sharing a policy: K/V and positions into their slots, one batched
    attention with scores.
  - "shared": decodes of caches whose heads share a layer's places (AdaKV) or whose layers keep different budgets
    (PyramidKV), one policy: the new tokens into the spare places, owner-masked attention, and the places the keep
    rule drops become the next spares, for the whole batch (`cache.steps.shared_decode`); a layer below its budget
    drops none and takes the next slot's.
  - "places": prefill pieces of one length of caches whose heads share places (AdaKV, PyramidKV), holding as many
    place rows, one policy: owner-masked attention over their entries and the pieces, the keep rule, and the kept
    new tokens into the lowest free places, for the whole batch (`cache.steps.shared_piece`).
  - everything else (a bounded piece that exactly fills its cache's room, policies without stacked metadata):
    each cache's own `attend`.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from ..cache.merge import attention_bias
from ..cache.stacked import StackedMeta, place_slots
from ..cache.steps import (bulk_decode_ok, bulk_evict_decode, chunk_attend, evict_decode, keep_and_rewrite,
                           piece_attention, shared_decode, shared_piece, table_attention)
from ..kernels import flash_ok, varlen_causal_attention
from ..staging import to_device


class GroupKey(NamedTuple):
    """Rows with equal keys attend together: the step kind (`KVCache.step_kind`), the stacked metadata of
    bounded kinds (one per policy), the piece length, the tokens held by "fill" caches, and the policy of "places"
    pieces, whose plan of each layer's budget the host reads (one layers=global metadata holds many plans). A named
    tuple: the engine builds one per row and step, on the host, between GPU steps."""
    kind: str
    meta: StackedMeta | None = None
    t: int = 1
    n: int = 0
    plan: object = None


def group_key(seq, t: int) -> GroupKey | None:
    kind = seq.cache.step_kind(t)
    if kind is None:
        return None
    if kind == "prefill":  # one group whatever the pieces' lengths
        return GroupKey(kind)
    meta = seq.cache.stacked[0] if kind in ("evict", "chunk", "fill", "shared", "places") else None
    n = len(seq.cache) if kind in ("fill", "chunk") else seq.cache.used if kind == "places" else 0
    return GroupKey(kind, meta, t, n, seq.cache.policy if kind == "places" else None)


def finish_step(cache, kind: str | None, t: int):
    """Bookkeeping after a group ran t tokens of this cache (a cache's own `attend` keeps its own counts)."""
    if kind in ("append", "prefill", "fill"):
        cache.appended(t)
    elif kind == "chunk":
        cache.chunked(t)
    elif kind in ("evict", "shared"):
        cache.decoded()
    elif kind == "places":
        cache.pieced(t)
    else:
        cache.advance(t)


def pool_rows(pool, seqs) -> torch.Tensor:
    """The sequences' rows in the pool's block tables, on the pool's device."""
    return to_device([s.cache.table_row for s in seqs], pool.device)


def stacked_rows(seqs, device) -> torch.Tensor:
    return to_device([s.cache.stacked[1] for s in seqs], device)


def decode_lens(seqs) -> list[int]:
    """The slots each decode attends over: the tokens its cache holds and the new one."""
    return [s.cache.decode_slots() for s in seqs]


def append_rows(pool, seqs):
    """(new slots, context lengths, slot-table width in blocks) of append decodes, computed on the host."""
    lens = decode_lens(seqs)
    return [s.cache.next_slot() for s in seqs], lens, -(-max(lens) // pool.block_size)


def bounded_tables(pool, seqs, cap) -> torch.Tensor:
    """Slot tables [B, cap] of bounded caches: local slot j of row b -> its pool slot."""
    return pool.slot_tables(pool_rows(pool, seqs), -(-cap // pool.block_size))[:, :cap].contiguous()


def append_tables(pool, seqs, width: int) -> torch.Tensor:
    """Slot tables [B, width * bs] of append decodes; striped (virtual storage): each sequence's first slot,
    expanded, since the kernel reads its stripe without a table."""
    if not pool.striped:
        return pool.slot_tables(pool_rows(pool, seqs), width)
    first = [pool.stripe_block(s.cache.table_row, 0) * pool.block_size for s in seqs]
    return to_device(first, pool.device, torch.int32)[:, None].expand(-1, width * pool.block_size)


class AppendGroup:
    """Decode rows whose caches only append: each new token's K/V go to pool slot `new[b]`, then one paged
    attention over `table[b, :lens[b]]` (striped: over each sequence's contiguous slots from `table[b, 0]`).
    Also the cache object of a captured decode graph."""

    def __init__(self, pool, new, lens, table):
        self.pool, self.new, self.lens, self.table = pool, new, lens, table

    def attend(self, layer, q, k, v, positions=None):
        self.pool.write(layer, self.new, k, v)
        return table_attention(q, self.pool, layer, self.table, self.lens, contiguous=self.pool.striped)


class EvictGroup:
    """Decodes into the spare slots of bounded caches sharing one policy, rows `rows` of its `StackedMeta`, each
    over lens[b] slots (`cache.steps.evict_decode` for all of them at once)."""

    def __init__(self, pool, meta, rows, table, lens):
        self.pool, self.meta, self.rows, self.table, self.lens = pool, meta, rows, table, lens

    def attend(self, layer, q, k, v, positions):
        m = self.meta
        return evict_decode(q, k, v, self.pool, layer, self.table, self.lens, self.rows, positions, m.pos[:, layer],
                            m.spare[:, layer], None if m.score is None else m.score[:, layer], m.policy, ring=m.ring,
                            count=None if m.count is None else m.count[:, layer])


def layer_slots(pool, meta, layer: int, table, rows, lens=None):
    """(storage, layer, slot table, lens, each row's place rows or None) a group of caches whose heads share places
    reads in `layer`: the pool and the table as they are, or, for layers of different budgets (PyramidKV's, the
    plans of layers=global), each row's place rows of the layer in the pool's view of every layer's slots
    (`BlockPool.all_layers`), some borrowed from other layers (`StackedMeta.set_plan`), as many as the layer's widest
    plan (`StackedMeta.layer_width`), and lens no longer than each row's."""
    if not meta.planned:
        return pool, layer, table, lens, None
    width, most = meta.plan_rows[rows, layer], meta.layer_width[layer]
    table = place_slots((meta.place_layer[rows, layer, :most], meta.place_row[rows, layer, :most]), table, pool)
    return pool.all_layers(), 0, table, None if lens is None else torch.minimum(lens, width), width


class SharedGroup:
    """Decodes of caches whose heads share a layer's places (AdaKV), rows `rows` of their policy's `StackedMeta`,
    each over lens[b] slots (`cache.steps.shared_decode` for all of them at once). Layers of different budgets
    (PyramidKV) read their place rows where `StackedMeta.places` puts them, some in other layers' slots, through
    the pool's `all_layers` view."""

    def __init__(self, pool, meta, rows, table, lens):
        self.pool, self.meta, self.rows, self.table, self.lens = pool, meta, rows, table, lens

    def attend(self, layer, q, k, v, positions):
        m = self.meta
        storage, at, table, lens, width = layer_slots(self.pool, m, layer, self.table, self.rows, self.lens)
        return shared_decode(q, k, v, storage, at, table, self.rows, positions, m.owner[:, layer], m.pos[:, layer],
                             m.spare[:, layer], m.score[:, layer], m.policy, m.sure[layer], lens, width)


# the most elements of a "places" step's largest tensors in one call: its places' keys [rows, entries, D] where
# FlashAttention runs it (`steps.owned_attention`), else its mask and probabilities [rows, t, query heads,
# entries]; a batch of long pieces runs in chunks of rows under it, as each cache's own `attend` once ran alone
PIECE_ELEMENTS = 1 << 28


class PlacesGroup:
    """Prefill pieces of t tokens of caches whose heads share a layer's places (AdaKV, PyramidKV), rows `rows` of
    their policy's `StackedMeta`, each holding as many place rows (`AdaptiveKVCache.used`): `cache.steps.shared_piece`
    for all of them at once, each layer's plan (rows held, rows the piece may take, whether it evicts) the same for
    every cache and made on the host before the step (`AdaptiveKVCache.piece_plan`)."""

    def __init__(self, pool, meta, rows, table, cache, t: int):
        self.pool, self.meta, self.rows, self.table, self.t = pool, meta, rows, table, t
        self.budgets = cache.budgets
        self.plans = [cache.piece_plan(layer, t) for layer in range(len(cache.budgets))]

    def attend(self, layer, q, k, v, positions):
        m, t = self.meta, self.t
        storage, at, table, _, _ = layer_slots(self.pool, m, layer, self.table, self.rows)
        plan = self.plans[layer]
        sure, share = self.budgets[layer]
        bsz, h = self.rows.shape[0], k.shape[1]
        q, k, v = (x.unflatten(0, (bsz, t)) for x in (q, k, v))
        positions = positions.view(bsz, t)
        per_row = (plan[0] + t) * h * (q.shape[3] if flash_ok(q) else t * q.shape[2])
        each = max(1, PIECE_ELEMENTS // per_row)  # rows a call takes
        outs = [shared_piece(q[a:a + each], k[a:a + each], v[a:a + each], storage, at, table[a:a + each],
                             self.rows[a:a + each], positions[a:a + each], m.owner[:, layer], m.pos[:, layer],
                             m.score[:, layer], m.policy, sure, share, *plan,
                             spare=m.spare[:, layer] if plan[2] else None) for a in range(0, bsz, each)]
        return torch.cat(outs).flatten(0, 1)


class PrefillGroup:
    """Prefill pieces of unbounded caches, piece i of t[i] tokens after the n[i] its cache holds: the new K/V go
    to their pool slots, then one varlen causal attention over all pieces. Pieces with nothing cached attend
    over the step's own K/V; otherwise (or when the pool quantizes) each piece's cached and new K/V are read
    back from the pool, packed.
    The slot indices are built once per step, on the device, for every layer."""

    def __init__(self, pool, held: list[int], lens: list[int], rows: torch.Tensor):
        dev, bs = pool.device, pool.block_size
        self.pool = pool
        total = [n + t for n, t in zip(held, lens)]
        table = pool.slot_tables(rows, -(-max(total) // bs))
        self.cu_q, self.max_q = _cumulative(lens, dev), max(lens)
        self.new = _packed_slots(table, torch.tensor(held, device=dev), lens, self.cu_q)
        self.cached = any(held) or not pool.exact
        self.cu_k, self.max_k = (_cumulative(total, dev), max(total)) if self.cached else (self.cu_q, self.max_q)
        self.slots = _packed_slots(table, torch.zeros_like(rows), total, self.cu_k) if self.cached else None

    def attend(self, layer, q, k, v, positions=None):
        self.pool.write(layer, self.new, k, v)
        if self.cached:
            k, v = self.pool.gather(layer, self.slots)
        return varlen_causal_attention(q, k, v, self.cu_q, self.cu_k, self.max_q, self.max_k)


def _cumulative(lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


def _packed_slots(table: torch.Tensor, start: torch.Tensor, lens: list[int], cu: torch.Tensor) -> torch.Tensor:
    """Pool slots table[i, start[i] : start[i] + lens[i]] of every row i, concatenated (no host sync)."""
    total = sum(lens)
    row = torch.repeat_interleave(torch.arange(len(lens), device=table.device),
                                  torch.tensor(lens, device=table.device), output_size=total)
    col = torch.arange(total, device=table.device) - cu[row].long() + start[row]
    return table[row, col].long()


class ChunkGroup:
    """Prefill pieces of t tokens past the room of bounded caches holding n tokens each that share one policy
    (or the decodes that fill the room of caches evicting every e steps): `cache.steps.chunk_attend` then
    `keep_and_rewrite` for all of them at once. Also a group of a captured decode graph (t = 1).
    lens: the decodes' [B] slots (`decode_lens`; the table that wide), given for one-token pieces: where
    `steps.bulk_decode_ok`, they run the fused evict step and a compaction instead (`steps.bulk_evict_decode`)."""

    def __init__(self, pool, meta, rows, table, n, lens=None):
        self.pool, self.meta, self.rows, self.table, self.n = pool, meta, rows, table, n
        bulk = lens is not None and bulk_decode_ok(meta.policy, pool, meta.ring)
        self.lens = lens if bulk else None

    def attend(self, layer, q, k, v, positions):
        m, n = self.meta, self.n
        pos, score = m.pos[:, layer], None if m.score is None else m.score[:, layer]
        count = None if m.count is None else m.count[:, layer]
        if self.lens is not None:
            return bulk_evict_decode(q, k, v, self.pool, layer, self.table, self.lens, self.rows, positions, pos,
                                     m.spare[:, layer], score, m.policy, count, m.ring)
        out, *cand = chunk_attend(q, k, v, self.pool, layer, self.table, n, self.rows, positions, pos, score, m.policy,
                                  ring=m.ring, count=count)
        new = (k.unflatten(0, (self.rows.shape[0], -1)), v.unflatten(0, (self.rows.shape[0], -1)))
        merged = keep_and_rewrite(self.pool, layer, self.table, n, self.rows, pos, score, m.policy, *cand, new=new,
                                  count=count)
        # the slot after the budget is a decode's spare that follows (a cache evicting every e steps keeps it)
        m.spare[self.rows, layer] = m.spare.new_full((), m.policy.budget)  # a device scalar: graphs copy no host data
        if m.ring is not None:
            piece = positions.view(self.rows.shape[0], -1)
            m.ring.write(layer, self.rows, piece, *new)
            if merged is not None:  # kept keys that took evicted ones, the new tokens' among them
                m.ring.rewrite(layer, self.rows, cand[2], *merged, piece[:, -1])
        return out


class FillGroup:
    """Prefill pieces of t tokens of bounded caches holding n tokens each, with room for the piece (no
    eviction), sharing one policy: what a cache's own `attend` does then, for all of them at once."""

    def __init__(self, pool, meta, rows, table, n, t):
        self.pool, self.meta, self.rows, self.table, self.n, self.t = pool, meta, rows, table, n, t

    def attend(self, layer, q, k, v, positions):
        m, n, t, rows = self.meta, self.n, self.t, self.rows
        bsz = rows.shape[0]
        self.pool.write(layer, self.table[:, n:n + t].flatten(), k, v)
        pos = m.pos[:, layer]
        pos[rows, n:n + t] = positions.view(bsz, t, 1).to(pos.dtype)
        count = None if m.count is None else m.count[:, layer]
        if count is not None:  # each new token stands for itself; kept ones of a cache that evicts every e steps
            count[rows, n:n + t] = 1.0  # may stand for more, which attention weighs (`merge`)
        kc, vc = self.pool.gather(layer, self.table)
        if m.ring is not None:  # the cached tokens as the window holds them, the piece's own at mixed precision
            new = (k.view(bsz, t, *k.shape[1:]), v.view(bsz, t, *v.shape[1:]))
            kc, vc = m.ring.with_piece(layer, rows, kc[:, :n], vc[:, :n], pos, positions.view(bsz, t)[:, 0], *new)
        score = None if m.score is None else m.score[:, layer]
        out, scores = piece_attention(q.unflatten(0, (bsz, t)), kc, vc, m.policy,
                                      None if score is None else score[rows, :n], pos[rows, :n + t],
                                      attention_bias(None if count is None else count[rows, :n + t]))
        if score is not None:
            score[rows, :n + t] = scores
        if m.ring is not None:
            m.ring.write(layer, rows, positions.view(bsz, t), *new)
        return out.flatten(0, 1)


def make_group(pool, key: GroupKey, pieces):
    """The group object of `pieces` [(seq, t)] that share `key`."""
    dev = pool.device
    seqs = [s for s, _ in pieces]
    if key.kind == "append":
        new, lens, width = append_rows(pool, seqs)
        return AppendGroup(pool, torch.tensor(new, device=dev), torch.tensor(lens, device=dev, dtype=torch.int32),
                           append_tables(pool, seqs, width))
    if key.kind == "prefill":
        return PrefillGroup(pool, [len(s.cache) for s in seqs], [t for _, t in pieces], pool_rows(pool, seqs))
    rows = stacked_rows(seqs, dev)
    if key.kind == "fill":
        return FillGroup(pool, key.meta, rows, bounded_tables(pool, seqs, key.n + key.t).long(), key.n, key.t)
    if key.kind == "chunk":
        # the caches' n tokens (past the budget in one that evicts every e steps) and a decode's, or the budget
        # they keep
        if key.t == 1:  # the decodes that fill the room of caches evicting every e steps
            lens = torch.tensor(decode_lens(seqs), dtype=torch.int32, device=dev)
            return ChunkGroup(pool, key.meta, rows, bounded_tables(pool, seqs, key.n + 1), key.n, lens)
        width = max(key.meta.policy.budget, key.n)
        return ChunkGroup(pool, key.meta, rows, bounded_tables(pool, seqs, width).long(), key.n)
    if key.kind == "places":
        return PlacesGroup(pool, key.meta, rows, bounded_tables(pool, seqs, key.meta.width), seqs[0].cache, key.t)
    group = SharedGroup if key.kind == "shared" else EvictGroup
    lens = torch.tensor(decode_lens(seqs), dtype=torch.int32, device=dev)
    return group(pool, key.meta, rows, bounded_tables(pool, seqs, key.meta.width), lens)


def group_spans(keys) -> list[tuple]:
    """(key, start, end) of each run of equal keys in a step's ordered rows; a row without a key (None) is a run
    of its own."""
    spans, i = [], 0
    while i < len(keys):
        j = i + 1
        while keys[i] is not None and j < len(keys) and keys[j] == keys[i]:
            j += 1
        spans.append((keys[i], i, j))
        i = j
    return spans


class Spans:
    """The cache object of consecutive groups in one flat run of tokens: tokens [start, end) attend through their
    group (or a sequence's own cache), one call per layer each. streams: CUDA streams for the groups after the
    first, which then attend at once (their rows and metadata are their own): a group's small grids leave most of
    the GPU idle, so in turn they take as long as the largest batch would."""

    def __init__(self, spans, streams=()):
        self.spans = spans  # (start, end, group)
        self.streams = streams if len(spans) > 1 else ()

    def attend(self, layer, q, k, v, positions):
        if self.streams:
            return self._at_once(layer, q, k, v, positions)
        outs = [group.attend(layer, q[a:b], k[a:b], v[a:b], positions[a:b]) for a, b, group in self.spans]
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _at_once(self, layer, q, k, v, positions):
        """The first group on the current stream, each other on a stream of its own that forks from it and joins
        it again (the caching allocator keeps each block on the stream that took it, and every stream waits for the
        current one before its next group, so no block is reused while another stream reads it)."""
        main = torch.cuda.current_stream()
        sides = self.streams[:len(self.spans) - 1]
        for stream in sides:
            stream.wait_stream(main)
        outs = []
        for (a, b, group), stream in zip(self.spans, [main, *sides]):
            with torch.cuda.stream(stream):
                outs.append(group.attend(layer, q[a:b], k[a:b], v[a:b], positions[a:b]))
        for stream in sides:
            main.wait_stream(stream)
        return torch.cat(outs)


class StepBatch:
    """The cache object the model sees for one step: `attend` splits the flat run by group."""

    def __init__(self, pool, batch, keys):
        """batch: [(seq, t)] and their group keys, as `order` returns them."""
        self.pool = pool
        self.batch = batch
        self.groups = [(key, i, j, None if key is None else make_group(pool, key, batch[i:j]))
                       for key, i, j in group_spans(keys)]
        starts = [0, *itertools.accumulate(t for _, t in batch)]
        # a row without a group attends through its own cache, in one call for the whole group otherwise
        self.spans = Spans([(starts[i], starts[j], batch[i][0].cache if group is None else group)
                            for _, i, j, group in self.groups])

    @staticmethod
    def order(batch) -> tuple[list, list]:
        """(batch, group keys) with the rows of one group next to each other (groups in order of first
        appearance), the rest last."""
        keys = [group_key(*st) for st in batch]
        rank = {}
        ranks = [1 << 30 if g is None else rank.setdefault(g, len(rank)) for g in keys]
        order = sorted(range(len(batch)), key=ranks.__getitem__)
        return [batch[i] for i in order], [keys[i] for i in order]

    def positions(self) -> torch.Tensor:
        pos = [p for seq, t in self.batch for p in range(seq.cache.seen, seq.cache.seen + t)]
        return torch.tensor(pos, device=self.pool.device)

    def advance(self):
        for key, i, j, _ in self.groups:
            for seq, t in self.batch[i:j]:
                finish_step(seq.cache, None if key is None else key.kind, t)

    def attend(self, layer, q, k, v, positions):
        return self.spans.attend(layer, q, k, v, positions)
