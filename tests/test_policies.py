"""Eviction policies against a brute-force reference that replays the whole attention history."""
import itertools
import math
import zlib
from dataclasses import replace

import pytest
import torch

from kvbound.cache import KVCache, sequence_cache
from kvbound.cache.adaptive_cache import AdaptiveKVCache
from kvbound.errors import KvboundError
from kvbound.models import ModelConfig
from kvbound.cache.policies import (AdaKVPolicy, H2OPolicy, KeyDiffPolicy, KeyNormPolicy, PyramidKVPolicy, SnapKVPolicy,
                                    TOVAPolicy, WindowPolicy, parse_policy, pyramid)

HQ, HKV, D = 4, 2, 8


def tiny_config():
    return ModelConfig(arch="LlamaForCausalLM", vocab_size=10, hidden_size=HQ * D, num_layers=1, num_heads=HQ,
                       num_kv_heads=HKV, head_dim=D, intermediate_size=8)


class Reference:
    """Per KV head: the kept token ids, every token's score, attention over kept+new, and the eviction
    rule written out with Python lists; with a merging policy, every evicted token averaged into its most similar
    kept key and each key's count of tokens, a log-count in its logit."""

    def __init__(self, policy, budgets=None):
        """budgets: (each head's sure tokens, the layer's budget per head) where heads share a layer's budget."""
        self.p = policy
        self.budgets = budgets
        self.kept = [[] for _ in range(HKV)]
        self.score = [dict() for _ in range(HKV)]
        self.K, self.V = {}, {}  # token -> [HKV, D]: a merge rewrites its head's row
        self.count = [dict() for _ in range(HKV)]
        self.seen = 0

    def step(self, q, k, v):
        p, t = self.p, q.shape[0]
        new = list(range(self.seen, self.seen + t))
        for i, tok in enumerate(new):
            self.K[tok], self.V[tok] = k[i].double(), v[i].double()
        out = torch.zeros(t, HQ, D, dtype=torch.float64)
        contrib = [dict() for _ in range(HKV)]
        g = HQ // HKV
        window = p.window if isinstance(p, SnapKVPolicy) and t > 1 else t  # queries that score keys
        if isinstance(p, TOVAPolicy):  # the current step: a piece's last query
            window = 1
        for h in range(HKV):
            for i in range(t):
                visible = self.kept[h] + new[:i + 1]
                keys = torch.stack([self.K[j][h] for j in visible])
                vals = torch.stack([self.V[j][h] for j in visible])
                bias = torch.tensor([math.log(self.count[h].get(j, 1)) for j in visible], dtype=torch.float64)
                for qh in range(h * g, (h + 1) * g):
                    probs = torch.softmax(keys @ q[i, qh].double() / math.sqrt(D) + bias, 0)
                    out[i, qh] = probs @ vals
                    w = len(visible) if p.score == "normalized" else 1.0
                    if i < t - window:
                        continue
                    for j, pr in zip(visible, probs.tolist()):
                        contrib[h][j] = contrib[h].get(j, 0.0) + pr * w
        if p.score and p.granularity == "layer":
            total = {}
            for h in range(HKV):
                for j, c in contrib[h].items():
                    total[j] = total.get(j, 0.0) + c
            contrib = [total] * HKV
        for h in range(HKV):
            if isinstance(p, SnapKVPolicy) and t > 1:  # the window's attention, averaged over neighbours
                cand = self.kept[h] + new
                c = [contrib[h].get(j, 0.0) for j in cand]
                r = p.kernel // 2
                contrib[h] = {j: sum(c[max(0, i - r):i + r + 1]) / len(c[max(0, i - r):i + r + 1])
                              for i, j in enumerate(cand)}
            for j in self.kept[h] + new:
                c = contrib[h].get(j, 0.0)
                if p.score == "key-norm":
                    heads = range(HKV) if p.granularity == "layer" else [h]
                    self.score[h].setdefault(j, -sum(float(self.K[j][x].norm()) for x in heads))
                elif p.score == "key-diff":  # against the anchor of every candidate, below
                    self.score[h][j] = 0.0
                elif p.score == "last" or (isinstance(p, SnapKVPolicy) and t > 1):
                    self.score[h][j] = c
                elif p.score == "ema":
                    self.score[h][j] = p.ema_decay * self.score[h].get(j, 0.0) + (1 - p.ema_decay) * c
                elif p.score:
                    self.score[h][j] = self.score[h].get(j, 0.0) + c
            cand = self.kept[h] + new
            if p.score == "key-diff":
                heads = range(HKV) if p.granularity == "layer" else [h]
                for x in heads:
                    unit = {j: self.K[j][x] / self.K[j][x].norm() for j in cand}
                    anchor = sum(unit.values())
                    anchor = anchor / anchor.norm()
                    for j in cand:
                        self.score[h][j] += -float(unit[j] @ anchor)
        for h in range(HKV):  # every head scored before any merges (a layer's scores read every head's keys)
            cand = self.kept[h] + new
            cap = p.budget + p.evict_every - 1
            if len(cand) > cap and self.budgets is None:
                kept = self._select(cand, h, new[-1])
                if p.merge:
                    self._merge(h, [j for j in cand if j not in kept], kept, new[-1])
                cand = kept
            self.kept[h] = cand
        if self.budgets is not None and sum(map(len, self.kept)) > HKV * (self.budgets[1] + p.evict_every - 1):
            self._share(new[-1])
        self.seen += t
        return out

    def _share(self, last):
        """AdaKV's rule over the layer: protected tokens, each head's best up to `sure`, then the best of all."""
        p, (sure, share) = self.p, self.budgets
        prot = lambda j: j < p.sink or any(a <= j < b for a, b in p.pinned) or j > last - p.recent  # noqa: E731
        age = (lambda j: last - j + 1) if p.score == "observed" else (lambda j: 1)  # noqa: E731
        order = sorted(((h, j) for h in range(HKV) for j in self.kept[h]), reverse=True,
                       key=lambda e: (math.inf if prot(e[1]) else self.score[e[0]][e[1]] / age(e[1]), e[1]))
        place = [0] * HKV
        kept, rest = [[] for _ in range(HKV)], []
        for h, j in order:
            place[h] += 1
            (kept[h].append(j) if place[h] <= sure else rest.append((h, j)))
        for h, j in rest[:HKV * share - sum(map(len, kept))]:
            kept[h].append(j)
        self.kept = [sorted(x) for x in kept]

    def _merge(self, h, dropped, kept, last):
        """Each dropped token into the kept key past the sinks and pins most like it (cosine, before any merge), the
        keys and values averaged by rank (or count), the counts summed."""
        p, count = self.p, self.count[h]
        pinned = lambda j: j < p.sink or any(a <= j < b for a, b in p.pinned)  # noqa: E731
        age = (lambda j: last - j + 1) if p.score == "observed" else (lambda j: 1)  # noqa: E731
        weight = {j: self.score[h][j] / age(j) + 1e-6 if p.merge == "rank" else count.get(j, 1)
                  for j in dropped + kept}
        unit = {j: self.K[j][h] / self.K[j][h].norm() for j in dropped + kept}
        targets, groups = [j for j in kept if not pinned(j)], {}
        for d in dropped:
            if targets:
                groups.setdefault(max(targets, key=lambda j: float(unit[d] @ unit[j])), []).append(d)
        for t, group in groups.items():
            members = [t] + group
            for X in (self.K, self.V):
                X[t][h] = sum(weight[j] * X[j][h] for j in members) / sum(weight[j] for j in members)
            count[t] = sum(count.get(j, 1) for j in members)

    def _select(self, cand, h, last):
        p = self.p
        pinned = lambda j: j < p.sink or any(a <= j < b for a, b in p.pinned)  # noqa: E731
        if isinstance(p, H2OPolicy):
            protected = [j for j in cand if pinned(j) or j > last - p.recent]
            age = (lambda j: last - j + 1) if p.score == "observed" else (lambda j: 1)  # noqa: E731
            rank = lambda j: (self.score[h][j] / age(j), j)  # noqa: E731  (ties: newer wins)
        else:
            protected = [j for j in cand if pinned(j)]
            rank = lambda j: (j, j)  # noqa: E731
        rest = sorted((j for j in cand if j not in protected), key=rank, reverse=True)
        return sorted(protected + rest[:p.budget - len(protected)])


POLICIES = [WindowPolicy(budget=12, sink=2), WindowPolicy(budget=12, sink=0, evict_every=3),
            WindowPolicy(budget=12, sink=2, pinned=((5, 8),))]
for score, gran, every, pinned in itertools.product(["cumulative", "ema", "normalized"], ["kv-head", "layer"],
                                                    [1, 4], [(), ((6, 9),)]):
    POLICIES.append(H2OPolicy(sink=2, heavy=5, recent=5, score=score, granularity=gran, evict_every=every,
                              pinned=pinned, ema_decay=0.8))
for gran, every, pinned in itertools.product(["kv-head", "layer"], [1, 4], [(), ((6, 9),)]):
    POLICIES += [H2OPolicy(sink=2, heavy=5, recent=5, score="observed", granularity=gran, evict_every=every,
                           pinned=pinned),
                 TOVAPolicy(sink=1, heavy=9, recent=2, granularity=gran, evict_every=every, pinned=pinned),
                 KeyNormPolicy(sink=2, heavy=6, recent=4, granularity=gran, evict_every=every, pinned=pinned),
                 KeyDiffPolicy(sink=2, heavy=6, recent=3, granularity=gran, evict_every=every, pinned=pinned),
                 SnapKVPolicy(sink=1, heavy=7, recent=4, window=3, kernel=3, granularity=gran, evict_every=every,
                              pinned=pinned)]
for gran, pinned in itertools.product(["kv-head", "layer"], [(), ((6, 9),)]):  # merging evicted tokens
    POLICIES += [H2OPolicy(sink=2, heavy=5, recent=5, score="observed", granularity=gran, pinned=pinned, merge="rank"),
                 H2OPolicy(sink=2, heavy=5, recent=5, granularity=gran, pinned=pinned, merge="count"),
                 TOVAPolicy(sink=1, heavy=9, recent=2, granularity=gran, pinned=pinned, merge="rank"),
                 KeyDiffPolicy(sink=2, heavy=6, recent=3, granularity=gran, pinned=pinned, merge="count"),
                 SnapKVPolicy(sink=1, heavy=7, recent=4, window=3, kernel=3, granularity=gran, pinned=pinned,
                              merge="rank")]
POLICIES += [H2OPolicy(sink=2, heavy=5, recent=5, score="observed", evict_every=4, merge="rank"),  # merging in bulk
             H2OPolicy(sink=2, heavy=5, recent=5, granularity="layer", evict_every=3, pinned=((6, 9),), merge="count"),
             KeyDiffPolicy(sink=2, heavy=6, recent=3, evict_every=4, merge="count")]


def _steps(seed, lengths=(5, 1, 1, 7, 1, 1, 1, 3, 1, 1, 1, 1, 9, 1, 1, 1, 1, 1, 2, 1, 1, 1)):
    gen = torch.Generator().manual_seed(seed)
    for t in lengths:
        yield (torch.randn(t, HQ, D, generator=gen) * 2, torch.randn(t, HKV, D, generator=gen) * 2,
               torch.randn(t, HKV, D, generator=gen))


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.describe() + f",every={p.evict_every},pin={p.pinned}")
def test_policy_matches_brute_force_reference(policy):
    cache, ref = KVCache(tiny_config(), policy), Reference(policy)
    differed = False
    for q, k, v in _steps(seed=zlib.crc32(repr(policy).encode())):
        pos = cache.next_positions(q.shape[0])
        out = cache.attend(0, q, k, v, pos)
        cache.advance(q.shape[0])
        want = ref.step(q, k, v)
        torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)
        kept = [cache.kept_positions(0, h) for h in range(HKV)]
        assert kept == ref.kept, f"step at {cache.seen}: {kept} != {ref.kept}"
        # invariants
        for h in range(HKV):
            assert len(kept[h]) <= policy.budget + policy.evict_every - 1
            assert all(j in kept[h] for j in range(min(policy.sink, cache.seen)))
            for a, b in policy.pinned:
                assert all(j in kept[h] for j in range(a, min(b, cache.seen)))
            if isinstance(policy, H2OPolicy):
                recent = range(max(0, cache.seen - policy.recent), cache.seen)
                assert all(j in kept[h] for j in recent)
        differed |= kept[0] != kept[1]
    if isinstance(policy, H2OPolicy) and not policy.pinned:  # with pins only 2 heavy places are left
        assert differed == (policy.granularity == "kv-head"), "kv-head choices should differ between heads"


def test_cache_never_exceeds_capacity_in_chunked_prefill():
    policy = H2OPolicy(sink=1, heavy=3, recent=4)
    cache = KVCache(tiny_config(), policy)
    for q, k, v in _steps(1, lengths=(20, 33, 1, 17)):
        cache.attend(0, q, k, v, cache.next_positions(q.shape[0]))
        cache.advance(q.shape[0])
        assert len(cache) <= policy.budget and cache.capacity == policy.budget + 1  # one spare slot
    assert cache.seen == 71  # positions keep counting tokens, not cache length


@pytest.mark.parametrize("kwargs, msg", [
    (dict(budget=4, sink=4), "must be < budget"),
    (dict(budget=-1, sink=0), "non-negative"),
])
def test_window_rejects_bad_config(kwargs, msg):
    with pytest.raises(KvboundError, match=msg):
        WindowPolicy(**kwargs)


@pytest.mark.parametrize("kwargs, msg", [
    (dict(sink=4, heavy=0, recent=-1), "non-negative"),
    (dict(sink=4, heavy=4, recent=4, ema_decay=1.0), "ema-decay"),
    (dict(sink=4, heavy=4, recent=4, ema_decay=0.0), "ema-decay"),
    (dict(sink=4, heavy=4, recent=4, score="max"), "unknown score"),
    (dict(sink=4, heavy=4, recent=4, granularity="token"), "unknown granularity"),
    (dict(sink=4, heavy=0, recent=4, pinned=((10, 20),)), "exceeds budget"),
])
def test_h2o_rejects_bad_config(kwargs, msg):
    with pytest.raises(KvboundError, match=msg):
        H2OPolicy(**kwargs)


def test_parse_policy_specs_and_errors():
    p = parse_policy("h2o:sink=4,heavy=128,recent=124,score=ema,granularity=layer")
    assert (p.sink, p.heavy, p.recent, p.score, p.granularity, p.budget) == (4, 128, 124, "ema", "layer", 256)
    assert parse_policy("h2o-balanced", 256).heavy == 64 and parse_policy("h2o-balanced", 256).recent == 188
    assert parse_policy("h2o-heavy", 256).heavy == 128 and parse_policy("h2o-heavy", 256).recent == 124
    assert parse_policy("window", 100).budget == 100
    keydiff = parse_policy("keydiff", 1024)  # SnapKV's window, the rest ranked
    assert (keydiff.sink, keydiff.heavy, keydiff.recent) == (4, 988, 32)
    assert parse_policy("keydiff", 1024) == parse_policy("keydiff:sink=4,heavy=988,recent=32")
    with pytest.raises(KvboundError, match="unknown policy"):
        parse_policy("lru", 64)
    with pytest.raises(KvboundError, match="!= budget"):
        parse_policy("h2o:sink=8,heavy=0,recent=8,budget=10")


def test_a_spec_of_options_alone_takes_the_named_shape_at_the_budget():
    """'snapkv:window=16' with --budget 256 is snapkv at 256 with that window; budget=N in the spec does the same;
    with no budget anywhere the error says so (before: a TypeError about sink and heavy)."""
    snap = parse_policy("snapkv:window=16", 256)  # the window kept whole as the recent tokens, the total unchanged
    assert snap == replace(parse_policy("snapkv", 256), window=16, recent=16, heavy=236)
    assert parse_policy("snapkv:budget=10,window=3") == SnapKVPolicy(sink=4, heavy=3, recent=3, window=3)
    assert parse_policy("keydiff:budget=1024") == parse_policy("keydiff", 1024)
    assert parse_policy("tova:granularity=layer", 64) == replace(parse_policy("tova", 64), granularity="layer")
    assert parse_policy("h2o:score=observed", 256) == parse_policy("observed", 256)
    assert parse_policy("h2o:sink=4,heavy=8,recent=4", 256).budget == 16  # a given shape ignores --budget
    for spec in ("snapkv:window=16", "h2o:heavy=100"):
        with pytest.raises(KvboundError, match="needs a budget: add --budget N or budget=N"):
            parse_policy(spec)
    with pytest.raises(KvboundError, match="window must be >= 1"):
        parse_policy("snapkv:window=0", 256)
    with pytest.raises(KvboundError, match="cannot fit budget 16"):
        parse_policy("snapkv:window=32", 16)


@pytest.mark.parametrize("policy", [WindowPolicy(budget=9, sink=2, pinned=((4, 6),)),
                                    H2OPolicy(sink=2, heavy=4, recent=3), H2OPolicy(sink=0, heavy=8, recent=1)])
def test_victim_fast_path_equals_keep_mask_with_ties(policy):
    gen = torch.Generator().manual_seed(5)
    for _ in range(50):
        n = policy.budget + 1
        pos = torch.stack([torch.randperm(40, generator=gen)[:n] for _ in range(HKV)], 1).int()
        score = torch.randint(0, 3, (n, HKV), generator=gen).float()  # many ties
        keep = policy.keep_mask(pos, score)
        assert (keep.sum(0) == policy.budget).all()
        assert torch.equal(policy.victim(pos, score), (~keep).int().argmax(0))


def test_byte_accounting_after_the_model_grew_an_unbounded_cache():
    """An unbounded cache that grew inside the model's inference mode reports its bytes and positions
    outside it (eval ppl / needle crashed here at the end of a run)."""
    from kvbound.models.llama import CausalLM
    torch.manual_seed(0)
    model = CausalLM(tiny_config()).eval()
    cache = KVCache(model.config, None, initial_slots=4)
    model(torch.arange(9) % 10, cache.next_positions(9), cache)  # grows past 4 slots under inference mode
    cache.advance(9)
    assert cache.nbytes()["tokens_held"] == 9
    assert cache.kept_positions(0, 1) == list(range(9))


@pytest.mark.parametrize("spec", ["window:budget=8,sink=2", "h2o:sink=2,heavy=3,recent=3",
                                  "h2o:sink=1,heavy=3,recent=2,evict_every=3"])
def test_reindexed_positions_run_past_the_context_as_streamingllm(spec):
    """With positions re-indexed within the cache, each head's kept keys sit at positions 0, 1, ... in stream
    order, far past the model's context of 16: in a one-layer model (keys depend on token and position only)
    they equal a fresh cache's keys of the same tokens, and a window cache's logits equal a fresh run on
    its kept tokens."""
    from kvbound.models.llama import CausalLM
    cfg = ModelConfig(arch="LlamaForCausalLM", vocab_size=50, hidden_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=32, max_position_embeddings=16)
    torch.manual_seed(0)
    model = CausalLM(cfg).eval()
    ids = torch.randint(0, 50, (60,), generator=torch.Generator().manual_seed(1))
    cache = KVCache(cfg, parse_policy(spec), rotate_keys=model.rerotate)
    model(ids[:7], cache.next_positions(7), cache)
    cache.advance(7)
    for i in range(7, 60):
        kept = cache.kept_positions(0, 0)
        logits = model(ids[i:i + 1], cache.next_positions(1), cache)[0]
        cache.advance(1)
        if spec.startswith("window"):
            fresh = KVCache(cfg, None)
            want = model(ids[kept + [i]], fresh.next_positions(len(kept) + 1), fresh, logits_at=-1)[0]
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    for h in range(2):
        kept = cache.kept_positions(0, h)
        fresh = KVCache(cfg, None)
        model(ids[kept], fresh.next_positions(len(kept)), fresh)
        used = cache._slots_used(0)
        pos = cache.pos[0, :used, h]
        order = pos.argsort()[(pos < 0).sum():]  # live slots in stream order
        torch.testing.assert_close(cache.store.k[0, order, h], fresh.store.k[0, :len(kept), h], atol=1e-4, rtol=1e-4)
    assert cache.seen == 60 > cfg.max_position_embeddings


def test_reindexed_positions_need_a_bounded_float32_dense_cache():
    from kvbound.models.llama import CausalLM
    cfg = ModelConfig(arch="LlamaForCausalLM", vocab_size=10, hidden_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=32, intermediate_size=8)
    model = CausalLM(cfg)
    for kw in (dict(policy=None), dict(policy=WindowPolicy(budget=8), kv_bits=8, kv_group_size=32),
               dict(policy=WindowPolicy(budget=8), dtype=torch.bfloat16)):
        with pytest.raises(KvboundError, match="re-indexed positions need"):
            KVCache(cfg, rotate_keys=model.rerotate, **kw)


SHARED = [AdaKVPolicy(sink=1, heavy=7, recent=4, window=3, kernel=3, alpha=a, evict_every=e, pinned=pin, score=sc)
          for a, e, pin, sc in [(0.0, 1, (), "cumulative"), (0.2, 1, ((6, 9),), "cumulative"), (0.5, 4, (), "ema"),
                                (1.0, 1, (), "cumulative")]]
SHARED += [PyramidKVPolicy(sink=1, heavy=7, recent=4, window=3, kernel=3, beta=b, evict_every=e)
           for b, e in [(1.0, 1), (4.0, 1), (7.0, 3)]]
SHARED += [H2OPolicy(sink=2, heavy=5, recent=5, score="observed", alpha=0.2),
           H2OPolicy(sink=2, heavy=5, recent=5, score="normalized", alpha=0.4, beta=3.0, evict_every=4),
           TOVAPolicy(sink=1, heavy=9, recent=2, alpha=0.0, pinned=((6, 9),)),
           KeyNormPolicy(sink=2, heavy=6, recent=4, alpha=0.3),
           KeyDiffPolicy(sink=2, heavy=6, recent=3, beta=5.0, evict_every=2)]


@pytest.mark.parametrize("policy", SHARED, ids=lambda p: p.describe() + f",every={p.evict_every},pin={p.pinned}")
def test_shared_budgets_match_brute_force_reference(policy):
    """AdaKV and PyramidKV through `AdaptiveKVCache`, three layers: each layer's kept tokens per head and its
    outputs equal the reference's, and a layer never holds more than heads x its budget per head. The store
    holds a uniform budget's slots per layer: PyramidKV's first layer borrows what its last ones leave."""
    layers = 3
    cfg = replace(tiny_config(), num_layers=layers)
    cache = sequence_cache(cfg, policy)
    assert isinstance(cache, AdaptiveKVCache)
    assert cache.store.capacity == policy.capacity
    refs = [Reference(policy, policy.head_budgets(layer, layers)) for layer in range(layers)]
    uneven = False
    steps = [list(_steps(seed=zlib.crc32(repr(policy).encode()) + layer)) for layer in range(layers)]
    for i in range(len(steps[0])):
        pos = cache.next_positions(steps[0][i][0].shape[0])
        for layer, ref in enumerate(refs):
            q, k, v = steps[layer][i]
            torch.testing.assert_close(cache.attend(layer, q, k, v, pos).double(), ref.step(q, k, v), atol=1e-4,
                                       rtol=1e-4)
            kept = [cache.kept_positions(layer, h) for h in range(HKV)]
            assert kept == ref.kept, f"layer {layer} at {cache.seen}: {kept} != {ref.kept}"
            share = policy.head_budgets(layer, layers)[1]
            assert sum(map(len, kept)) <= HKV * (share + policy.evict_every - 1)
            uneven |= len(kept[0]) != len(kept[1])
        cache.advance(q.shape[0])
    assert uneven == (policy.alpha is not None and policy.alpha < 1), "heads should share unevenly"
    if policy.alpha is None:
        held = [len(cache.kept_positions(layer, 0)) for layer in range(layers)]
        budgets = [policy.head_budgets(layer, layers)[0] for layer in range(layers)]
        assert all(0 <= n - b < policy.evict_every for n, b in zip(held, budgets))
        assert (budgets[0] > budgets[-1]) == (policy.beta > 1) and sum(budgets) == layers * policy.budget
    elif policy.beta is None:
        for layer in range(layers):  # the heads share the layer's uniform total
            held = sum(len(cache.kept_positions(layer, h)) for h in range(HKV))
            assert HKV * policy.budget <= held <= HKV * (policy.budget + policy.evict_every - 1)


def test_pyramid_schedule_keeps_the_total():
    for heavy, beta, layers in [(124, 20, 30), (7, 4, 3), (100, 1, 5), (3, 20, 24)]:
        got = pyramid(heavy, beta, layers)
        assert sum(got) == heavy * layers and got == sorted(got, reverse=True) and min(got) >= 0
    assert pyramid(124, 1, 4) == [124] * 4


def test_shared_budgets_equal_snapkv_when_nothing_is_shared():
    """alpha = 1 (each head sure of its whole share) and beta = 1 (a flat schedule) are SnapKV: the same logits as
    SnapKV's uniform cache, through a model."""
    from kvbound.models.llama import CausalLM
    cfg = replace(tiny_config(), num_layers=2, vocab_size=64)
    torch.manual_seed(0)
    model = CausalLM(cfg).eval()
    ids = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(3))
    base = dict(sink=1, heavy=7, recent=4, window=3, kernel=3)

    @torch.no_grad()
    def logits(policy):
        cache, out = sequence_cache(cfg, policy), []
        for part in (ids[:17], *ids[17:, None]):
            out.append(model(part, cache.next_positions(len(part)), cache)[-1])
            cache.advance(len(part))
        return torch.stack(out)

    want = logits(SnapKVPolicy(**base))
    for policy in (AdaKVPolicy(alpha=1.0, **base), PyramidKVPolicy(beta=1.0, **base)):
        torch.testing.assert_close(logits(policy), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits(AdaKVPolicy(alpha=0.0, **base)), want, atol=1e-3)


def test_shared_budget_errors():
    with pytest.raises(KvboundError, match="granularity must be kv-head"):
        AdaKVPolicy(sink=1, heavy=7, recent=4, granularity="layer")
    with pytest.raises(KvboundError, match="alpha must be in"):
        parse_policy("adakv:budget=64,alpha=2")
    with pytest.raises(KvboundError, match="beta must be >= 1"):
        parse_policy("pyramidkv:budget=64,beta=0.5")
    with pytest.raises(KvboundError, match="unknown option 'alpha' for window"):
        parse_policy("window:budget=64,alpha=0.2")
    assert parse_policy("h2o:budget=64,score=observed,alpha=0.2").adapts
    assert not parse_policy("h2o:budget=64").adapts and not parse_policy("snapkv", 64).adapts
    with pytest.raises(KvboundError, match="smallest per-head budget"):  # the last layer keeps 1 + 4 + 0 heavy
        sequence_cache(replace(tiny_config(), num_layers=4), PyramidKVPolicy(sink=1, heavy=4, recent=4, beta=20,
                                                                             pinned=((3, 5),)))
    with pytest.raises(KvboundError, match="unquantized"):
        sequence_cache(tiny_config(), parse_policy("adakv", 32), kv_bits=8)
    pyramid_64 = parse_policy("pyramidkv:sink=4,heavy=28,recent=32,beta=4")
    assert pyramid_64.head_budgets(0, 2) == (4 + 32 + 49,) * 2  # heavy 28: 49 and 7


def test_merge_specs_and_refusals():
    """merge= in specs and the named observed-merge; a bad value, a rank without attention, adaptive budgets and mixed
    widths each get one line naming what is wrong."""
    assert parse_policy("observed-merge", 64) == replace(parse_policy("observed", 64), merge="rank")
    assert parse_policy("h2o:merge=count", 64).merge == "count"
    assert parse_policy("h2o:merge=count,evict_every=4", 64).evict_every == 4
    assert parse_policy("h2o:merge=none", 64).merge is None
    assert "merge=rank" in parse_policy("snapkv:merge=rank", 64).describe()
    # the description a user reads (generate's stderr, the server's kv field) names every setting that changes what
    # is kept
    assert "evict_every=4" in parse_policy("h2o:merge=count,evict_every=4", 64).describe()
    assert "evict_every=5" in parse_policy("window:budget=20,evict_every=5").describe()
    assert "evict_every" not in parse_policy("h2o", 64).describe()
    for spec, msg in (("h2o:merge=mean", "unknown merge 'mean'"), ("knorm:merge=rank", "use merge=count"),
                      ("h2o:merge=rank,alpha=0.2", "equal budgets"),
                      ("window:merge=rank", "unknown option 'merge'")):
        with pytest.raises(KvboundError, match=msg):
            parse_policy(spec, 64)


def test_merged_counts_account_for_every_token():
    """Every evicted token lives on in one kept key, through decodes, pieces that fit and pieces past the budget:
    each head's counts sum to the tokens seen."""
    policy = H2OPolicy(sink=2, heavy=5, recent=5, score="observed", merge="rank")
    cache = KVCache(tiny_config(), policy)
    for q, k, v in _steps(3, lengths=(6, 1, 1, 9, 1, 1, 20, 1, 3, 1)):
        cache.attend(0, q, k, v, cache.next_positions(q.shape[0]))
        cache.advance(q.shape[0])
        held = cache.pos[0] >= 0
        assert (cache.count[0] * held).sum(0).tolist() == [cache.seen] * HKV
    assert cache.count[0].max() > 2


def test_merge_similarities_in_blocks_equal_one_block(monkeypatch):
    """A long piece's evicted tokens find their targets a block of similarities at a time (`merge.SIMILARITIES`):
    the same merge as all at once, K and V each at its own width."""
    from kvbound.cache import merge
    gen = torch.Generator().manual_seed(3)
    b, m, h, n = 2, 40, 3, 17
    k, v = torch.randn(b, m, h, 8, generator=gen), torch.randn(b, m, h, 5, generator=gen)
    count, weight = torch.randint(1, 4, (b, m, h), generator=gen).float(), torch.rand(b, m, h, generator=gen)
    dropped = torch.stack([torch.randperm(m, generator=gen)[:n] for _ in range(b * h)]).view(b, h, n).transpose(1, 2)
    ok = torch.ones(b, m, h, dtype=torch.bool).scatter(1, dropped, False)
    ok[:, :2] = False  # the sinks
    whole = merge.merge_into_kept(k, v, count, weight, dropped, ok)
    monkeypatch.setattr(merge, "SIMILARITIES", 2 * b * m * h)  # blocks of two evicted tokens
    for got, want in zip(merge.merge_into_kept(k, v, count, weight, dropped, ok), whole):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert whole[5].any() and whole[1].shape == v.shape


@pytest.mark.parametrize("mode", [None, "cumulative", "normalized"])
def test_log_count_bias_equals_attention_over_copies(mode):
    """A key standing for c tokens with log(c) in its logit draws what c copies of it would: the same output, and its
    probability the sum of theirs (decode and prefill pieces; `merge.attention_bias`)."""
    from kvbound.kernels import causal_attention_batch, decode_with_scores
    gen = torch.Generator().manual_seed(7)
    b, n, t = 2, 6, 3
    k, v = (torch.randn(b, n + t, HKV, D, generator=gen) for _ in range(2))
    count = torch.ones(b, n + t, HKV)
    count[:, 2], count[0, 4, 1] = 3.0, 2.0
    reps = count[0, :, 1].long()  # copy keys by row 0 head 1's counts, the same for every row and head below
    count[:] = reps[None, :, None].float()
    copies = lambda x: x.repeat_interleave(reps, dim=1)  # noqa: E731
    q = torch.randn(b, t, HQ, D, generator=gen)
    out, step = decode_with_scores(q[:, 0], k, v, torch.full((b,), n + t), mode, bias=count.log())
    want, want_step = decode_with_scores(q[:, 0], copies(k), copies(v), torch.full((b,), int(reps.sum())), mode)
    torch.testing.assert_close(out, want)
    if mode == "cumulative":
        summed = torch.zeros_like(step).index_add_(1, torch.arange(n + t).repeat_interleave(reps), want_step)
        torch.testing.assert_close(step, summed)
    # a prefill piece: its own t tokens count once each, the n cached ones as above
    cached = reps[:n]
    kk, vv = (torch.cat([x[:, :n].repeat_interleave(cached, dim=1), x[:, n:]], 1) for x in (k, v))
    out, scores = causal_attention_batch(q, k, v, mode, bias=torch.cat([count[:, :n], torch.ones(b, t, HKV)], 1).log())
    want, want_scores = causal_attention_batch(q, kk, vv, mode)
    torch.testing.assert_close(out, want)
    if mode == "cumulative":
        idx = torch.cat([torch.arange(n).repeat_interleave(cached), torch.arange(n, n + t)])
        torch.testing.assert_close(scores, torch.zeros_like(scores).index_add_(1, idx, want_scores))


def test_biased_prefill_in_chunks_of_sequences_equals_one_call(monkeypatch):
    """A batch of prefill pieces whose biased logits pass `BIASED_ELEMENTS` runs in chunks of sequences: the same
    outputs and scores as one call."""
    import kvbound.kernels.reference as ref
    gen = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(5, 4, HQ, D, generator=gen), torch.randn(5, 10, HKV, D, generator=gen), \
        torch.randn(5, 10, HKV, D, generator=gen)
    bias = torch.rand(5, 10, HKV, generator=gen).log1p()
    whole = ref.causal_attention_batch(q, k, v, "cumulative", bias=bias)
    monkeypatch.setattr(ref, "BIASED_ELEMENTS", 2 * 4 * HQ * 10)  # two sequences a call
    parts = ref.causal_attention_batch(q, k, v, "cumulative", bias=bias)
    for a, b in zip(whole, parts):
        torch.testing.assert_close(a, b)
