"""Virtual-memory KV storage: a sequence's K/V in one reserved virtual range, physical pages mapped as it grows,
unmapped behind a window, shared between prefixes (copy-on-write at the first write), and moved to host memory
when the sequence is cold, instead of a software block table.

`VirtualPages` is the page accounting, plain Python: which pages a step maps, unmaps, shares, copies and
offloads, over a `PageBackend`. `CudaPages` drives the CUDA driver's virtual memory API through cuda-bindings
(cuMemAddressReserve, cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease) in the primary context
PyTorch uses; a range reads as an ordinary tensor (`CudaPages.tensor`). `HostPages` simulates the same calls
with host tensors, for the CPU and CI. Physical pages come from a shared pool that grows `chunk_pages` at a
time and gives its unused pages back on `trim`.

A sequence's range holds `regions` equal regions (one per layer and K / V), each `tokens x token_bytes`
rounded up to whole pages, so region r's token j lives at byte r * region_bytes + j * token_bytes.
"""
from __future__ import annotations

import itertools
import mmap
import sys
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..errors import KvboundError

# Linux's MAP_NORESERVE (the mmap module names it from Python 3.13): no swap is set aside for an untouched range
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)


class PageBackend(Protocol):
    """Physical pages, virtual ranges, and the mappings between them."""
    page_bytes: int

    def reserve(self, pages: int) -> int: ...  # a virtual range of `pages` pages, nothing mapped
    def free(self, rng: int) -> None: ...
    def create(self) -> int: ...  # a physical page
    def release(self, page: int) -> None: ...
    def map(self, rng: int, index: int, page: int, access: bool = True) -> None: ...  # access=False: `allow` later
    def allow(self, rng: int, index: int, count: int) -> None: ...  # access to pages [index, index + count), mapped
    def unmap(self, rng: int, index: int) -> None: ...
    def copy(self, dst: int, src: int) -> None: ...  # page to page
    def to_host(self, page: int) -> torch.Tensor: ...  # uint8 [page_bytes]
    def from_host(self, page: int, data: torch.Tensor) -> None: ...
    def read(self, rng: int, offset: int, n: int) -> torch.Tensor: ...  # uint8 bytes of mapped pages
    def write(self, rng: int, offset: int, data: torch.Tensor) -> None: ...


def release_all(backend: PageBackend, pages: list[int]) -> int:
    """Release unmapped physical pages to the device and empty the list; returns how many."""
    n = len(pages)
    for page in pages:
        backend.release(page)
    pages.clear()
    return n


class HostPages:
    """`PageBackend` simulated with host tensors: a page is a uint8 tensor, a range a dict of mapped pages.
    Writes through one range land in the page, so every range mapping it sees them, as on the GPU."""

    def __init__(self, page_bytes: int = 2 << 20):
        self.page_bytes = page_bytes
        self.pages: dict[int, torch.Tensor] = {}
        self.ranges: dict[int, dict[int, int]] = {}
        self._next = 0
        self.access_calls = 0  # `allow` calls (the driver's cuMemSetAccess)

    def _id(self) -> int:
        self._next += 1
        return self._next

    def reserve(self, pages):
        rng = self._id()
        self.ranges[rng] = {}
        return rng

    def free(self, rng):
        if self.ranges.pop(rng):
            raise KvboundError("a virtual range was freed with pages still mapped")

    def create(self):
        page = self._id()
        self.pages[page] = torch.zeros(self.page_bytes, dtype=torch.uint8)
        return page

    def release(self, page):
        if any(page in m.values() for m in self.ranges.values()):
            raise KvboundError(f"page {page} released while mapped")
        del self.pages[page]

    def map(self, rng, index, page, access=True):
        if index in self.ranges[rng]:
            raise KvboundError(f"page {index} of range {rng} is already mapped")
        self.ranges[rng][index] = page

    def allow(self, rng, index, count):
        self.access_calls += 1
        if any(i not in self.ranges[rng] for i in range(index, index + count)):
            raise KvboundError(f"access set on pages {index}..{index + count - 1} of range {rng}, not all mapped")

    def unmap(self, rng, index):
        del self.ranges[rng][index]

    def copy(self, dst, src):
        self.pages[dst].copy_(self.pages[src])

    def to_host(self, page):
        return self.pages[page].clone()

    def from_host(self, page, data):
        self.pages[page].copy_(data)

    def _spans(self, rng, offset, n):
        """(page tensor, start, end) pieces covering bytes [offset, offset + n) of a range."""
        while n > 0:
            index, start = divmod(offset, self.page_bytes)
            take = min(n, self.page_bytes - start)
            page = self.ranges[rng].get(index)
            if page is None:
                raise KvboundError(f"byte {offset} of range {rng} is not mapped")
            yield self.pages[page], start, start + take
            offset, n = offset + take, n - take

    def read(self, rng, offset, n):
        return torch.cat([p[a:b] for p, a, b in self._spans(rng, offset, n)])

    def write(self, rng, offset, data):
        at = 0
        for p, a, b in self._spans(rng, offset, data.numel()):
            p[a:b] = data[at:at + b - a]
            at += b - a


@dataclass
class SequencePages:
    """One sequence's range: its mapped pages by index, the first index still kept (a window moves it), and
    its pages' bytes on the host while offloaded."""
    rng: int
    mapped: dict[int, int] = field(default_factory=dict)
    floor: int = 0  # region-relative page index below which pages stay unmapped (behind a window)
    host: dict[int, torch.Tensor] | None = None


class VirtualPages:
    """The page accounting of every sequence's virtual range over one backend and one pool of physical pages.
    Each operation returns how many pages it mapped, unmapped, copied or moved, so a step's work is visible."""

    def __init__(self, backend: PageBackend, regions: int, token_bytes: int, max_tokens: int, chunk_pages: int = 8):
        self.backend, self.regions, self.token_bytes = backend, regions, token_bytes
        self.page_bytes = backend.page_bytes
        self.max_tokens = max_tokens
        self.region_pages = -(-max_tokens * token_bytes // self.page_bytes)
        self.chunk_pages = chunk_pages
        self.pool: list[int] = []  # created, unmapped pages ready for reuse
        self.ref: dict[int, int] = {}  # page -> ranges mapping it
        self.seqs: dict[object, SequencePages] = {}
        self.counts = dict(mapped=0, unmapped=0, copied=0, offloaded=0, restored=0)

    # --- pages -----------------------------------------------------------------------------------
    @property
    def pages_in_use(self) -> int:
        """Physical pages mapped by at least one sequence (a shared page counts once)."""
        return len(self.ref)

    @property
    def pages_created(self) -> int:
        """Physical memory committed: pages in use plus the pool's spare ones."""
        return len(self.ref) + len(self.pool)

    def _take(self) -> int:
        if not self.pool:
            self.pool = [self.backend.create() for _ in range(self.chunk_pages)]
        page = self.pool.pop()
        self.ref[page] = 0
        return page

    def _map(self, seq: SequencePages, index: int, page: int):
        self.backend.map(seq.rng, index, page)
        seq.mapped[index] = page
        self.ref[page] += 1
        self.counts["mapped"] += 1

    def _unmap(self, seq: SequencePages, index: int):
        page = seq.mapped.pop(index)
        self.backend.unmap(seq.rng, index)
        self.ref[page] -= 1
        if self.ref[page] == 0:
            del self.ref[page]
            self.pool.append(page)
        self.counts["unmapped"] += 1

    def trim(self) -> int:
        """Give the pool's spare pages back to the device; returns how many."""
        return release_all(self.backend, self.pool)

    # --- sequences -------------------------------------------------------------------------------
    def add(self, sid) -> SequencePages:
        if sid in self.seqs:
            raise KvboundError(f"sequence {sid!r} already has a virtual range")
        self.seqs[sid] = SequencePages(self.backend.reserve(self.regions * self.region_pages))
        return self.seqs[sid]

    def _indices(self, first_token: int, end_token: int, floor: int = 0):
        """Page indices, in every region, holding any byte of tokens [first_token, end_token)."""
        if end_token <= first_token:
            return []
        lo = max(floor, first_token * self.token_bytes // self.page_bytes)
        hi = -(-end_token * self.token_bytes // self.page_bytes)
        return [r * self.region_pages + i for r in range(self.regions) for i in range(lo, hi)]

    def grow(self, sid, tokens: int) -> int:
        """Map pages so that tokens [0, tokens) are backed (those behind a window stay unmapped): only the
        pages not mapped yet, so a step's work is the page boundaries it crossed. Returns pages mapped."""
        seq = self.seqs[sid]
        if tokens > self.max_tokens:
            raise KvboundError(f"sequence {sid!r}: {tokens} tokens exceed its reserved range ({self.max_tokens})")
        new = [i for i in self._indices(0, tokens, seq.floor) if i not in seq.mapped]
        for index in new:
            self._map(seq, index, self._take())
        return len(new)

    def drop_before(self, sid, token: int) -> int:
        """A window's first kept token: unmap every page wholly behind it. Returns pages unmapped."""
        seq = self.seqs[sid]
        seq.floor = max(seq.floor, token * self.token_bytes // self.page_bytes)
        behind = [i for i in list(seq.mapped) if i % self.region_pages < seq.floor]
        for index in behind:
            self._unmap(seq, index)
        return len(behind)

    def share(self, src, dst, tokens: int) -> int:
        """dst starts from src's first `tokens` tokens: the pages wholly inside them are mapped into dst too
        (the same physical pages, counted once); the rest is dst's own. Returns pages shared."""
        a, b = self.seqs[src], self.seqs[dst]
        whole = tokens * self.token_bytes // self.page_bytes  # per region
        shared = [r * self.region_pages + i for r in range(self.regions) for i in range(whole)
                  if r * self.region_pages + i in a.mapped and r * self.region_pages + i not in b.mapped]
        for index in shared:
            self._map(b, index, a.mapped[index])
        return len(shared)

    def before_write(self, sid, first_token: int, end_token: int) -> int:
        """Copy-on-write: every shared page that writing tokens [first_token, end_token) touches becomes a
        private copy. Returns pages copied."""
        seq = self.seqs[sid]
        copied = 0
        for index in self._indices(first_token, end_token, seq.floor):
            page = seq.mapped.get(index)
            if page is not None and self.ref[page] > 1:
                mine = self._take()
                self.backend.copy(mine, page)
                self._unmap(seq, index)
                self._map(seq, index, mine)
                copied += 1
        self.counts["copied"] += copied
        return copied

    def offload(self, sid) -> int:
        """Move a cold sequence's pages to host memory and unmap them (shared pages stay mapped for the other
        sequences). Returns pages moved."""
        seq = self.seqs[sid]
        if seq.host is not None:
            raise KvboundError(f"sequence {sid!r} is already offloaded")
        seq.host = {index: self.backend.to_host(page) for index, page in seq.mapped.items()}
        for index in list(seq.mapped):
            self._unmap(seq, index)
        self.counts["offloaded"] += len(seq.host)
        return len(seq.host)

    def restore(self, sid) -> int:
        """Map an offloaded sequence's pages back (fresh pages, its bytes copied in). Returns pages restored."""
        seq = self.seqs[sid]
        if seq.host is None:
            raise KvboundError(f"sequence {sid!r} is not offloaded")
        for index, data in seq.host.items():
            page = self._take()
            self.backend.from_host(page, data)
            self._map(seq, index, page)
        n, seq.host = len(seq.host), None
        self.counts["restored"] += n
        return n

    def release(self, sid):
        """A finished sequence: unmap its pages (back to the pool once no one maps them) and free its range."""
        seq = self.seqs.pop(sid)
        for index in list(seq.mapped):
            self._unmap(seq, index)
        self.backend.free(seq.rng)

    def byte_offset(self, region: int, token: int) -> int:
        """Where region `region`'s token `token` starts in a sequence's range."""
        return region * self.region_pages * self.page_bytes + token * self.token_bytes


def _runs(keys):
    """(range index, first page, count) of each run of consecutive pages in sorted (range index, page) keys."""
    runs = []
    for i, index in keys:
        if runs and runs[-1][0] == i and runs[-1][1] + runs[-1][2] == index:
            runs[-1][2] += 1
        else:
            runs.append([i, index, 1])
    return runs


class BlockPages:
    """The engine's block pool in virtual ranges (`--kv-storage virtual`): each pool tensor is reserved whole
    but stored token-major ([slots, layers, ...], exposed as the pool's [layers, slots, ...] view), so one
    block's bytes are contiguous and physical pages back only the blocks that hold data (taken, or cached for
    prefix reuse). A page is mapped (and zeroed) when its first such block appears; when its last goes it
    stays mapped, idle, until its physical page is wanted elsewhere or `trim` unmaps it (see `drop`); unmapped
    pages wait for reuse until `trim` gives them back. Without the CUDA driver API (CPU, CI) the tensors are
    dense and `HostPages` keeps the same accounting."""

    def __init__(self, backend: PageBackend, device, block_size: int):
        self.backend, self.device, self.block_size = backend, torch.device(device), block_size
        self.page_bytes = backend.page_bytes
        self.ranges: list[tuple[int, int]] = []  # (range, bytes of one slot over all layers)
        self.users: dict[tuple[int, int], int] = {}  # (range index, page index) -> blocks holding data on it
        self.mapped: dict[tuple[int, int], int] = {}  # (range index, page index) -> physical page
        self.keys_of: dict[int, int] = {}  # physical page -> how many keys map it (more than 1: shared)
        self.spare: list[int] = []  # physical pages unmapped, ready for reuse
        self.idle: dict[tuple[int, int], None] = {}  # mapped keys no block holds, oldest first
        self.flat: list[torch.Tensor] = []  # each range as bytes, to zero fresh pages through
        self.home: dict[int, int] = {}  # physical page -> the range index it last held data of
        self.reserved_bytes = 0
        self.counts = dict(mapped=0, unmapped=0, shared=0, copied=0)
        self.map_seconds = 0.0  # host time in hold / drop's driver calls and page zeroing: the storage's step cost

    def zeros(self, shape, dtype) -> torch.Tensor:
        """A pool tensor [layers, slots, ...] over a fresh reserved range (the allocator `BlockPool` passes down)."""
        layers, slots, *rest = shape
        row = layers * torch.empty((), dtype=dtype).element_size()
        for d in rest:
            row *= d
        pages = -(-slots * row // self.page_bytes)
        rng = self.backend.reserve(pages)
        self.ranges.append((rng, row))
        self.reserved_bytes += pages * self.page_bytes
        token_major = (slots, layers, *rest)
        if isinstance(self.backend, CudaPages):
            self.flat.append(self.backend.tensor(rng, 0, (pages * self.page_bytes,)))  # for zeroing pages
            return self.backend.tensor(rng, 0, token_major, dtype).transpose(0, 1)
        try:  # the host's own virtual memory, reserved without backing: pages take memory once written
            buf = mmap.mmap(-1, slots * row, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
        except OSError:
            raise KvboundError(f"virtual storage on the CPU reserves {slots * row / 2**30:.1f} GiB of address space, "
                               "more than this machine allows: lower --max-num-seqs or use --kv-storage paged") from None
        flat = torch.frombuffer(buf, dtype=torch.uint8)
        self.flat.append(flat)
        return flat.view(dtype).view(token_major).transpose(0, 1)

    def _pages(self, block: int):
        bs = self.block_size
        for i, (_, row) in enumerate(self.ranges):
            for index in range(block * bs * row // self.page_bytes, -(-(block + 1) * bs * row // self.page_bytes)):
                yield i, index

    def hold(self, blocks: list[int], keep=frozenset()):
        """`blocks` now hold data: map a page under them where none is (a page still mapped from earlier data
        is kept as it is: stale finite values, as a paged pool's reused blocks hold), and give a page that
        another key maps too a private copy first (copy-on-write), unless its key is in `keep` (just shared,
        to be read). Access is granted once per run of pages newly mapped side by side (a prompt's blocks:
        one driver call, not one per page)."""
        t0 = time.perf_counter()
        fresh = []
        for key in (key for block in blocks for key in self._pages(block)):
            self.users[key] = self.users.get(key, 0) + 1
            self.idle.pop(key, None)
            if key in self.mapped and key not in keep and self.keys_of[self.mapped[key]] > 1:
                self._private(key)
            if self.users[key] == 1 and key not in self.mapped:
                if not self.spare:
                    self._unmap_idle()
                page = self.spare.pop() if self.spare else self.backend.create()
                self._map(key, page)
                fresh.append((key, page))
        for i, first, count in _runs(sorted(key for key, _ in fresh)):
            self.backend.allow(self.ranges[i][0], first, count)
        # fresh bytes, or another tensor's (fp16 scales as e4m3 codes), could read as NaN under masked attention;
        # stale values of the same tensor are finite, as in a paged pool's reused blocks (on the host one mapping
        # stands in, whose bytes do not move with the page: zeroed at every map). One launch for all.
        stale = [self._bytes(key) for key, page in fresh
                 if self.home.get(page) != key[0] or not isinstance(self.backend, CudaPages)]
        if stale:
            torch._foreach_zero_(stale)
        self.home.update((page, key[0]) for key, page in fresh)
        self.map_seconds += time.perf_counter() - t0

    def share(self, pairs: list[tuple[tuple[int, int], tuple[int, int]]]):
        """Map each (source key, destination key)'s source physical page under the destination key too (a
        prefix's pages into a second sequence's range), replacing what the destination mapped. On the host,
        whose single mapping cannot alias, the bytes are copied: the same as long as neither key writes, which
        `hold`'s copy-on-write keeps."""
        t0 = time.perf_counter()
        for src, dst in pairs:
            if dst in self.mapped:
                self._unmap(dst)
            self._map(dst, self.mapped[src])
            if not isinstance(self.backend, CudaPages):
                self._bytes(dst).copy_(self._bytes(src))
            self.counts["shared"] += 1
        for i, first, count in _runs(sorted(dst for _, dst in pairs)):
            self.backend.allow(self.ranges[i][0], first, count)
        self.map_seconds += time.perf_counter() - t0

    def _private(self, key):
        """Copy-on-write: key's shared page replaced by a private page holding the same bytes."""
        keep = self._bytes(key).clone() if isinstance(self.backend, CudaPages) else None
        self._unmap(key)
        page = self.spare.pop() if self.spare else self.backend.create()
        self._map(key, page)
        self.backend.allow(self.ranges[key[0]][0], key[1], 1)
        if keep is not None:
            self._bytes(key).copy_(keep)
        self.home[page] = key[0]
        self.counts["copied"] += 1

    def _bytes(self, key) -> torch.Tensor:
        return self.flat[key[0]][key[1] * self.page_bytes:(key[1] + 1) * self.page_bytes]

    def _map(self, key, page):
        self.backend.map(self.ranges[key[0]][0], key[1], page, access=False)
        self.mapped[key] = page
        self.keys_of[page] = self.keys_of.get(page, 0) + 1
        self.counts["mapped"] += 1

    def _unmap(self, key):
        """Unmap key; its physical page goes spare once no key maps it."""
        self.backend.unmap(self.ranges[key[0]][0], key[1])
        page = self.mapped.pop(key)
        self.keys_of[page] -= 1
        if not self.keys_of[page]:
            del self.keys_of[page]
            self.spare.append(page)
        self.counts["unmapped"] += 1

    def drop(self, block: int):
        """`block` holds nothing any more. Pages no block holds stay mapped (idle) until a page is needed
        elsewhere or `trim`: unmapping waits for the GPU, and a stripe's next owner comes back to them."""
        for key in self._pages(block):
            self.users[key] -= 1
            if self.users[key] == 0:
                del self.users[key]
                self.idle[key] = None

    def _unmap_idle(self, every: bool = False):
        """Unmap the oldest idle page (every one with `every`) into the spare list."""
        for key in list(self.idle) if every else list(itertools.islice(self.idle, 1)):
            del self.idle[key]
            self._unmap(key)

    def trim(self) -> int:
        """Unmap the idle pages and give every spare page back to the device; returns how many."""
        self._unmap_idle(every=True)
        for page in self.spare:
            self.home.pop(page, None)
        return release_all(self.backend, self.spare)

    @property
    def committed_bytes(self) -> int:
        """Physical memory taken: mapped pages (a shared one once) and spare ones."""
        return (len(self.keys_of) + len(self.spare)) * self.page_bytes

    def close(self):
        """Unmap and release every page and free the ranges; the pool's tensors must not be read after this."""
        for key in list(self.mapped):
            self._unmap(key)
        self.users, self.idle, self.home, self.flat = {}, {}, {}, []
        self.trim()
        for rng, _ in self.ranges:
            self.backend.free(rng)
        self.ranges = []

    def __del__(self):
        try:
            self.close()
        except Exception:  # at interpreter exit the driver may be gone already
            pass


class CudaPages:
    """`PageBackend` on the CUDA driver's virtual memory API (cuda-bindings), on PyTorch's primary context.
    Pages are the allocation granularity (2 MiB on current drivers), or `page_bytes` rounded up to it."""

    def __init__(self, device=None, page_bytes: int | None = None):
        try:
            from cuda.bindings import driver
        except ImportError:
            raise KvboundError("virtual KV storage on CUDA needs cuda-bindings: pip install 'kvbound[gpu]' "
                               "(or cuda-bindings), or use --kv-storage paged") from None
        self.cu = driver
        torch.cuda.init()
        index = None if device is None else torch.device(device).index
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        torch.empty(1, device=self.device)  # PyTorch makes the primary context current on this thread
        self._check(driver.cuInit(0))
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device.index
        self.prop = prop
        gran = self._check(driver.cuMemGetAllocationGranularity(
            prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        self.page_bytes = -(-(page_bytes or gran) // gran) * gran  # whole granules
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device.index
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access = access
        self.ranges: dict[int, tuple[int, int]] = {}  # range id (its address) -> (address, bytes)
        self.pages: dict[int, object] = {}  # page id -> allocation handle
        self._next = 0
        self.scratch = self.reserve(2)  # two pages of address space to reach unmapped pages through

    def _check(self, result):
        err, *rest = result
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise KvboundError(f"CUDA driver call failed: {err}")
        return rest[0] if len(rest) == 1 else (rest or None)

    def reserve(self, pages):
        size = pages * self.page_bytes
        addr = int(self._check(self.cu.cuMemAddressReserve(size, self.page_bytes, 0, 0)))
        self.ranges[addr] = (addr, size)
        return addr

    def free(self, rng):
        addr, size = self.ranges.pop(rng)
        self._check(self.cu.cuMemAddressFree(self.cu.CUdeviceptr(addr), size))

    def create(self):
        handle = self._check(self.cu.cuMemCreate(self.page_bytes, self.prop, 0))
        self._next += 1
        self.pages[self._next] = handle
        return self._next

    def release(self, page):
        self._check(self.cu.cuMemRelease(self.pages.pop(page)))

    def map(self, rng, index, page, access=True):
        at = self.cu.CUdeviceptr(rng + index * self.page_bytes)
        self._check(self.cu.cuMemMap(at, self.page_bytes, 0, self.pages[page], 0))
        if access:
            self.allow(rng, index, 1)

    def allow(self, rng, index, count):
        """Read-write access to mapped pages [index, index + count) of a range, in one driver call."""
        at = self.cu.CUdeviceptr(rng + index * self.page_bytes)
        self._check(self.cu.cuMemSetAccess(at, count * self.page_bytes, [self.access], 1))

    def unmap(self, rng, index):
        torch.cuda.current_stream(self.device).synchronize()  # kernels still reading the page finish first
        self._check(self.cu.cuMemUnmap(self.cu.CUdeviceptr(rng + index * self.page_bytes), self.page_bytes))

    def tensor(self, rng, offset: int, shape, dtype=torch.uint8) -> torch.Tensor:
        """A tensor over bytes [offset, ...) of a range, without a copy (the pages under it must be mapped)."""
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        view = _CudaArray(rng + offset, nbytes)
        return torch.as_tensor(view, device=self.device).view(dtype).view(*shape)

    def _through_scratch(self, pages, fn):
        for slot, page in enumerate(pages):
            self.map(self.scratch, slot, page)
        try:
            return fn(*[self.tensor(self.scratch, slot * self.page_bytes, (self.page_bytes,))
                        for slot in range(len(pages))])
        finally:
            for slot in range(len(pages)):
                self.unmap(self.scratch, slot)

    def copy(self, dst, src):
        self._through_scratch([dst, src], lambda d, s: d.copy_(s))

    def to_host(self, page):
        out = torch.empty(self.page_bytes, dtype=torch.uint8, pin_memory=True)
        return self._through_scratch([page], lambda p: out.copy_(p))

    def from_host(self, page, data):
        self._through_scratch([page], lambda p: p.copy_(data))

    def read(self, rng, offset, n):
        return self.tensor(rng, offset, (n,)).cpu()

    def write(self, rng, offset, data):
        self.tensor(rng, offset, (data.numel(),)).copy_(data)


class _CudaArray:
    """A device pointer as `__cuda_array_interface__` (bytes), so torch.as_tensor wraps it without a copy."""

    def __init__(self, addr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3,
                                         "strides": None, "stream": None}
