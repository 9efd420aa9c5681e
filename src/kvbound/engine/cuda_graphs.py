"""CUDA graphs of whole decode steps: the host launches one graph instead of every kernel of every layer."""
from __future__ import annotations

import torch

from ..staging import to_device
from .runner import AppendGroup, EvictGroup, GroupKey, SharedGroup, append_rows, append_tables, bounded_tables


class DecodeGraphs:
    """CUDA graphs of whole decode steps, one per (group, batch size[, table width]): steps whose rows all
    append (unbounded caches), and steps whose rows all evict under one policy (or share places, AdaKV).
    Batch sizes are 1, 2, 4, ... up to max_seqs; a step is padded to the next size with rows that write and
    read one scratch slot (and a scratch metadata row). Append graphs come in table widths max_len,
    2 max_len, 4 max_len, ... up to the longest row there can be (the model's context, or the pool's tokens
    if fewer): the kernel splits each graph's width over the GPU, so a step runs in the narrowest width that
    holds its longest row, as an eager step would. Width max_len is captured at start-up, wider ones and
    evict graphs when first used. Only the slot table grows with the longest row (4 bytes per token per batch
    row). Other steps run eagerly."""

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
        self.ids = torch.zeros(top, dtype=torch.long, device=dev)
        self.pos = torch.zeros(top, dtype=torch.long, device=dev)
        self.new = torch.full((top,), self.scratch, dtype=torch.long, device=dev)
        self.lens = torch.ones(top, dtype=torch.int32, device=dev)
        self.table = torch.full((top, self.widths[-1] * bs), self.scratch, dtype=torch.int32, device=dev)
        self.evict_buffers = {}  # StackedMeta -> (rows, table)
        self.generations = {}  # StackedMeta -> its generation when its graphs were captured (rows grow)
        self.graphs, self.logits, self.attn = {}, {}, {}
        self.last = None  # the key of the graph the last step replayed (benchmarks time it alone)
        self.mempool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            self._capture(GroupKey("append"), size, self.widths[0])

    def _group(self, key, size, width):
        if key.kind == "append":
            return AppendGroup(self.pool, self.new[:size], self.lens[:size],
                               self.table[:size, :width * self.pool.block_size])
        rows, table = self.evict_buffers[key.meta]
        group = SharedGroup if key.kind == "shared" else EvictGroup
        return group(self.pool, key.meta, rows[:size], table[:size])

    def capture_append(self, size, width):
        """An append graph captured while serving: its warm-up runs execute, so every row points at the
        scratch slot first (the buffers still hold the last step's slots, whose K/V must not be overwritten)."""
        self.new[:size], self.lens[:size], self.table[:size, 0] = self.scratch, 1, self.scratch
        self._capture(GroupKey("append"), size, width)

    def _capture(self, key, size, width=None):
        key = (key, size, width)
        attn = self._group(*key)
        self.attn[key] = attn  # the graph reads its tensors (EvictGroup's lens): keep them alive
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile the kernels and settle the allocator outside the graph
                self.model(self.ids[:size], self.pos[:size], attn)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.mempool):
            self.logits[key] = self.model(self.ids[:size], self.pos[:size], attn)
        self.graphs[key] = g

    def capture_evict(self, meta, sizes=None, kind="evict"):
        """Capture the evict graphs (or "shared": AdaKV's) of one policy's stacked metadata (all batch sizes by
        default). Their warm-up runs execute, so the buffers point at the scratch row and slot while capturing."""
        dev = self.ids.device
        self.generations[meta] = meta.generation
        if meta not in self.evict_buffers:
            self.evict_buffers[meta] = (
                torch.full((self.sizes[-1],), meta.scratch_row, dtype=torch.long, device=dev),
                torch.full((self.sizes[-1], meta.pos.shape[2]), self.scratch, dtype=torch.int32, device=dev))
        rows, table = self.evict_buffers[meta]
        for size in sorted(sizes or self.sizes, reverse=True):
            rows[:size], table[:size] = meta.scratch_row, self.scratch
            self._capture(GroupKey(kind, meta), size)

    def drop(self, meta):
        """Forget the evict graphs of a policy's stacked metadata and their buffers (no cache uses it any more, or
        its rows grew into new tensors), once a step in flight that may replay them is done; their memory in the
        graphs' pool goes to later captures."""
        torch.cuda.current_stream().synchronize()
        self.evict_buffers.pop(meta, None)
        self.generations.pop(meta, None)
        for key in [key for key in self.graphs if key[0].meta is meta]:
            del self.graphs[key], self.logits[key], self.attn[key]
        if self.last is not None and self.last[0].meta is meta:
            self.last = None

    def run(self, batch, keys, fill=None):
        """Logits [B, vocab] of a decode step that a graph covers, else None. The caller does the caches'
        bookkeeping (`runner.finish_step`). fill: (rows on the device, () -> tokens there), the input ids of
        rows whose token is still on the device (the engine's run-ahead), taken last."""
        key = keys[0] if keys[0] == keys[-1] else None  # one group, since `StepBatch.order` sorted them
        b = len(batch)
        if key is None or key.kind not in ("append", "evict", "shared") or b > self.sizes[-1]:
            return None
        seqs = [s for s, _ in batch]
        size = next(x for x in self.sizes if x >= b)
        dev = self.ids.device
        width = None
        if key.kind == "append":
            new, lens, need = append_rows(self.pool, seqs)
            width = next((w for w in self.widths if w >= need), None)
            if width is None:
                return None
            if (key, size, width) not in self.graphs:
                self.capture_append(size, width)
        else:
            if self.generations.get(key.meta, key.meta.generation) != key.meta.generation:
                self.drop(key.meta)  # its rows grew: the graphs read the old tensors
            if (key, size, None) not in self.graphs:
                self.capture_evict(key.meta, [size], key.kind)
        ids = [s.feed(1)[0] for s in seqs]
        if key.kind == "append":
            host = to_device([ids, [s.cache.seen for s in seqs], new, lens], dev)
            self.new[:b], self.lens[:b] = host[2], host[3].to(torch.int32)
            self.new[b:size], self.lens[b:size], self.table[b:size, 0] = self.scratch, 1, self.scratch
            if self.pool.striped:  # the kernel reads column 0 alone
                self.table[:b, 0] = append_tables(self.pool, seqs, 1)[:, 0]
            else:
                self.table[:b, :need * self.pool.block_size] = append_tables(self.pool, seqs, need)
        else:
            rows, table = self.evict_buffers[key.meta]
            host = to_device([ids, [s.cache.seen for s in seqs], [s.cache.stacked[1] for s in seqs]], dev)
            rows[:b], rows[b:size], table[b:size] = host[2], key.meta.scratch_row, self.scratch
            table[:b] = bounded_tables(self.pool, seqs, table.shape[1])
        self.ids[:b], self.pos[:b] = host[0], host[1]
        if fill is not None:
            self.ids[fill[0]] = fill[1]()
        self.last = (key, size, width)
        self.graphs[self.last].replay()
        return self.logits[self.last][:b]
