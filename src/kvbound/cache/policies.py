"""Eviction policies: which cached tokens to keep when the cache is over its budget.

Every policy follows `Policy` (below). Ties on score keep the newer token. The scored policies share H2O's
keep rule (sinks, pinned spans and a recent window protected, the highest-ranked others kept) and differ
in the score: accumulated attention (h2o), the same divided by the queries that could see each key
(ObservedAttention), the current step's attention only (TOVA), an observation window's pooled attention in
prefill (SnapKV), or the key alone (KNorm: its norm; KeyDiff: how unlike the other keys it is; no attention
needed). AdaKV and PyramidKV keep SnapKV's score and change who gets the budget: a layer's heads share it by
rank (AdaKV), or deeper layers get less of it (PyramidKV), the total unchanged (`head_budgets`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from ..errors import KvboundError

SCORES = ("cumulative", "ema", "normalized", "observed")
# what an evicted token is merged by (`H2OPolicy.merge`): its rank, or the tokens each key stands for
MERGES = ("rank", "count")
# how each score folds a step's attention probabilities in (the kernels' score modes): "last" keeps only the
# newest step's (an EMA that forgets at once), "key-norm" takes none
FOLDS = {"cumulative": "cumulative", "ema": "ema", "normalized": "normalized", "observed": "cumulative",
         "last": "ema", "key-norm": None, "key-diff": None}
GRANULARITIES = ("kv-head", "layer")
# who shares a budget of heads x budget tokens a layer (`H2OPolicy.layers`): each layer its own ("equal"), or every
# layer's heads together, by one ranking of the model's entries ("global": KVzip's own budgets)
LAYER_SHARES = ("equal", "global")


def _check_nonneg(**kw):
    for k, v in kw.items():
        if not isinstance(v, int) or v < 0:
            raise KvboundError(f"policy: {k} must be a non-negative integer, got {v!r}")


def _check_spans(spans):
    out = []
    for s in spans:
        try:
            a, b = (int(x) for x in s)
        except (TypeError, ValueError):
            raise KvboundError(f"policy: pinned span {s!r} must be (start, end)") from None
        if a < 0 or b <= a:
            raise KvboundError(f"policy: pinned span {s!r} must satisfy 0 <= start < end")
        out.append((a, b))
    return tuple(out)


def _protected_base(pos: torch.Tensor, sink: int, pinned) -> torch.Tensor:
    prot = pos < sink
    for a, b in pinned:
        prot |= (pos >= a) & (pos < b)
    return prot


def _protected_words(sink: int, pinned, count: int) -> str:
    """How many tokens sinks and pinned spans protect, in words that add up (spans may overlap the sinks)."""
    if not pinned:
        return f"sink ({sink})"
    spans = ", ".join(f"[{a}, {b})" for a, b in pinned)
    return f"sink ({sink}) and pinned {spans} protect {count} tokens, which"


def pinned_count(sink: int, pinned) -> int:
    marked = set(range(sink))
    for a, b in pinned:
        marked.update(range(a, b))
    return len(marked)


def lowest(pos: torch.Tensor, rank: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
    """Per column, the index of the unprotected token with the lowest rank (the oldest among ties): the one
    `select_keep` drops when exactly one token must go. Cheaper than sorting, for the decode step.
    [M, H] -> [H], or batched [B, M, H] -> [B, H]."""
    key = rank.float().masked_fill(protected, float("inf"))
    tied = key == key.min(-2, keepdim=True).values
    return torch.where(tied, pos, torch.iinfo(pos.dtype).max).argmin(-2)


def newest(pos: torch.Tensor) -> torch.Tensor:
    """The newest position held, per sequence: a scalar for [M, H], [B, 1, 1] for a batch [B, M, H]."""
    return pos.max() if pos.dim() == 2 else pos.flatten(1).amax(1)[:, None, None]


def _shared_order(pos, rank, protected, owner, heads: int):
    """The keep order of places [..., E] owned by KV heads (protected first, then by rank, newer first among
    ties) as indices, and each place's 1-based rank within its head in that order."""
    key = rank.float().masked_fill(protected, float("inf"))
    by_age = pos.argsort(dim=-1, descending=True, stable=True)
    order = by_age.gather(-1, key.gather(-1, by_age).argsort(dim=-1, descending=True, stable=True))
    own = owner.gather(-1, order).long().clamp(min=0)  # a graph's padding row holds free places (-1)
    # [..., heads, E], not one_hot (which syncs to check its input); heads first, as a scan along the last dim
    # runs in parallel, where one along E for each of a few head columns ran 5.7 ms a layer at 32k places (H200)
    mine = own[..., None, :] == torch.arange(heads, device=own.device)[:, None]
    return order, mine.cumsum(-1).gather(-2, own[..., None, :])[..., 0, :]


def select_shared(pos: torch.Tensor, rank: torch.Tensor, protected: torch.Tensor, owner: torch.Tensor, heads: int,
                  guaranteed: int, total: int) -> torch.Tensor:
    """`select_keep` over a layer's entries [..., E], each owned by a KV head (`owner`; -1: no entry, never kept):
    every protected entry, then each head's highest-ranked up to `guaranteed` entries, then the highest-ranked others
    up to `total` in all (newer wins ties). Protected entries must fit in each head's `guaranteed`."""
    held = owner >= 0
    rank = torch.where(held, rank.float(), float("-inf"))  # no entry: last in the order, after every held one
    order, place = _shared_order(pos, rank, protected & held, owner, heads)
    sure = (place <= guaranteed) & held.gather(-1, order)
    rest = ~sure & held.gather(-1, order)
    take = sure | (rest & (rest.cumsum(-1) <= total - sure.sum(-1, keepdim=True)))
    return torch.zeros_like(protected).scatter_(-1, order, take)


def shared_victims(pos: torch.Tensor, rank: torch.Tensor, protected: torch.Tensor, owner: torch.Tensor, heads: int,
                   guaranteed: int) -> torch.Tensor:
    """Per row of a batch of layers' places [B, E] holding heads x share + heads tokens: the `heads` places that
    `select_shared` would drop (the lowest-ranked past each head's `guaranteed`, the oldest among ties) -> [B, heads],
    with no host sync."""
    held = owner >= 0  # free places (a plan's padding past its layer's rows, a graph's padding row) are no victims
    order, place = _shared_order(pos, torch.where(held, rank.float(), float("-inf")), protected & held, owner, heads)
    rest = (place > guaranteed) & held.gather(-1, order)
    last = rest & (rest.flip(1).cumsum(1).flip(1) <= heads)  # the last `heads` of the rest, in keep order
    at = torch.where(last, torch.arange(pos.shape[1], device=pos.device), -1).topk(heads, -1).indices
    return order.gather(1, at)


def select_keep(pos: torch.Tensor, rank: torch.Tensor, protected: torch.Tensor, budget: int) -> torch.Tensor:
    """Keep every protected token, then the highest-`rank` others up to `budget` per column (newer wins ties).
    [M, H], or batched [B, M, H]."""
    key = rank.float().masked_fill(protected, float("inf"))
    by_age = pos.argsort(dim=-2, descending=True, stable=True)
    by_key = key.gather(-2, by_age).argsort(dim=-2, descending=True, stable=True)
    chosen = by_age.gather(-2, by_key.narrow(-2, 0, budget))
    return torch.zeros_like(protected).scatter_(-2, chosen, True)


class Policy:
    """What the cache, the engine and the kernels ask of a policy. The dataclasses below set the fields:
      - `budget` (None = unbounded) and `evict_every`: the cache holds at most budget + evict_every - 1
        tokens and, when that would be exceeded, evicts down to `budget`;
      - `score`: "cumulative" | "ema" | "normalized", or None when it needs no attention scores; `granularity`
        "kv-head" (each KV head keeps its own tokens) or "layer" (one choice per layer);
      - `sink` first tokens and `pinned` spans that are never evicted, `recent` newest tokens kept (0 and ()
        where a policy has none);
      - `keep_mask(pos, score)`: given candidate tokens' stream positions and scores, [M, H] each (one
        column per KV head; batched [B, M, H]), a bool mask keeping exactly `budget` tokens per column;
      - `victim(pos, score)`: the same choice when exactly one token per column must go, without sorting;
      - `merge`: None (an evicted token is dropped), or how an evicted token is averaged into its most similar kept
        key (`cache.merge`): "rank" weighs each by its rank, "count" by the tokens each stands for."""
    budget: int | None
    evict_every: int
    score: str | None
    granularity: str
    sink: int
    recent: int
    pinned: tuple
    ema_decay: float  # the "ema" score's decay
    merge: str | None = None
    reconstructs = False  # scores its prompt at once by reading it twice (KVzip, `cache.reconstruct`)

    @property
    def bounded(self) -> bool:
        return self.budget is not None

    @property
    def capacity(self) -> int | None:
        """Slots a bounded cache needs: budget + evict_every (the last one is the spare slot a decoded
        token is written into before the victim leaves); None when unbounded."""
        return None if self.budget is None else self.budget + self.evict_every

    @property
    def needs_plan(self) -> bool:
        """Whether its layers' budgets wait for a prompt's scores (kvzip's layers=global, `H2OPolicy.plan`)."""
        return False

    @property
    def unplanned(self) -> "Policy":
        """The policy a plan of layer budgets came from (itself if none): the caches of its plans batch together."""
        return self

    def reads_again(self, context):
        """Whether a prompt-scoring policy (KVzip) reads a context of this many tokens a second time: one past the
        bounded cache's room; one within it is kept as it is. (A tensor of lengths gives a mask.)"""
        return self.reconstructs and context >= self.capacity

    @property
    def protected_prefix(self) -> int:
        """Length of the run of positions [0, P) that the policy never evicts (sinks and pinned spans)."""
        p = self.sink
        for a, b in sorted(self.pinned):
            if a <= p:
                p = max(p, b)
        return p

    def fused_protection(self) -> tuple[int, int] | None:
        """(prefix, recent) when the protected tokens are positions [0, prefix) plus the `recent` newest,
        the form the fused evict kernels take; None for pinned spans past the protected prefix."""
        prefix = self.protected_prefix
        if any(b > prefix for _, b in self.pinned):
            return None
        return prefix, self.recent

    @property
    def rank_source(self) -> str:
        """What the keep rule ranks by, as the fused evict kernels name it: "attention" (the folded scores),
        "age" (ObservedAttention: the folded scores over each key's age), or "key-norm" / "key-diff" (from
        the keys as the store reads them back)."""
        if self.score == "observed":
            return "age"
        return self.score if self.score in ("key-norm", "key-diff") else "attention"

    @property
    def fold(self) -> str | None:
        """The attention kernels' score mode for this policy (None: it needs no attention probabilities)."""
        return FOLDS.get(self.score)

    @property
    def fold_decay(self) -> float:
        return 0.0 if self.score == "last" else self.ema_decay

    @property
    def score_window(self) -> int | None:
        """In a prefill piece, only the last this many queries' attention scores the keys (None: all)."""
        return None

    def rank(self, pos: torch.Tensor, score: torch.Tensor | None) -> torch.Tensor | None:
        """What the keep rule sorts by, from the stored scores: ObservedAttention divides each key's summed
        attention by the number of queries that could see it (its age + 1)."""
        if self.score == "observed":
            return score / (newest(pos) - pos + 1).clamp(min=1)
        return score

    def mergeable(self, pos: torch.Tensor) -> torch.Tensor:
        """Held tokens that may take an evicted token's key and value (`cache.merge`): not the sinks or pinned
        spans, which stay as they came."""
        return (pos >= 0) & ~_protected_base(pos, self.sink, self.pinned)

    @property
    def scores_keys(self) -> bool:
        """Whether a new token's score starts from its key (`key_score`) instead of 0."""
        return self.score == "key-norm"

    def key_score(self, k: torch.Tensor) -> torch.Tensor:
        """A new token's starting score from its key, k [..., H, D] -> [..., H]."""
        return -k.float().norm(dim=-1)  # KNorm keeps the keys of lowest L2 norm

    @property
    def rescores(self) -> bool:
        """Whether every held token's score is recomputed from all held keys (`rescore`) before each eviction."""
        return self.score == "key-diff"

    def rescore(self, k: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """KeyDiff's score of each key, k [..., M, H, D] with `valid` [..., M, H] marking the held ones: minus
        its cosine similarity to the anchor, the mean of the valid keys' unit vectors, per head -> [..., M, H]."""
        unit = F.normalize(k.float(), dim=-1)
        anchor = F.normalize((unit * valid[..., None]).sum(-3, keepdim=True), dim=-1)
        return -(unit * anchor).sum(-1)

    def piece_scores(self, old: torch.Tensor, step: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Scores after a prefill piece whose probabilities are `step` (both [..., M, H])."""
        from ..kernels import fold_scores
        return fold_scores(old, step, self.fold, self.fold_decay)

    @property
    def adapts(self) -> bool:
        """Whether heads or layers keep different numbers of tokens (`head_budgets`), which needs a cache that
        stores a layer's tokens as entries owned by heads (`AdaptiveKVCache`)."""
        return False

    @property
    def layered(self) -> bool:
        """Whether layers keep different numbers of tokens (PyramidKV's `beta`, or a layers=global plan's `shares`)."""
        return False

    def at_layer(self, layer: int, layers: int) -> "Policy":
        """The policy one layer of `layers` runs where each layer is a cache of its own (transformers' layers)."""
        return self

    def head_budgets(self, layer: int, layers: int) -> tuple[int, int]:
        """(tokens each KV head of `layer` is sure to keep, the layer's budget per head): the layer keeps
        heads x the second, its heads sharing what is past the first by rank."""
        return self.budget, self.budget

    def keep_mask(self, pos: torch.Tensor, score: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def victim(self, pos: torch.Tensor, score: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class FullPolicy(Policy):
    """No bound: the baseline."""
    name: str = "full"
    budget: None = None
    evict_every: int = 1
    score: None = None
    granularity: str = "kv-head"
    sink: int = field(default=0, init=False, repr=False)
    recent: int = field(default=0, init=False, repr=False)
    pinned: tuple = field(default=(), init=False, repr=False)
    ema_decay: float = field(default=0.95, init=False, repr=False)

    def describe(self) -> str:
        return "full"


@dataclass(frozen=True)
class WindowPolicy(Policy):
    """`sink` first tokens (+ pinned spans) and the most recent tokens up to `budget` (StreamingLLM)."""
    budget: int
    sink: int = 4
    evict_every: int = 1
    pinned: tuple = field(default_factory=tuple)
    name: str = "window"
    score: None = None
    granularity: str = "layer"
    recent: int = field(default=0, init=False, repr=False)  # protection is by position already
    ema_decay: float = field(default=0.95, init=False, repr=False)

    def __post_init__(self):
        _check_nonneg(budget=self.budget, sink=self.sink)
        if self.evict_every < 1:
            raise KvboundError(f"policy: evict_every must be >= 1, got {self.evict_every}")
        object.__setattr__(self, "pinned", _check_spans(self.pinned))
        protected = pinned_count(self.sink, self.pinned)
        if protected >= self.budget:
            raise KvboundError(f"window: {_protected_words(self.sink, self.pinned, protected)} must be < budget "
                               f"({self.budget})")

    def keep_mask(self, pos, score):
        return select_keep(pos, pos, _protected_base(pos, self.sink, self.pinned), self.budget)

    def victim(self, pos, score):
        return lowest(pos, pos, _protected_base(pos, self.sink, self.pinned))

    def describe(self) -> str:
        every = f",evict_every={self.evict_every}" if self.evict_every > 1 else ""
        return f"window(budget={self.budget},sink={self.sink}{every})"


@dataclass(frozen=True)
class H2OPolicy(Policy):
    """Heavy-hitter oracle: sinks + pinned spans + `recent` newest tokens + the highest-scored others.

    Pinned tokens count against the budget: heavy hitters fill what sinks, pins and the window leave.
    Adaptive budgets, for this and every policy below (`head_budgets`):
      - `alpha` (AdaKV): a layer keeps heads x budget tokens, its KV heads sharing them by rank (scores are
        comparable across heads), so a head that spreads its attention keeps more than one that looks at few
        keys; each head is sure of its protected tokens plus `alpha` of the rest of its equal share;
      - `beta` (PyramidKV): heavy hitters per layer fall linearly with depth (`pyramid`, steeper for larger
        beta), on the finding that attention narrows in deeper layers; the total over layers is unchanged;
      - `layers="global"` (KVzip's budgets, a policy that scores a whole prompt at once): the model's heads x
        layers x budget places go to the best-scored entries wherever they are, each head of each layer sure of its
        protected tokens only (`global_shares`); a layer's budget is then fixed for the sequence's decodes.
    """
    sink: int
    heavy: int
    recent: int
    score: str = "cumulative"
    ema_decay: float = 0.95
    granularity: str = "kv-head"
    evict_every: int = 1
    pinned: tuple = field(default_factory=tuple)
    alpha: float | None = None
    beta: float | None = None
    merge: str | None = None
    layers: str = "equal"
    shares: tuple | None = None  # layers=global: each layer's budget, planned from one prompt's scores (`plan`)
    name: str = "h2o"
    score_choices = SCORES

    def __post_init__(self):
        _check_nonneg(sink=self.sink, heavy=self.heavy, recent=self.recent)
        if self.score not in self.score_choices:
            raise KvboundError(f"{self.name}: unknown score {self.score!r} (choose from "
                               f"{', '.join(self.score_choices)})")
        if self.granularity not in GRANULARITIES:
            raise KvboundError(f"{self.name}: unknown granularity {self.granularity!r} (choose from "
                               f"{', '.join(GRANULARITIES)})")
        if not 0.0 < float(self.ema_decay) < 1.0:
            raise KvboundError(f"{self.name}: ema-decay must be in (0, 1), got {self.ema_decay}")
        if self.evict_every < 1:
            raise KvboundError(f"policy: evict_every must be >= 1, got {self.evict_every}")
        if self.budget < 1:
            raise KvboundError(f"{self.name}: budget (sink + heavy + recent) must be at least 1")
        object.__setattr__(self, "pinned", _check_spans(self.pinned))
        protected = pinned_count(self.sink, self.pinned)
        if protected + self.recent > self.budget:
            raise KvboundError(f"{self.name}: {_protected_words(self.sink, self.pinned, protected)} plus recent "
                               f"{self.recent} = {protected + self.recent} exceeds budget ({self.budget})")
        if self.alpha is not None and not 0.0 <= float(self.alpha) <= 1.0:
            raise KvboundError(f"{self.name}: alpha must be in [0, 1], got {self.alpha}")
        if self.beta is not None and not float(self.beta) >= 1.0:
            raise KvboundError(f"{self.name}: beta must be >= 1, got {self.beta}")
        self._check_layers()
        if self.adapts and self.granularity != "kv-head":
            raise KvboundError(f"{self.name}: alpha and beta give heads and layers budgets of their own, so "
                               "granularity must be kv-head")
        self._check_merge()

    def _check_layers(self):
        """layers=global ranks every head of every layer together, so its heads share budgets too (alpha 0)."""
        if self.layers not in LAYER_SHARES:
            raise KvboundError(f"{self.name}: unknown layers {self.layers!r} (choose from {', '.join(LAYER_SHARES)})")
        if self.layers == "equal":
            if self.shares is not None:
                raise KvboundError(f"{self.name}: layer shares are planned with layers=global")
            return
        if not self.reconstructs:
            raise KvboundError(f"{self.name}: layers=global shares a budget across layers by a whole prompt's "
                               "scores, which only kvzip gives")
        if self.beta is not None or (self.alpha or 0.0) != 0.0:
            raise KvboundError(f"{self.name}: layers=global ranks every head of every layer together; leave out "
                               f"alpha (or give 0) and beta, got alpha={self.alpha}, beta={self.beta}")
        object.__setattr__(self, "alpha", 0.0)

    def _check_merge(self):
        if self.merge is None:
            return
        if self.merge not in MERGES:
            raise KvboundError(f"{self.name}: unknown merge {self.merge!r} (choose from {', '.join(MERGES)}, or none)")
        if self.merge == "rank" and self.rank_source.startswith("key"):
            raise KvboundError(f"{self.name}: merge=rank weighs tokens by attention, which {self.name} does not "
                               "gather: use merge=count")
        if self.adapts:
            raise KvboundError(f"{self.name}: merge runs with equal budgets (no alpha or beta)")

    @property
    def budget(self) -> int:
        return self.sink + self.heavy + self.recent

    def _protected(self, pos):
        return _protected_base(pos, self.sink, self.pinned) | (pos > newest(pos) - self.recent)

    def keep_mask(self, pos, score):
        return select_keep(pos, self.rank(pos, score), self._protected(pos), self.budget)

    def victim(self, pos, score):
        return lowest(pos, self.rank(pos, score), self._protected(pos))

    @property
    def adapts(self) -> bool:
        return self.alpha is not None or self.beta is not None

    @property
    def layered(self) -> bool:
        return self.beta is not None or self.shares is not None

    @property
    def needs_plan(self) -> bool:
        """layers=global before a prompt's scores have set each layer's budget (`plan`)."""
        return self.layers == "global" and self.shares is None

    @property
    def unplanned(self) -> "H2OPolicy":
        return self if self.shares is None else replace(self, shares=None)

    def plan(self, score: torch.Tensor) -> "H2OPolicy":
        """layers=global: this policy with each layer's budget fixed by one prompt's scores [layers, n, heads]
        (`global_shares`). Its caches lay their layers out as PyramidKV's schedule does; sequences of one plan batch."""
        layers, n, _ = score.shape
        protected = self._protected(torch.arange(n, device=score.device)[:, None])[:, 0]
        return replace(self, shares=tuple(global_shares(score, protected, *self.head_budgets(0, layers))))

    def at_layer(self, layer, layers):
        """PyramidKV's layer as an equal-heads policy of its own: its heavy hitters from the schedule."""
        if self.beta is None:
            return self
        return replace(self, heavy=pyramid(self.heavy, self.beta, layers)[layer], beta=None)

    def head_budgets(self, layer, layers):
        if self.shares is not None:
            return pinned_count(self.sink, self.pinned) + self.recent, self.shares[layer]
        share = self.budget if self.beta is None else (self.budget - self.heavy
                                                       + pyramid(self.heavy, self.beta, layers)[layer])
        if self.alpha is None:
            return share, share
        protected = pinned_count(self.sink, self.pinned) + self.recent
        return protected + int(self.alpha * max(0, share - protected)), share

    def keep_entries(self, pos, score, owner, heads: int, guaranteed: int, total: int) -> torch.Tensor:
        """The keep rule over a layer's entries [E], or a batch of layers' [B, E], owned by heads (`select_shared`)."""
        col = pos[..., None]  # one column: protection and rank see the whole layer's newest position
        return select_shared(pos, self.rank(col, score[..., None])[..., 0], self._protected(col)[..., 0], owner, heads,
                             guaranteed, total)

    def entry_victims(self, pos, score, owner, heads: int, guaranteed: int) -> torch.Tensor:
        """The same rule for a batch of layers' places [B, E] one step over budget: the `heads` places it drops."""
        col = pos[..., None]  # [B, E, 1]: each row's newest position
        return shared_victims(pos, self.rank(col, score[..., None])[..., 0], self._protected(col)[..., 0], owner,
                              heads, guaranteed)

    def describe(self) -> str:
        adaptive = "".join(f",{k}={getattr(self, k)}" for k in ("alpha", "beta", "merge")
                           if getattr(self, k) is not None)
        adaptive += f",layers={self.layers}" if self.layers != "equal" else ""
        adaptive += f",evict_every={self.evict_every}" if self.evict_every > 1 else ""
        return (f"{self.name}(sink={self.sink},heavy={self.heavy},recent={self.recent},score={self.score},"
                f"granularity={self.granularity}{adaptive})")


@dataclass(frozen=True)
class TOVAPolicy(H2OPolicy):
    """TOVA: keep the tokens the current step attends to most (each step's attention replaces the last; in a
    prefill piece, the attention of its last query, as TOVA's own token-by-token rule would leave it and as
    kvpress's press scores). As in the paper and kvpress, the layer's heads average their attention and keep
    the same tokens: head by head, SmolLM2 lost every single needle at 1k, keep 0.25
    (results/ruler_tova_granularity.log). No recent window unless asked for. Adaptive budgets (alpha, beta) are
    per head, so they default to kv-head."""
    recent: int = 0
    score: str = "last"
    granularity: str | None = None  # "layer", or "kv-head" with alpha or beta
    name: str = "tova"
    score_choices = ("last",)

    def __post_init__(self):
        if self.granularity is None:
            object.__setattr__(self, "granularity", "kv-head" if self.adapts else "layer")
        super().__post_init__()

    @property
    def score_window(self) -> int:
        return 1


@dataclass(frozen=True)
class KeyNormPolicy(H2OPolicy):
    """KNorm: keep the keys of lowest L2 norm (low-norm keys draw the most attention). Scored once, when a
    token is written, from its key: no attention probabilities, so any attention kernel serves it."""
    score: str = "key-norm"
    name: str = "knorm"
    score_choices = ("key-norm",)


@dataclass(frozen=True)
class KeyDiffPolicy(H2OPolicy):
    """KeyDiff: keep the keys least like the rest (lowest cosine similarity to the mean unit key of the cache,
    per head): distinctive keys draw attention. Before each eviction every held key is scored against the
    anchor of all the held and new keys; no attention probabilities, so any attention kernel serves it."""
    score: str = "key-diff"
    name: str = "keydiff"
    score_choices = ("key-diff",)


@dataclass(frozen=True)
class SnapKVPolicy(H2OPolicy):
    """SnapKV: in each prefill piece, keys are scored by the attention of the piece's last `window` queries,
    averaged over `kernel` neighbouring positions (the question at the end of a prompt picks what stays);
    the window itself is kept (recent >= window by default). Decode then accumulates attention as H2O."""
    window: int = 32
    kernel: int = 5
    name: str = "snapkv"
    score_choices = ("cumulative", "ema")

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise KvboundError(f"snapkv: window must be >= 1 and kernel an odd number >= 1, got window="
                               f"{self.window}, kernel={self.kernel}")

    @property
    def score_window(self) -> int:
        return self.window

    def piece_scores(self, old, step, pos):
        """The window's probabilities, pooled along stream order, replace the piece's candidates' scores. Entries at
        position -1 (none: another head's place, `steps.piece_places`) go last in that order, count for nothing in the
        pool and keep their old scores; with none of them the pool is avg_pool's alone."""
        held = pos >= 0
        order = torch.where(held, pos, torch.iinfo(pos.dtype).max).argsort(dim=-2)

        def pooled(x):  # [..., M, H] in stream order, pooled along it
            by_pos = x.gather(-2, order).movedim(-2, -1)  # [..., H, M]
            shape = by_pos.shape
            return F.avg_pool1d(by_pos.reshape(-1, 1, shape[-1]), self.kernel, 1, self.kernel // 2,
                                count_include_pad=False).reshape(shape).movedim(-1, -2)
        mean = pooled(step * held) / pooled(held.to(step.dtype))  # exactly avg_pool's when every entry is held
        return torch.where(held, torch.empty_like(mean).scatter_(-2, order, mean), old)

    def describe(self) -> str:
        return super().describe()[:-1] + f",window={self.window},kernel={self.kernel})"


@dataclass(frozen=True)
class KVzipPolicy(H2OPolicy):
    """KVzip (Kim et al., 2025): the prompt's tokens are scored once, after it, by the most attention the model
    gives each while it reads the prompt again right after itself (`cache.reconstruct`): what the model needs to
    reproduce the context stays, whatever question follows. The pass holds the prompt in a full cache meanwhile
    and reads it a second time (`engine.generate.prefill` on a sequence's own cache; in the engine, in pool blocks,
    `LLMEngine._start_reading`); with a `question_start`, the context before the question is scored and the
    question read after. Decoding then accumulates attention as H2O. With `alpha`, a layer's heads share its budget
    by these scores (AdaKV's rule; KVzip's own budgets are uneven across heads too). `chunk`: as KVzip and kvpress
    read it (2,048 there), the context is scored in blocks of this many tokens, each by its own reading over the
    sinks, itself and the reading's tokens, so a block's tokens compete among themselves; 0 (the default): the whole
    context at once, one attention pass a piece instead of two. On Qwen's RULER at 4k, 2,048-token blocks scored
    the same mean (RESULTS.md, "KVzip's blocks")."""
    chunk: int = 0
    name: str = "kvzip"
    score_choices = ("cumulative", "ema")
    reconstructs = True

    def __post_init__(self):
        super().__post_init__()
        if self.chunk < 0:
            raise KvboundError(f"kvzip: chunk must be >= 0 (0: the whole context), got {self.chunk}")

    def describe(self) -> str:
        return super().describe()[:-1] + (f",chunk={self.chunk})" if self.chunk else ")")


def global_shares(score: torch.Tensor, protected: torch.Tensor, sure: int, share: int) -> list[int]:
    """Each layer's budget (place rows of `heads` entries) under layers=global: of the prompt's unprotected entries
    (score [layers, n, heads]; protected [n], the tokens every head keeps anyway, `sure` of them), the layers x
    heads x (share - sure) best scored are kept wherever they are. A layer's count is rounded to whole rows, the
    rows left over going to the largest remainders, so the rows still sum to layers x share."""
    layers, n, heads = score.shape
    free = score.float().masked_fill(protected[None, :, None], -math.inf).flatten()
    chosen = free.topk(layers * heads * (share - sure)).indices // (n * heads)
    rows = torch.bincount(chosen, minlength=layers).double() / heads
    whole = rows.floor().long()
    left = layers * (share - sure) - int(whole.sum())
    whole[(rows - whole).argsort(descending=True, stable=True)[:left]] += 1
    return [sure + int(r) for r in whole]


def refuse_prompt_scoring(policy, where: str):
    """One line for a policy that scores a whole prompt at once (KVzip) where tokens come a piece at a time."""
    if policy is not None and policy.reconstructs:
        raise KvboundError(f"{policy.name} scores a whole prompt at once, reading it twice (kvbound generate / serve, "
                           f"the engine, eval ruler / needle, engine.generate.prefill, or transformers' generate() "
                           f"under kvbound.hf); {where} does not run it")


def pyramid(heavy: int, beta: float, layers: int) -> list[int]:
    """PyramidKV's schedule: heavy hitters per layer falling linearly from 2*heavy - heavy/beta in the first
    layer to heavy/beta in the last, rounded down, the remainder going to the largest fractions (still
    non-increasing), so that they sum to layers * heavy."""
    low = heavy / beta
    step = 0.0 if layers == 1 else 2 * (heavy - low) / (layers - 1)
    share = [2 * heavy - low - step * i for i in range(layers)]
    out = [math.floor(x) for x in share]
    for i in sorted(range(layers), key=lambda i: out[i] - share[i])[:heavy * layers - sum(out)]:
        out[i] += 1
    return out


@dataclass(frozen=True)
class AdaKVPolicy(SnapKVPolicy):
    """AdaKV over SnapKV's scores (Ada-SnapKV): the layer's heads share its budget, each sure of `alpha` of
    its own share (`H2OPolicy.alpha`)."""
    alpha: float | None = 0.2
    name: str = "adakv"


@dataclass(frozen=True)
class PyramidKVPolicy(SnapKVPolicy):
    """PyramidKV over SnapKV's scores: deeper layers keep fewer heavy hitters (`H2OPolicy.beta`)."""
    beta: float | None = 20.0
    name: str = "pyramidkv"


NAMED = ("window", "h2o", "h2o-balanced", "h2o-heavy", "observed", "observed-merge", "tova", "snapkv", "knorm",
         "keydiff", "adakv", "pyramidkv", "kvzip")  # "h2o" is h2o-heavy
SCORED = {"h2o": H2OPolicy, "tova": TOVAPolicy, "snapkv": SnapKVPolicy, "knorm": KeyNormPolicy,
          "keydiff": KeyDiffPolicy, "adakv": AdaKVPolicy, "pyramidkv": PyramidKVPolicy, "kvzip": KVzipPolicy}
_H2O_KEYS = ("budget", "sink", "heavy", "recent", "score", "ema_decay", "granularity", "evict_every", "alpha",
             "beta", "merge")
SPEC_KEYS = {"full": (), "window": ("budget", "sink", "evict_every"), "h2o": _H2O_KEYS,
             "tova": ("budget", "sink", "heavy", "recent", "granularity", "evict_every", "alpha", "beta", "merge"),
             "snapkv": _H2O_KEYS + ("window", "kernel"), "adakv": _H2O_KEYS + ("window", "kernel"),
             "pyramidkv": _H2O_KEYS + ("window", "kernel"),
             "knorm": ("budget", "sink", "heavy", "recent", "granularity", "evict_every", "alpha", "beta", "merge"),
             "keydiff": ("budget", "sink", "heavy", "recent", "granularity", "evict_every", "alpha", "beta", "merge"),
             "kvzip": ("budget", "sink", "heavy", "recent", "score", "ema_decay", "alpha", "layers", "chunk")}


def named_policy(name: str, budget: int | None, pinned=()):
    """The evaluation's named strategies, scaled to `budget` (their shapes are given at budget 256): 4 sinks,
    then half the budget heavy and the rest recent (h2o-heavy, observed, observed-merge, knorm), a quarter heavy
    (h2o-balanced), no recent window (tova), or a recent window of SnapKV's observation window (snapkv, adakv,
    pyramidkv, keydiff, kvzip). observed-merge is observed whose evicted tokens are merged by rank (`cache.merge`)."""
    if name in ("baseline", "full"):
        return FullPolicy()
    if name not in NAMED:
        raise KvboundError(f"unknown policy {name!r} (choose from {', '.join(('full',) + NAMED)}, or a spec like "
                           "'h2o:sink=4,heavy=128,recent=124')")
    if budget is None:
        raise KvboundError(f"policy {name!r} needs a budget: add --budget N (KV tokens kept per layer), or give a "
                           "spec like 'h2o:sink=4,heavy=128,recent=124'")
    if name == "window":
        return WindowPolicy(budget=budget, sink=4, pinned=pinned)
    if budget <= 4:
        raise KvboundError(f"budget {budget} is too small for {name!r}, which keeps 4 sink tokens: use a budget "
                           "of at least 5, or a spec with fewer sinks")
    pins = pinned_count(4, _check_spans(pinned))
    if name == "tova":
        return TOVAPolicy(sink=4, heavy=budget - 4, recent=0, pinned=pinned)
    if name in ("snapkv", "adakv", "pyramidkv", "keydiff", "kvzip"):
        # KeyDiff too: with half its budget in the window it kept 41% on Qwen RULER at 4k, keep 0.5, with
        # SnapKV's 32-token window 55% (results/ruler_qwen_4k_h100_05_onepiece.log)
        window = max(1, min(32, (budget - 4) // 4))
        recent = max(0, min(window, budget - pins))
        if name in ("keydiff", "kvzip"):
            return SCORED[name](sink=4, heavy=budget - 4 - recent, recent=recent, pinned=pinned)
        return SCORED[name](sink=4, heavy=budget - 4 - recent, recent=recent, window=window, pinned=pinned)
    heavy = min(budget - 4, round(budget * (64 if name == "h2o-balanced" else 128) / 256))
    # pinned tokens count against the budget: the recent window gives way to them, heavy hitters fill the rest
    recent = max(0, min(budget - 4 - heavy, budget - pins))
    if name == "knorm":
        return KeyNormPolicy(sink=4, heavy=budget - 4 - recent, recent=recent, pinned=pinned)
    observed = name.startswith("observed")
    return H2OPolicy(sink=4, heavy=budget - 4 - recent, recent=recent, pinned=pinned,
                     score="observed" if observed else "cumulative", merge="rank" if name == "observed-merge" else None)


def parse_policy(spec: str, budget: int | None = None, pinned=(), exact: bool = False, **defaults):
    """`_parse_policy`; with `exact` (a budget the user asked for: --budget, kv_budget), a spec whose own shape keeps
    another number of tokens is refused, never run at its own size."""
    policy = _parse_policy(spec, budget, pinned, **defaults)
    if exact and budget is not None and policy.bounded and policy.budget != budget:
        raise KvboundError(f"budget {budget} != the {policy.budget} tokens that {spec!r} keeps (sink + heavy + "
                           "recent): give the budget or the shape, not both")
    return policy


def _parse_policy(spec: str, budget: int | None = None, pinned=(), **defaults):
    """'full' | 'window[:budget=..,sink=..]' | 'h2o:sink=..,heavy=..,recent=..[,score=..,granularity=..,
    ema_decay=..,evict_every=..,alpha=..,beta=..,merge=rank|count|none]' (and tova / knorm / keydiff /
    snapkv[:..,window=..,kernel=..] / adakv / pyramidkv with the same shape options; kvzip with its shape, score,
    ema_decay, alpha, layers=equal|global and chunk) | a named strategy ('baseline', 'window', 'h2o-balanced',
    'h2o-heavy', 'observed', 'observed-merge', 'tova', 'snapkv', 'knorm', 'keydiff', 'adakv', 'pyramidkv', 'kvzip')."""
    spec = spec.strip()
    if ":" not in spec:
        pol = named_policy(spec, budget, pinned)
        return _with(pol, defaults)
    kind, _, args = spec.partition(":")
    if kind not in SPEC_KEYS:
        raise KvboundError(f"unknown policy {kind!r} in {spec!r} (choose from {', '.join(SPEC_KEYS)})")
    kw = {}
    for item in filter(None, args.split(",")):
        key, eq, val = item.partition("=")
        if not eq:
            raise KvboundError(f"policy spec {spec!r}: expected key=value, got {item!r}")
        key = key.strip().replace("-", "_")
        if key not in SPEC_KEYS[kind]:
            raise KvboundError(f"policy spec {spec!r}: unknown option {key!r} for {kind} (options: "
                               f"{', '.join(SPEC_KEYS[kind]) or 'none'})")
        try:
            text = key in ("score", "granularity", "merge", "layers")
            kw[key] = float(val) if key in ("ema_decay", "alpha", "beta") else (val if text else int(val))
            if text and not val:
                raise ValueError
            if key == "merge" and val == "none":
                kw[key] = None
        except ValueError:
            raise KvboundError(f"policy spec {spec!r}: bad value {val!r} for {key}") from None
    kw = {**{k: v for k, v in defaults.items() if v is not None}, **kw}
    try:
        if kind == "full":
            return FullPolicy()
        if kind == "window":
            kw.setdefault("budget", budget)
            if kw["budget"] is None:
                raise KvboundError(f"policy spec {spec!r}: window needs a budget")
            return WindowPolicy(pinned=pinned, **{k: v for k, v in kw.items() if k in ("budget", "sink", "evict_every")})
        if kind in SCORED:
            kw = {k: v for k, v in kw.items() if k in SPEC_KEYS[kind]}
            if not {"sink", "heavy", "recent"} & kw.keys() and kw.get("budget", budget) is not None:
                # options alone ('snapkv:window=16'): the named strategy's shape at the budget, then the options
                # (a SnapKV window given becomes the recent tokens below, as in a spec with sink and heavy)
                kw.setdefault("budget", budget)
                base, window_given = named_policy(kind, kw["budget"], pinned), "window" in kw
                kw["sink"] = base.sink
                if isinstance(base, SnapKVPolicy):
                    kw.setdefault("window", base.window)
                if not window_given:
                    kw["recent"] = base.recent
            if issubclass(SCORED[kind], SnapKVPolicy) and "recent" not in kw:  # the observation window stays
                kw["recent"] = kw.get("window", SnapKVPolicy.window)
            if "budget" in kw:
                b = kw.pop("budget")
                sink = kw.setdefault("sink", 4)
                if "heavy" in kw and "recent" in kw:
                    if sink + kw["heavy"] + kw["recent"] != b:
                        raise KvboundError(f"{kind}: sink + heavy + recent ({sink + kw['heavy'] + kw['recent']}) "
                                           f"!= budget ({b})")
                elif "heavy" in kw:
                    kw["recent"] = b - sink - kw["heavy"]
                else:
                    kw.setdefault("recent", 0 if kind == "tova" else b - sink - (b - sink) // 2)
                    kw["heavy"] = b - sink - kw["recent"]
                if kw["heavy"] < 0 or kw["recent"] < 0:
                    raise KvboundError(f"{kind}: sink ({sink}) + recent ({kw['recent']}) + heavy ({kw['heavy']}) "
                                       f"cannot fit budget {b}")
            return SCORED[kind](pinned=pinned, **kw)
    except TypeError as e:
        if "missing" in str(e):  # neither a budget nor the shape's sizes
            raise KvboundError(f"policy spec {spec!r} needs a budget: add --budget N or budget=N, or give its shape "
                               "as sink=..,heavy=..[,recent=..]") from None
        raise KvboundError(f"policy spec {spec!r}: {e}") from None
    raise KvboundError(f"unknown policy {kind!r} in {spec!r} (choose from {', '.join(SPEC_KEYS)})")


def _with(pol, defaults):
    """Apply CLI-wide option defaults (score, granularity, ...) to a named policy that accepts them."""
    accepts = SPEC_KEYS.get(getattr(pol, "name", None), ())  # the options its spec takes
    ok = {k: v for k, v in defaults.items() if v is not None and k in accepts}
    return replace(pol, **ok) if ok else pol
