"""Batched sampling against simple one-row references on fixed logits."""
import pytest
import torch

from kvbound.engine.sampling import SamplingParams, sample_batch, seeded_uniform
from kvbound.errors import KvboundError

V = 40


def logits_rows(n, seed=0):
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def reference(logits, p, prompt, output, u):
    """One row written out: penalties, temperature, top-k, top-p, min-p, then the inverse CDF at u."""
    x = [float(v) for v in logits]
    for t in range(V):
        n = output.count(t)
        if (n or t in prompt) and p.repetition_penalty != 1:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.presence_penalty * (n > 0) + p.frequency_penalty * n
    if p.temperature == 0:
        return max(range(V), key=lambda t: x[t])
    probs = torch.softmax(torch.tensor(x) / p.temperature, -1).tolist()
    truncated = p.top_k > 0 or p.top_p < 1 or p.min_p > 0
    order = sorted(range(V), key=lambda t: -probs[t]) if truncated else range(V)  # untruncated: token order
    kept, mass = [], 0.0
    for r, t in enumerate(order):
        if (p.top_k > 0 and r >= p.top_k) or mass >= p.top_p or probs[t] < p.min_p * probs[order[0]]:
            break  # probabilities fall along the order, so nothing after this is kept either
        kept.append(t)
        mass += probs[t]
    target, acc = u * sum(probs[t] for t in kept), 0.0
    for t in kept:
        acc += probs[t]
        if acc > target:
            return t
    return kept[-1]


CASES = [SamplingParams(temperature=0.9, seed=1), SamplingParams(temperature=0.7, top_k=5, seed=2),
         SamplingParams(temperature=1.2, top_p=0.6, seed=3), SamplingParams(temperature=1.0, min_p=0.2, seed=4),
         SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05, seed=5),
         SamplingParams(temperature=0.0, repetition_penalty=1.8, presence_penalty=1.0, frequency_penalty=0.7),
         SamplingParams(temperature=0.6, repetition_penalty=1.3, frequency_penalty=0.5, seed=6)]


@pytest.mark.parametrize("p", CASES, ids=range(len(CASES)))
def test_each_option_matches_the_one_row_reference(p):
    logits = logits_rows(30, seed=p.seed or 9)
    prompt, output = [3, 7, 7, 11], [int(t) for t in logits[0].topk(6).indices] + [2, 2]
    for step, row in enumerate(logits):
        out = output[:step % 9]
        (got, _), = sample_batch(row[None], [p], [prompt], [out], [p.seed])
        u = seeded_uniform(p.seed, len(out)) if p.seed is not None else 0.0
        assert got == reference(row, p, prompt, out, u), step


@pytest.mark.parametrize("p", CASES[1:5], ids=range(1, 5))
def test_truncated_rows_beyond_the_candidates_fall_back_to_the_whole_vocabulary(p, monkeypatch):
    import kvbound.engine.sampling as sampling
    monkeypatch.setattr(sampling, "CANDIDATES", 3)  # fewer than top-k / top-p / min-p keep on these logits
    logits = logits_rows(30, seed=p.seed) / 3  # flatter: the kept set is often over 3 tokens
    for step, row in enumerate(logits):
        (got, _), = sample_batch(row[None], [p], [[1]], [[0] * step], [p.seed])
        assert got == reference(row, p, [1], [0] * step, seeded_uniform(p.seed, step)), step


@pytest.mark.parametrize("p", CASES[1:5], ids=range(1, 5))
def test_truncated_rows_within_the_candidates_draw_from_them_alone(p, monkeypatch):
    """Candidates fewer than the vocabulary but enough for the rules: no full sort, the reference's token."""
    import kvbound.engine.sampling as sampling
    monkeypatch.setattr(sampling, "CANDIDATES", 12)
    sorts = []
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **k: sorts.append(1) or torch.sort(self, *a, **k))
    for step, row in enumerate(logits_rows(30, seed=p.seed) * 2):  # sharper: the kept set fits in 12
        (got, _), = sample_batch(row[None], [p], [[1]], [[0] * step], [p.seed])
        assert got == reference(row, p, [1], [0] * step, seeded_uniform(p.seed, step)), step
    assert not sorts


def test_seeded_rows_draw_the_same_alone_and_anywhere_in_a_batch():
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    others = [SamplingParams(temperature=0.8), SamplingParams(), SamplingParams(temperature=1.5, top_k=3)]
    for step in range(20):
        logits = logits_rows(4, seed=step)
        (alone, _), = sample_batch(logits[:1], [p], [[1]], [[0] * step], [42])
        mixed = sample_batch(logits[[1, 2, 0, 3]], [others[0], others[1], p, others[2]], [[1]] * 4,
                             [[0] * step] * 4, [None, None, 42, None])
        assert mixed[2][0] == alone


def test_logprobs_are_the_models_log_softmax():
    logits = logits_rows(3)
    ps = [SamplingParams(logprobs=3), SamplingParams(temperature=0.9, seed=1, logprobs=0), SamplingParams()]
    out = sample_batch(logits, ps, [[1]] * 3, [[]] * 3, [None, 1, None])
    lp = torch.log_softmax(logits, -1)
    tok, info = out[0]
    assert info["logprob"] == pytest.approx(float(lp[0, tok]))
    assert [t for t, _ in info["top"]] == lp[0].topk(3).indices.tolist()
    assert [v for _, v in info["top"]] == pytest.approx(lp[0].topk(3).values.tolist())
    assert out[1][1]["top"] == [] and out[1][1]["logprob"] == pytest.approx(float(lp[1, out[1][0]]))
    assert out[2][1] is None


def test_min_tokens_holds_back_eos_and_stop_tokens():
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 6], logits[0, 7] = 10.0, 9.0, 8.0
    p = SamplingParams(min_tokens=2, stop_token_ids=(6,))
    assert sample_batch(logits, [p], [[1]], [[]], [None], eos_ids={5})[0][0] == 7
    assert sample_batch(logits, [p], [[1]], [[9, 9]], [None], eos_ids={5})[0][0] == 5


@pytest.mark.parametrize("kw, needle", [
    (dict(top_k=-2), "top_k must be"), (dict(min_p=1.5), "min_p must be"),
    (dict(presence_penalty=3.0), "presence_penalty must be"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_tokens=100), "min_tokens must be"), (dict(logprobs=99), "logprobs must be"),
    (dict(stop=("",)), "stop must be"),
    (dict(teacher_tokens=(1, 2, 3), max_tokens=2), "teacher_tokens must be"),
])
def test_bad_sampling_params_are_refused(kw, needle):
    with pytest.raises(KvboundError, match=needle):
        SamplingParams(**kw)
