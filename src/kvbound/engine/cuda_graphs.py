"""CUDA graphs of whole decode steps: the host launches one graph instead of every kernel of every layer."""
from __future__ import annotations

import torch

from ..staging import to_device
from .runner import (AppendGroup, ChunkGroup, EvictGroup, GroupKey, SharedGroup, Spans, append_rows, append_tables,
                     bounded_tables, decode_lens, group_spans)

KINDS = ("append", "evict", "shared", "chunk")  # the group kinds a graph can hold ("chunk": one token a row)
MAX_GROUPS = 16  # a step of more groups than this runs eagerly
MAX_SEVERAL = 64  # graphs of several groups kept at once; the one replayed least recently goes first


class DecodeGraphs:
    """CUDA graphs of whole decode steps, keyed by their parts: (group, batch size[, table width]) for each group of
    the step, in its order. A group's rows all append (unbounded caches), or all evict under one policy (or share
    places, AdaKV; or fill the room of caches evicting every e steps, which keep their budget: one-token "chunk"
    groups); a step of up to MAX_GROUPS groups (policies served side by side, full caches beside bounded
    ones) replays one graph, whose groups attend over consecutive rows at once, each on a CUDA stream of its own
    (`runner.Spans`). Batch sizes are 1, 2, 4, ... up to max_seqs per group; each group is padded to the next size
    with rows that write and read one scratch slot (and a scratch metadata row). Append graphs come in table widths
    max_len, 2 max_len, 4 max_len, ... up to the longest row there can be (the model's context, or the pool's tokens
    if fewer): the kernel splits each graph's width over the GPU, so a step runs in the narrowest width that holds
    its longest row, as an eager step would. Single-group append graphs of width max_len are captured at start-up,
    every other graph when first used. Only the slot table grows with the longest row (4 bytes per token per batch
    row). Graphs of several groups, whose sizes combine in many ways, write their logits into one buffer they share,
    so they hold no memory of their own, and at most MAX_SEVERAL are kept. Other steps run eagerly."""

    def __init__(self, model, pool, max_seqs: int, max_len: int, context_len: int | None = None):
        self.model, self.pool = model, pool
        bs, dev = pool.block_size, pool.device
        longest = min(context_len or max_len, pool.num_blocks * bs)
        self.widths = [-(-min(max_len, longest) // bs)]  # append table widths in blocks
        while self.widths[-1] * bs < longest:
            self.widths.append(self.widths[-1] * 2)
        self.sizes = [1]
        while self.sizes[-1] < max_seqs:
            self.sizes.append(self.sizes[-1] * 2)
        top = self.sizes[-1]
        self.scratch = pool.reserve() * bs  # padding rows write here
        self.ids = torch.zeros(top * MAX_GROUPS, dtype=torch.long, device=dev)
        self.pos = torch.zeros(top * MAX_GROUPS, dtype=torch.long, device=dev)
        self.new = torch.full((top,), self.scratch, dtype=torch.long, device=dev)
        self.lens = torch.ones(top, dtype=torch.int32, device=dev)
        self.table = torch.full((top, self.widths[-1] * bs), self.scratch, dtype=torch.int32, device=dev)
        self.evict_buffers = {}  # (StackedMeta, kind) -> (rows, table, lens)
        self.generations = {}  # StackedMeta -> its generation when its graphs were captured (rows grow)
        self.graphs, self.logits, self.attn = {}, {}, {}
        self.several = {}  # the graphs of several groups, least recently replayed first (a dict keeps order)
        self.shared_logits = None  # [rows, vocab], the logits of the graphs of several groups
        self.last = None  # the key of the graph the last step replayed (benchmarks time it alone)
        self.mempool = torch.cuda.graph_pool_handle()
        self.streams = [torch.cuda.Stream() for _ in range(MAX_GROUPS - 1)]  # a graph's groups attend at once
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            self._capture(((GroupKey("append"), size, self.widths[0]),))

    def parts(self):
        """(group key, batch size, width) of every group of every captured graph."""
        return [part for parts in self.graphs for part in parts]

    def _group(self, key, size, width):
        if key.kind == "append":
            return AppendGroup(self.pool, self.new[:size], self.lens[:size],
                               self.table[:size, :width * self.pool.block_size])
        rows, table, lens = self.evict_buffers[key.meta, key.kind]
        if key.kind == "chunk":
            return ChunkGroup(self.pool, key.meta, rows[:size], table[:size], key.n, lens[:size])
        group = SharedGroup if key.kind == "shared" else EvictGroup
        return group(self.pool, key.meta, rows[:size], table[:size], lens[:size])

    def _buffers(self, meta, kind):
        """The rows, slot tables and slots held that an evict (shared, chunk) group of this policy's metadata reads,
        made once for each kind (one step may hold a policy's evict and chunk groups; never two groups of one kind:
        their decode keys are equal, a one-token chunk always following width - 1 held tokens)."""
        if (meta, kind) not in self.evict_buffers:
            dev, top, width = self.ids.device, self.sizes[-1], meta.pos.shape[2]
            self.generations[meta] = meta.generation
            self.evict_buffers[meta, kind] = (
                torch.full((top,), meta.scratch_row, dtype=torch.long, device=dev),
                torch.full((top, width), self.scratch, dtype=torch.int32, device=dev),
                torch.full((top,), width, dtype=torch.int32, device=dev))
        return self.evict_buffers[meta, kind]

    def _capture(self, parts):
        """Capture the graph of `parts`. Its warm-up runs execute, so every group's rows point at the scratch slot
        (and row) first: the buffers still hold the last step's, whose K/V and metadata must not be overwritten."""
        spans, start = [], 0
        for key, size, width in parts:
            if key.kind == "append":
                self.new[:size], self.lens[:size], self.table[:size, 0] = self.scratch, 1, self.scratch
            else:
                rows, table, lens = self._buffers(key.meta, key.kind)
                rows[:size], table[:size], lens[:size] = key.meta.scratch_row, self.scratch, table.shape[1]
            spans.append((start, start + size, self._group(key, size, width)))
            start += size
        attn = Spans(spans, self.streams)
        if len(parts) > 1 and len(self.several) >= MAX_SEVERAL:
            self._forget([next(iter(self.several))])  # the least recently replayed
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile the kernels and settle the allocator outside the graph
                vocab = self.model(self.ids[:start], self.pos[:start], attn).shape[1]
        torch.cuda.current_stream().wait_stream(stream)
        if len(parts) > 1 and (self.shared_logits is None or self.shared_logits.shape[0] < start):
            self._forget(list(self.several))  # they write into the buffer this one replaces
            self.shared_logits = None
            rows = min(self.ids.shape[0], 1 << (start - 1).bit_length())
            self.shared_logits = torch.empty((rows, vocab), dtype=torch.float32, device=self.ids.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.mempool):
            logits = self.model(self.ids[:start], self.pos[:start], attn)
            if len(parts) > 1:
                logits = self.shared_logits[:start].copy_(logits)
        self.graphs[parts], self.logits[parts] = g, logits
        self.attn[parts] = attn  # the graph reads its tensors (EvictGroup's lens): keep them alive
        if len(parts) > 1:
            self.several[parts] = None

    def _forget(self, keys):
        """Forget these graphs, once a step in flight that may replay them is done."""
        if keys:
            torch.cuda.current_stream().synchronize()
        for parts in keys:
            del self.graphs[parts], self.logits[parts], self.attn[parts]
            self.several.pop(parts, None)
        if self.last is not None and self.last not in self.graphs:
            self.last = None

    def capture_evict(self, meta, sizes=None, kind="evict"):
        """Capture the single-group evict graphs (or "shared": AdaKV's; or "chunk": the decodes that fill the room of
        caches evicting every e steps) of one policy's stacked metadata (all batch sizes by default)."""
        key = GroupKey(kind, meta, 1, meta.width - 1 if kind == "chunk" else 0)
        for size in sorted(sizes or self.sizes, reverse=True):
            self._capture(((key, size, None),))

    def drop(self, meta):
        """Forget the graphs with a group of a policy's stacked metadata and its buffers (no cache uses it any
        more, or its rows grew into new tensors), once a step in flight that may replay them is done; their memory
        in the graphs' pool goes to later captures."""
        torch.cuda.current_stream().synchronize()
        for kind in KINDS:
            self.evict_buffers.pop((meta, kind), None)
        self.generations.pop(meta, None)
        self._forget([parts for parts in self.graphs if any(key.meta is meta for key, _, _ in parts)])

    def _part(self, key, seqs):
        """(key, batch size, width) of one group of a step, and its append rows (new slots, lengths, table width in
        blocks) when it appends; None when no graph can hold it."""
        size = next((x for x in self.sizes if x >= len(seqs)), None)
        if size is None:
            return None
        if key.kind != "append":
            if self.generations.get(key.meta, key.meta.generation) != key.meta.generation:
                self.drop(key.meta)  # its rows grew: the graphs read the old tensors
            return (key, size, None), None
        rows = append_rows(self.pool, seqs)
        width = next((w for w in self.widths if w >= rows[2]), None)
        return None if width is None else ((key, size, width), rows)

    def run(self, batch, keys, fill=None):
        """Logits [B, vocab] of a decode step that a graph covers, else None. The caller does the caches'
        bookkeeping (`runner.finish_step`). fill: (rows on the device, () -> tokens there), the input ids of
        rows whose token is still on the device (the engine's run-ahead), taken last."""
        spans = group_spans(keys)  # one span per group, since `StepBatch.order` sorted them
        if len(spans) > MAX_GROUPS or any(key is None or key.kind not in KINDS or key.t != 1 for key, _, _ in spans):
            return None
        seqs = [s for s, _ in batch]
        parts, appends = [], {}
        for key, i, j in spans:
            part = self._part(key, seqs[i:j])
            if part is None:
                return None
            parts.append(part[0])
            if part[1] is not None:
                appends[i] = part[1]
        parts = tuple(parts)
        if parts not in self.graphs:
            self._capture(parts)
        # one copy to the device: ids, positions, each row's place among the padded rows, then each group's own
        ids, pos, place, start = [], [], [], 0
        for (_, size, _), (_, i, j) in zip(parts, spans):
            pad = [0] * (size - (j - i))
            ids += [s.feed(1)[0] for s in seqs[i:j]] + pad
            pos += [s.cache.seen for s in seqs[i:j]] + pad
            place += range(start, start + j - i)
            start += size
        own = [appends[i][0] + appends[i][1] if i in appends else
               [s.cache.stacked[1] for s in seqs[i:j]] + decode_lens(seqs[i:j]) for _, i, j in spans]
        place = place if len(parts) > 1 else []  # one group: its rows are the first, in order
        host = to_device(ids + pos + place + [x for values in own for x in values], self.ids.device)
        self.ids[:start], self.pos[:start] = host[:start], host[start:2 * start]
        place, at = host[2 * start:2 * start + len(place)], 2 * start + len(place)
        for (key, size, _), (_, i, j), values in zip(parts, spans, own):
            self._fill(key, size, seqs[i:j], host[at:at + len(values)], appends.get(i))
            at += len(values)
        if fill is not None:
            self.ids[place[fill[0]] if len(parts) > 1 else fill[0]] = fill[1]()
        self.last = parts
        if parts in self.several:  # now the most recently replayed
            self.several[parts] = self.several.pop(parts)
        self.graphs[parts].replay()
        logits = self.logits[parts]
        return logits[:len(batch)] if len(parts) == 1 else logits[place]

    def _fill(self, key, size, seqs, values, append):
        """Point one group's buffers at its sequences' slots (and metadata rows), its padding at the scratch.
        values: on the device, the new slots and context lengths of an append group (`append`: its rows on the
        host), else the sequences' metadata rows, then the slots they hold (`runner.decode_lens`)."""
        b = len(seqs)
        if key.kind == "append":
            self.new[:b], self.lens[:b] = values[:b], values[b:].to(torch.int32)
            self.new[b:size], self.lens[b:size], self.table[b:size, 0] = self.scratch, 1, self.scratch
            need = append[2]
            if self.pool.striped:  # the kernel reads column 0 alone
                self.table[:b, 0] = append_tables(self.pool, seqs, 1)[:, 0]
            else:
                self.table[:b, :need * self.pool.block_size] = append_tables(self.pool, seqs, need)
            return
        rows, table, lens = self.evict_buffers[key.meta, key.kind]
        rows[:b], rows[b:size], table[b:size] = values[:b], key.meta.scratch_row, self.scratch
        lens[:b], lens[b:size] = values[b:].to(torch.int32), table.shape[1]
        table[:b] = bounded_tables(self.pool, seqs, table.shape[1])
