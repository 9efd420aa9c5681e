"""The paged KV pool: fixed-size blocks of slots shared by all sequences, with refcounts and prefix caching.

K/V of every layer live in two tensors shaped [layers, num_blocks * block_size, kv_heads, head_dim]; pool
slot s belongs to block s // block_size. A sequence owns a list of block ids (its block table); its cache
addresses local slot j as pool slot `table[j // bs] * bs + j % bs` (`slot_tables`; `PagedStore` in store.py
is one sequence's view). The pool is a `store.SlotStorage`: the attention steps read and write it by slot.

Blocks are refcounted: a fork shares its parent's blocks, and a shared block is copied before it is
written (copy-on-write). Automatic prefix caching: a full block that its owner will never write again is
published under the hash of its token ids chained with the previous block's hash; a new request reuses
every leading block whose hash matches *and whose stored token ids match* (a hash collision never serves
the wrong KV). A freed published block keeps its contents and its hash until its memory is needed: free
blocks are handed out never-published first, then least recently freed.

Virtual storage (`kv_storage="virtual"`) gives each block-table row a stripe of its own: the row's block i is
`stripe_block(row, i)`, so every sequence's slots are one contiguous run of the pool and the decode kernel
reads it without a table (`contiguous`). The tensors are reserved address ranges, with physical pages only
under blocks that hold data; `num_blocks` is then the physical bound (blocks holding data at once), not the
reserved size. A prefix-cache hit or a fork from another row brings its blocks into the new row's stripe: the
physical pages wholly under them are mapped there too (copy-on-write, `virtual.BlockPages`), the rest copied.
So a block is only ever held by its own row.
"""
from __future__ import annotations

from collections import OrderedDict
from copy import copy

import torch

from ..errors import KvboundError
from ..staging import to_device
from .quant import Fp8KV, PackedKV, zeros_on
from .store import EACH_HEAD, at
from .virtual import BlockPages, CudaPages, HostPages


# virtual storage's page (two 2 MiB granules): each stripe has its own partly used frontier page, so memory wants
# small pages, while a growing batch maps bytes grown / page bytes pages per step at ~0.13-0.17 ms of host time
# each. On the H100 (results/engine_virtual_smollm2_h100.log, 43 growing 4k-token caches) 2 MiB pages cost 1.9% of
# a decode step, and prefill ran at 0.44-0.94x paged over four calls; 4 MiB cost 1.1% and commit 0.8% over the
# blocks' bytes; 8 MiB 0.6%, but 9% over, and twice a bounded batch's memory
POOL_PAGE_BYTES = 4 << 20
COMMON_BLOCKS = 2  # virtual storage: blocks before the stripes, taken for good (block 0, a decode graph's scratch)


def block_hash(prev: int | None, tokens) -> int:
    return hash((prev, tuple(tokens)))


def _slots_per_head(slots, k, heads):
    """The store kernel's slot table [tokens, H] of a write of k [..., H, D] at `slots` (`store.at`): every head of
    slots' tokens, or one slot per token and head; None where the write broadcasts k or names its own heads."""
    h = k.shape[-2]
    if heads is EACH_HEAD:
        per_head = slots.reshape(-1, h)
    elif heads is None:
        per_head = slots.reshape(-1, 1).expand(-1, h)
    else:
        return None
    return per_head if per_head.shape[0] * h * k.shape[-1] == k.numel() else None


class BlockPool:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, num_blocks: int, block_size: int = 16,
                 device="cpu", dtype=torch.float32, kv_bits: int | None = None, group_size: int = 64,
                 kv_storage: str = "paged", max_seqs: int = 16, max_seq_blocks: int | None = None,
                 offload_bytes: int = 0):
        """kv_bits 8 or 4: blocks hold packed codes with an fp16 scale and bias per group of `group_size`
        (`kernels.packing`), written quantized once and moved as packed bytes; "fp8": float8 e4m3 codes with
        a scale per token and head; None: `dtype` K/V. kv_storage "virtual": a stripe of `max_seq_blocks`
        blocks (default num_blocks) for each of `max_seqs` rows in reserved ranges, physical pages only under
        blocks holding data (`virtual.BlockPages`); "paged": ordinary tensors of num_blocks blocks, all committed.
        offload_bytes: host memory for prefix-cache blocks whose device memory is taken back (a host tier,
        least recently offloaded dropped first); a later prefix match finds them there (`host_match`)."""
        if block_size < 1 or num_blocks < 1:
            raise KvboundError(f"block pool: block_size ({block_size}) and num_blocks ({num_blocks}) must be >= 1")
        if kv_storage not in ("paged", "virtual"):
            raise KvboundError(f"kv_storage must be 'paged' or 'virtual', got {kv_storage!r}")
        self.pages = None
        self.striped = kv_storage == "virtual"
        zeros = zeros_on(device)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.stripe = min(num_blocks, max_seq_blocks or num_blocks) if self.striped else 0
        total = COMMON_BLOCKS + max_seqs * self.stripe if self.striped else num_blocks  # block ids there are
        if self.striped:
            cuda = torch.device(device).type == "cuda"
            backend = CudaPages(device, POOL_PAGE_BYTES) if cuda else HostPages(POOL_PAGE_BYTES)
            self.pages = BlockPages(backend, device, block_size)
            zeros = self.pages.zeros
        self.device, self.dtype, self.kv_heads, self.head_dim = torch.device(device), dtype, kv_heads, head_dim
        slots = total * block_size
        self.packed = (None if kv_bits is None else Fp8KV(layers, slots, kv_heads, head_dim, zeros)
                       if kv_bits == "fp8" else PackedKV(layers, slots, kv_heads, head_dim, kv_bits, group_size, zeros))
        self.exact = self.packed is None  # reads back exactly what was written
        self.k = self.v = None
        if self.packed is None:
            self.k = zeros((layers, slots, kv_heads, head_dim), dtype)
            self.v = zeros((layers, slots, kv_heads, head_dim), dtype)
        self.ref = [0] * total
        self.free_plain = [] if self.striped else list(range(num_blocks - 1, -1, -1))  # popped from the end: 0 first
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # published blocks with refcount 0, LRU first
        self.by_hash: dict[int, int] = {}  # hash -> block
        self.block_info: dict[int, tuple[int, tuple]] = {}  # block -> (hash, token ids) while published
        self.offload_left = offload_bytes
        self.host: OrderedDict[int, tuple[tuple, list[torch.Tensor]]] = OrderedDict()  # hash -> (token ids, bytes)
        self.offloaded = 0  # prefix-cache blocks copied to the host tier
        self.copies = 0  # blocks whose bytes were copied: copy-on-write, or into a stripe (for tests and stats)
        self.reserved = 0  # blocks taken for good (a decode graph's scratch block)
        self.held = 0  # striped: blocks with a reference (the common ones aside), against the num_blocks bound
        # blocks kept for this step's later takers (`Scheduler._take`): striped, the forks' copies; a KVzip
        # sequence's bounded cache, taken once its context is scored
        self.promised = 0
        # every live sequence's block table, one row each, on the pool's device: the batched decode reads
        # its slot tables from here with one gather per step
        rows = max_seqs if self.striped else 16
        self.tables = torch.zeros(rows, self.stripe or num_blocks, dtype=torch.int32, device=device)
        self.free_rows = list(range(rows - 1, -1, -1))
        self._all_layers = None  # `all_layers`, made on first use
        if self.striped:
            # block 0, held for good: the tables' unused entries point at it, since a batch's gather reads a
            # whole table width and an entry left from a freed block could point at an unmapped page
            self.reserve()

    def reserve(self) -> int:
        """A block that is never given back (striped: one of the common blocks, outside the num_blocks bound)."""
        self.reserved += 1
        if not self.striped:
            return self.allocate()
        if self.reserved > COMMON_BLOCKS:
            raise KvboundError(f"virtual storage keeps {COMMON_BLOCKS} blocks for good, and all are taken")
        b = self.reserved - 1
        self.pages.hold([b])
        self.ref[b] = 1
        return b

    @property
    def usable_blocks(self) -> int:
        """The most blocks one sequence may hold: the pool less its reserved blocks, or (striped) its stripe."""
        return self.stripe if self.striped else self.num_blocks - self.reserved

    def stripe_block(self, row: int, i: int) -> int:
        """Striped: the block that holds local block i of table row `row`."""
        if i >= self.stripe:
            raise KvboundError(f"a sequence needs block {i + 1}, but virtual storage gives each {self.stripe}")
        return COMMON_BLOCKS + row * self.stripe + i

    def take_row(self) -> int:
        if not self.free_rows:
            if self.striped:
                raise KvboundError(f"virtual storage has stripes for {self.tables.shape[0]} sequences, all in use")
            old = self.tables.shape[0]
            self.tables = torch.cat([self.tables, torch.zeros_like(self.tables)])
            self.free_rows = list(range(2 * old - 1, old - 1, -1))
        return self.free_rows.pop()

    def give_row(self, row: int):
        if self.striped:
            self.tables[row].zero_()  # its blocks may be unmapped once freed: point the row at block 0 again
        self.free_rows.append(row)

    def set_blocks(self, row: int, blocks: list[int]):
        """Row `row` of the block tables: a sequence's blocks."""
        if blocks:
            self.tables[row, :len(blocks)] = to_device(blocks, self.tables.device, torch.int32)

    def slot_of(self, blocks: list[int], j: int) -> int:
        """`slot_tables` on the host for one slot: local slot j of a sequence owning `blocks`."""
        return blocks[j // self.block_size] * self.block_size + j % self.block_size

    def slot_tables(self, rows, width_blocks: int) -> torch.Tensor:
        """Slot tables [len(rows), width_blocks * bs] (int32, on the pool's device) of the sequences at `rows`
        of the block tables: local slot j of row i -> pool slot tables[row, j // bs] * bs + j % bs."""
        bs = self.block_size
        rows = torch.as_tensor(rows, device=self.tables.device)
        return (self.tables[rows, :width_blocks][:, :, None] * bs
                + torch.arange(bs, device=self.tables.device, dtype=torch.int32)).flatten(1)

    # --- slot storage ---------------------------------------------------------------------------
    @property
    def raw(self) -> list[torch.Tensor]:
        """The stored tensors, [layers, slots, heads, ...] each: K and V, or K's and V's codes, scales, biases."""
        return [self.k, self.v] if self.packed is None else self.packed.tensors

    @property
    def token_major(self) -> bool:
        """Whether a slot's layers lie together (virtual storage's pages), not a layer's slots."""
        return self.raw[0].stride(0) < self.raw[0].stride(1)

    def flat_slots(self, layer, slots):
        """Where slot `slots` of `layer` is in `all_layers`' view: after the slots of the layers before it
        (l * slots per layer + s), or, token-major, beside the same slot of the other layers (s * layers + l)."""
        layers, per_layer = self.raw[0].shape[:2]
        return slots * layers + layer if self.token_major else slots + layer * per_layer

    def all_layers(self) -> "BlockPool":
        """This pool's storage with every layer's slots as layer 0's (`flat_slots`), a view of the same tensors: a
        step that reads slots of several layers at once (PyramidKV's rows borrowed from other layers) passes it, with
        layer 0. Only its slot storage (reads, writes, kernel arguments) is for use."""
        if self._all_layers is None:
            major = self.token_major

            def one(t):
                return (t.transpose(0, 1) if major else t).reshape(1, -1, *t.shape[2:])
            flat = copy(self)
            if self.packed is None:
                flat.k, flat.v = one(self.k), one(self.v)
            else:
                flat.packed = self.packed.mapped(one)
            assert all(x.data_ptr() == y.data_ptr() for x, y in zip(flat.raw, self.raw)), "a view, not a copy"
            self._all_layers = flat
        return self._all_layers

    def pack(self, k, v) -> list[torch.Tensor]:
        """New tokens' K/V [..., H, D] as stored (quantized for a packed pool), matching `raw`."""
        return [k.to(self.dtype), v.to(self.dtype)] if self.packed is None else self.packed.pack(k, v)

    def unpack(self, raw) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(raw) if self.packed is None else self.packed.unpack(raw, self.dtype)

    def write_raw(self, layer, slots, raw, heads=None):
        for t, x in zip(self.raw, raw):
            t[at(layer, slots, heads)] = x

    def gather_raw(self, layer, slots) -> list[torch.Tensor]:
        return [t[layer, slots] for t in self.raw]

    def write(self, layer, slots, k, v, heads=None):
        per_head = _slots_per_head(slots, k, heads) if k.is_cuda else None
        if per_head is None:
            self.write_raw(layer, slots, self.pack(k, v), heads)
            return
        k, v = (x.reshape(-1, *x.shape[-2:]) for x in (k, v))  # [tokens, H, D], as per_head's rows
        if self.packed is None:  # one store kernel writes K and V: two index_put launches otherwise
            from ..kernels.triton_decode import store_kv
            store_kv(k, per_head, self.k[layer], also=(v, self.v[layer], None, None))
        else:  # one store kernel quantizes and writes (a dozen PyTorch ops otherwise)
            self.packed.store(layer, per_head, k, v)

    def gather(self, layer, slots):
        return self.unpack(self.gather_raw(layer, slots))

    def move(self, layer, heads, src, dst):
        for t in self.raw:
            t[layer, dst, heads] = t[layer, src, heads]

    def roundtrip(self, layer, x):
        return x if self.packed is None else self.packed.roundtrip(x)

    def kernel_args(self, layer):
        return (self.k[layer], self.v[layer], None) if self.packed is None else self.packed.kernel_args(layer)

    def bytes_per_token(self) -> int:
        """Bytes one token takes in one layer (K and V, all KV heads)."""
        return sum(t.shape[2] * t.shape[3] * t.element_size() for t in self.raw)

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes over all layers."""
        return self.block_size * self.bytes_per_token() * self.raw[0].shape[0]

    # --- accounting -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        if self.striped:  # cached blocks count: their pages are taken back when wanted
            return self.num_blocks - self.held - self.promised
        return len(self.free_plain) + len(self.free_cached) - self.promised

    def allocate(self, at: int | None = None) -> int:
        """A free block (striped: block `at`, which must be free), with a reference."""
        if self.striped:
            return self.take([at])[0]
        if self.free_plain:
            b = self.free_plain.pop()
        elif self.free_cached:
            b, _ = self.free_cached.popitem(last=False)  # drop the least recently freed cached block
            self._unpublish(b)
        else:
            raise KvboundError("block pool exhausted: no free block (the scheduler should have preempted)")
        self.ref[b] = 1
        return b

    def take(self, blocks: list[int]) -> list[int]:
        """Striped: free blocks `blocks` (a stripe's next ones), each with a reference; the pages under them are
        mapped in one pass."""
        self.pages.hold([b for b in blocks if self._claim(b)])
        return blocks

    def _claim(self, b: int) -> bool:
        """Block b's accounting; True when pages must be held under it (it is no cached block)."""
        if self.ref[b]:
            raise KvboundError(f"block {b} is in use: a stripe's blocks belong to its row alone")
        if self.held >= self.num_blocks:
            raise KvboundError("block pool exhausted: no free block (the scheduler should have preempted)")
        self.ref[b] = 1
        self.held += 1
        if b in self.free_cached:  # its cached contents give way (its pages stay)
            del self.free_cached[b]
            self._unpublish(b)
            return False
        if self.held + len(self.free_cached) > self.num_blocks:  # the bound counts cached blocks' pages
            old, _ = self.free_cached.popitem(last=False)
            self._unpublish(old)
            self.pages.drop(old)
        return True

    def _unpublish(self, b: int):
        """A cached block's contents give way: off the device's prefix cache, into the host tier if it has room."""
        h, tokens = self.block_info.pop(b)
        del self.by_hash[h]
        cost = self.block_bytes
        if cost > self.offload_left + len(self.host) * cost:
            return
        while cost > self.offload_left:  # the least recently offloaded go first
            self.host.popitem(last=False)
            self.offload_left += cost
        self.host[h] = (tokens, self.read_blocks([b], wait=False))
        self.offload_left -= cost
        self.offloaded += 1

    def host_match(self, tokens: list[int], first: int, limit: int, chain: int | None) -> list[int]:
        """Hashes of the blocks after the first `first` full blocks of `tokens` (whose hash chain ends at `chain`),
        up to `limit`, found in the host tier (hash and token ids equal), in order."""
        bs, out, h = self.block_size, [], chain
        for i in range(first, min(limit, len(tokens) // bs)):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = block_hash(h, chunk)
            if self.host.get(h, (None,))[0] != chunk:
                break
            out.append(h)
        return out

    def take_host(self, hashes: list[int]) -> list[torch.Tensor]:
        """The host tier's bytes of `hashes` (from `host_match`), as `read_blocks` gives them; they leave the tier."""
        got = [self.host.pop(h)[1] for h in hashes]
        self.offload_left += len(hashes) * self.block_bytes
        if self.device.type == "cuda":  # their copies out were queued, not awaited
            torch.cuda.current_stream(self.device).synchronize()
        return [torch.cat(parts, 1) for parts in zip(*got)]

    def incref(self, b: int):
        if self.ref[b] == 0:  # a cached free block comes back into use
            self.free_cached.pop(b)
            self.held += self.striped
        self.ref[b] += 1

    def decref(self, b: int):
        if self.ref[b] <= 0:
            raise KvboundError(f"block {b} freed more times than it was taken")
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.held -= self.striped
            if b in self.block_info:
                self.free_cached[b] = None  # keeps its contents (and pages) for a prefix hit
            elif self.striped:
                self.pages.drop(b)
            else:
                self.free_plain.append(b)

    def free_all(self, blocks: list[int]):
        for b in reversed(blocks):  # the tail first, so a prompt's head stays cached longest
            self.decref(b)

    def copy_block(self, src: int) -> int:
        """A private copy of a shared block (copy-on-write); the caller drops its reference to `src`."""
        dst = self.allocate()
        self.copy_blocks([src], [dst])
        self.copies += 1
        return dst

    def copy_blocks(self, src: list[int], dst: list[int]):
        """The bytes of blocks `src` into blocks `dst` (every layer), one copy per tensor."""
        if src:
            dst_slots, src_slots = self.block_slots(dst), self.block_slots(src)
            for t in self.raw:
                t[:, dst_slots] = t[:, src_slots]

    def adopt(self, row: int, blocks: list[int]) -> list[int]:
        """Striped: a new row's leading blocks (prefix-cache hits, or a fork's, each with a reference) brought
        into its stripe while there is room (a hit already there stays); the rest are let go. Pages wholly
        under blocks from one other stripe are shared (mapped twice, copy-on-write), the rest copied. Returns
        the row's blocks."""
        kept, src, dst, room = [], [], [], self.num_free
        for i, b in enumerate(blocks):
            at = self.stripe_block(row, i)
            if b != at and len(dst) >= room:
                for rest in blocks[i:]:
                    self.decref(rest)
                break
            if b != at:
                src.append(b)
                dst.append(at)
            kept.append(at)
        claimed = [b for b in dst if self._claim(b)]
        pairs = self._shareable(row, len(kept), dict(zip(dst, src)))
        self.pages.share(pairs)
        shared = {key for _, key in pairs}
        self.pages.hold(claimed, shared)
        copy = [(s, d) for s, d in zip(src, dst) if not all(key in shared for key in self.pages._pages(d))]
        self.copy_blocks([s for s, _ in copy], [d for _, d in copy])
        self.copies += len(copy)
        for b in src:
            self.decref(b)
        return kept

    def _shareable(self, row: int, n: int, source: dict[int, int]) -> list[tuple]:
        """(source key, destination key) of each page of row's first n blocks that lies wholly under blocks
        copied from one other stripe, at the same place in it (stripes a whole number of pages apart)."""
        pairs, page = [], self.pages.page_bytes
        origin = [source.get(self.stripe_block(row, j)) for j in range(n)]  # the block each is copied from
        first = self.stripe_block(row, 0)
        for i, (_, slot_bytes) in enumerate(self.pages.ranges):
            unit = self.block_size * slot_bytes
            for p in range(-(-first * unit // page), ((first + n) * unit) // page):
                j0, j1 = (p * page - first * unit) // unit, ((p + 1) * page - 1 - first * unit) // unit
                shifts = {None if origin[j] is None else origin[j] - j - first for j in range(j0, j1 + 1)}
                if len(shifts) != 1 or None in shifts:
                    continue
                shift = shifts.pop() * unit  # the source stripe's offset from this one, in bytes
                if shift % page == 0 and (i, p + shift // page) in self.pages.mapped:
                    pairs.append(((i, p + shift // page), (i, p)))
        return pairs


    def trim(self) -> int:
        """Virtual storage: give unmapped physical pages back to the device (bytes returned)."""
        return 0 if self.pages is None else self.pages.trim() * self.pages.page_bytes

    @property
    def committed_bytes(self) -> int:
        """Device memory the K/V hold: the whole pool, or with virtual storage the pages taken."""
        if self.pages is not None:
            return self.pages.committed_bytes
        return self.num_blocks * self.block_bytes

    # --- host copies (swap) ------------------------------------------------------------------------
    def block_slots(self, blocks: list[int]) -> torch.Tensor:
        """Every pool slot of `blocks`, block by block (on the pool's device)."""
        bs = self.block_size
        return (torch.tensor(blocks, device=self.device)[:, None] * bs + torch.arange(bs, device=self.device)).flatten()

    def read_blocks(self, blocks: list[int], wait: bool = True) -> list[torch.Tensor]:
        """The stored bytes of `blocks`, every layer, copied to host memory (pinned where the pool is on CUDA).
        wait=False: the copy is queued on the stream, ahead of any later write to the blocks, and the bytes are
        only read back through `write_blocks` (queued behind it too)."""
        slots = self.block_slots(blocks)
        out = []
        for t in self.raw:
            got = t.index_select(1, slots)
            host = torch.empty(got.shape, dtype=got.dtype, pin_memory=got.is_cuda)
            out.append(host.copy_(got, non_blocking=not wait))
        return out

    def write_blocks(self, blocks: list[int], host: list[torch.Tensor]):
        """Bytes from `read_blocks` (of as many blocks) back into `blocks`."""
        slots = self.block_slots(blocks)
        for t, x in zip(self.raw, host):
            t[:, slots] = x.to(self.device, non_blocking=True)

    # --- prefix cache ---------------------------------------------------------------------------
    def publish(self, b: int, h: int, tokens):
        """Make full block `b` findable by its hash. Its owner promises never to write it again."""
        if b in self.block_info or h in self.by_hash:
            return
        self.by_hash[h] = b
        self.block_info[b] = (h, tuple(tokens))

    def match_prefix(self, tokens: list[int], max_blocks: int) -> list[int]:
        """Leading full blocks of `tokens` that are cached (hash and token ids equal), up to max_blocks.
        Takes a reference on each."""
        bs, out, h = self.block_size, [], None
        for i in range(min(max_blocks, len(tokens) // bs)):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = block_hash(h, chunk)
            b = self.by_hash.get(h)
            if b is None or self.block_info[b][1] != chunk:
                break
            out.append(b)
        for b in out:
            self.incref(b)
        return out

    def check(self):
        """Invariants (used by tests): refcounts >= 0, and a block is free exactly when its refcount is 0."""
        if self.striped:
            assert self.held == sum(r > 0 for r in self.ref) - self.reserved <= self.num_blocks
            assert sum(self.pages.keys_of.values()) == len(self.pages.mapped)
            assert all(self.ref[b] == 0 and b in self.block_info for b in self.free_cached)
            return
        free = set(self.free_plain) | set(self.free_cached)
        assert len(free) == len(self.free_plain) + len(self.free_cached), "a block is on a free list twice"
        for b, r in enumerate(self.ref):
            assert r >= 0, f"block {b} has refcount {r}"
            assert (r == 0) == (b in free), f"block {b}: refcount {r} but free={b in free}"
