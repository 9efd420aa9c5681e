"""Paged engine: block pool, prefix cache, copy-on-write, scheduler (batching, preemption), LLM API."""
import copy

import pytest
import torch

from kvbound.cache.block_pool import BlockPool, block_hash
from kvbound.cache import KVCache, sequence_cache
from kvbound.errors import KvboundError
from kvbound.models import ModelConfig
from kvbound.engine import LLM, LLMEngine
from kvbound.engine.runner import StepBatch
from kvbound.engine import SamplingParams, generate_ids
from kvbound.models.llama import CausalLM
from kvbound.cache.policies import H2OPolicy, parse_policy

VOCAB = 96


def tiny_model(head_dim: int):
    cfg = ModelConfig(arch="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=head_dim, intermediate_size=96)
    torch.manual_seed(0)
    m = CausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits than the default init, so greedy choices are not near-ties
        m.lm_head.weight.mul_(8)
    return m


@pytest.fixture(scope="module")
def model():
    return tiny_model(16)


def prompt(seed, n):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(model, ids, policy, params, chunk):
    cache = sequence_cache(model.config, policy)
    return list(generate_ids(model, ids, params, cache, (), chunk))


def group_sizes(monkeypatch, group) -> list[int]:
    """The rows of each call of a batched group's attend (a runner group class), recorded while the test runs."""
    sizes, orig = [], group.attend

    def counted(self, layer, q, *a):
        sizes.append(self.rows.shape[0])
        return orig(self, layer, q, *a)
    monkeypatch.setattr(group, "attend", counted)
    return sizes


GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
POLICIES = [None, "h2o:sink=2,heavy=10,recent=12", "window:budget=20,sink=2",
            "h2o:sink=2,heavy=8,recent=14,score=ema,granularity=layer", "h2o:sink=2,heavy=9,recent=9,evict_every=3"]


def mixed_requests():
    """Mixed lengths (some prompts longer than their budget, so they evict during prefill) and policies."""
    lengths = [5, 70, 33, 18, 51, 9, 40, 26]
    return [(prompt(i, n), POLICIES[i % len(POLICIES)]) for i, n in enumerate(lengths)]


def run_engine(model, requests, chunk=16, shared_policies=False, **kw):
    """shared_policies: requests with one spec share one policy object, so their bounded caches batch together."""
    llm = LLM(model, prefill_chunk=chunk, **kw)
    parsed = {}
    pols = [(parsed.setdefault(p, parse_policy(p)) if shared_policies else parse_policy(p)) if p else None
            for _, p in requests]
    outs = llm.generate([ids for ids, _ in requests], GREEDY, pols, use_tqdm=False)
    llm.engine.pool.check()
    pool = llm.engine.pool  # on CUDA the decode graphs keep a scratch block for good
    assert pool.num_free == pool.num_blocks - (0 if pool.striped else pool.reserved), "blocks leaked"
    return [o.outputs[0].token_ids for o in outs], llm.engine


def test_batch_equals_each_sequence_alone(model):
    reqs = mixed_requests()
    got, engine = run_engine(model, reqs, num_blocks=256, max_num_batched_tokens=48)
    for (ids, pol), out in zip(reqs, got):
        assert out == alone(model, ids, parse_policy(pol) if pol else None, GREEDY, 16), pol
    assert engine.scheduler.stats["preemptions"] == 0


@pytest.mark.parametrize("spec", ["keydiff:sink=2,heavy=12,recent=10,alpha=0.2",
                                  "knorm:sink=2,heavy=12,recent=10,alpha=0.2", "tova:sink=2,heavy=22,alpha=0.2",
                                  "h2o:sink=2,heavy=12,recent=10,score=observed,alpha=0.2",
                                  "keydiff:sink=2,heavy=12,recent=10,beta=4"])
def test_head_budgets_over_every_rank_batched_equal_each_sequence_alone(model, spec):
    """Every rank under AdaKV's head budgets (`alpha=`), and KeyDiff under PyramidKV's (`beta=`): batched outputs equal
    each sequence's own cache. KeyDiff's shared-place decodes rescore every place against its head's anchor each
    step, as the cache does (they once kept the prefill's scores, and 3 of these 4 sequences decoded other tokens)."""
    pol = parse_policy(spec)
    reqs = [prompt(40 + i, 30 + 7 * i) for i in range(4)]
    outs = LLM(model, num_blocks=128, block_size=8, prefill_chunk=16).generate(reqs, GREEDY, pol, use_tqdm=False)
    for ids, out in zip(reqs, outs):
        assert out.outputs[0].token_ids == list(generate_ids(model, ids, GREEDY, sequence_cache(model.config, pol),
                                                             (), 16))


def test_merging_policies_batched_and_preempted_equal_each_sequence_alone(model):
    """Merging (`merge=`) through the engine's batched groups (chunks past the budget, fills, evicting decodes) and
    through preemption, which swaps the merged counts out and back: each sequence's tokens as its own cache gives."""
    specs = ["h2o:sink=2,heavy=10,recent=12,score=observed,merge=rank", "keydiff:sink=2,heavy=12,recent=10,merge=count",
             "tova:sink=2,heavy=22,merge=rank", "h2o:sink=2,heavy=10,recent=12,score=observed,merge=rank,evict_every=4"]
    # full caches first, which grow: the newest sequences, the merging ones, are the ones preempted
    reqs = [(prompt(70, 30), None), (prompt(71, 36), None)]
    reqs += [(prompt(60 + i, 20 + 9 * i), specs[i % len(specs)]) for i in range(6)]
    roomy, engine = run_engine(model, reqs, shared_policies=True, num_blocks=256, block_size=8)
    assert all(m.count is not None for m in engine.caches.stacked.values())
    for (ids, spec), out in zip(reqs, roomy):
        assert out == alone(model, ids, parse_policy(spec) if spec else None, GREEDY, 16), spec
    tight, engine = run_engine(model, reqs, shared_policies=True, num_blocks=24, block_size=8)
    assert engine.scheduler.stats["preemptions"] > 0 and engine.scheduler.stats["swapped_out_blocks"] > 0
    assert tight == roomy


def test_preemption_under_a_small_pool_gives_the_same_outputs(model):
    reqs = mixed_requests()
    roomy, _ = run_engine(model, reqs, num_blocks=256, max_num_batched_tokens=48)
    tight, engine = run_engine(model, reqs, num_blocks=10, block_size=8, max_num_batched_tokens=48)
    assert engine.scheduler.stats["preemptions"] > 0
    assert tight == roomy
    # a recomputed prompt is counted once: neither its tokens nor its blocks found again count twice
    assert engine.scheduler.stats["prompt_tokens"] == sum(len(ids) for ids, _ in reqs)


def test_request_that_can_never_fit_is_refused(model):
    engine = LLMEngine(model, num_blocks=4, block_size=8)
    with pytest.raises(KvboundError, match="needs 8 blocks"):
        engine.add_request(prompt(0, 40), SamplingParams(max_tokens=24))
    with pytest.raises(KvboundError, match="cache bound"):
        engine.add_request(prompt(0, 10), SamplingParams(max_tokens=1), parse_policy("window:budget=40,sink=2"))
    with pytest.raises(KvboundError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(KvboundError, match="token ids"):
        engine.add_request([VOCAB + 3], SamplingParams())
    with pytest.raises(KvboundError, match="max_num_batched_tokens"):
        LLMEngine(model, max_num_batched_tokens=64, prefill_chunk=128)


def test_decodes_run_every_step_while_a_long_prompt_is_chunked(model):
    engine = LLMEngine(model, num_blocks=64, max_num_batched_tokens=16, prefill_chunk=16)
    short = engine.add_request(prompt(1, 4), SamplingParams(max_tokens=12, ignore_eos=True))
    engine.step()  # the short prompt is prefilled; it decodes from now on
    engine.add_request(prompt(2, 120), SamplingParams(max_tokens=2, ignore_eos=True))
    seen, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda **kw: seen.append(schedule(**kw)) or seen[-1]
    for _ in range(6):
        engine.step()
        feeds = {s.request_id: t for s, t in seen[-1]}
        assert feeds[short] == 1 and sum(feeds.values()) == 16 and len(feeds) == 2


def test_prefix_hit_reuses_blocks_and_matches_a_cold_run(model):
    system = prompt(7, 40)
    a, b = system + prompt(8, 9), system + prompt(9, 5)
    engine = LLMEngine(model, num_blocks=64, block_size=8)
    engine.add_request(a, GREEDY)
    while engine.has_unfinished():
        engine.step()
    engine.pool.check()
    cold = alone(model, b, None, GREEDY, 512)
    rid = engine.add_request(b, GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert engine.scheduler.stats["prefix_hit_tokens"] == 40  # 5 full blocks of the shared prefix
    assert [o for o in outs if o.request_id == rid][-1].outputs[0].token_ids == cold


def test_logits_after_prefix_hit_equal_cold_logits(model):
    ids = prompt(3, 37)
    logits = []
    for warm in (False, True):
        engine = LLMEngine(model, num_blocks=32, block_size=8)
        if warm:
            engine.add_request(ids[:33] + [1, 2], SamplingParams(max_tokens=1))
            engine.step()
        engine.add_request(ids, SamplingParams(max_tokens=1))
        batch = engine.scheduler.schedule()
        assert [t for _, t in batch] == ([5] if warm else [37])  # 4 cached blocks of 8; the rest computed
        logits.append(engine._forward(*StepBatch.order(batch), [0])[0])
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_bounded_sequence_pins_shared_prefix_and_never_writes_it(model):
    system = prompt(11, 24)
    pol = H2OPolicy(sink=2, heavy=26, recent=12, pinned=((0, 24),))
    engine = LLMEngine(model, num_blocks=64, block_size=8, prefill_chunk=16, max_num_batched_tokens=32)
    engine.add_request(system + prompt(12, 3), SamplingParams(max_tokens=1), pol)
    while engine.has_unfinished():
        engine.step()
    shared = sorted(engine.pool.block_info)
    assert len(shared) == 3  # the pinned 24 tokens, published by the bounded sequence
    before = engine.pool.k.clone(), engine.pool.v.clone()
    ids = system + prompt(13, 50)  # longer than the budget: evicts during prefill and decode
    rid = engine.add_request(ids, GREEDY, pol)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert engine.scheduler.stats["prefix_hit_tokens"] == 24
    bs = engine.pool.block_size
    for b in shared:
        torch.testing.assert_close(engine.pool.k[:, b * bs:(b + 1) * bs], before[0][:, b * bs:(b + 1) * bs],
                                   rtol=0, atol=0)
        torch.testing.assert_close(engine.pool.v[:, b * bs:(b + 1) * bs], before[1][:, b * bs:(b + 1) * bs],
                                   rtol=0, atol=0)
    cold = alone(model, ids, pol, GREEDY, 16)
    assert [o for o in outs if o.request_id == rid][-1].outputs[0].token_ids == cold


def test_fork_shares_the_prompt_and_copies_one_block_on_divergence(model):
    engine = LLMEngine(model, num_blocks=64, block_size=8)
    ids = prompt(4, 20)  # 2 full blocks + a partial third
    engine.add_request(ids, SamplingParams(max_tokens=3, n=2, temperature=1.0, seed=5, ignore_eos=True))
    engine.step()  # prefill, then fork: both completions share the 3 prompt blocks
    parent, kid = engine.requests["0"]
    assert parent.cache.store.blocks == kid.cache.store.blocks
    assert all(engine.pool.ref[b] == 2 for b in parent.cache.store.blocks)
    engine.step()  # both append into the shared partial block: the first writer copies it
    assert engine.pool.copies == 1
    assert parent.cache.store.blocks[:2] == kid.cache.store.blocks[:2]
    assert parent.cache.store.blocks[2] != kid.cache.store.blocks[2]
    while engine.has_unfinished():
        out = engine.step()
    assert engine.pool.copies == 1 and engine.pool.num_free == engine.pool.num_blocks
    engine.pool.check()
    assert [o.index for o in out[0].outputs] == [0, 1]


def test_forked_completions_equal_separate_seeded_runs(model):
    ids = prompt(5, 13)
    llm = LLM(model, num_blocks=64, block_size=4)
    p = SamplingParams(max_tokens=10, n=3, temperature=0.9, seed=21, ignore_eos=True)
    together = llm.generate(ids, p, use_tqdm=False)[0].outputs
    for i, comp in enumerate(together):
        one = SamplingParams(max_tokens=10, temperature=0.9, seed=21 + i, ignore_eos=True)
        assert comp.token_ids == alone(model, ids, None, one, 512)
    assert len({tuple(c.token_ids) for c in together}) > 1


def test_prefix_hash_collision_never_serves_the_wrong_blocks(model, monkeypatch):
    import kvbound.cache.block_pool as bm
    monkeypatch.setattr(bm, "block_hash", lambda prev, tokens: 42)  # every block collides
    import kvbound.engine.scheduler as sch
    monkeypatch.setattr(sch, "block_hash", bm.block_hash)
    pool = BlockPool(1, 1, 4, num_blocks=4, block_size=2)
    b = pool.allocate()
    pool.publish(b, 42, (1, 2))
    assert pool.match_prefix([1, 2, 3], 1) == [b]
    pool.decref(b)
    assert pool.match_prefix([5, 6, 3], 1) == []  # same hash, other tokens: a miss


def test_block_pool_lru_and_refcounts():
    pool = BlockPool(1, 1, 4, num_blocks=3, block_size=2)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.publish(a, block_hash(None, (1, 2)), (1, 2))
    pool.publish(b, block_hash(None, (3, 4)), (3, 4))
    pool.free_all([a, b, c])
    assert pool.num_free == 3
    assert pool.allocate() == c  # never-published blocks go first; cached ones stay findable
    assert pool.match_prefix([1, 2], 1) == [a]
    assert pool.allocate() == b  # then the least recently freed cached block, which loses its hash
    assert block_hash(None, (3, 4)) not in pool.by_hash and pool.match_prefix([3, 4], 1) == []
    with pytest.raises(KvboundError, match="exhausted"):
        pool.allocate()
    pool.decref(a)
    with pytest.raises(KvboundError, match="freed more times"):
        pool.decref(a)
    pool.check()


def test_stream_yields_the_same_tokens_as_generate(model):
    ids = prompt(6, 12)
    llm = LLM(model, num_blocks=32)
    streamed = list(llm.stream(ids, GREEDY))
    assert streamed == llm.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_a_bad_prompt_refuses_generate_whole_and_leaves_nothing_queued(model):
    """vLLM's LLM.generate aborts the requests it queued before a bad one: none of them runs in a later call."""
    llm = LLM(model, num_blocks=32)
    with pytest.raises(KvboundError, match="the prompt is empty"):
        llm.generate([prompt(6, 12), prompt(7, 5), []], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    later = llm.generate(prompt(6, 12), GREEDY, use_tqdm=False)
    assert later[0].outputs[0].token_ids == LLM(model, num_blocks=32).generate(prompt(6, 12), GREEDY,
                                                                                use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_new_tokens_plus_the_finished_outputs_give_every_token_once(model, async_scheduling):
    """What a server streams: each step's new_tokens of unfinished completions; the rest comes with the
    finished output, for sampled n=2 completions with logprobs beside a plain request, both streamed. With
    async scheduling one call can read a plain request's tokens of two steps (the logprobs request's are read
    at once): both reach the stream."""
    engine = LLMEngine(model, num_blocks=64, prefill_chunk=8, async_scheduling=async_scheduling)
    params = SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=3, ignore_eos=True, logprobs=1)
    first = engine.add_request(prompt(7, 20), params)
    second = engine.add_request(prompt(8, 5), SamplingParams(max_tokens=10, ignore_eos=True))
    streamed, final = {}, {}
    while engine.has_unfinished():
        for out in engine.step(only_finished=True):
            final.update({(out.request_id, c.index): c for c in out.outputs})
        for rid, index, tok, lp in engine.new_tokens({first, second}):
            assert (lp is not None) == (rid == first)
            streamed.setdefault((rid, index), []).append(tok)
    for key in [(first, 0), (first, 1), (second, 0)]:
        got, want = streamed[key], final[key].token_ids
        assert got == want[:len(got)] and len(got) >= len(want) - 2, key
    assert engine.new_tokens({first, second}) == []


@pytest.mark.parametrize("mode", [None, "cumulative", "normalized", "ema"])
def test_paged_decode_reference_matches_per_sequence_attend(mode):
    """The batched CPU path of paged decode attention against `attend` run on each sequence alone."""
    from kvbound.kernels import causal_attention as attend, paged_decode_attention
    gen = torch.Generator().manual_seed(len(str(mode)))
    lens, hq, hkv, d, slots = [9, 1, 30], 6, 2, 16, 64
    q = torch.randn(3, hq, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(slots, hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
    table = torch.randperm(slots, generator=gen)[:sum(lens)].split(lens)
    padded = torch.zeros(3, max(lens), dtype=torch.int32)
    for b, t in enumerate(table):
        padded[b, :len(t)] = t
    score0 = torch.rand(3, max(lens), hkv, generator=gen, dtype=torch.float64)
    score = score0.clone()
    out = paged_decode_attention(q, k, v, padded, torch.tensor(lens), score=score if mode else None,
                                 score_mode=mode, ema_decay=0.9)
    for b, t in enumerate(table):
        ref, ks = attend(q[b:b + 1], k[t.long()], v[t.long()], mode)
        torch.testing.assert_close(out[b], ref[0])
        n = lens[b]
        if mode == "ema":
            torch.testing.assert_close(score[b, :n], 0.9 * score0[b, :n] + 0.1 * ks, rtol=1e-5, atol=1e-6)
        elif mode:  # `attend` computes its scores in float32
            torch.testing.assert_close(score[b, :n], score0[b, :n] + ks, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(score[b, n:], score0[b, n:])  # padding keys untouched


def test_batched_groups_carry_the_decode_steps(model, monkeypatch):
    """The append, evict, prefill and fill groups (one call per layer for many sequences) really run, and give each
    sequence what it gets alone (test_batch_equals_each_sequence_alone checks the tokens)."""
    from kvbound.engine.runner import AppendGroup, EvictGroup, FillGroup, PrefillGroup
    calls = {"append": 0, "evict": 0, "prefill": 0, "fill": 0}
    for name, cls, meth in [("append", AppendGroup, "attend"), ("evict", EvictGroup, "attend"),
                            ("prefill", PrefillGroup, "attend"), ("fill", FillGroup, "attend")]:
        orig = getattr(cls, meth)

        def wrapped(self, layer, q, *a, _orig=orig, _name=name):
            calls[_name] += q.shape[0]
            return _orig(self, layer, q, *a)
        monkeypatch.setattr(cls, meth, wrapped)
    reqs = mixed_requests()
    got, _ = run_engine(model, reqs, num_blocks=256, max_num_batched_tokens=48)
    assert calls["append"] > 0 and calls["evict"] > 0 and calls["prefill"] > 0 and calls["fill"] > 0
    for (ids, pol), out in zip(reqs, got):
        assert out == alone(model, ids, parse_policy(pol) if pol else None, GREEDY, 16), pol


@pytest.mark.parametrize("spec", ["tova:sink=2,heavy=22", "h2o:sink=2,heavy=10,recent=12,granularity=layer,score=ema"])
def test_layer_granularity_decodes_in_the_evict_group(model, monkeypatch, spec):
    """A layer's heads keep the same tokens in the same slots (tova's default, and granularity=layer), so their
    steady-state decode runs batched in the evict group, the layer's summed attention folded into every head:
    each sequence's tokens equal its own cache's, and every head of the stacked rows holds the same positions."""
    from kvbound.engine.runner import EvictGroup
    seen = group_sizes(monkeypatch, EvictGroup)
    pol = parse_policy(spec)
    assert pol.granularity == "layer"
    reqs = [prompt(60 + i, 40 + 9 * i) for i in range(4)]
    llm = LLM(model, num_blocks=128, block_size=8, prefill_chunk=16)
    outs = llm.generate(reqs, GREEDY, pol, use_tqdm=False)
    assert max(seen) > 1
    for ids, out in zip(reqs, outs):
        assert out.outputs[0].token_ids == alone(model, ids, pol, GREEDY, 16)
    pos = llm.engine.caches.stacked[pol].pos  # the rows as the last steps left them
    assert (pos >= 0).any() and (pos == pos[..., :1]).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs"))])
def test_per_request_budgets_hold_stacked_rows_only_while_in_use(model, device):
    """Each budget a request brings is a policy with stacked metadata (and on CUDA evict graphs) of its own. A step
    after its last cache is gone they are dropped, so what is held follows the budgets in use (they piled up
    before), and `release_idle` drops them at once when nothing runs; a policy met again gets fresh rows and graphs
    and gives the same replies as a cache of its own."""
    from kvbound.engine import LLMEngine
    pols = [parse_policy(f"window:budget={b},sink=2") for b in (12, 16, 20)]
    pols.append(parse_policy("h2o:sink=2,heavy=8,recent=8"))
    reqs = [prompt(70 + i, 40) for i in range(len(pols))]
    gpu = model.to(device)
    try:
        engine = LLMEngine(gpu, num_blocks=128, block_size=8, prefill_chunk=16)
        evict_graphs = lambda: {key.meta for key, _, _ in engine.graphs.parts() if key.meta is not None}

        def wave():  # one request at a time: a step of one policy's rows alone replays its evict graph
            out, held, graphed = [], set(), set()
            for r, p in zip(reqs, pols):
                engine.add_request(r, GREEDY, policy=p)
                while engine.has_unfinished():
                    held |= set(engine.caches.stacked)
                    graphed |= evict_graphs() if engine.graphs is not None else set()
                    out += [f.outputs[0].token_ids for f in engine.step(only_finished=True)]
            return out, held, graphed
        first, held, graphed = wave()
        assert held == set(pols) and (engine.graphs is None or {meta.policy for meta in graphed} == set(pols))
        engine.release_idle()  # what an idle server's loop does before it waits (two empty steps)
        assert engine.caches.stacked == {} and (engine.graphs is None or not evict_graphs())
        again = [alone(gpu, ids, pol, GREEDY, 16) if device == "cpu" else
                 list(generate_ids(gpu, ids, GREEDY, sequence_cache(gpu.config, pol, device=device), (), 16))
                 for ids, pol in zip(reqs, pols)]
        assert wave()[0] == first == again
    finally:
        model.cpu()


def test_an_idle_servers_loop_gives_back_per_request_budgets_rows(model):
    """The server's engine loop, with nothing left to run, releases every per-request policy's stacked rows before
    it waits for the next request (the bounded default policy's stay); `release_idle` refuses while requests run."""
    pytest.importorskip("fastapi")  # the serve package's (the GPU machine has none)
    from kvbound.engine import LLMEngine
    from kvbound.serve.engine_loop import EngineLoop
    default = parse_policy("window:budget=24,sink=2")
    engine = LLMEngine(model, policy=default, num_blocks=128, block_size=8, prefill_chunk=16)
    pols = [parse_policy(f"h2o:sink=2,heavy={h},recent=8") for h in (6, 8)] + [None]
    inbox = [("add", f"r{i}", prompt(90 + i, 30), GREEDY, p, False, 0.0) for i, p in enumerate(pols)]
    held_at_wait, replies = [], []

    def receive(block):
        if inbox:
            return inbox.pop(0)
        if not block:
            return None
        held_at_wait.append(set(engine.caches.stacked))
        return ("stop",)
    EngineLoop(engine, receive, lambda out: replies.extend(out["updates"]), 4).run()
    assert len(replies) == 3 and held_at_wait == [{default}]
    engine = LLMEngine(model, num_blocks=128, block_size=8, prefill_chunk=16)
    engine.add_request(prompt(99, 30), GREEDY, policy=pols[0])
    with pytest.raises(RuntimeError, match="requests are still running"):
        engine.release_idle()


@pytest.mark.parametrize("spec", ["h2o:sink=2,heavy=8,recent=8", "adakv:sink=2,heavy=12,recent=10,window=6"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs"))])
def test_stacked_rows_grow_as_sequences_come(model, device, spec):
    """A policy's stacked metadata starts with FIRST_ROWS rows and doubles when a sequence finds none free: the rows
    in use are copied and their caches re-pointed, and on CUDA the evict graphs captured over the old rows are
    captured again (AdaKV's shared places too). Sequences running across the growth, and those after it, equal
    their own caches."""
    from kvbound.engine.llm_engine import FIRST_ROWS
    pol = parse_policy(spec)
    reqs = [prompt(90 + i, 30 + i) for i in range(FIRST_ROWS + 4)]
    gpu = model.to(device)
    try:
        engine = LLMEngine(gpu, num_blocks=1024, block_size=8, prefill_chunk=16, max_num_seqs=64)
        ids, out = {}, {}

        def steps(n):
            for _ in range(n):
                out.update({ids[f.request_id]: f.outputs[0].token_ids for f in engine.step(only_finished=True)})
        ids.update({engine.add_request(r, GREEDY, policy=pol): i for i, r in enumerate(reqs[:3])})
        steps(12)  # the first three decode in steady state (on CUDA in their evict graph)
        meta = engine.caches.stacked[pol]
        assert meta.rows == FIRST_ROWS and meta.generation == 0 and meta.pos.shape[0] == FIRST_ROWS + 1
        before = engine.graphs is not None and any(key.meta is meta for key, _, _ in engine.graphs.parts())
        assert before == (device == "cuda")
        ids.update({engine.add_request(r, GREEDY, policy=pol): i + 3 for i, r in enumerate(reqs[3:])})
        while engine.has_unfinished():
            steps(1)
        assert meta.rows == 2 * FIRST_ROWS and meta.generation == 1 and meta.pos.shape[0] == 2 * FIRST_ROWS + 1
        for i, ids_ in enumerate(reqs):
            cache = sequence_cache(gpu.config, pol, device=device)
            assert out[i] == list(generate_ids(gpu, ids_, GREEDY, cache, (), 16)), i
    finally:
        model.cpu()


def test_forked_bounded_completions_equal_separate_seeded_runs(model):
    """n > 1 under an evicting policy: each fork owns its metadata and copies shared blocks before writing."""
    ids = prompt(12, 45)  # longer than the budget
    pol = parse_policy("h2o:sink=2,heavy=10,recent=12")
    llm = LLM(model, num_blocks=64, block_size=4, prefill_chunk=16)
    p = SamplingParams(max_tokens=20, n=3, temperature=0.9, seed=4, ignore_eos=True)
    together = llm.generate(ids, p, pol, use_tqdm=False)[0].outputs
    for i, comp in enumerate(together):
        one = SamplingParams(max_tokens=20, temperature=0.9, seed=4 + i, ignore_eos=True)
        assert comp.token_ids == alone(model, ids, pol, one, 16)
    assert llm.engine.pool.copies > 0 and llm.engine.pool.num_free == llm.engine.pool.num_blocks


@pytest.mark.parametrize("spec", ["h2o:sink=2,heavy=10,recent=12", "h2o:sink=2,heavy=10,recent=12,score=ema",
                                  "h2o:sink=1,heavy=11,recent=12,score=normalized", "window:budget=24,sink=3",
                                  "h2o:sink=2,heavy=10,recent=12,score=observed", "tova:sink=2,heavy=22",
                                  "knorm:sink=2,heavy=10,recent=12", "snapkv:sink=2,heavy=12,recent=10,window=6",
                                  "snapkv:sink=2,heavy=12,recent=10,window=6,kernel=3,score=ema",
                                  "keydiff:sink=2,heavy=10,recent=12"])
def test_bounded_prefill_pieces_evict_as_one_batch(model, monkeypatch, spec):
    """Later prefill pieces of full bounded caches with one policy keep-and-rewrite together ("chunk" group),
    with the same outputs as each sequence alone; a pinned prefix is honoured."""
    from kvbound.engine.runner import ChunkGroup
    seen = group_sizes(monkeypatch, ChunkGroup)
    pol = parse_policy(spec, pinned=((0, 5),))
    reqs = [prompt(20 + i, 80 + (i % 2)) for i in range(4)]
    llm = LLM(model, num_blocks=128, block_size=8, prefill_chunk=16, max_num_batched_tokens=64)
    outs = llm.generate(reqs, GREEDY, pol, use_tqdm=False)
    assert max(seen) > 1  # several sequences in one call
    for ids, out in zip(reqs, outs):
        assert out.outputs[0].token_ids == alone(model, ids, pol, GREEDY, 16)


@pytest.mark.parametrize("spec", ["h2o:sink=2,heavy=10,recent=12", "window:budget=24,sink=3", "tova:sink=2,heavy=22",
                                  "snapkv:sink=2,heavy=12,recent=10,window=6", "keydiff:sink=2,heavy=10,recent=12"])
def test_first_prefill_pieces_past_the_room_evict_as_one_batch(model, monkeypatch, spec):
    """A prefill piece longer than a bounded cache's room joins the "chunk" group of the caches holding as many
    tokens, the first piece (nothing held) as well as a full cache's later ones, with the same outputs as each
    sequence alone (a piece that exactly fills the room is written, then evicts one, in the cache's own attend)."""
    from kvbound.engine.runner import ChunkGroup
    held, attend = [], ChunkGroup.attend

    def recorded(self, layer, *a):
        held.append((self.n, self.rows.shape[0]))
        return attend(self, layer, *a)
    monkeypatch.setattr(ChunkGroup, "attend", recorded)
    pol = parse_policy(spec, pinned=((0, 5),))
    reqs = [prompt(30 + i, 70 + (i % 2)) for i in range(4)]
    llm = LLM(model, num_blocks=128, block_size=8, prefill_chunk=32, max_num_batched_tokens=128)
    outs = llm.generate(reqs, GREEDY, pol, use_tqdm=False)
    assert (0, 4) in held and (pol.budget, 4) in held, set(held)
    for ids, out in zip(reqs, outs):
        assert out.outputs[0].token_ids == alone(model, ids, pol, GREEDY, 32)


def recorded_own_decodes(monkeypatch) -> list:
    """The layers of every decode step a cache ran in its own `attend` (KVCache or AdaptiveKVCache), not in a
    batched group, from now on."""
    from kvbound.cache.adaptive_cache import AdaptiveKVCache
    layers = []

    def recorded(attend):
        def attend_recorded(self, layer, q, *a):
            if q.shape[0] == 1:
                layers.append(layer)
            return attend(self, layer, q, *a)
        return attend_recorded
    for cls in (KVCache, AdaptiveKVCache):
        monkeypatch.setattr(cls, "attend", recorded(cls.attend))
    return layers


@pytest.mark.parametrize("spec", ["h2o:sink=2,heavy=10,recent=12", "keydiff:sink=2,heavy=10,recent=12",
                                  "window:budget=24,sink=2", "knorm:sink=2,heavy=10,recent=12,granularity=layer",
                                  "adakv:sink=2,heavy=12,recent=10,window=6",
                                  "keydiff:sink=2,heavy=12,recent=10,alpha=0.2",
                                  "pyramidkv:sink=2,heavy=12,recent=10,window=6,beta=4",
                                  "keydiff:sink=2,heavy=12,recent=10,beta=4"])
def test_every_decode_of_a_bounded_cache_joins_the_evict_group(model, monkeypatch, spec):
    """Every decode of a bounded cache runs in the batched "evict" group ("shared" for AdaKV's head budgets and
    PyramidKV's layer budgets), not in its own `attend`, so on CUDA every decode step replays a graph: after a
    prompt that filled the budget (its spare slot the empty one after the budget) and after a shorter prompt, whose
    decodes evict nothing until the cache is full, one of them while the others evict (PyramidKV: prompts between
    its layers' budgets, a layer filling while the other evicts). Outputs equal each sequence alone."""
    alone_decodes = recorded_own_decodes(monkeypatch)
    pol = parse_policy(spec)
    reqs = [prompt(50 + i, n) for i, n in enumerate((3, 12, 23, 24, 30, 57))]  # below, at and past the budget
    llm = LLM(model, num_blocks=128, block_size=8, prefill_chunk=16, max_num_batched_tokens=64)
    outs = llm.generate(reqs, GREEDY, pol, use_tqdm=False)
    assert alone_decodes == []
    for ids, out in zip(reqs, outs):
        assert out.outputs[0].token_ids == alone(model, ids, pol, GREEDY, 16)


@pytest.mark.parametrize("spec", ["h2o:sink=2,heavy=9,recent=9,evict_every=3", "window:budget=20,sink=2,evict_every=5",
                                  "keydiff:sink=2,heavy=9,recent=9,evict_every=4"])
def test_decodes_of_caches_evicting_every_few_steps_batch(model, monkeypatch, spec):
    """A cache that evicts every e steps holds stacked rows too: its decodes with room join the "evict" group,
    evicting nothing, and the decode that fills it evicts down to the budget as a one-token "chunk" piece: none runs
    its own `attend`, and no decode runs as a "fill" piece (their steps are the kinds a CUDA graph holds). Outputs
    equal each sequence alone, below the budget and past it."""
    from kvbound.engine.runner import ChunkGroup, EvictGroup, FillGroup
    own = recorded_own_decodes(monkeypatch)
    sizes = {group: [] for group in (ChunkGroup, EvictGroup, FillGroup)}
    for group, rows in sizes.items():
        attend = group.attend
        monkeypatch.setattr(group, "attend", lambda self, layer, q, *a, attend=attend, rows=rows:
                            rows.append(q.shape[0] // self.rows.shape[0]) or attend(self, layer, q, *a))
    pol = parse_policy(spec)
    reqs = [prompt(80 + i, n) for i, n in enumerate((5, 19, 30, 41))]
    outs = LLM(model, num_blocks=128, block_size=8, prefill_chunk=16).generate(reqs, GREEDY, pol, use_tqdm=False)
    assert own == [] and 1 not in sizes[FillGroup]
    assert sizes[EvictGroup] and 1 in sizes[ChunkGroup]
    for ids, out in zip(reqs, outs):
        assert out.outputs[0].token_ids == alone(model, ids, pol, GREEDY, 16)


@pytest.mark.parametrize("spec", ["adakv:sink=2,heavy=12,recent=10,window=6",
                                  "keydiff:sink=2,heavy=12,recent=10,alpha=0.2",
                                  "h2o:sink=2,heavy=12,recent=10,score=observed,alpha=0.2",
                                  "pyramidkv:sink=2,heavy=12,recent=10,window=6,beta=4"])
def test_prefill_pieces_of_shared_places_run_batched(model, monkeypatch, spec):
    """Prefill pieces of caches whose heads share places (AdaKV, PyramidKV) run as batched "places" groups, never a
    cache's own `attend`: pieces that fill, that evict for the first time, and that evict from a full cache, several
    caches a group. Each sequence's outputs equal its own cache's."""
    from kvbound.cache.adaptive_cache import AdaptiveKVCache
    from kvbound.engine import runner
    from kvbound.engine.runner import PlacesGroup
    rows = group_sizes(monkeypatch, PlacesGroup)
    own = []
    attend = AdaptiveKVCache.attend
    monkeypatch.setattr(AdaptiveKVCache, "attend", lambda self, *a: own.append(1) or attend(self, *a))
    pol = parse_policy(spec)
    reqs = [prompt(90 + i, n) for i, n in enumerate((9, 20, 20, 47, 47, 47, 70))]
    llm = LLM(model, num_blocks=128, block_size=8, prefill_chunk=16, max_num_batched_tokens=128)
    outs = llm.generate(reqs, GREEDY, pol, use_tqdm=False)
    assert own == [] and max(rows) >= 3
    for ids, out in zip(reqs, outs):
        assert out.outputs[0].token_ids == alone(model, ids, pol, GREEDY, 16)
    # a bound on one call's attention tensors splits a group's rows into calls of one row: the same outputs
    monkeypatch.setattr(runner, "PIECE_ELEMENTS", 1)
    llm = LLM(model, num_blocks=128, block_size=8, prefill_chunk=16, max_num_batched_tokens=128)
    assert [o.outputs[0].token_ids for o in llm.generate(reqs, GREEDY, pol, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("bits", [8, 4])
def test_shared_places_over_packed_blocks_batch_as_they_run_alone(model32, bits):
    """AdaKV and PyramidKV over a pool of packed blocks (which a single-sequence cache of theirs refuses): a batch's
    outputs equal each request run alone through the engine, prefill pieces and decodes in groups of one row."""
    for spec in ("adakv:sink=2,heavy=12,recent=10,window=6", "pyramidkv:sink=2,heavy=12,recent=10,window=6,beta=4"):
        pol = parse_policy(spec)
        reqs = [prompt(60 + i, n) for i, n in enumerate((5, 20, 33, 33, 70))]

        def run(batch):
            llm = LLM(model32, num_blocks=128, block_size=8, prefill_chunk=16, max_num_batched_tokens=64,
                      kv_bits=bits, kv_group_size=32)
            return [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, pol, use_tqdm=False)]
        assert run(reqs) == [run([ids])[0] for ids in reqs], spec


@pytest.mark.parametrize("spec", ["h2o:sink=2,heavy=10,recent=12", "keydiff:sink=2,heavy=12,recent=10,alpha=0.2",
                                  "h2o:sink=2,heavy=9,recent=9,score=observed,merge=rank,evict_every=3"])
def test_forks_of_a_bounded_request_decode_in_the_batched_group(model, monkeypatch, spec):
    """n > 1 completions of a bounded request: each fork takes a stacked row of its own, a copy of its parent's,
    so its decodes batch with the others' (never its cache's own `attend`). Each completion equals a single
    sequence sampled with its seed, below the budget and past it."""
    alone_decodes = recorded_own_decodes(monkeypatch)
    pol = parse_policy(spec)
    llm = LLM(model, num_blocks=128, block_size=8, prefill_chunk=16)
    for n in (9, 40):
        ids = prompt(n, n)
        p = SamplingParams(max_tokens=20, n=3, temperature=0.9, seed=4, ignore_eos=True)
        outs = llm.generate(ids, p, pol, use_tqdm=False)[0].outputs
        assert not alone_decodes
        for i, comp in enumerate(outs):
            one = SamplingParams(max_tokens=20, temperature=0.9, seed=4 + i, ignore_eos=True)
            assert comp.token_ids == alone(model, ids, pol, one, 16), (n, i)
        alone_decodes.clear()  # the references' own decodes
    assert all(meta.idle for meta in llm.engine.caches.stacked.values())  # every fork gave its row back


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernels and CUDA graphs")
def test_forks_of_bounded_requests_on_cuda_equal_alone(model):
    """On CUDA, the forks' stacked rows go through the fused kernels and the decode graphs: n = 3 greedy
    completions of a bounded request, below its budget and past it, each equal to the sequence alone."""
    gpu = model.cuda()
    try:
        for spec in ("h2o:sink=2,heavy=10,recent=12", "keydiff:sink=2,heavy=12,recent=10,alpha=0.2",
                     "h2o:sink=2,heavy=9,recent=9,score=observed,merge=rank,evict_every=3"):
            pol = parse_policy(spec)
            llm = LLM(gpu, num_blocks=128, block_size=8, prefill_chunk=16)
            for n in (9, 40):
                ids = prompt(n, n)
                outs = llm.generate(ids, SamplingParams(max_tokens=20, n=3, ignore_eos=True), pol, use_tqdm=False)
                want = list(generate_ids(gpu, ids, SamplingParams(max_tokens=20, ignore_eos=True),
                                         sequence_cache(gpu.config, pol, device="cuda"), (), 16))
                assert [c.token_ids for c in outs[0].outputs] == [want] * 3, (spec, n)
    finally:
        model.cpu()


def test_a_question_start_ends_a_bounded_prefill_piece(model, monkeypatch):
    """add_request(question_start=q): a bounded sequence's prefill pieces also end at q, so its context is evicted
    before the question is read (kvpress's protocol), with the single-sequence path's outputs; an unbounded one
    ignores it. The question changes what a snapkv cache keeps. A bad index is one clear error."""
    from kvbound.engine import prefill
    from kvbound.engine.generate import piece_end
    from kvbound.engine.scheduler import Scheduler
    assert [piece_end(s, 80, 32, 70) for s in (0, 32, 64, 70)] == [32, 64, 70, 80]
    assert piece_end(0, 80, 32, None) == 32 and piece_end(64, 80, 32, 20) == 80
    pieces, orig = {}, Scheduler.schedule

    def recorded(self, *a, **kw):
        batch = orig(self, *a, **kw)
        for seq, t in batch or []:
            if seq.cache.seen < len(seq.prompt):
                pieces.setdefault(seq.request_id, []).append(t)
        return batch
    monkeypatch.setattr(Scheduler, "schedule", recorded)
    pol = parse_policy("snapkv:sink=2,heavy=12,recent=10,window=6")
    ids = prompt(81, 80)
    engine = LLMEngine(model, num_blocks=128, block_size=8, prefill_chunk=32, max_num_batched_tokens=64)
    with engine:
        apart = engine.add_request(ids, GREEDY, pol, question_start=70)
        whole = engine.add_request(ids, GREEDY, pol)
        full = engine.add_request(ids, GREEDY, question_start=70)
        outs = {}
        while engine.has_unfinished():
            outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step(only_finished=True)})
        with pytest.raises(KvboundError, match="question_start must be in \\[1, 80\\).*got 80"):
            engine.add_request(ids, GREEDY, pol, question_start=80)
    assert pieces[apart] == [32, 32, 6, 10] and pieces[whole] == [32, 32, 16] and sum(pieces[full]) == 80
    cache = sequence_cache(model.config, pol)
    assert outs[apart] == list(generate_ids(model, ids, GREEDY, cache, (), 32, 70))
    assert outs[whole] == alone(model, ids, pol, GREEDY, 32)
    kept = []
    for start in (70, None):
        cache = sequence_cache(model.config, pol)
        prefill(model, cache, ids, 32, start)
        kept.append([cache.kept_positions(layer, head) for layer in range(2) for head in range(2)])
    assert kept[0] != kept[1]


def test_heads_sharing_a_budget_run_in_the_engine(model, monkeypatch):
    """AdaKV (alpha) in the paged pool: places owned by heads; prefill pieces on each cache's own attend, steady
    decodes as one batch ("shared"), in a batch with other policies. Greedy outputs equal the single-sequence
    cache's, also from a prefix-cache hit on its pinned prefix, for seeded n=2 forks, and when a tight pool
    preempts. PyramidKV (beta: its first layer keeps more, borrowing rows its last layer leaves) runs beside
    them in a uniform budget's blocks."""
    from kvbound.engine.runner import SharedGroup
    rows = group_sizes(monkeypatch, SharedGroup)
    ada = parse_policy("adakv:sink=2,heavy=12,recent=10,window=6,alpha=0.2", pinned=((0, 8),))
    pyr = parse_policy("pyramidkv:sink=2,heavy=12,recent=10,window=6,beta=4")
    assert pyr.head_budgets(0, 2)[1] > pyr.budget > pyr.head_budgets(1, 2)[1]
    reqs = [prompt(70 + i, n) for i, n in enumerate([60, 9, 41, 75, 66])]
    pols = [ada, ada, parse_policy("h2o:sink=2,heavy=10,recent=12"), ada, pyr]
    outs = {}
    for name, blocks in (("roomy", 128), ("tight", 9)):
        llm = LLM(model, num_blocks=blocks, block_size=8, prefill_chunk=16, max_num_batched_tokens=64)
        got = llm.generate(reqs, GREEDY, pols, use_tqdm=False)
        outs[name] = [o.outputs[0].token_ids for o in got]
        assert llm.engine.pool.num_free == blocks
    assert llm.engine.scheduler.stats["preemptions"] > 0  # the tight pool
    assert outs["tight"] == outs["roomy"] and max(rows) == 3  # the three adakv rows decode together
    for ids, pol, out in zip(reqs, pols, outs["roomy"]):
        assert out == alone(model, ids, pol, GREEDY, 16)
    llm = LLM(model, num_blocks=128, block_size=8, prefill_chunk=16)
    llm.generate(reqs[0], GREEDY, ada, use_tqdm=False)
    again = reqs[0][:8] + prompt(79, 30)  # shares the pinned first block
    assert llm.generate(again, GREEDY, ada, use_tqdm=False)[0].outputs[0].token_ids == alone(model, again, ada,
                                                                                             GREEDY, 16)
    assert llm.engine.scheduler.stats["prefix_hit_tokens"] == 8
    p = SamplingParams(max_tokens=20, n=2, temperature=0.9, seed=4, ignore_eos=True)
    for i, comp in enumerate(llm.generate(reqs[3], p, ada, use_tqdm=False)[0].outputs):
        assert comp.token_ids == alone(model, reqs[3], ada, SamplingParams(max_tokens=20, temperature=0.9, seed=4 + i,
                                                                            ignore_eos=True), 16)


def test_heads_sharing_a_budget_in_a_packed_pool():
    """In an 8-bit pool (new tokens quantized once, kept ones never again), AdaKV sure of its whole share
    (alpha=1) keeps what SnapKV keeps: the same greedy outputs."""
    model = tiny_model(64)
    reqs = [prompt(70 + i, n) for i, n in enumerate([60, 9, 41, 75])]
    outs = []
    for spec in ("adakv:sink=2,heavy=12,recent=10,window=6,alpha=1.0", "snapkv:sink=2,heavy=12,recent=10,window=6"):
        llm = LLM(model, num_blocks=128, block_size=8, prefill_chunk=16, kv_bits=8, kv_group_size=32)
        outs.append([o.outputs[0].token_ids for o in llm.generate(reqs, GREEDY, parse_policy(spec), use_tqdm=False)])
    assert outs[0] == outs[1]


def test_preempted_forks_finish_with_the_same_outputs(model):
    """n > 1 completions under a pool too small for all of them: forks are preempted, recomputed from
    prompt + what they generated, and end with what a roomy pool gives."""
    reqs = [prompt(30 + i, 20) for i in range(3)]
    p = SamplingParams(max_tokens=30, n=2, temperature=0.8, seed=9, ignore_eos=True)
    outs = {}
    for name, blocks in (("roomy", 128), ("tight", 14)):
        llm = LLM(model, num_blocks=blocks, block_size=8, max_num_batched_tokens=32, prefill_chunk=16)
        res = llm.generate(reqs, p, use_tqdm=False)
        outs[name] = [[c.token_ids for c in r.outputs] for r in res]
        llm.engine.pool.check()
        assert llm.engine.pool.num_free == blocks
        if name == "tight":
            assert llm.engine.scheduler.stats["preemptions"] > 0
    assert outs["tight"] == outs["roomy"]


def test_dropped_engine_frees_its_pool_at_once(model):
    """No reference cycle keeps a dropped engine's pool alive until the garbage collector runs."""
    import gc
    import weakref
    gc.disable()
    try:
        engine = LLMEngine(model, num_blocks=64, block_size=8)
        engine.add_request(prompt(50, 20), SamplingParams(max_tokens=3, ignore_eos=True),
                           parse_policy("h2o:sink=2,heavy=4,recent=4"))
        while engine.has_unfinished():
            engine.step()
        pool = weakref.ref(engine.pool.k)
        del engine
        assert pool() is None
    finally:
        gc.enable()


def test_close_and_context_manager_free_the_pool(model):
    import weakref
    with LLM(model, num_blocks=64) as llm:
        out = llm.generate(prompt(51, 9), GREEDY, use_tqdm=False)
        pool = weakref.ref(llm.engine.pool.k)
    assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens
    assert pool() is None and not llm.engine.has_unfinished()
    with pytest.raises(KvboundError, match="this engine is closed"):
        llm.generate(prompt(52, 9), GREEDY, use_tqdm=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA logits")
def test_seeded_sampling_of_cuda_logits_matches_cpu():
    from kvbound.engine.sampling import sample_batch
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    draws = [sample_batch(x, [p], [[1]], [[]], [5]) for x in (logits, logits.cuda())]
    assert draws[0] == draws[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_greedy_at_20k_context_alone_equals_batched_and_replays_wide_graphs():
    """Past the start-up graphs' 8,192 tokens, decode steps replay graphs of a wider table (captured when first
    needed), and a long request's greedy tokens do not depend on what runs beside it."""
    cfg = ModelConfig(arch="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=96, max_position_embeddings=32768)
    torch.manual_seed(0)
    m = CausalLM(cfg).eval().cuda()
    with torch.no_grad():
        m.lm_head.weight.mul_(8)
    long_prompt = prompt(60, 20000)
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def run(prompts):
        with LLMEngine(m, None, kv_cache_tokens=65536, max_num_seqs=8, max_num_batched_tokens=4096,
                       prefill_chunk=4096) as engine:
            ids = [engine.add_request(p, params) for p in prompts]
            outs = {}
            while engine.has_unfinished():
                outs.update({o.request_id: o for o in engine.step(only_finished=True)})
            widths = {w for (_, _, w) in engine.graphs.parts() if w is not None}
            return [outs[i].outputs[0].token_ids for i in ids], widths
    (alone_tokens,), widths = run([long_prompt])
    batched, _ = run([prompt(61, 40), long_prompt, prompt(62, 3000)])
    assert batched[1] == alone_tokens
    assert max(widths) * 16 >= 20000 + 12  # the long row's steps replayed a graph wide enough for it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernels and CUDA graphs")
@pytest.mark.parametrize("spec", ["tova:sink=2,heavy=22", "knorm:sink=2,heavy=10,recent=12",
                                  "h2o:sink=2,heavy=10,recent=12,score=observed", "keydiff:sink=2,heavy=10,recent=12",
                                  "snapkv:sink=2,heavy=12,recent=10,window=6",
                                  "adakv:sink=2,heavy=12,recent=10,window=6",
                                  "keydiff:sink=2,heavy=12,recent=10,alpha=0.2",
                                  "knorm:sink=2,heavy=12,recent=10,alpha=0.2",
                                  "h2o:sink=2,heavy=12,recent=10,score=observed,alpha=0.2",
                                  "pyramidkv:sink=2,heavy=12,recent=10,window=6,beta=4",
                                  "h2o:sink=2,heavy=10,recent=12,score=observed,merge=rank",
                                  "kvzip:sink=2,heavy=10,recent=12", "kvzip:sink=2,heavy=12,recent=10,alpha=0.2",
                                  "kvzip:sink=2,heavy=12,recent=10,layers=global"])
def test_scored_policies_on_cuda_batched_equal_alone(model, spec, monkeypatch):
    """On CUDA the decode steps of tova, knorm, observed and keydiff run the fused evict kernels (an EMA that
    forgets at once; the new key's norm; the sum over each key's age; every key against the anchor), adakv's
    the shared-place kernels (`triton_shared`; KNorm, KeyDiff and observed under head budgets too, and pyramidkv's
    layers, some rows borrowed from another layer, and kvzip's layers=global plans, a plan a row); kvzip's prompts are
    read again from pool blocks: batched outputs still equal each sequence alone."""
    gpu = model.cuda()
    try:
        import kvbound.kernels.triton_shared as shared
        fused, calls = shared.shared_decode, []
        monkeypatch.setattr(shared, "shared_decode", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
        pol = parse_policy(spec)
        reqs = [prompt(40 + i, 30 + 7 * i) for i in range(4)] + [prompt(39, 9)]  # the last below the budget
        # AdaKV as the engine's default: its "shared" graphs are captured up front
        llm = LLM(gpu, num_blocks=128, block_size=8, prefill_chunk=16, policy=pol if pol.adapts else None)
        if pol.adapts:
            assert any(key.kind == "shared" for key, _, _ in llm.engine.graphs.parts())
        outs = llm.generate(reqs, GREEDY, pol, use_tqdm=False)
        for ids, out in zip(reqs, outs):
            cache = sequence_cache(gpu.config, pol, device="cuda")
            assert out.outputs[0].token_ids == list(generate_ids(gpu, ids, GREEDY, cache, (), 16)), spec
        assert bool(calls) == pol.adapts
    finally:
        model.cpu()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention's varlen kernel")
@pytest.mark.parametrize("spec", ["adakv:sink=2,heavy=12,recent=10,window=6",
                                  "keydiff:sink=2,heavy=12,recent=10,alpha=0.2",
                                  "pyramidkv:sink=2,heavy=12,recent=10,window=6,beta=4"])
def test_shared_places_prefill_in_half_precision_runs_flash_batched_as_alone(spec, monkeypatch):
    """In bf16 on CUDA, prefill pieces over shared places attend through FlashAttention, one varlen sequence per
    (cache, KV head) (`steps.owned_attention`), in the engine's groups as in a cache alone: the same outputs."""
    from kvbound.cache import steps
    gpu = tiny_model(16).to("cuda", torch.bfloat16)
    owned, calls = steps.owned_attention, []
    monkeypatch.setattr(steps, "owned_attention", lambda *a: calls.append(a[0].shape[0]) or owned(*a))
    pol = parse_policy(spec)
    reqs = [prompt(70 + i, n) for i, n in enumerate((9, 20, 47, 47, 70))]
    outs = LLM(gpu, num_blocks=128, block_size=8, prefill_chunk=16).generate(reqs, GREEDY, pol, use_tqdm=False)
    assert max(calls) >= 2
    for ids, out in zip(reqs, outs):
        cache = sequence_cache(gpu.config, pol, device="cuda", dtype=torch.bfloat16)
        assert out.outputs[0].token_ids == list(generate_ids(gpu, ids, GREEDY, cache, (), 16)), spec


# --- packed KV blocks (kv_bits) -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model32():
    """head_dim 32: one quantization group of 32 per head."""
    return tiny_model(32)


def alone_quantized(model, ids, policy, params, chunk, bits):
    cache = KVCache(model.config, policy, kv_bits=bits, kv_group_size=32)
    return list(generate_ids(model, ids, params, cache, (), chunk))


@pytest.mark.parametrize("bits", [8, 4, "mixed"])
def test_merging_over_packed_blocks_gives_the_single_sequence_quantized_outputs(model32, bits):
    """Merging over packed blocks: a merged key is a new value, packed once where it is written (the merge step of a
    decode, the kept candidates of a piece past the budget), the others keep their bytes; the engine's batched groups
    give each sequence's own packed cache's tokens. Mixed widths (heavy=4,recent=8) read the window's keys with their
    residuals, and a target in the window gets its new value's residual (`RecentResiduals.rewrite`)."""
    specs = ["h2o:sink=2,heavy=10,recent=12,score=observed,merge=rank", "knorm:sink=2,heavy=12,recent=10,merge=count",
             "h2o:sink=2,heavy=10,recent=12,merge=count,evict_every=3"]
    if bits == "mixed":  # h2o policies alone keep a window at 8 bits
        bits, specs[1] = {"heavy": 4, "recent": 8}, "h2o:sink=2,heavy=12,recent=10,score=ema,merge=count"
    reqs = [(prompt(80 + i, 20 + 11 * i), specs[i % 3]) for i in range(6)]
    got, _ = run_engine(model32, reqs, shared_policies=True, num_blocks=256, kv_bits=bits, kv_group_size=32)
    for (ids, spec), out in zip(reqs, got):
        assert out == alone_quantized(model32, ids, parse_policy(spec), GREEDY, 16, bits), spec
    if isinstance(bits, dict):  # merging changed what mixed widths keep
        unmerged = [parse_policy(spec.replace(",merge=count", "").replace(",merge=rank", "")) for _, spec in reqs]
        plain = [alone_quantized(model32, ids, pol, GREEDY, 16, bits) for (ids, _), pol in zip(reqs, unmerged)]
        assert plain != got


@pytest.mark.parametrize("bits", [8, 4])
def test_packed_blocks_give_the_single_sequence_quantized_outputs(model32, bits):
    """A mixed batch (full, h2o, window, layer granularity, evict_every 3) over a pool of packed blocks: each
    sequence's greedy tokens equal its own quantized cache's, and the pool holds a half / a quarter of the
    bytes (plus scales) per token."""
    reqs = mixed_requests()
    got, engine = run_engine(model32, reqs, num_blocks=256, max_num_batched_tokens=48, kv_bits=bits, kv_group_size=32)
    for (ids, pol), out in zip(reqs, got):
        assert out == alone_quantized(model32, ids, parse_policy(pol) if pol else None, GREEDY, 16, bits), pol
    dense = BlockPool(2, 2, 32, 4, dtype=torch.bfloat16).bytes_per_token()  # K and V, 2 heads x 32 x 2 bytes
    assert engine.pool.bytes_per_token() == dense * bits // 16 + 2 * 2 * 2 * 2  # + an fp16 scale and bias each


def test_packed_blocks_prefix_hit_gives_the_cold_runs_logits(model32):
    ids = prompt(5, 40)
    outs = []
    for _ in range(2):
        engine = LLMEngine(model32, num_blocks=64, block_size=8, max_num_batched_tokens=64, prefill_chunk=64,
                           kv_bits=8, kv_group_size=32)
        engine.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True, logprobs=5))
        outs.append(next(o for o in engine.step() if o.finished))
        engine.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True, logprobs=5))
        hit = [o for o in engine.step() if o.finished][0]
        assert hit.cached_tokens == 32  # four full blocks served from the prefix cache
        assert hit.outputs[0].logprobs == outs[-1].outputs[0].logprobs


def test_packed_blocks_fork_copies_exactly_one_block_on_a_diverging_write(model32):
    engine = LLMEngine(model32, num_blocks=64, block_size=8, kv_bits=4, kv_group_size=32)
    engine.add_request(prompt(6, 20), SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=3, ignore_eos=True))
    engine.step()  # prefill and the first token, then the fork
    assert engine.pool.copies == 0
    engine.step()  # both completions write into the shared last block: one of them copies it
    assert engine.pool.copies == 1
    while engine.has_unfinished():
        engine.step()
    engine.pool.check()


def test_packed_blocks_preemption_under_a_tight_pool_gives_the_same_outputs(model32):
    reqs = mixed_requests()
    roomy, _ = run_engine(model32, reqs, num_blocks=256, max_num_batched_tokens=48, kv_bits=8, kv_group_size=32)
    tight, engine = run_engine(model32, reqs, num_blocks=10, block_size=8, max_num_batched_tokens=48, kv_bits=8,
                               kv_group_size=32)
    assert engine.scheduler.stats["preemptions"] > 0
    assert tight == roomy


def test_the_pool_describes_its_tokens_width_and_bytes(model32):
    assert LLMEngine(model32, num_blocks=64, block_size=8, kv_bits=4, kv_group_size=32).describe_pool() == (
        f"KV pool: 64 blocks x 8 = 512 tokens, 4-bit packed, {64 * 8 * 2 * 2 * 2 * (16 + 4) / 2**30:.2f} GiB")
    assert "fp8 e4m3" in LLMEngine(model32, num_blocks=4, kv_bits="fp8").describe_pool()
    assert "float32" in LLMEngine(model32, num_blocks=4).describe_pool()


MIXED_POLICIES = ["h2o:sink=2,heavy=10,recent=12", "h2o:sink=2,heavy=8,recent=14,score=ema,granularity=layer",
                  "h2o:sink=2,heavy=9,recent=9,evict_every=3", "h2o:sink=1,heavy=10,recent=6,score=observed"]


def mixed_width_requests():
    """h2o policies only (mixed widths keep their recent windows at 8 bits), prompts under and over budget."""
    return [(prompt(i, n), MIXED_POLICIES[i % 4]) for i, n in enumerate([5, 70, 33, 18, 5, 70, 51, 40])]


def test_mixed_widths_in_the_engine_give_the_single_sequence_outputs(model32, monkeypatch):
    """heavy=4,recent=8 over a 4-bit pool, the batched evict, chunk and fill rows reading the residuals in their
    stacked rows: each sequence's greedy tokens equal its own mixed cache's, which differ from plain 4-bit caches';
    preemption under a tight pool (the residuals swapped with the blocks) and a fork (its own residuals) change
    nothing."""
    from kvbound.engine.runner import ChunkGroup, EvictGroup, FillGroup
    mixed = {"heavy": 4, "recent": 8}
    reqs = mixed_width_requests()
    batched = [group_sizes(monkeypatch, g) for g in (EvictGroup, ChunkGroup, FillGroup)]
    got, engine = run_engine(model32, reqs, num_blocks=256, max_num_batched_tokens=48, kv_bits=mixed,
                             kv_group_size=32, shared_policies=True)
    assert max(batched[0]) > 1 and batched[1] and batched[2], batched
    pol, long = parse_policy(MIXED_POLICIES[0]), [prompt(20 + i, 80) for i in range(4)]  # chunk rows together
    llm = LLM(model32, num_blocks=128, block_size=8, prefill_chunk=16, max_num_batched_tokens=64, kv_bits=mixed,
              kv_group_size=32)
    for ids, out in zip(long, llm.generate(long, GREEDY, pol, use_tqdm=False)):
        assert out.outputs[0].token_ids == alone_quantized(model32, ids, pol, GREEDY, 16, mixed)
    assert max(batched[1]) > 1 and max(batched[2]) > 1, batched
    assert "heavy=4,recent=8" in engine.describe_pool()
    four = []
    for (ids, pol), out in zip(reqs, got):
        assert out == alone_quantized(model32, ids, parse_policy(pol), GREEDY, 16, mixed), pol
        four.append(alone_quantized(model32, ids, parse_policy(pol), GREEDY, 16, 4))
    assert four != got
    tight, engine = run_engine(model32, reqs, num_blocks=14, block_size=8, max_num_batched_tokens=48, kv_bits=mixed,
                               kv_group_size=32, shared_policies=True)
    assert engine.scheduler.stats["preemptions"] > 0 and engine.scheduler.stats["swapped_out_blocks"] > 0
    assert tight == got
    llm = LLM(model32, num_blocks=64, block_size=8, kv_bits=mixed, kv_group_size=32,
              policy=parse_policy(MIXED_POLICIES[0]))
    ids = prompt(7, 30)
    sampled = SamplingParams(max_tokens=12, n=2, temperature=1.0, seed=3, ignore_eos=True)
    pair = llm.generate([ids], sampled, use_tqdm=False)[0].outputs
    for i, completion in enumerate(pair):
        cache = KVCache(model32.config, parse_policy(MIXED_POLICIES[0]), kv_bits=mixed, kv_group_size=32)
        alone_params = SamplingParams(max_tokens=12, temperature=1.0, seed=3 + i, ignore_eos=True)
        assert completion.token_ids == list(generate_ids(model32, ids, alone_params, cache, (), 16))


def test_mixed_widths_need_h2o_policies(model32):
    with pytest.raises(KvboundError, match="heavy=4,recent=8"):
        LLMEngine(model32, kv_bits={"heavy": 8, "recent": 4})
    with pytest.raises(KvboundError, match="needs an h2o policy"):
        LLMEngine(model32, kv_bits={"heavy": 4, "recent": 8}, policy=parse_policy("window:budget=20,sink=2"))
    engine = LLMEngine(model32, num_blocks=16, kv_bits={"heavy": 4, "recent": 8}, kv_group_size=32)
    with pytest.raises(KvboundError, match="needs an h2o policy"):
        engine.add_request(prompt(1, 8))  # the default full cache has no window
    with pytest.raises(KvboundError, match="kv_bits 2: the paged pool packs 8, 4"):
        LLMEngine(model32, kv_bits=2)


def test_fp8_pool_round_trip_stays_within_e4m3_precision():
    from kvbound.cache.quant import Fp8KV, zeros_on
    x = torch.randn(50, 2, 32, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 2, 50)[:, None, None]
    back = Fp8KV(1, 1, 2, 32, zeros_on("cpu")).roundtrip(x)
    scale = x.abs().amax(-1, keepdim=True) / 448
    # 3 mantissa bits: half an ulp is 1/16 of a normal value; below e4m3's smallest normal, 2^-10 of the scale
    assert ((back - x).abs() <= x.abs() / 16 * 1.002 + scale * 2 ** -9).all()


def test_fp8_pool_batches_equal_alone_and_survive_prefix_hits_and_preemption(model32):
    """Preemption by recompute (swap_space=0): with swaps, other batches form, and e4m3's coarse codes can turn
    a last-bit difference of a batched matmul into another code (the swap itself restores bytes exactly:
    test_swapped_bounded_caches_come_back_bit_for_bit)."""
    reqs = mixed_requests()
    roomy, _ = run_engine(model32, reqs, num_blocks=256, max_num_batched_tokens=48, kv_bits="fp8")
    tight, engine = run_engine(model32, reqs, num_blocks=10, block_size=8, max_num_batched_tokens=48, kv_bits="fp8",
                               swap_space=0)
    assert engine.scheduler.stats["preemptions"] > 0 and tight == roomy
    for (ids, pol), out in list(zip(reqs, roomy))[:3]:
        single, _ = run_engine(model32, [(ids, pol)], num_blocks=256, max_num_batched_tokens=48, kv_bits="fp8")
        assert single[0] == out, pol
    assert engine.pool.bytes_per_token() == 2 * 2 * (32 + 2)  # K and V, 2 heads, a byte a value + an fp16 scale


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the store kernel writes CUDA pools")
@pytest.mark.parametrize("dtype, d", [(torch.bfloat16, 64), (torch.float32, 48)])
def test_unquantized_cuda_pool_writes_equal_indexed_copies(dtype, d):
    """On CUDA an unquantized pool's write is one store kernel for K and V (from the projection's strided views):
    it puts what indexed copies put, for every head of a token's slot, for one slot per token and head, and for
    slot tables of any shape (an evict step's [1, 1, n] against K [1, n, H, D])."""
    from kvbound.cache.store import EACH_HEAD
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(6, 2 * 3 * d, generator=gen).cuda()
    k, v = kv[:, :3 * d].view(6, 3, d), kv[:, 3 * d:].view(6, 3, d)
    per_head = torch.randperm(40, generator=gen)[:18].view(6, 3).cuda()  # no (slot, head) twice
    slots = torch.tensor([5, 0, 17, 9, 30, 2]).cuda()
    for slots, heads, k, v in ((slots, None, k, v), (per_head, EACH_HEAD, k, v),
                               (slots.view(1, 1, 6), None, k.view(1, 6, 3, d), v.view(1, 6, 3, d))):
        pool, copies = (BlockPool(2, 3, d, num_blocks=5, block_size=8, device="cuda", dtype=dtype) for _ in range(2))
        pool.write(1, slots, k, v, heads)
        copies.write_raw(1, slots, copies.pack(k, v), heads)
        assert all(torch.equal(a, b) for a, b in zip(pool.raw, copies.raw))
        assert pool.k[1].abs().sum() > 0 and pool.k[0].abs().sum() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the packed decode and store kernels and CUDA graphs")
@pytest.mark.parametrize("bits", [8, 4, "fp8"])
def test_packed_pools_on_cuda_batched_equal_alone(model32, bits, monkeypatch):
    """On CUDA, packed blocks are written by the store kernel and read by the decode kernel (in CUDA graphs):
    a mixed batch's greedy tokens equal each request run alone, and for 8/4 bits the single-sequence
    quantized cache's. The fused evict step on packed blocks gives the PyTorch steps' tokens."""
    gpu = model32.cuda()
    try:
        reqs = mixed_requests()
        got, _ = run_engine(gpu, reqs, num_blocks=256, max_num_batched_tokens=48, kv_bits=bits, kv_group_size=32)
        with monkeypatch.context() as m:
            from kvbound.cache.policies import Policy
            m.setattr(Policy, "fused_protection", lambda self: None)
            unfused, _ = run_engine(gpu, reqs, num_blocks=256, max_num_batched_tokens=48, kv_bits=bits,
                                    kv_group_size=32)
        assert unfused == got
        for (ids, pol), out in zip(reqs, got):
            single, _ = run_engine(gpu, [(ids, pol)], num_blocks=256, max_num_batched_tokens=48, kv_bits=bits,
                                   kv_group_size=32)
            assert out == single[0], pol
            if bits != "fp8" and pol is None:
                cache = KVCache(gpu.config, None, device="cuda", kv_bits=bits, kv_group_size=32)
                assert out == list(generate_ids(gpu, ids, GREEDY, cache, (), 16))
    finally:
        model32.cpu()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the packed decode kernel with merged keys' counts")
@pytest.mark.parametrize("bits", [8, 4, "fp8"])
def test_merging_over_packed_pools_on_cuda_batched_equal_alone(model32, bits):
    """On CUDA, merging over packed blocks (the decode kernel reads each key's count; the victim and the merge in
    PyTorch, the target written packed): batched greedy tokens equal each request alone, and for 8/4 bits the
    single-sequence quantized cache's."""
    gpu = model32.cuda()
    try:
        specs = ["h2o:sink=2,heavy=10,recent=12,score=observed,merge=rank",
                 "knorm:sink=2,heavy=12,recent=10,merge=count",
                 "h2o:sink=2,heavy=10,recent=12,merge=count,evict_every=3"]
        reqs = [(prompt(80 + i, 20 + 11 * i), specs[i % 3]) for i in range(6)]
        got, _ = run_engine(gpu, reqs, shared_policies=True, num_blocks=256, kv_bits=bits, kv_group_size=32)
        for (ids, spec), out in zip(reqs, got):
            assert out == run_engine(gpu, [(ids, spec)], num_blocks=256, kv_bits=bits, kv_group_size=32)[0][0], spec
            if bits != "fp8":
                cache = KVCache(gpu.config, parse_policy(spec), device="cuda", kv_bits=bits, kv_group_size=32)
                assert out == list(generate_ids(gpu, ids, GREEDY, cache, (), 16)), spec
    finally:
        model32.cpu()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused evict kernels on packed pools")
@pytest.mark.parametrize("budgets", ["", ",alpha=0.2"])
@pytest.mark.parametrize("bits", [8, 4, "fp8"])
def test_key_ranks_on_packed_cuda_pools_equal_the_pytorch_steps(model32, bits, budgets, monkeypatch):
    """observed, knorm and keydiff rank in the fused evict kernels (`Policy.rank_source`), and under head budgets
    in the shared-place kernels, which read packed keys back as the pool's gather does: batched greedy tokens
    equal the PyTorch steps' (fused_protection None)."""
    from kvbound.cache.policies import Policy
    gpu = model32.cuda()
    try:
        import kvbound.kernels.triton_shared as shared
        fused, calls = shared.shared_decode, []
        monkeypatch.setattr(shared, "shared_decode", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
        specs = [s + budgets for s in ("h2o:sink=2,heavy=10,recent=12,score=observed",
                                       "knorm:sink=2,heavy=10,recent=12", "keydiff:sink=2,heavy=10,recent=12")]
        reqs = [(prompt(60 + i, 30 + 9 * i), specs[i % len(specs)]) for i in range(6)]
        kw = dict(num_blocks=256, max_num_batched_tokens=48, kv_bits=bits, kv_group_size=32, shared_policies=True)
        got, _ = run_engine(gpu, reqs, **kw)
        assert bool(calls) == (bool(budgets) and bits != "fp8")  # fp8 pools: the shared places' PyTorch route
        with monkeypatch.context() as m:
            m.setattr(Policy, "fused_protection", lambda self: None)
            unfused, _ = run_engine(gpu, reqs, **kw)
        assert got == unfused
    finally:
        model32.cpu()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs"))])
def test_mixed_widths_stacked_rows_grow_with_their_residuals(model32, device):
    """heavy=4,recent=8: a policy's stacked rows start with FIRST_ROWS rows and their residual ring as many; when
    they grow, the ring grows with them (rows in use copied, caches re-pointed, on CUDA the evict graphs captured
    again). Sequences running across the growth, and those after it, equal their own mixed caches."""
    from kvbound.engine.llm_engine import FIRST_ROWS
    mixed, pol = {"heavy": 4, "recent": 8}, parse_policy("h2o:sink=2,heavy=8,recent=8")
    reqs = [prompt(110 + i, 30 + i) for i in range(FIRST_ROWS + 4)]
    gpu = model32.to(device)
    try:
        engine = LLMEngine(gpu, num_blocks=1024, block_size=8, prefill_chunk=16, max_num_seqs=64, kv_bits=mixed,
                           kv_group_size=32)
        ids, out = {}, {}

        def steps(n):
            for _ in range(n):
                out.update({ids[f.request_id]: f.outputs[0].token_ids for f in engine.step(only_finished=True)})
        ids.update({engine.add_request(r, GREEDY, policy=pol): i for i, r in enumerate(reqs[:3])})
        steps(12)
        meta = engine.caches.stacked[pol]
        assert meta.rows == FIRST_ROWS and meta.ring.k.codes.shape[0] == FIRST_ROWS + 1
        ids.update({engine.add_request(r, GREEDY, policy=pol): i + 3 for i, r in enumerate(reqs[3:])})
        while engine.has_unfinished():
            steps(1)
        assert meta.rows == 2 * FIRST_ROWS and meta.generation == 1
        assert all(t.shape[0] == 2 * FIRST_ROWS + 1 for t in meta.ring.tensors())
        for i, ids_ in enumerate(reqs):
            cache = KVCache(gpu.config, pol, device=device, kv_bits=mixed, kv_group_size=32)
            assert out[i] == list(generate_ids(gpu, ids_, GREEDY, cache, (), 16)), i
    finally:
        model32.cpu()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="mixed widths' evict steps in CUDA graphs")
@pytest.mark.parametrize("merging", [False, True])
def test_mixed_widths_on_cuda_in_graphs_equal_alone(model32, merging):
    """heavy=4,recent=8 on CUDA: the batched evict steps (the fused kernels, reading the residuals in the stacked
    rows; the evict_every=3 cache fills its room through the compaction kernel) replay in CUDA graphs; greedy tokens
    equal eager steps' and each sequence's own mixed cache's. Merging policies merge in the merge kernel, and the
    evict_every=3 one in the compaction kernel, both rewriting merged window keys' residuals, in the graphs too."""
    gpu, mixed = model32.cuda(), {"heavy": 4, "recent": 8}
    try:
        reqs = mixed_width_requests()
        if merging:
            specs = ["h2o:sink=2,heavy=10,recent=12,score=observed,merge=rank",
                     "h2o:sink=2,heavy=12,recent=10,score=ema,merge=count",
                     "h2o:sink=2,heavy=10,recent=12,merge=count,evict_every=3"]
            reqs = [(ids, specs[i % 3]) for i, (ids, _) in enumerate(reqs)]
        got, engine = run_engine(gpu, reqs, num_blocks=256, max_num_batched_tokens=48, kv_bits=mixed,
                                 kv_group_size=32, shared_policies=True)
        assert any(key.kind == "evict" for key, _, _ in engine.graphs.parts()), "no evict graph ran"
        eager, _ = run_engine(gpu, reqs, num_blocks=256, max_num_batched_tokens=48, kv_bits=mixed, kv_group_size=32,
                              shared_policies=True, cuda_graphs=False)
        assert got == eager
        for (ids, pol), out in zip(reqs, got):
            cache = KVCache(gpu.config, parse_policy(pol), device="cuda", kv_bits=mixed, kv_group_size=32)
            assert out == list(generate_ids(gpu, ids, GREEDY, cache, (), 16)), pol
    finally:
        model32.cpu()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
@pytest.mark.parametrize("bits", [None, 8])
def test_decodes_of_several_policies_replay_one_graph_and_equal_eager(model32, bits, monkeypatch):
    """Decode steps whose rows run under several policies (full caches beside bounded ones of several budgets)
    replay one CUDA graph of all their groups, each padded to its own batch size; greedy tokens equal eager steps'
    and each sequence's own cache's. Each policy's requests stop at their own length (the full caches' last), so
    the steps go from five groups (more than MAX_GROUPS: eager) to one. With 8 bits, at most 2 graphs of several
    groups are kept, so the older ones are dropped and captured again."""
    from kvbound.engine import cuda_graphs
    from kvbound.engine.cuda_graphs import MAX_GROUPS, DecodeGraphs
    kept = 2 if bits == 8 else cuda_graphs.MAX_SEVERAL
    monkeypatch.setattr(cuda_graphs, "MAX_SEVERAL", kept)
    replayed, run, most = [], DecodeGraphs.run, []

    def recorded(self, batch, keys, fill=None):
        logits = run(self, batch, keys, fill)
        replayed.append(None if logits is None else self.last)
        most.append(len(self.several))
        return logits
    monkeypatch.setattr(DecodeGraphs, "run", recorded)
    specs = [None, "h2o:sink=2,heavy=10,recent=12", "window:budget=20,sink=2", "h2o:sink=2,heavy=6,recent=8",
             "window:budget=12,sink=2"]
    pols = {s: parse_policy(s) if s else None for s in specs}
    reqs = [(prompt(90 + i, 8 + 9 * i), specs[i % 5], SamplingParams(max_tokens=48 - 8 * (i % 5),
                                                                        ignore_eos=True)) for i in range(10)]
    gpu = model32.cuda()

    def served(**kw):
        with LLM(gpu, prefill_chunk=64, num_blocks=512, max_num_batched_tokens=1024, kv_bits=bits, kv_group_size=32,
                 **kw) as llm:
            outs = llm.generate([r[0] for r in reqs], [r[2] for r in reqs], [pols[r[1]] for r in reqs],
                                use_tqdm=False)
            return [o.outputs[0].token_ids for o in outs]
    try:
        got = served()
        kinds = [sorted(key.kind for key, _, _ in parts) for parts in replayed if parts is not None]
        assert any("append" in k and k.count("evict") > 1 for k in kinds), kinds
        assert max(map(len, kinds)) <= MAX_GROUPS and max(most) <= kept
        if bits == 8:  # more of them ran than were kept
            assert len({parts for parts in replayed if parts is not None and len(parts) > 1}) > kept
        assert served(cuda_graphs=False) == got
        for (ids, spec, params), out in zip(reqs, got):
            if bits is None or spec is None:  # a packed single cache evicts by its own route (see above)
                cache = KVCache(gpu.config, pols[spec], device="cuda", kv_bits=bits, kv_group_size=32)
                assert out == list(generate_ids(gpu, ids, params, cache, (), 64)), spec
    finally:
        model32.cpu()


# --- virtual storage (kv_storage="virtual") ---------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
@pytest.mark.parametrize("bits", [None, 8, "mixed"])
def test_decodes_of_caches_evicting_every_few_steps_replay_graphs_and_equal_eager(model32, bits, monkeypatch):
    """Caches that evict every e steps decode in CUDA graphs: their decodes with room in the evict group's, the
    decode that fills the room in a one-token chunk group's, both in one graph when the sequences are out of step
    (a policy's two groups each read buffers of their own). Every step of decodes alone replays a graph (as the
    default policy, its chunk graphs are captured up front); greedy tokens equal eager steps' and each sequence's
    own cache's, with and without merging, and with mixed widths (h2o alone: they refuse merging and windows). The
    decodes that fill the room run the compaction kernel."""
    from kvbound.engine import runner
    from kvbound.engine.cuda_graphs import DecodeGraphs
    replayed, run = [], DecodeGraphs.run

    def recorded(self, batch, keys, fill=None):
        logits = run(self, batch, keys, fill)
        if all(t == 1 and s.to_feed() == 1 for s, t in batch):
            replayed.append(None if logits is None else self.last)
        return logits
    monkeypatch.setattr(DecodeGraphs, "run", recorded)
    specs = ["h2o:sink=2,heavy=9,recent=9,evict_every=4", "h2o:sink=2,heavy=10,recent=12,score=observed,merge=rank,"
             "evict_every=3", "window:budget=20,sink=2,evict_every=5"]
    reqs = [(prompt(110 + i, 14 + 7 * i), specs[i % 3]) for i in range(9)]
    if bits == "mixed":
        bits, specs = {"heavy": 4, "recent": 8}, [specs[0], "h2o:sink=2,heavy=10,recent=12,score=observed,evict_every=3"]
        reqs = [(prompt(110 + i, 14 + 7 * i), specs[i % 2]) for i in range(6)]
    bulk = []
    monkeypatch.setattr(runner, "bulk_decode_ok", lambda *a, ok=runner.bulk_decode_ok: bulk.append(ok(*a)) or bulk[-1])
    gpu = model32.cuda()
    try:
        for spec in specs:
            mine = [(ids, s) for ids, s in reqs if s == spec]
            got, engine = run_engine(gpu, mine, shared_policies=True, num_blocks=256, kv_bits=bits,
                                     kv_group_size=32, policy=parse_policy(spec))
            assert None not in replayed, spec
            assert any(key.kind == "chunk" for key, _, _ in engine.graphs.parts()), spec
            assert any({"chunk", "evict"} <= {key.kind for key, _, _ in parts} for parts in replayed), spec
            assert bulk and all(bulk), spec
            replayed.clear()
            bulk.clear()
            eager, _ = run_engine(gpu, mine, shared_policies=True, num_blocks=256, kv_bits=bits, kv_group_size=32,
                                  cuda_graphs=False)
            assert got == eager, spec
            for (ids, _), out in zip(mine, got):
                cache = KVCache(gpu.config, parse_policy(spec), device="cuda", kv_bits=bits, kv_group_size=32)
                assert out == list(generate_ids(gpu, ids, GREEDY, cache, (), 16)), spec
    finally:
        model32.cpu()


def held_pages(pool):
    """(range, page) pairs under the blocks that hold data: taken, or cached for a prefix hit."""
    pages = pool.pages
    return {key for b in range(len(pool.ref)) if pool.ref[b] > 0 or b in pool.free_cached
            for key in pages._pages(b)}


@pytest.mark.parametrize("bits", [None, 8])
def test_virtual_storage_gives_the_paged_outputs_and_commits_only_the_pages_in_use(model32, bits, monkeypatch):
    """Token-major tensors in reserved ranges (dense here, pages simulated): the same greedy tokens as the
    paged pool, PyramidKV's layers reading rows of other layers among them (`BlockPool.all_layers` of token-major
    tensors), and after every step exactly the pages under blocks holding data are mapped; idle, the spare pages
    go back."""
    from kvbound.cache import block_pool
    from kvbound.cache.virtual import HostPages
    monkeypatch.setattr(block_pool, "HostPages", lambda _: HostPages(page_bytes=4096))
    reqs = mixed_requests()
    if bits is None:  # head and layer budgets store K/V unquantized
        reqs += [(prompt(90, 44), "pyramidkv:sink=2,heavy=12,recent=10,window=6,beta=4"),
                 (prompt(91, 37), "adakv:sink=2,heavy=12,recent=10,window=6")]
    paged, _ = run_engine(model32, reqs, num_blocks=64, block_size=8, max_num_batched_tokens=48, kv_bits=bits,
                          kv_group_size=32)
    engine = LLMEngine(model32, num_blocks=64, block_size=8, max_num_batched_tokens=48, prefill_chunk=16,
                       kv_bits=bits, kv_group_size=32, kv_storage="virtual")
    pool = engine.pool
    assert pool.committed_bytes == len(held_pages(pool)) * 4096 > 0  # block 0's pages only
    assert pool.pages.reserved_bytes >= pool.num_blocks * pool.block_bytes
    ids = [engine.add_request(p, GREEDY, parse_policy(pol) if pol else None) for p, pol in reqs]
    outs, peak = {}, 0
    while engine.has_unfinished():
        outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step(only_finished=True)})
        pages = pool.pages
        assert set(pages.users) == held_pages(pool) and set(pages.mapped) == set(pages.users) | set(pages.idle)
        assert pool.pages.counts["mapped"] - pool.pages.counts["unmapped"] == len(pool.pages.mapped)
        peak = max(peak, len(pool.pages.mapped))
    assert [outs[i] for i in ids] == paged
    assert pool.pages.map_seconds > 0
    assert 0 < peak < len(list(pool.pages._pages(0))) * pool.num_blocks  # never the whole pool
    assert not pool.pages.spare and pool.committed_bytes == len(held_pages(pool)) * 4096  # idle: trimmed
    assert "committed (virtual storage)" in engine.describe_pool()
    assert not engine.pool.tables.any()  # every row given back points at block 0, never at an unmapped page
    engine.close()


def test_virtual_pages_stay_mapped_when_idle_until_wanted_elsewhere():
    """A dropped block's page stays mapped (unmapping waits for the GPU): holding it again maps nothing, a
    block on a new page takes the oldest idle page's memory before creating one, and trim unmaps the rest."""
    from kvbound.cache.virtual import BlockPages, HostPages
    pages = BlockPages(HostPages(page_bytes=1024), "cpu", block_size=4)
    pages.zeros((2, 64, 4, 8), torch.float32)  # 2 layers x 4 heads x 8 x 4 bytes = 256-byte rows: a page per block
    pages.hold([0, 1, 2])
    assert pages.backend.access_calls == 1  # three pages side by side: access granted in one call
    pages.drop(1)
    pages.drop(2)
    assert pages.counts == dict(mapped=3, unmapped=0, shared=0, copied=0) and list(pages.idle) == [(0, 1), (0, 2)]
    pages.hold([1])
    assert pages.counts["mapped"] == 3 and list(pages.idle) == [(0, 2)]
    created = len(pages.backend.pages)
    pages.hold([5])
    assert pages.counts == dict(mapped=4, unmapped=1, shared=0, copied=0) and not pages.idle and len(pages.backend.pages) == created
    assert pages.backend.access_calls == 2
    pages.drop(5)
    assert pages.committed_bytes == 3 * 1024 and pages.trim() == 1 and pages.committed_bytes == 2 * 1024
    assert set(pages.mapped) == {(0, 0), (0, 1)}


def test_virtual_storage_gives_each_sequence_one_contiguous_stripe(model, monkeypatch):
    """Striped virtual storage: after every step each sequence's block i is its row's stripe block i, and its
    decodes read it without a table (`contiguous`); a prefix hit from another row is copied into the stripe
    (one in its own stripe stays), forks copy their parent's blocks, a tight bound preempts: outputs equal
    the paged pool's (and a cold run's) throughout, and no block leaks."""
    from kvbound.cache import block_pool
    from kvbound.cache.virtual import HostPages
    from kvbound.engine import runner
    monkeypatch.setattr(block_pool, "HostPages", lambda _: HostPages(page_bytes=4096))
    flags, attention = [], runner.table_attention
    monkeypatch.setattr(runner, "table_attention", lambda *a, **kw: flags.append(kw.get("contiguous")) or attention(*a, **kw))

    def virtual(**kw):
        """A striped engine whose unmapped bytes read NaN (a page is zeroed as it is mapped), so a read outside
        the mapped stripes shows in the outputs."""
        engine = LLMEngine(model, block_size=8, kv_storage="virtual", **kw)
        for t in engine.pool.raw:
            t.fill_(float("nan"))
        return engine

    def run(engine, adds):
        """adds: {step: [(prompt, params, policy)]}; every sequence's blocks checked after each step."""
        ids, done, step = [], {}, 0
        while step <= max(adds) or engine.has_unfinished():
            ids += [engine.add_request(p, params, pol) for p, params, pol in adds.get(step, [])]
            for out in engine.step(only_finished=True):
                done[out.request_id] = [c.token_ids for c in out.outputs]
            pool = engine.pool
            for seq in engine.scheduler.running if pool.striped else ():
                row = seq.cache.table_row
                assert seq.cache.store.blocks == [pool.stripe_block(row, i) for i in range(len(seq.cache.store.blocks))]
            pool.check()
            step += 1
        assert engine.pool.num_free == engine.pool.num_blocks and engine.pool.held == 0, "blocks leaked"
        assert not engine.pool.striped or not engine.pool.tables.any()  # given back: rows point at block 0
        return [done[i] for i in ids]

    system = prompt(7, 40)
    a, b, c = system + prompt(8, 9), system + prompt(9, 5), system + prompt(10, 7)
    engine = virtual(num_blocks=64)
    run(engine, {0: [(a, GREEDY, None)]})
    got = run(engine, {0: [(b, GREEDY, None)], 2: [(c, GREEDY, None)]})
    assert got == [[alone(model, x, None, GREEDY, 512)] for x in (b, c)]
    # b took a's row again and found its 5 blocks in place; c, on another row, took them from a's stripe
    # c mapped the two pages wholly under a's first four blocks (K and V) and copied the fifth
    assert engine.scheduler.stats["prefix_hit_tokens"] == 80
    assert engine.pool.copies == 1 and engine.pool.pages.counts["shared"] == 2 * 2
    assert flags and all(flags)

    seeded = SamplingParams(max_tokens=10, n=3, temperature=0.9, seed=21, ignore_eos=True)
    bounded = parse_policy("h2o:sink=2,heavy=10,recent=12")
    reqs = {0: [(prompt(5, 13), seeded, None), (prompt(12, 45), seeded, bounded)],
            3: [(p, SamplingParams(max_tokens=30, n=2, temperature=0.8, seed=9, ignore_eos=True), None)
                for p in (prompt(30 + i, 20) for i in range(3))]}
    paged = run(LLMEngine(model, num_blocks=128, block_size=8, max_num_batched_tokens=32, prefill_chunk=16), reqs)
    tight = virtual(num_blocks=16, max_num_batched_tokens=32, prefill_chunk=16, max_num_seqs=6)
    assert run(tight, reqs) == paged
    assert tight.scheduler.stats["preemptions"] > 0 and tight.pool.copies > 0
    with pytest.raises(KvboundError, match="max_num_seqs"):
        tight.add_request(prompt(1, 4), SamplingParams(n=7))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the CUDA driver's virtual memory"))])
def test_stripes_share_a_prefix_s_pages_and_copy_them_on_write(device, monkeypatch):
    """A row adopting another row's blocks maps the pages wholly under them (copies the rest); committed memory
    counts a shared page once; the other row's next owner writing there first gets a private copy, and the
    adopter still reads the prefix's bytes (on CUDA the two keys alias one physical page until then)."""
    from kvbound.cache import block_pool
    from kvbound.cache.store import PagedStore
    from kvbound.cache.virtual import HostPages
    if device == "cpu":
        monkeypatch.setattr(block_pool, "HostPages", lambda _: HostPages(page_bytes=16384))
    unit = 8 * 2 * 2 * 64 * 4  # one tensor's bytes per block: 8 slots x 2 layers x 2 heads x 64 x float32
    per_page = (16384 if device == "cpu" else block_pool.POOL_PAGE_BYTES) // unit
    pool = BlockPool(2, 2, 64, num_blocks=8 * per_page + 8, block_size=8, device=device, kv_storage="virtual",
                     max_seqs=3, max_seq_blocks=4 * per_page)
    pages = pool.pages
    source = PagedStore(pool)
    row = source.row
    source.grow((3 * per_page + 1) * 8)  # three pages of blocks and one block more
    slots = pool.block_slots(source.blocks)
    for layer in range(2):
        pool.write(layer, slots, *torch.randn(2, len(slots), 2, 64, device=device))
    prefix = [x[:, slots].clone() for x in pool.raw]
    before, keys = pages.committed_bytes, len(pages.mapped)
    for b in source.blocks:
        pool.incref(b)
    adopter = PagedStore(pool, source.blocks)  # as a prefix-cache hit does
    shared = pages.counts["shared"]
    assert shared >= 2 * 2  # K and V: at least two whole pages each
    assert pages.committed_bytes - before == (len(pages.mapped) - keys - shared) * pages.page_bytes
    theirs = pool.block_slots(adopter.blocks)
    assert all(torch.equal(x[:, theirs], p) for x, p in zip(pool.raw, prefix))
    source.release()  # its pages stay mapped (idle), shared with the adopter
    again = PagedStore(pool)  # the freed row again (rows are reused last freed first), writing over them
    assert again.row == row
    again.grow((3 * per_page + 1) * 8)
    assert pages.counts["copied"] == shared
    mine = pool.block_slots(again.blocks)
    for layer in range(2):
        pool.write(layer, mine, *torch.zeros(2, len(mine), 2, 64, device=device))
    assert all(torch.equal(x[:, theirs], p) for x, p in zip(pool.raw, prefix))  # the adopter's prefix is intact
    adopter.release()
    again.release()
    pool.check()
    assert pool.held == 0 and sum(pages.keys_of.values()) == len(pages.mapped)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA driver's virtual memory")
def test_virtual_storage_on_cuda_maps_pages_as_blocks_fill_and_gives_them_back(model32, monkeypatch):
    """Real reserved ranges and 2 MiB pages under the pool's tensors (CUDA graphs and the decode kernels read
    them through strided token-major views): the paged pool's tokens, and pages mapped only under data."""
    from kvbound.cache import block_pool
    monkeypatch.setattr(block_pool, "POOL_PAGE_BYTES", 2 << 20)  # the granularity: more page boundaries crossed
    gpu = model32.cuda()
    try:
        reqs = mixed_requests()
        for bits in (None, 8):
            paged, _ = run_engine(gpu, reqs, num_blocks=4096, max_num_batched_tokens=48, kv_bits=bits,
                                  kv_group_size=32)
            llm = LLM(gpu, prefill_chunk=16, num_blocks=4096, max_num_batched_tokens=48, kv_bits=bits,
                      kv_group_size=32, kv_storage="virtual")
            outs = llm.generate([ids for ids, _ in reqs], GREEDY, [parse_policy(p) if p else None for _, p in reqs],
                                use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == paged
            pool = llm.engine.pool
            assert set(pool.pages.mapped) == held_pages(pool) and not pool.pages.spare and not pool.pages.idle
            assert pool.committed_bytes == len(held_pages(pool)) * pool.pages.page_bytes < pool.pages.reserved_bytes
            llm.engine.close()
    finally:
        model32.cpu()


# --- swap: preempted sequences' blocks in host memory ----------------------------------------------------


def test_preempted_sequences_resume_from_host_copies_with_the_same_outputs(model):
    """In a pool too small for all, preempted unbounded sequences copy their full blocks to host memory and
    get them back on resume: outputs equal a roomy pool's and recompute-only preemption's, and of the tokens
    they had processed only those of a partial block are computed again."""
    reqs = [(prompt(70 + i, 20 + 8 * i), None) for i in range(8)]
    roomy, _ = run_engine(model, reqs, num_blocks=256, max_num_batched_tokens=48)
    runs = {}
    for swap in (0, 1.0):
        got, engine = run_engine(model, reqs, num_blocks=16, block_size=8, max_num_batched_tokens=48,
                                 swap_space=swap)
        assert got == roomy, swap
        runs[swap] = engine.scheduler
    recompute, swapped = runs[0].stats, runs[1.0].stats
    assert recompute["preemptions"] > 0 and recompute["swapped_out_blocks"] == 0
    assert swapped["swapped_out_blocks"] > 0 and swapped["swapped_in_blocks"] > 0
    assert swapped["recomputed_tokens"] < 8 * swapped["preemptions"]  # at most a partial block each
    assert recompute["recomputed_tokens"] > 8 * swapped["recomputed_tokens"]
    assert runs[1.0].swap_left == 2**30  # every host copy was given back
    with pytest.raises(KvboundError, match="swap_space must be >= 0"):
        LLMEngine(model, num_blocks=4, swap_space=-1)


@pytest.mark.parametrize("bits, storage", [(None, "paged"), (8, "paged"), ("fp8", "paged"), (None, "virtual")])
def test_swapped_bounded_caches_come_back_bit_for_bit(model32, bits, storage, monkeypatch):
    """Every bounded cache restored from host memory holds exactly the bytes and metadata it was preempted with,
    and a mixed batch under a tight pool still gives the roomy pool's outputs (float32 and 8-bit)."""
    from kvbound.engine import scheduler
    restore, swap_out, checked, at_swap = scheduler.Scheduler._restore, scheduler.Scheduler._swap_out, [], {}

    def recording(self, seq):  # the state as it was when swapped out, whatever happens to the rows meanwhile
        swap_out(self, seq)
        if seq.swapped is not None and seq.bounded:
            at_swap[seq.request_id] = copy.deepcopy(seq.swapped[1])

    def checking(self, seq):
        state = at_swap[seq.request_id]
        restore(self, seq)
        if seq.cache is not None:
            again = seq.cache.snapshot()
            assert all(torch.equal(a, b) for a, b in zip(state["bytes"], again["bytes"]))
            assert torch.equal(state["pos"], again["pos"]) and torch.equal(state["spare"], again["spare"])
            assert state["score"] is None or torch.equal(state["score"], again["score"])
            assert (state["n"], state["has_spare"], state["seen"]) == (again["n"], again["has_spare"], again["seen"])
            checked.append(seq.request_id)
    monkeypatch.setattr(scheduler.Scheduler, "_restore", checking)
    monkeypatch.setattr(scheduler.Scheduler, "_swap_out", recording)
    reqs = mixed_requests()
    tight, engine = run_engine(model32, reqs, num_blocks=10 + (storage == "virtual"), block_size=8,
                               max_num_batched_tokens=48, kv_bits=bits, kv_group_size=32, kv_storage=storage)
    assert checked and engine.scheduler.stats["swapped_in_blocks"] > 0
    if bits != "fp8":
        roomy, _ = run_engine(model32, reqs, num_blocks=256, max_num_batched_tokens=48, kv_bits=bits,
                              kv_group_size=32)
        assert tight == roomy


@pytest.mark.parametrize("storage, device", [("paged", "cpu"), ("virtual", "cpu"), *[pytest.param(
    st, "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")) for st in ("paged", "virtual")]])
def test_prefix_blocks_evicted_from_the_pool_come_back_from_the_host_tier(model, storage, device, monkeypatch):
    """With kv_offloading_size, a cached prefix whose blocks other requests take is copied to host memory; a
    later request with that prefix copies it back instead of computing it, and answers as a cold run does
    (on CUDA: as the same engine without the host tier, whose copies out are queued, not awaited). Without
    it, the prefix is computed again."""
    from kvbound.cache import block_pool
    from kvbound.cache.virtual import HostPages
    if device == "cpu":
        monkeypatch.setattr(block_pool, "HostPages", lambda _: HostPages(page_bytes=4096))
    system = prompt(40, 40)  # 5 blocks of 8
    first, other, again = system + prompt(41, 6), prompt(42, 80), system + prompt(43, 9)
    cold = None if device == "cuda" else [alone(model, p, None, GREEDY, 512) for p in (first, other, again)]
    for size in (1 / 1024, 0):
        try:
            engine = LLMEngine(model.to(device), num_blocks=14, block_size=8, kv_storage=storage,
                               kv_offloading_size=size)
            got = [run_steps(engine, [(p, GREEDY, None)])[0][0] for p in (first, other, again)]
        finally:
            model.cpu()
        cold = cold or got
        assert got == cold
        stats = engine.scheduler.stats
        if size:  # the pool kept some of the prefix's blocks, the host tier gave back the others
            assert stats["prefix_hit_tokens"] == 40 and stats["host_hit_tokens"] > 0 and engine.pool.offloaded > 0
        else:
            assert stats["prefix_hit_tokens"] < 40 and stats["host_hit_tokens"] == 0 == engine.pool.offloaded
    with pytest.raises(KvboundError, match="kv_offloading_size must be >= 0"):
        LLMEngine(model, num_blocks=4, kv_offloading_size=-1)


def run_steps(engine, requests, abort_at=None):
    """Step the engine to the end; {request id: token lists}. abort_at: (step, request id) to abort then."""
    ids = [engine.add_request(p, params, policy=parse_policy(pol) if pol else None) for p, params, pol in requests]
    done, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step(only_finished=True):
            done[out.request_id] = [c.token_ids for c in out.outputs]
        steps += 1
        if abort_at is not None and steps == abort_at[0]:
            engine.abort(abort_at[1])
    engine.pool.check()
    pool = engine.pool
    assert pool.num_free == pool.num_blocks - (0 if pool.striped else pool.reserved), "blocks leaked"
    return [done.get(i) for i in ids]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_async_scheduling_gives_the_same_outputs(model, monkeypatch, device):
    """A step's tokens read while the next step runs (fed there from the device): the same tokens as reading
    them at once, for mixed policies, lengths, EOS stops, greedy forks, preemption, a seeded request with
    penalties and min_tokens whose top-p candidates often fall short (drawn again when settled), and a sampled
    request with logprobs (which runs synchronously), and the steps did run ahead (on CUDA: through the decode
    graphs)."""
    model = model if device == "cpu" else tiny_model(16).cuda()
    eos = 35  # the second token of request 1, the seventh of request 4
    reqs = [(ids, SamplingParams(max_tokens=6 + 5 * i, ignore_eos=i % 3 == 0, n=2 if i == 4 else 1), pol)
            for i, (ids, pol) in enumerate(mixed_requests())]
    reqs.append((prompt(99, 12), SamplingParams(max_tokens=9, temperature=1.0, seed=4, logprobs=2), None))
    reqs.append((prompt(98, 10), SamplingParams(max_tokens=15, temperature=4.0, top_p=0.95, seed=6, min_tokens=4,
                                                presence_penalty=0.5, repetition_penalty=1.3), POLICIES[1]))
    monkeypatch.setattr("kvbound.engine.sampling.CANDIDATES", 2)  # top_p 0.95 then often draws from the whole vocab
    ahead = []
    real = LLMEngine._forward_step
    monkeypatch.setattr(LLMEngine, "_forward_step", lambda self, batch, launched=None: (
        ahead.append(launched is not None), real(self, batch, launched))[1])
    for blocks in (256, 12):
        got = {}
        for mode in (False, True):
            engine = LLMEngine(model, None, num_blocks=blocks, block_size=8, max_num_batched_tokens=48,
                               prefill_chunk=16, async_scheduling=mode)
            engine.eos_ids = {eos}
            got[mode] = run_steps(engine, reqs)
            if blocks == 12:
                assert engine.scheduler.stats["preemptions"] > 0
        assert got[True] == got[False]
        assert any(eos in outs[0] or len(outs[0]) < reqs[i][1].max_tokens for i, outs in enumerate(got[True])
                   if not reqs[i][1].ignore_eos), "no request stopped on EOS"
    assert sum(ahead) > 20


def test_async_scheduling_abort_frees_a_pending_request(model):
    """Aborted while its token is still on the device: its blocks are freed, the others' outputs unchanged."""
    reqs = [(ids, SamplingParams(max_tokens=20, ignore_eos=True), pol) for ids, pol in mixed_requests()[:4]]
    calm = run_steps(LLMEngine(model, None, num_blocks=128, prefill_chunk=16, async_scheduling=True), reqs)
    engine = LLMEngine(model, None, num_blocks=128, prefill_chunk=16, async_scheduling=True)
    cut = run_steps(engine, reqs, abort_at=(8, "1"))
    assert cut[1] is None or len(cut[1][0]) < 20
    assert [cut[i] for i in (0, 2, 3)] == [calm[i] for i in (0, 2, 3)]
