"""Virtual-memory KV storage: the page accounting over simulated pages (CPU), and the real mappings on CUDA."""
import pytest
import torch

from kvbound.cache.virtual import HostPages, VirtualPages
from kvbound.errors import KvboundError

PAGE, TOKEN, REGIONS, MAX = 256, 24, 3, 200  # a token's bytes do not divide the page: tokens straddle pages


def pages_for(tokens):
    return -(-tokens * TOKEN // PAGE)


def accounting(backend=None, **kw):
    return VirtualPages(backend or HostPages(PAGE), REGIONS, TOKEN, MAX, **kw)


def fill(vp, sid, first, end, seed):
    """Random bytes for tokens [first, end) of every region; returns them per region."""
    gen = torch.Generator().manual_seed(seed)
    data = []
    for r in range(REGIONS):
        x = torch.randint(0, 256, ((end - first) * TOKEN,), generator=gen, dtype=torch.uint8)
        vp.backend.write(vp.seqs[sid].rng, vp.byte_offset(r, first), x)
        data.append(x)
    return data


def read(vp, sid, first, end):
    return [vp.backend.read(vp.seqs[sid].rng, vp.byte_offset(r, first), (end - first) * TOKEN)
            for r in range(REGIONS)]


def test_committed_pages_follow_the_length_and_steps_map_only_crossed_boundaries():
    vp = accounting()
    vp.add("a")
    n = 0
    for step in [1, 1, 9, 1, 30, 2, 57, 1, 98]:  # to MAX
        before = pages_for(n)
        n += step
        assert vp.grow("a", n) == REGIONS * (pages_for(n) - before)  # the page boundaries crossed, no more
        assert vp.pages_in_use == REGIONS * pages_for(n)
    assert vp.grow("a", n) == 0
    with pytest.raises(KvboundError, match="exceed its reserved range"):
        vp.grow("a", MAX + 1)


def test_a_window_unmaps_exactly_the_pages_behind_it_and_keeps_the_rest_intact():
    vp = accounting()
    vp.add("w")
    vp.grow("w", 120)
    kept = fill(vp, "w", 0, 120, seed=1)
    start = 75  # the window's first token: pages wholly before byte 75 * TOKEN go
    behind = start * TOKEN // PAGE
    assert vp.drop_before("w", start) == REGIONS * behind
    assert sorted(i % vp.region_pages for i in vp.seqs["w"].mapped) == sorted(
        list(range(behind, pages_for(120))) * REGIONS)
    assert all(torch.equal(a, b[start * TOKEN:]) for a, b in zip(read(vp, "w", start, 120), kept))
    assert vp.grow("w", 150) == REGIONS * (pages_for(150) - pages_for(120))  # dropped pages stay unmapped
    with pytest.raises(KvboundError, match="not mapped"):
        read(vp, "w", 0, 1)


def test_a_shared_prefix_is_counted_once_and_a_divergent_write_copies_one_page_per_region():
    vp = accounting()
    vp.add("a")
    vp.grow("a", 100)
    a_bytes = fill(vp, "a", 0, 100, seed=2)
    vp.add("b")
    prefix = 50
    whole = prefix * TOKEN // PAGE
    assert vp.share("a", "b", prefix) == REGIONS * whole
    assert vp.pages_in_use == REGIONS * pages_for(100)  # nothing new: b maps a's pages
    vp.grow("b", 80)
    assert vp.pages_in_use == REGIONS * (pages_for(100) + pages_for(80) - whole)
    assert vp.before_write("b", 60, 61) == 0  # b's own page: no copy
    assert all(torch.equal(x, y[:len(x)]) for x, y in zip(read(vp, "b", 0, whole * PAGE // TOKEN), a_bytes))
    assert vp.before_write("b", 3, 4) == REGIONS  # the shared page under token 3, once in each region
    assert vp.before_write("b", 3, 4) == 0  # private now
    fill(vp, "b", 3, 4, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(read(vp, "a", 0, 100), a_bytes))  # a never sees b's write
    assert vp.pages_in_use == REGIONS * (pages_for(100) + pages_for(80) - whole + 1)


def test_offload_then_restore_gives_identical_bytes_and_frees_the_pages_meanwhile():
    vp = accounting()
    vp.add("cold")
    vp.grow("cold", 90)
    data = fill(vp, "cold", 0, 90, seed=4)
    assert vp.offload("cold") == REGIONS * pages_for(90)
    assert vp.pages_in_use == 0
    vp.add("hot")
    vp.grow("hot", 90)  # reuses the freed pages, overwriting them
    fill(vp, "hot", 0, 90, seed=5)
    assert vp.restore("cold") == REGIONS * pages_for(90)
    assert all(torch.equal(x, y) for x, y in zip(read(vp, "cold", 0, 90), data))
    with pytest.raises(KvboundError, match="not offloaded"):
        vp.restore("cold")


def test_no_page_leaks_after_every_sequence_finishes():
    backend = HostPages(PAGE)
    vp = accounting(backend, chunk_pages=4)
    for sid, n in [("a", 40), ("b", 130), ("c", 7)]:
        vp.add(sid)
        vp.grow(sid, n)
    vp.share("b", "c", 5)
    vp.before_write("c", 0, 2)
    vp.drop_before("b", 60)
    vp.offload("a")
    vp.restore("a")
    for sid in ["a", "b", "c"]:
        vp.release(sid)
    assert vp.pages_in_use == 0 and not backend.ranges
    assert vp.pages_created == len(backend.pages) and vp.pages_created % 4 == 0  # the pool grows in chunks
    created = vp.pages_created
    assert vp.trim() == created and not backend.pages


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA driver's virtual memory API needs a GPU")
def test_cuda_mappings_round_trip_share_and_copy_on_write():
    pytest.importorskip("cuda.bindings")
    from kvbound.cache.virtual import CudaPages
    backend = CudaPages()
    page = backend.page_bytes
    vp = VirtualPages(backend, regions=2, token_bytes=4096, max_tokens=4 * page // 4096)
    vp.add("a")
    vp.grow("a", page // 4096 + 1)  # two pages per region
    data = torch.randint(0, 256, (2 * page,), dtype=torch.uint8)
    backend.write(vp.seqs["a"].rng, 0, data[:page + 4096])
    assert torch.equal(backend.read(vp.seqs["a"].rng, 0, page + 4096), data[:page + 4096])
    view = backend.tensor(vp.seqs["a"].rng, 0, (page // 2,), torch.bfloat16)  # an ordinary tensor over the range
    assert view.is_cuda and torch.equal(view.view(torch.uint8).cpu(), data[:page])
    vp.add("b")
    assert vp.share("a", "b", page // 4096) == 2
    backend.write(vp.seqs["a"].rng, 0, torch.full((16,), 7, dtype=torch.uint8))  # shared: b sees it
    assert (backend.read(vp.seqs["b"].rng, 0, 16) == 7).all()
    assert vp.before_write("b", 0, 1) == 2
    backend.write(vp.seqs["b"].rng, 0, torch.full((16,), 9, dtype=torch.uint8))
    assert (backend.read(vp.seqs["a"].rng, 0, 16) == 7).all() and (backend.read(vp.seqs["b"].rng, 0, 16) == 9).all()
    before = backend.read(vp.seqs["a"].rng, 0, page + 4096)
    vp.offload("a")
    vp.restore("a")
    assert torch.equal(backend.read(vp.seqs["a"].rng, 0, page + 4096), before)
    for sid in ["a", "b"]:
        vp.release(sid)
    assert vp.pages_in_use == 0
    vp.trim()


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_refcounts_mappings_and_bytes_consistent(seed):
    """Any order of grow / window / share / write / offload / restore / release: every page's refcount is the
    number of ranges mapping it, the backend maps exactly what the accounting says, and every byte a sequence
    wrote (or shared whole pages of) reads back while its page is mapped (a shadow copy per sequence)."""
    import random
    rng = random.Random(seed)
    backend = HostPages(PAGE)
    vp = accounting(backend, chunk_pages=3)
    size = vp.region_pages * PAGE
    shadow, known, length = {}, {}, {}

    def new(sid):
        vp.add(sid)
        shadow[sid], known[sid] = torch.zeros(REGIONS, size, dtype=torch.uint8), torch.zeros(REGIONS, size, dtype=torch.bool)
        length[sid] = 0

    for step in range(150):
        live = [s for s in vp.seqs if vp.seqs[s].host is None]
        op = rng.choice(["add", "grow", "grow", "write", "write", "share", "drop", "offload", "release"])
        if op == "add" or not live:
            new(f"s{step}")
            continue
        sid = rng.choice(live)
        first = -(-vp.seqs[sid].floor * PAGE // TOKEN)  # the first token wholly on a page still kept
        if op == "grow" and length[sid] < MAX:
            length[sid] = rng.randint(length[sid], MAX)
            vp.grow(sid, length[sid])
        elif op == "write" and length[sid] > first:
            a = rng.randint(first, length[sid] - 1)
            b = rng.randint(a + 1, length[sid])
            vp.before_write(sid, a, b)
            for r, x in enumerate(fill(vp, sid, a, b, seed=step)):
                shadow[sid][r, a * TOKEN:b * TOKEN], known[sid][r, a * TOKEN:b * TOKEN] = x, True
        elif op == "share":
            dst = f"s{step}"
            new(dst)
            n = rng.randint(0, length[sid])
            vp.share(sid, dst, n)
            vp.grow(dst, n)
            length[dst] = n
            whole = n * TOKEN // PAGE * PAGE  # whole pages are shared; the tail page is dst's own
            shadow[dst][:, :whole], known[dst][:, :whole] = shadow[sid][:, :whole], known[sid][:, :whole]
            known[dst][:, :vp.seqs[sid].floor * PAGE] = False  # pages src had dropped are not shared
        elif op == "drop" and length[sid]:
            vp.drop_before(sid, rng.randint(0, length[sid]))
            known[sid][:, :vp.seqs[sid].floor * PAGE] = False
        elif op == "offload":
            vp.offload(sid)
            vp.restore(sid)
        elif op == "release":
            vp.release(sid)
            del shadow[sid], known[sid], length[sid]
        counts = {}
        for s in vp.seqs.values():
            assert backend.ranges[s.rng] == s.mapped
            for page in s.mapped.values():
                counts[page] = counts.get(page, 0) + 1
        assert counts == vp.ref and set(vp.pool).isdisjoint(vp.ref)
        for s, seq in vp.seqs.items():
            for r in range(REGIONS):
                for index in seq.mapped:
                    if index // vp.region_pages == r:
                        at = (index % vp.region_pages) * PAGE
                        got = backend.read(seq.rng, r * size + at, PAGE)
                        mask = known[s][r, at:at + PAGE]
                        assert torch.equal(got[mask], shadow[s][r, at:at + PAGE][mask]), (step, s, r, index)
