"""KVzip (`policies.KVzipPolicy`): the reconstruction pass's scores against transformers' own attention over the
prompt read twice, the kept set against a brute-force choice by those scores, and the places that refuse it."""
import math

import pytest
import torch

from kvbound.cache import BlockPool, KVCache, parse_policy, sequence_cache
from kvbound.cache.store import PagedStore
from kvbound.engine import LLM, LLMEngine
from kvbound.engine import llm_engine
from kvbound.engine.generate import SecondReading, generate_ids, prefill, read_again, read_pieces
from kvbound.engine.sampling import SamplingParams
from kvbound.errors import KvboundError

transformers = pytest.importorskip("transformers")

T = 70  # prompt tokens


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A random Llama in transformers (eager attention, fp32) and the same weights loaded by kvbound."""
    from tokenizers import Tokenizer, models
    from kvbound.models.loader import load
    d = tmp_path_factory.mktemp("kvzip")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(d)
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0")).save(str(d / "tokenizer.json"))
    return hf, load(d)[0]


def ids_of(seed, n=T):
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed))


def hf_best(hf, ids, chunk, block=0, sink=2):
    """Each prompt token's highest attention from the prompt read again after itself in pieces of `chunk` (each
    piece a sequence of its own after the prompt), over the query heads of its KV head: [layers, n, H], from
    transformers' attention probabilities. With `block` (KVzip's chunks), each block of that many tokens is read by
    pieces of its own, their probabilities renormalized over the first `sink` tokens, the block and the piece."""
    n, heads = len(ids), hf.config.num_key_value_heads
    best = torch.zeros(hf.config.num_hidden_layers, n, heads)
    block = block or n
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        for start in range(lo, hi, chunk):
            part = ids[start:min(hi, start + chunk)]
            with torch.no_grad():
                att = hf(torch.cat([ids, part])[None], output_attentions=True).attentions
            scored = torch.zeros(n + len(part), dtype=torch.bool)
            scored[:min(sink, lo)] = scored[lo:hi] = scored[n:] = True
            for layer, a in enumerate(att):  # [1, Hq, n + t, n + t]
                p = a[0, :, n:] * scored
                seen = (p / p.sum(-1, keepdim=True))[..., lo:hi].amax(1)  # [Hq, hi - lo]
                best[layer, lo:hi] = torch.maximum(best[layer, lo:hi], seen.view(heads, -1, hi - lo).amax(1).T)
    return best


@pytest.mark.parametrize("chunk,block", [(T, 0), (24, 0), (24, 32), (16, 32), (T, 48)])
def test_reconstruction_scores_equal_transformers_attention_over_the_prompt_read_twice(pair, chunk, block):
    """The second reading over kvbound's full cache gives, for every layer, token and KV head, the largest
    probability transformers' eager attention gives that token from the second reading (whole, or in pieces); with
    KVzip's blocks (`kvzip:chunk=`), each block's from its own pieces, over the sinks, the block and the piece."""
    hf, model = pair
    ids = ids_of(1)
    held = KVCache(model.config, None)
    prefill(model, held, ids, 32)
    best = read_again(model, held, ids, chunk, parse_policy(f"kvzip:sink=2,heavy=14,recent=6,chunk={block}"))
    want = hf_best(hf, ids, chunk, block)
    torch.testing.assert_close(best, want, atol=1e-5, rtol=1e-4)
    if block:  # the blocks' own normalization: not the whole context's
        assert not torch.allclose(want, hf_best(hf, ids, chunk), atol=1e-3)


@pytest.mark.parametrize("block", [0, 32])
def test_readings_of_several_contexts_in_one_forward_score_each_as_transformers(pair, block):
    """`read_pieces` reads the next piece of several second readings in one forward (the engine's step), contexts of
    different lengths whose last pieces differ too, pieces ending at KVzip's blocks: each context's scores equal
    transformers' for it alone."""
    hf, model = pair
    contexts = [ids_of(10 + i, n) for i, n in enumerate((37, 70, 16))]
    readings = []
    for ids in contexts:
        held = KVCache(model.config, None)
        prefill(model, held, ids, 32)
        readings.append(SecondReading(held, ids, 24, parse_policy(f"kvzip:sink=2,heavy=6,recent=6,chunk={block}")))
    widths = []
    while not all(r.done for r in readings):
        under_way = [r for r in readings if not r.done]
        widths.append(sum(r.piece for r in under_way))
        read_pieces(model, under_way)
    assert widths == ([24 + 24 + 16, 8 + 8, 5 + 24, 8, 6] if block else [24 + 24 + 16, 13 + 24, 22])
    for ids, reading in zip(contexts, readings):
        torch.testing.assert_close(reading.best, hf_best(hf, ids, 24, block), atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention's varlen kernel")
@pytest.mark.parametrize("block", [0, 32])
def test_readings_on_cuda_pieces_of_one_length_in_one_varlen_call_score_as_each_alone(pair, monkeypatch, block):
    """On CUDA, in bf16, the pieces of one length from several readings attend in one FlashAttention varlen call
    (`reconstruct.PiecesOfOneLength`), with `key_scores`' varlen mode (KVzip's blocks' scores by a second varlen
    call over each piece's scored keys): each context's scores equal its reading alone's (a piece at a time through
    `causal_attention_batch`)."""
    import copy
    from kvbound.cache import reconstruct
    gpu = copy.deepcopy(pair[1]).to("cuda", torch.bfloat16)
    calls, varlen = [], reconstruct.varlen_attention_lse
    monkeypatch.setattr(reconstruct, "varlen_attention_lse", lambda q, *a: calls.append(len(a[2]) - 1) or varlen(q, *a))
    contexts = [ids_of(20 + i, n).cuda() for i, n in enumerate((40, 56, 40, 23))]
    readings, alone = [], []
    for ids in contexts:
        held = KVCache(gpu.config, None, device="cuda", dtype=torch.bfloat16)
        prefill(gpu, held, ids, 32)
        pol = parse_policy(f"kvzip:sink=2,heavy=6,recent=6,chunk={block}")
        readings.append(SecondReading(held, ids, 16, pol))
        alone.append(read_again(gpu, held, ids, 16, pol))
    assert not calls
    while not all(r.done for r in readings):
        read_pieces(gpu, [r for r in readings if not r.done])
    assert max(calls) == 4 and 2 in calls  # four pieces of 16, then the two 8-token last pieces of the 40s
    for reading, best in zip(readings, alone):
        torch.testing.assert_close(reading.best, best, atol=1e-2, rtol=2e-2)


@pytest.mark.parametrize("bits", [None, 8])
def test_kvzip_keeps_each_heads_sinks_window_and_best_scored_tokens(pair, bits):
    """After a kvzip prefill each layer's heads hold their sinks, the recent window and the heavy tokens of highest
    reconstruction score (transformers' figures, brute force), with those scores; the logits are the full
    cache's; a packed cache (8-bit) keeps the same tokens."""
    hf, model = pair
    ids = ids_of(2)
    pol = parse_policy("kvzip:sink=2,heavy=14,recent=6")
    cache = KVCache(model.config, pol, kv_bits=bits, kv_group_size=32)
    logits = prefill(model, cache, ids, 32)
    full = KVCache(model.config, None)
    torch.testing.assert_close(logits, prefill(model, full, ids, 32))
    best = hf_best(hf, ids, 32)
    for layer in range(model.config.num_layers):
        for h in range(model.config.num_kv_heads):
            held = cache.pos[layer, :, h]
            kept = sorted(held[held >= 0].tolist())
            protected = [0, 1] + list(range(T - 6, T))
            rest = [p for p in range(T) if p not in protected]
            heavy = sorted(rest, key=lambda p: -float(best[layer, p, h]))[:14]
            assert kept == sorted(protected + heavy), (layer, h)
            at = {int(p): float(s) for p, s in zip(held, cache.score[layer, :, h]) if p >= 0}
            assert all(abs(at[p] - float(best[layer, p, h])) < 1e-5 for p in heavy)
    assert cache.seen == T and cache.n == [22, 22]


def test_kvzip_reads_the_question_after_scoring_the_context(pair):
    """With question_start the context alone is read twice and kept; the question then goes in as a piece of its
    own, evicting by H2O's accumulated scores, and generation runs on."""
    _, model = pair
    ids = ids_of(3, T + 12)
    pol = parse_policy("kvzip:sink=2,heavy=14,recent=16")
    out = list(generate_ids(model, ids.tolist(), SamplingParams(max_tokens=6, ignore_eos=True),
                            KVCache(model.config, pol), (), 32, question_start=T))
    assert len(out) == 6
    cache = KVCache(model.config, pol)
    prefill(model, cache, ids, 32, question_start=T)
    assert cache.seen == T + 12 and all((cache.pos[layer, :, 0] >= T).sum() == 12 for layer in range(2))


def test_kvzip_short_prompt_and_named_shape(pair):
    """A prompt within the cache's room is written whole (nothing to choose); the named policy scales to a budget
    as keydiff's does (SnapKV's 32-token window as its recent tokens)."""
    _, model = pair
    pol = parse_policy("kvzip", budget=256)
    assert (pol.sink, pol.heavy, pol.recent) == (4, 220, 32) and pol.reconstructs
    cache = KVCache(model.config, parse_policy("kvzip:sink=2,heavy=40,recent=40"))
    prefill(model, cache, ids_of(4, 30), 16)
    assert cache.n == [30, 30] and cache.prompt_scored
    full = KVCache(model.config, None)
    prefill(model, full, ids_of(4, 30), 16)
    with pytest.raises(KvboundError, match="keep_scored: needs an empty cache and more than 82 tokens, got 30 held"):
        cache.keep_scored(full, torch.zeros(2, 30, 2))
    with pytest.raises(KvboundError, match="unknown option 'evict_every'"):
        parse_policy("kvzip:sink=2,heavy=4,recent=4,evict_every=4")


def test_kvzip_is_refused_where_tokens_come_a_piece_at_a_time(pair):
    """A model forward straight over the cache refuses kvzip in one line, instead of running it as H2O; so does a
    cache that re-indexes positions, whose keys it would leave rotated where they were read."""
    _, model = pair
    pol = parse_policy("kvzip:sink=2,heavy=14,recent=6")
    with pytest.raises(KvboundError, match="a model forward over the cache does not run it"):
        model(ids_of(5), torch.arange(T), KVCache(model.config, pol))
    with pytest.raises(KvboundError, match="kvzip keeps a prompt's keys where they were read"):
        KVCache(model.config, pol, rotate_keys=model.rerotate)


def ada_keep(best, sink, recent, sure, share):
    """AdaKV's rule over a layer written out (`test_policies.Reference._share`): protected tokens first, each head's
    best up to `sure`, then the best of all up to heads x share; ties to the newer token."""
    n, heads = best.shape
    prot = lambda j: j < sink or j > n - 1 - recent  # noqa: E731
    order = sorted(((h, j) for h in range(heads) for j in range(n)), reverse=True,
                   key=lambda e: (math.inf if prot(e[1]) else float(best[e[1], e[0]]), e[1]))
    place, kept, rest = [0] * heads, [[] for _ in range(heads)], []
    for h, j in order:
        place[h] += 1
        (kept[h].append(j) if place[h] <= sure else rest.append((h, j)))
    for h, j in rest[:heads * share - sum(map(len, kept))]:
        kept[h].append(j)
    return [sorted(x) for x in kept]


def test_kvzip_with_head_budgets_keeps_adakvs_choice_by_those_scores(pair):
    """`kvzip:alpha=`: the layer's heads share its budget by the reconstruction scores (an `AdaptiveKVCache`): each
    head's kept tokens equal AdaKV's rule written out over transformers' figures, and generation runs on."""
    from kvbound.cache import sequence_cache
    from kvbound.cache.adaptive_cache import AdaptiveKVCache
    hf, model = pair
    ids = ids_of(6)
    pol = parse_policy("kvzip:sink=2,heavy=14,recent=6,alpha=0.2")
    cache = sequence_cache(model.config, pol)
    assert isinstance(cache, AdaptiveKVCache)
    torch.testing.assert_close(prefill(model, cache, ids, 32), prefill(model, KVCache(model.config, None), ids, 32))
    best = hf_best(hf, ids, 32)
    sure, share = pol.head_budgets(0, 2)
    uneven = False
    for layer in range(model.config.num_layers):
        want = ada_keep(best[layer], 2, 6, sure, share)
        got = [cache.kept_positions(layer, h) for h in range(model.config.num_kv_heads)]
        assert got == want, layer
        uneven |= len(got[0]) != len(got[1])
    assert uneven
    out = list(generate_ids(model, ids_of(7, T + 9).tolist(), SamplingParams(max_tokens=5, ignore_eos=True),
                            sequence_cache(model.config, pol), (), 32, question_start=T))
    assert len(out) == 5


def global_rows(best, sink, recent, heavy):
    """KVzip's budgets across layers written out: of every layer's unprotected (token, head) entries, the
    layers x heads x heavy best scored, counted per layer in rows of `heads`, rounded down, the rows left over to
    the largest remainders (ties to the earlier layer)."""
    layers, n, heads = best.shape
    free = [(float(best[layer, j, h]), layer) for layer in range(layers) for j in range(sink, n - recent)
            for h in range(heads)]
    counts = [0] * layers
    for _, layer in sorted(free, reverse=True)[:layers * heads * heavy]:
        counts[layer] += 1
    rows = [c // heads for c in counts]
    by_remainder = sorted(range(layers), key=lambda layer: (-(counts[layer] % heads), layer))
    for layer in by_remainder[:layers * heavy - sum(rows)]:
        rows[layer] += 1
    return rows


def test_kvzip_across_layers_keeps_the_models_best_entries_wherever_they_are(pair):
    """`kvzip:layers=global` (KVzip's own budgets): the model's heavy places go to the best-scored entries of any
    layer and head, so layers keep different numbers of tokens, each layer's heads sharing its count by AdaKV's rule
    with nothing sure but the protected tokens (transformers' figures, brute force); the logits are the full
    cache's, and each layer decodes on within its own budget."""
    from kvbound.cache.adaptive_cache import AdaptiveKVCache
    hf, model = pair
    ids = ids_of(6)
    pol = parse_policy("kvzip:sink=2,heavy=14,recent=6,layers=global")
    assert pol.alpha == 0.0 and pol.describe().endswith(",alpha=0.0,layers=global)")
    cache = sequence_cache(model.config, pol)
    assert isinstance(cache, AdaptiveKVCache)
    torch.testing.assert_close(prefill(model, cache, ids, 32), prefill(model, KVCache(model.config, None), ids, 32))
    best = hf_best(hf, ids, 32)
    rows = global_rows(best, 2, 6, 14)
    assert rows[0] != rows[1] and sum(rows) == 2 * 14
    for layer in range(model.config.num_layers):
        want = ada_keep(best[layer], 2, 6, 8, 8 + rows[layer])
        assert [cache.kept_positions(layer, h) for h in range(2)] == want, layer
    cache = sequence_cache(model.config, pol)
    out = list(generate_ids(model, ids_of(7, T + 9).tolist(), SamplingParams(max_tokens=5, ignore_eos=True),
                            cache, (), 32, question_start=T))
    assert len(out) == 5 and cache.seen == T + 9 + 4
    assert [int((cache.owner[layer] >= 0).sum()) for layer in range(2)] == [2 * s for _, s in cache.budgets]


def test_kvzip_across_layers_gives_a_layer_all_it_can_hold(pair):
    """A layer whose every entry outscores the other layer's takes all the heavy places there are (the other keeps
    its protected tokens alone); the rows follow the global ranking with whole rows and largest remainders on other
    shapes (brute force); transformers' generate() and other policies refuse layers=global in one line."""
    from kvbound import hf as kh
    _, model = pair
    pol = parse_policy("kvzip:sink=2,heavy=14,recent=6,layers=global")
    full = KVCache(model.config, None)
    prefill(model, full, ids_of(8), 32)
    score = torch.zeros(2, T, 2)
    score[1] = torch.rand(T, 2) + 1
    cache = sequence_cache(model.config, pol)
    cache.keep_scored(full, score)
    assert [s for _, s in cache.budgets] == [8, 8 + 28]
    assert [len(cache.kept_positions(layer, h)) for layer in range(2) for h in range(2)] == [8, 8, 36, 36]
    with pytest.raises(KvboundError, match=r"budget of its own \(alpha, or layers=global\)"):
        kh.install_kv_eviction(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1)), pol)
    from kvbound.cache.policies import global_shares
    for seed, (layers, n, heads) in enumerate([(3, 40, 4), (5, 33, 3), (4, 50, 8)]):
        best = torch.rand(layers, n, heads, generator=torch.Generator().manual_seed(seed))
        protected = (torch.arange(n) < 2) | (torch.arange(n) >= n - 5)
        assert global_shares(best, protected, 7, 7 + 9) == [7 + r for r in global_rows(best, 2, 5, 9)]
    for spec, why in (("kvzip:budget=64,layers=all", "unknown layers 'all'"),
                      ("kvzip:budget=64,alpha=0.2,layers=global", "leave out alpha"),
                      ("keydiff:budget=64,layers=global", "unknown option 'layers'"),
                      ("kvzip:budget=64,chunk=-1", r"chunk must be >= 0 \(0: the whole context\), got -1"),
                      ("keydiff:budget=64,chunk=64", "unknown option 'chunk'")):
        with pytest.raises(KvboundError, match=why):
            parse_policy(spec)


def test_kvzip_across_layers_in_the_engine_keeps_each_plan_in_a_row_of_one_metadata(pair):
    """Once the engine has read a layers=global context again, the sequence runs under its plan: a policy whose layer
    budgets are that reading's (as its own cache would plan them), laid out in its row of the policy's one stacked
    metadata (`StackedMeta.set_plan`), so sequences of different plans decode in one batched group."""
    from kvbound.engine.runner import group_key
    _, model = pair
    pol = parse_policy("kvzip:sink=2,heavy=14,recent=6,layers=global")
    engine = LLMEngine(model, num_blocks=64, block_size=8, prefill_chunk=16)
    prompts = [ids_of(12, 60).tolist(), ids_of(11, 60).tolist()]  # plans (26, 18) and (30, 14): wider rows
    seqs = [engine.requests[engine.add_request(ids, SamplingParams(max_tokens=30, ignore_eos=True), pol)][0]
            for ids in prompts]
    while not all(seq.scored for seq in seqs):
        engine.step()
    assert all(seq.policy.shares is not None and seq.policy.unplanned == pol for seq in seqs)
    assert seqs[0].policy.shares != seqs[1].policy.shares
    assert list(engine.caches.stacked) == [pol]
    meta = engine.caches.stacked[pol]
    assert meta.width == 30 + 1  # widened from the policy's 22 + 1 for the first layer of the second plan
    assert meta.layer_width == [30 + 1, 22 + 1]  # each layer's widest row: groups read each layer this wide
    for ids, seq in zip(prompts, seqs):
        own = sequence_cache(model.config, pol)
        prefill(model, own, torch.tensor(ids), 16)
        assert own.policy == seq.policy
        assert meta.plan_rows[seq.cache.stacked[1]].tolist() == [share + 1 for share in seq.policy.shares]
    keys = [group_key(seq, 1) for seq in seqs]
    assert keys[0] == keys[1] and keys[0].kind == "shared"


GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def engine_outputs(engine, requests) -> list[list[int]]:
    """Each request's (ids, policy spec or None, question_start) greedy tokens through the engine, which is left with
    no block held."""
    rids = [engine.add_request(ids, GREEDY, spec and parse_policy(spec), question_start=q) for ids, spec, q in requests]
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    engine.pool.check()
    assert engine.pool.num_free == engine.pool.num_blocks and engine.pool.promised == 0, "blocks leaked"
    return [done[r] for r in rids]


def scored_lengths(monkeypatch) -> list[int]:
    """The contexts the engine reads a second time, recorded while the test runs."""
    seen = []

    class Recorded(SecondReading):
        def __init__(self, held, ids, chunk, policy):
            seen.append(len(ids))
            super().__init__(held, ids, chunk, policy)
    monkeypatch.setattr(llm_engine, "SecondReading", Recorded)
    return seen


def test_kvzip_in_the_engine_batched_and_preempted_equals_each_sequence_alone(pair, monkeypatch):
    """kvzip, with equal and with AdaKV's head budgets and across layers, in a batch beside full and h2o caches: a
    sequence holds its context whole in pool blocks, the engine reads it again once it is in and keeps what that
    scores in the blocks kept for it (across layers, after planning its layers' budgets from that reading), and each
    sequence's tokens equal its own cache's (`generate_ids`), question apart or not. A
    context within the room is kept as it is, unread. Under a tight pool, preempted sequences (held, scored, swapped
    out or recomputed; in virtual storage too) give the same tokens, and so does async scheduling."""
    _, model = pair
    specs = ["kvzip:sink=2,heavy=14,recent=6", "kvzip:sink=2,heavy=14,recent=6,alpha=0.2", None,
             "h2o:sink=2,heavy=10,recent=10"]
    reqs = [(ids_of(20 + i, 12 + 11 * i).tolist(), specs[i % 4], 8 + 10 * i if i % 3 == 2 else None)
            for i in range(8)]
    reqs += [(ids_of(40 + i, 50 + 7 * i).tolist(), "kvzip:sink=2,heavy=14,recent=6,layers=global,chunk=24", q)
             for i, q in enumerate([None, 40, None])]
    # a layers=global context within the room: unread, it decodes in the policy's own layout beside the plans
    reqs += [(ids_of(43, 15).tolist(), "kvzip:sink=2,heavy=14,recent=6,layers=global,chunk=24", None)]
    scored, together = scored_lengths(monkeypatch), []
    read = llm_engine.read_pieces
    monkeypatch.setattr(llm_engine, "read_pieces", lambda m, rs: (together.append(len(rs)), read(m, rs))[1])
    roomy = engine_outputs(LLMEngine(model, num_blocks=128, block_size=8, prefill_chunk=16), reqs)
    assert max(together) >= 2  # contexts read again in one forward
    for (ids, spec, q), out in zip(reqs, roomy):
        cache = sequence_cache(model.config, spec and parse_policy(spec))
        assert out == list(generate_ids(model, ids, GREEDY, cache, (), 16, question_start=q)), spec
    assert sorted(scored) == sorted(q or len(ids) for ids, spec, q in reqs if spec and "kvzip" in spec
                                    and (q or len(ids)) >= 23)
    for kw in (dict(swap_space=4.0), dict(swap_space=0.0), dict(kv_storage="virtual")):
        engine = LLMEngine(model, num_blocks=22, block_size=8, prefill_chunk=16, **kw)
        assert engine_outputs(engine, reqs) == roomy, kw
        assert engine.scheduler.stats["preemptions"] > 0
        assert (engine.scheduler.stats["swapped_out_blocks"] > 0) == bool(kw.get("swap_space", 4.0))
    engine = LLMEngine(model, num_blocks=128, block_size=8, prefill_chunk=16, async_scheduling=True)
    assert engine_outputs(engine, reqs) == roomy
    with pytest.raises(KvboundError, match=r"its context \(60 tokens, held whole until it is read again\) and its "
                       r"cache bound \(22 tokens\) need 11 blocks of 8 tokens, but the pool has only 10"):
        LLMEngine(model, num_blocks=10, block_size=8).add_request(ids_of(1, 60).tolist(), GREEDY,
                                                                  parse_policy(specs[0]))


def test_kvzip_contexts_start_only_while_their_peaks_fit_so_none_is_preempted(pair):
    """Six kvzip prompts in a pool that holds two of their contexts whole at once: each starts only when the rest of
    its peak fits beside the others' still to come, so none is preempted (and computed again) and each equals its
    own cache, as does an h2o prompt beside them."""
    _, model = pair
    spec = "kvzip:sink=2,heavy=14,recent=6"  # 60-token contexts: 8 blocks held, 3 for the bound
    reqs = [(ids_of(60 + i, 60).tolist(), spec, None) for i in range(6)]
    reqs.append((ids_of(70, 30).tolist(), "h2o:sink=2,heavy=10,recent=10", None))
    engine = LLMEngine(model, num_blocks=26, block_size=8, prefill_chunk=16, max_num_batched_tokens=512)
    reading = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda **kw: (lambda b: (reading.append(sum(
        s.reading for s in engine.scheduler.running)), b)[1])(schedule(**kw))
    outs = engine_outputs(engine, reqs)
    assert engine.scheduler.stats["preemptions"] == 0 and max(reading) == 2
    for (ids, spec_, _), out in zip(reqs, outs):
        assert out == list(generate_ids(model, ids, GREEDY, sequence_cache(model.config, parse_policy(spec_)), (), 16))


def test_kvzip_in_the_engine_reads_a_piece_a_step_while_the_others_decode(pair, monkeypatch):
    """The second reading goes a prefill piece a step, counted in the step's token budget, so a sequence decoding
    beside it gets a token every step instead of waiting for a whole context to be read again, and a prompt
    prefilled meanwhile takes what the budget leaves. A request aborted while it reads gives every block back."""
    _, model = pair
    engine = LLMEngine(model, num_blocks=64, block_size=8, prefill_chunk=16, max_num_batched_tokens=32)
    steps, read, fed = [], [], []
    orig, schedule = llm_engine.read_pieces, engine.scheduler.schedule
    monkeypatch.setattr(llm_engine, "read_pieces", lambda m, rs: (read.extend((len(steps), r.piece) for r in rs),
                                                                   orig(m, rs))[1])
    monkeypatch.setattr(engine.scheduler, "schedule", lambda **kw: (lambda b: (fed.append(
        sum(t for _, t in b or [])), b)[1])(schedule(**kw)))
    decoding = engine.add_request(ids_of(40, 6).tolist(), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    ids = ids_of(41, 80).tolist()
    zipped = engine.add_request(ids, GREEDY, parse_policy("kvzip:sink=2,heavy=14,recent=6"))
    engine.add_request(ids_of(42, 150).tolist(), SamplingParams(max_tokens=2, ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        outs = {o.request_id: o for o in engine.step()}
        steps.append(len(outs[decoding].outputs[0].token_ids) if decoding in outs else None)
        done.update((r, o.outputs[0].token_ids) for r, o in outs.items() if o.finished)
    # after the 5 steps that held the context (16 tokens a step): one piece a step
    assert [at for at, _ in read] == [5, 6, 7, 8, 9]
    assert steps[:11] == list(range(2, 13))  # the other sequence drew a token in every one of those steps
    pieces = dict(read)
    assert all(fed[i + 1] + pieces.get(i, 0) <= 32 for i in range(len(steps))), (fed, read)
    assert done[zipped] == list(generate_ids(model, ids, GREEDY, KVCache(model.config, parse_policy(
        "kvzip:sink=2,heavy=14,recent=6")), (), 16))
    aborted = engine.add_request(ids, GREEDY, parse_policy("kvzip:sink=2,heavy=14,recent=6"))
    while engine.requests[aborted][0].rereading is None:
        engine.step()
    engine.abort(aborted)  # mid-reading: its held and bounded blocks go back at once
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.has_unfinished()


def test_kvzip_in_the_engine_forks_hits_the_prefix_cache_and_counts_its_peak(pair, monkeypatch):
    """n completions fork the scored cache (each equal to a seeded run of its own); a second request with the same
    prompt finds its context's blocks in the prefix cache, as any full cache does, and reads them again; a
    request's peak memory counts its held context and its bounded cache at once."""
    _, model = pair
    ids = ids_of(30, 60).tolist()
    pol = parse_policy("kvzip:sink=2,heavy=14,recent=6")
    params = SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=5)
    llm = LLM(model, num_blocks=64, block_size=8, prefill_chunk=16)
    out = llm.generate([ids], params, pol, use_tqdm=False)[0]
    for c in out.outputs:
        alone = SamplingParams(max_tokens=8, temperature=1.0, seed=5 + c.index)
        assert c.token_ids == list(generate_ids(model, ids, alone, KVCache(model.config, pol), (), 16)), c.index
    block = llm.engine.pool.block_bytes
    assert out.outputs[0].peak_kv_bytes == (60 // 8 + 1 + -(-23 // 8)) * block  # 8 held blocks and 3 bounded
    scored = scored_lengths(monkeypatch)
    again = llm.generate([ids], SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=5), pol, use_tqdm=False)[0]
    assert again.cached_tokens == 56 and scored == [60]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def packed_alone(model, ids, pol, bits, steps):
    """A context held at `bits`, read again, kept by a kvzip cache at that width; then greedy decode: what the engine's
    packed pool does, in stores of their own (fp8, which lives in pools alone: in blocks of a pool of their own)."""
    cfg = model.config
    if bits == "fp8":
        pool = BlockPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, 8, kv_bits=bits, group_size=32)
        make = lambda p: KVCache(cfg, p, store=PagedStore(pool))  # noqa: E731
    else:
        make = lambda p: KVCache(cfg, p, kv_bits=bits, kv_group_size=32)  # noqa: E731
    held, cache = make(None), make(pol)
    if bits == "fp8":  # pool blocks are taken when asked for, as the engine asks
        held.prepare(len(ids))
        cache.prepare(len(ids))
    logits = prefill(model, held, ids, 16)
    cache.keep_scored(held, read_again(model, held, ids, 16, pol))
    out = []
    for _ in range(steps):
        out.append(int(logits.argmax()))
        logits = model(torch.tensor([out[-1]]), cache.next_positions(1), cache)[0]
        cache.advance(1)
    return out


@pytest.mark.parametrize("bits", [8, 4, "fp8"])
def test_kvzip_over_packed_blocks_reads_the_context_at_the_pools_width(pair, bits):
    """Over packed blocks the context is held packed, as every block of the pool is, and read again from there: the
    engine's tokens equal a packed cache of the sequence's own that holds the context at that width; in fp8 they
    part from the full-precision reading's."""
    _, model = pair
    ids = ids_of(31, 64)
    pol = parse_policy("kvzip:sink=2,heavy=14,recent=6")
    engine = LLMEngine(model, num_blocks=64, block_size=8, prefill_chunk=16, kv_bits=bits, kv_group_size=32)
    got = engine_outputs(engine, [(ids.tolist(), "kvzip:sink=2,heavy=14,recent=6", None)])[0]
    assert got == packed_alone(model, ids, pol, bits, GREEDY.max_tokens)
    if bits == "fp8":
        assert got != list(generate_ids(model, ids.tolist(), GREEDY, KVCache(model.config, pol), (), 16))
