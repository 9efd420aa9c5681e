"""Bounded KV for Hugging Face transformers models: kvbound's eviction policies inside `model.generate()`.

`install_kv_eviction(model, ...)` registers an attention function ("kvbound") through transformers'
`AttentionInterface`: it computes the attention output with SDPA and, for policies that score by attention,
the exact probabilities each cached key received (summed over the query heads that share its cached head and
over the step's queries; a prompt's forward as kvbound's own prefill pieces, through FlashAttention and the key-score
kernel on CUDA), then lets the cache layer evict (or merge, `cache.merge`). Each `DynamicLayer` the
model meets becomes an `EvictingLayer` (same tensors, plus positions, scores, merged counts and the policy):
every sequence of a batch and every cached head keeps its own tokens, left padding included. Positions keep
counting the tokens processed: the layer reports its logical length, so transformers never derives RoPE
positions from the physical one. KVzip (`kvzip`) holds the prompt whole through the forward that feeds it; a hook
on the model then reads the prompt again through the model's decoder, storing nothing, and each layer keeps its
choice by that reading's scores (`read_again`).
"""
from __future__ import annotations

import inspect
import math
import weakref

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..cache.merge import attention_bias
from ..cache.policies import H2OPolicy, Policy, parse_policy
from ..cache.reconstruct import next_piece
from ..cache.steps import fresh_scores, kept_order, marked_first, merge_dropped, piece_fold, policy_fold, rescored
from ..errors import KvboundError
from ..kernels import causal_attention_batch, flash_ok

ATTENTION = "kvbound"
SUPPORTED = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention", "Gemma3Attention",
             "DeepseekV3Attention")
QUERY_BLOCK = 64  # queries whose probabilities are computed at once (bounds a long prefill's scratch memory)
READ_CHUNK = 512  # KVzip's second reading goes in pieces of this many tokens (kvbound's default prefill chunk)


# --- the user's functions -------------------------------------------------------------------------------
def install_kv_eviction(model, policy="h2o", budget: int | None = None, n_sink: int = 4, n_recent: int | None = None,
                        evict_every: int = 1, granularity: str | None = None, score: str = "cumulative"):
    """Bound the KV cache of every (non-sliding) attention layer of `model` during `generate()` and forward.

    With policy="h2o" (the default), `budget` counts the heavy hitters: the cache holds n_sink + budget +
    n_recent tokens (n_recent defaults to budget), and at most that plus evict_every - 1 between steps.
    `policy` may also be a kvbound Policy object or spec string ("window", "tova", "snapkv:budget=512,window=32",
    ...): a named policy then gets n_sink + budget + n_recent as its total budget. `granularity` "kv-head"
    lets every cached head keep its own tokens, "layer" shares one choice per layer (None: the policy's own,
    kv-head except for tova). Call `remove_kv_eviction(model)` to restore the model."""
    chosen = _policy(policy, budget, n_sink, n_recent, evict_every, granularity, score)
    _prepare(model)
    for module in _attention_modules(model):
        module._kvbound_policy = chosen
    return chosen


def remove_kv_eviction(model):
    """Undo `install_kv_eviction` (and `KVBoundCache`'s preparation): the model's own attention again."""
    installed = getattr(model, "_kvbound", None)
    if installed is None:
        return
    for handle in installed["hooks"]:
        handle.remove()
    for module in _attention_modules(model):
        for name in ("_kvbound_policy", "_kvbound_cache"):
            if hasattr(module, name):
                delattr(module, name)
    model.set_attn_implementation(installed["previous"])
    del model._kvbound


def reset_eviction_scores(model):
    """Forget the attention scores accumulated so far (the cache layers' kept tokens stay): call between
    independent generations that reuse one cache object. A fresh cache (each generate() without
    past_key_values) starts from zero anyway."""
    for module in _attention_modules(model):
        ref = getattr(module, "_kvbound_cache", None)
        cache = ref() if ref is not None else None
        if cache is not None and isinstance(cache.layers[module.layer_idx], EvictingLayer):
            cache.layers[module.layer_idx].reset_scores()
        module._kvbound_cache = None


class KVBoundCache(DynamicCache):
    """A `DynamicCache` whose full-attention layers evict under `policy` (the arguments of
    `install_kv_eviction`), for passing as `past_key_values=` (or `cache=`, its name from transformers 5.24); it
    prepares `model` to export scores to it."""

    def __init__(self, model, policy="h2o", budget: int | None = None, n_sink: int = 4, n_recent: int | None = None,
                 evict_every: int = 1, granularity: str | None = None, score: str = "cumulative"):
        super().__init__(config=model.config)
        chosen = _policy(policy, budget, n_sink, n_recent, evict_every, granularity, score)
        _prepare(model)
        layers = model.config.get_text_config().num_hidden_layers
        for index, layer in enumerate(self.layers):
            if type(layer) is DynamicLayer:
                EvictingLayer.convert(layer, chosen.at_layer(index, layers))


# --- the cache layer ------------------------------------------------------------------------------------
class EvictingLayer(DynamicLayer):
    """A DynamicLayer that keeps at most policy.budget + evict_every - 1 tokens per sequence and cached head.
    `pos`, `score` and, for a merging policy, `count` (the tokens each held one stands for, `cache.merge`) are
    [B, L, H] in kvbound's layout (stream positions, -1 for left padding)."""
    policy: Policy

    @classmethod
    def convert(cls, layer: DynamicLayer, policy: Policy):
        layer.__class__ = cls
        layer.policy, layer.pos, layer.score, layer.count, layer.seen, layer.logical = policy, None, None, None, None, 0
        layer.unread, layer.best, layer.read_queries, layer.read_span = False, None, None, None
        return layer

    def update(self, key_states, value_states, *args, **kwargs):
        if self.best is not None:  # KVzip's second reading: the piece attends over the held tokens, nothing is stored
            return torch.cat([self.keys, key_states], -2), torch.cat([self.values, value_states], -2)
        self.logical += key_states.shape[-2]
        return super().update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self) -> int:
        """Tokens processed (left padding included), not tokens held: what transformers counts positions by."""
        return self.logical

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        held = 0 if not self.is_initialized or self.keys.numel() == 0 else self.keys.shape[-2]
        return held, 0  # update() has run: the held tokens include the new ones

    def reset(self):
        super().reset()
        self.pos = self.score = self.count = self.seen = self.best = self.read_queries = self.read_span = None
        self.logical, self.unread = 0, False

    def reset_scores(self):
        if self.score is not None:
            self.score.zero_()

    def crop(self, tokens_to_remove: int):
        raise KvboundError("a cache under kvbound eviction cannot be cropped (assisted generation is not supported)")

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self.pos, self.score, self.count, self.seen = (None if x is None else x.repeat_interleave(repeats, 0)
                                                       for x in (self.pos, self.score, self.count, self.seen))

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        self.pos, self.score, self.count, self.seen = (None if x is None else x[indices]
                                                       for x in (self.pos, self.score, self.count, self.seen))

    # called by the attention function, after update() appended the step's t tokens
    def attend(self, query, key, value, attention_mask, scaling):
        """Attention of query [B, Hq, t, D] over key/value [B, Hk, L, D] (the cache's, expanded for MLA),
        then this step's scores and eviction. Returns the output [B, t, Hq, Dv]."""
        if self.best is not None:
            return self._read(query, key, value, scaling)
        t, held = query.shape[2], self.keys.shape[-2]
        first = self.pos is None
        valid = self._admit(t, attention_mask if first else None)  # [B, L]: not left padding
        evicted = held < self.logical  # only then may a count have grown past 1
        bias = attention_bias(self.count) if evicted else None  # [B, L, H]: merged keys' log counts
        folds = self.score is not None and self.policy.fold is not None
        out, step = _attend(query, key, value, valid, scaling, bias, "cumulative" if folds else None,
                            self.policy.score_window if t > 1 else None, self.keys.shape[1])
        self._score(step, valid, t)
        if held > self.policy.budget + self.policy.evict_every - 1:
            if first and self.policy.reconstructs:  # KVzip: held whole until the prompt is read again (`read_again`)
                self.unread = True
            else:
                self._evict(valid)
        return out.contiguous()

    def _read(self, query, key, value, scaling):
        """A piece of KVzip's second reading, key/value [B, Hk, L + t, D] the held tokens and then the piece's: its
        attention output, and into `best` [B, L, H] each held token of the piece's block (`read_span`, positions
        [lo, hi)) its highest probability from the piece's real queries (`read_queries` [B, t]), over the query heads
        of its cached head and the keys the block's scores are over: the sinks, the block and the piece
        (`cache.reconstruct.ReconstructionPass`)."""
        b, t, held = query.shape[0], query.shape[2], self.keys.shape[-2]
        pos = self.pos[:, :, 0]
        lo, hi = self.read_span
        span = (pos >= lo) & (pos < hi)
        scored = span | ((pos >= 0) & (pos < min(self.policy.sink, lo)))
        whole = bool((scored == (pos >= 0)).all())  # every held token: one pass gives the output and the scores
        ones = torch.ones(b, t, dtype=torch.bool, device=query.device)
        out, seen = _attend(query, key, value, torch.cat([pos >= 0, ones], 1), scaling, None,
                            "max" if whole else None, None, self.keys.shape[1], self.read_queries)
        if not whole:  # the scored keys first in each row, in order, then the piece's
            count, at = scored.sum(1), marked_first(scored, 1)
            at = at[:, :int(count.max())]
            keys = torch.cat([key.gather(2, at[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[3])),
                              key[:, :, held:]], 2)
            valid = torch.cat([torch.arange(at.shape[1], device=at.device) < count[:, None], ones], 1)
            got = _attend(query, keys, keys, valid, scaling, None, "max", None, self.keys.shape[1],  # scores only
                          self.read_queries)[1][:, :at.shape[1]]
            seen = torch.zeros(b, held, got.shape[2], device=got.device).scatter_(
                1, at[..., None].expand(-1, -1, got.shape[2]), got)
        self.best = torch.where(span[..., None], torch.maximum(self.best, seen[:, :held]), self.best)
        return out.contiguous()

    def keep_read(self):
        """After KVzip's second reading: each sequence whose prompt passed the cache's room keeps the policy's choice
        by the reading's scores (a shorter one, read only because it shares the batch, keeps its own scores)."""
        valid = self.pos[:, :, 0] >= 0
        read = self.policy.reads_again(valid.sum(1))
        self.score = torch.where((valid & read[:, None])[..., None], self.best, self.score)
        self.best = self.read_queries = self.read_span = None
        self._evict(valid)

    def _admit(self, t, attention_mask) -> torch.Tensor:
        """Positions of the step's t new tokens: on the first step from the mask's padding (pads get -1),
        then counting on per sequence. Returns which held tokens are real."""
        b, heads, dev = self.keys.shape[0], self.keys.shape[1], self.keys.device
        if self.pos is None:
            real = torch.ones(b, t, dtype=torch.bool, device=dev)
            if attention_mask is not None:  # sdpa-style: bool, True = may attend; the last query sees every real key
                last = attention_mask[:, 0, -1, -t:]
                real = last if last.dtype == torch.bool else last == 0
            new = torch.where(real, real.long().cumsum(1) - 1, -1)
            self.seen = real.long().sum(1)
            self.pos = new[:, :, None].expand(-1, -1, heads).to(torch.int32).contiguous()
            self.score = torch.zeros(self.pos.shape, device=dev) if self.policy.score is not None else None
            self.count = torch.ones(self.pos.shape, device=dev) if self.policy.merge else None
        else:
            new = self.seen[:, None] + torch.arange(t, device=dev)[None, :]
            self.seen = self.seen + t
            self.pos = torch.cat([self.pos, new[:, :, None].expand(-1, -1, heads).to(torch.int32)], 1)
            if self.score is not None:
                self.score = torch.cat([self.score, self.score.new_zeros(b, t, heads)], 1)
            if self.count is not None:
                self.count = torch.cat([self.count, self.count.new_ones(b, t, heads)], 1)
        return self.pos[:, :, 0] >= 0

    def _score(self, step, valid, t):
        """Fold the step's probabilities `step` [B, L, H] (or the new keys' own scores) into the held tokens'
        scores."""
        if self.score is None:
            return
        p = self.policy
        if p.scores_keys:
            self.score[:, -t:] = fresh_scores(p, self.keys[:, :, -t:].transpose(1, 2), self.score)
        if p.rescores:  # left padding is no key of the anchor's
            held = torch.where(valid[:, :, None], self.pos, -1)
            self.score = rescored(p, self.score, self.keys.transpose(1, 2), held)
        if p.fold is None:
            return
        folded = policy_fold(p, self.score, step) if t == 1 else piece_fold(p, self.score, step, self.pos)
        self.score = torch.where(valid[:, :, None], folded, self.score)

    def _evict(self, valid):
        """Down to the budget: the policy's choice per sequence and cached head, left padding going first. A
        merging policy first averages each evicted token into its most similar kept one (`cache.merge`)."""
        p, b = self.policy, self.policy.budget
        if bool(valid.all()):
            keep = p.keep_mask(self.pos, self.score)
            if self.count is not None:
                self._merge(keep)
            order = kept_order(p, self.pos, self.score, keep)  # [B, budget, H], stream order
        else:
            order = torch.stack([self._row_order(valid[r], r) for r in range(valid.shape[0])])
        idx = order.transpose(1, 2)  # [B, H, budget]
        self.keys = self.keys.gather(2, idx[..., None].expand(-1, -1, -1, self.keys.shape[-1]))
        self.values = self.values.gather(2, idx[..., None].expand(-1, -1, -1, self.values.shape[-1]))
        self.pos = self.pos.gather(1, order)
        if self.score is not None:
            self.score = self.score.gather(1, order)
        if self.count is not None:
            self.count = self.count.gather(1, order)
        assert self.keys.shape[2] == b

    def _merge(self, keep, r=None, held=None):
        """The held tokens that `keep` [B, L, H] drops, merged into the kept ones (`cache.merge`); with r, only
        sequence r's tokens at `held` (keep [len(held), H]), in place."""
        p = self.policy
        if r is None:
            k, v, self.count, _ = merge_dropped(p, keep, self.keys.transpose(1, 2), self.values.transpose(1, 2),
                                                self.pos, self.score, self.count)
            self.keys, self.values = k.transpose(1, 2), v.transpose(1, 2)
        else:
            def row(x):
                return None if x is None else x[r, held][None]
            k, v, count, _ = merge_dropped(p, keep[None], self.keys[r][:, held].transpose(0, 1)[None],
                                           self.values[r][:, held].transpose(0, 1)[None], row(self.pos),
                                           row(self.score), row(self.count))
            self.keys[r][:, held], self.values[r][:, held] = k[0].transpose(0, 1), v[0].transpose(0, 1)
            self.count[r, held] = count[0]

    def _row_order(self, real, r) -> torch.Tensor:
        """One sequence with left padding: the policy chooses among its real tokens; while it has no more
        than the budget, it keeps them all and the newest pads fill the rest (the same slots in every head)."""
        p, heads = self.policy, self.pos.shape[2]
        held = torch.arange(real.shape[0], device=real.device)
        reals, pads = held[real], held[~real]
        if len(reals) <= p.budget:
            keep = torch.cat([pads[len(pads) - (p.budget - len(reals)):], reals]).sort().values
            return keep[:, None].expand(-1, heads)
        score = None if self.score is None else self.score[r, reals]
        keep = p.keep_mask(self.pos[r, reals], score)
        if self.count is not None:
            self._merge(keep, r, reals)
        return reals[kept_order(p, self.pos[r, reals], score, keep)]


def _causal(t: int, held: int, start: int, rows: int, device) -> torch.Tensor:
    """[rows, held]: which held keys the step's queries start..start+rows may see (the t new ones are last)."""
    return torch.arange(held, device=device)[None, :] <= torch.arange(held - t + start, held - t + start + rows,
                                                                      device=device)[:, None]


def _attend(query, key, value, valid, scaling, bias, mode, last, cached_heads, real=None):
    """A step's attention, query [B, Hq, t, D] over key/value [B, Hk, L, D] (the t new last): its output
    [B, t, Hq, D] and, with `mode`, each held key's probabilities [B, L, H] over the query heads of its cached head
    and the step's queries (the last `last`; those `real` [B, t] marks), summed ("cumulative") or their highest
    ("max"). A prefill piece with every key real, none merged and the usual scale runs as kvbound's own pieces do
    (`causal_attention_batch`) where that is FlashAttention and the key-score kernel (CUDA), or where its fp32
    logits are no more than one block of queries'; any other step runs SDPA, with the probabilities in fp32 blocks
    of queries (a one-pass prefill of a long prompt on the CPU)."""
    t, d, dv = query.shape[2], query.shape[-1], value.shape[-1]
    whole = bool(valid.all())  # no left padding (one host sync)
    if (1 < t and (t <= QUERY_BLOCK or flash_ok(query)) and bias is None and dv <= d
            and math.isclose(scaling, d ** -0.5) and whole and (real is None or bool(real.all()))):
        padded = value if dv == d else F.pad(value, (0, d - dv))  # MLA's narrower values: one head size for Flash
        out, step = causal_attention_batch(*(x.transpose(1, 2) for x in (query, key, padded)), mode, last)
        out = out[..., :dv]
        if step is None:
            return out, None
        step = step.view(*step.shape[:2], cached_heads, -1)  # the expanded heads of each cached head (MLA)
        return out, step.amax(-1) if mode == "max" else step.sum(-1)
    out = _attention(query, key, value, None if whole else valid, scaling, bias).transpose(1, 2)
    if mode is None:
        return out, None
    return out, _key_probs(query, key, valid, scaling, cached_heads, last, bias, real if mode == "max" else None)


def _attention(query, key, value, valid, scaling, bias=None):
    """SDPA over the held keys, the step's t queries last. Without left padding (valid None) the causal mask
    stays implicit, so the fused kernels serve it; with padding, a pad query sees itself (no row fully masked,
    where SDPA would return NaN). bias [B, L, H]: each held key's logit bias in its cached head (merged keys)."""
    t, held, dev = query.shape[2], key.shape[2], query.device
    gqa = query.shape[1] != key.shape[1]
    key, value = key.to(query.dtype), value.to(query.dtype)
    if bias is not None:
        allowed = _causal(t, held, 0, t, dev)
        if valid is not None:
            itself = torch.arange(held, device=dev)[None, :] == torch.arange(held - t, held, device=dev)[:, None]
            allowed = (valid[:, None, None, :] | itself) & allowed
        mask = _per_query_head(bias, query.shape[1])[:, :, None, :].masked_fill(~allowed, float("-inf"))
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask.to(query.dtype), scale=scaling,
                                              enable_gqa=gqa)
    if valid is None:
        if t == 1:
            return F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=gqa)
        if t == held:
            return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
        from torch.nn.attention.bias import causal_lower_right
        return F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(t, held), scale=scaling,
                                              enable_gqa=gqa)
    itself = torch.arange(held, device=dev)[None, :] == torch.arange(held - t, held, device=dev)[:, None]
    mask = (valid[:, None, None, :] | itself) & _causal(t, held, 0, t, dev)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)


def _per_query_head(bias, heads: int) -> torch.Tensor:
    """A cached head's bias [B, L, H] for each of `heads` query (or expanded key) heads that read it: [B, heads, L]."""
    return bias.transpose(1, 2).repeat_interleave(heads // bias.shape[2], 1)


def _key_probs(query, key, valid, scaling, cached_heads, last, bias=None, best_of=None) -> torch.Tensor:
    """[B, L, H]: each held key's attention probability summed over the query heads of its cached head and
    over the step's real queries (the last `last` of them, if given), in float32, in blocks of queries, with
    each key's logit `bias` [B, L, H] (merged keys). best_of [B, t]: the highest probability over those heads and
    the queries it marks instead (KVzip's score)."""
    b, hq, t, d = query.shape
    hk, held = key.shape[1], key.shape[2]
    g = hq // hk
    k = key.float().transpose(-1, -2)  # [B, Hk, D, L]
    first = t - min(t, last or t)
    total = torch.zeros(b, hk, held, device=query.device)
    for start in range(first, t, QUERY_BLOCK):
        q = query[:, :, start:start + QUERY_BLOCK].float()
        tq = q.shape[2]
        logits = (q.reshape(b, hk, g * tq, d) @ k).view(b, hk, g, tq, held) * scaling
        if bias is not None:
            logits += _per_query_head(bias, hk).float()[:, :, None, None, :]
        allowed = valid[:, None, None, None, :] & _causal(t, held, start, tq, query.device)
        probs = logits.masked_fill_(~allowed, float("-inf")).softmax(-1).nan_to_num_(0.0)
        if best_of is None:
            total += probs.sum((2, 3))
        else:
            real = best_of[:, None, None, start:start + tq, None]
            total = torch.maximum(total, probs.masked_fill_(~real, 0.0).amax((2, 3)))
    total = total.view(b, cached_heads, hk // cached_heads, held)
    return (total.sum(2) if best_of is None else total.amax(2)).transpose(1, 2)


# --- wiring ---------------------------------------------------------------------------------------------
def kvbound_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The attention function transformers calls: evicting layers attend and score, the rest (no cache,
    sliding-window layers, layers of a cache not under eviction) run SDPA as usual."""
    ref = getattr(module, "_kvbound_cache", None)
    cache = ref() if ref is not None else None
    layer = cache.layers[module.layer_idx] if cache is not None and hasattr(cache, "layers") else None
    if not isinstance(layer, EvictingLayer):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("softcap") is not None:
        raise KvboundError(f"{type(module).__name__}: attention logit soft-capping is not supported by kvbound")
    return layer.attend(query, key, value, attention_mask, scaling if scaling is not None else query.shape[-1] ** -0.5), None


def _capture(module, args, kwargs):
    """Before each attention call: remember the cache it will use, and put its layer under the policy."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5.24 renamed it for attention modules
    module._kvbound_cache = None if cache is None else weakref.ref(cache)
    policy = getattr(module, "_kvbound_policy", None)
    if cache is None or policy is None or getattr(module, "is_sliding", False):
        return
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise KvboundError(f"kvbound eviction needs a DynamicCache (or KVBoundCache), got {type(cache).__name__}")
    layer = layers[module.layer_idx]
    if type(layer) is DynamicLayer:  # PyramidKV: each layer its own budget
        EvictingLayer.convert(layer, policy.at_layer(module.layer_idx, module.config.num_hidden_layers))
    elif not isinstance(layer, EvictingLayer) and not getattr(layer, "is_sliding", False):
        raise KvboundError(f"kvbound eviction needs a DynamicCache (or KVBoundCache); layer {module.layer_idx} is "
                           f"a {type(layer).__name__}")


def read_again(model, args, kwargs, output):
    """KVzip (a forward hook on the model): after the forward that fed a prompt past the room of layers under a
    prompt-scoring policy (`EvictingLayer.unread`), the model's decoder reads each sequence's prompt again in pieces
    of READ_CHUNK tokens, each right after the prompt (positions n on) and over it alone, storing nothing; then each
    layer keeps its choice by the most attention each token drew (`engine.generate.read_again`'s score). Sliding-window
    layers (Gemma 3) read each piece over their window of the prompt, and are put back as they were after it."""
    layers = getattr(getattr(output, "past_key_values", None), "layers", None) or []
    unread = [layer for layer in layers if isinstance(layer, EvictingLayer) and layer.unread]
    if not unread:
        return
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        raise KvboundError(f"{unread[0].policy.name} reads the prompt's token ids again: pass input_ids, not "
                           "inputs_embeds")
    valid = unread[0].pos[:, :, 0] >= 0  # [B, n]: real tokens, left padding first
    decoder = model.get_decoder()
    cache = {"cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values":
             output.past_key_values}  # transformers 5.24 renamed it
    for layer in unread:  # reading from here on: a forward hook of the decoder's own sees nothing unread
        layer.unread, layer.best = False, torch.zeros(layer.pos.shape, device=layer.pos.device)
    sliding = [layer for layer in layers if getattr(layer, "is_sliding", False)]
    with torch.no_grad():
        for piece, real, positions, span in _pieces(ids, valid, READ_CHUNK, unread[0].policy.chunk):
            for layer in unread:
                layer.read_queries, layer.read_span = real, span
            held = [dict(vars(layer)) for layer in sliding]  # their tensors are replaced, never written in place
            # a sliding layer's window keeps left padding out by the mask (an evicting layer reads by `pos`)
            mask = {"attention_mask": torch.cat([valid, torch.ones_like(real)], 1).long()} if sliding else {}
            decoder(input_ids=piece, position_ids=positions, use_cache=True, **mask, **cache)
            for layer, state in zip(sliding, held):
                vars(layer).clear()
                vars(layer).update(state)
    for layer in unread:
        layer.keep_read()


def _pieces(ids, valid, chunk: int, block: int):
    """Each sequence's real tokens (left padding dropped) in pieces of `chunk` within blocks of `block` (KVzip's, 0:
    one), aligned to its own first token so that a batch reads as each sequence alone: (ids [B, t], right-padded;
    which are real [B, t]; positions [B, t], from the sequence's length on; the piece's block, token indices [lo,
    hi))."""
    n = valid.sum(1)
    start, longest = valid.shape[1] - n, int(n.max())
    at = 0
    while at < longest:
        t, span = next_piece(at, chunk, longest, block)
        offs = torch.arange(t, device=ids.device)
        real = at + offs[None] < n[:, None]
        src = (start[:, None] + at + offs[None]).clamp(max=valid.shape[1] - 1)
        yield torch.where(real, ids.gather(1, src), ids[:, -1:]), real, n[:, None] + offs[None], span
        at += t


def _prepare(model):
    """Register the attention function once, switch the model to it and hook its attention modules, and its forward
    for KVzip's second reading (`read_again`)."""
    if not isinstance(model, torch.nn.Module):
        raise KvboundError(f"install_kv_eviction needs a transformers model, got {type(model).__name__}")
    if "_kvbound" in vars(model):
        return
    modules = _attention_modules(model)
    AttentionInterface.register(ATTENTION, kvbound_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    previous = model.config._attn_implementation
    hooks = [m.register_forward_pre_hook(_capture, with_kwargs=True) for m in modules]
    hooks.append(model.register_forward_hook(read_again, with_kwargs=True))
    model.set_attn_implementation(ATTENTION)
    model._kvbound = {"previous": previous, "hooks": hooks}


def _attention_modules(model) -> list:
    found = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]
    unsupported = sorted({type(m).__name__ for m in found} - set(SUPPORTED))
    if unsupported or not found:
        raise KvboundError(f"kvbound eviction does not support {', '.join(unsupported) or type(model).__name__} "
                           f"(supported: {', '.join(SUPPORTED)})")
    return found


def _policy(policy, budget, n_sink, n_recent, evict_every, granularity, score) -> Policy:
    chosen = _named_policy(policy, budget, n_sink, n_recent, evict_every, granularity, score)
    if chosen.at_layer(0, 1).adapts:  # a layer of it still gives its heads budgets of their own
        raise KvboundError(f"{chosen.name} gives each KV head of a layer a budget of its own (alpha, or "
                           "layers=global), which transformers' cache (one length for all heads of a layer) does not "
                           "hold; run it on kvbound's own cache (kvbound generate, kvbound eval), or without alpha "
                           "(layer budgets, beta, run here)")
    return chosen


def _named_policy(policy, budget, n_sink, n_recent, evict_every, granularity, score) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if not isinstance(policy, str):
        raise KvboundError(f"policy must be a kvbound Policy or a spec string such as 'h2o', got {policy!r}")
    defaults = {"granularity": granularity, "evict_every": evict_every}
    if budget is None:
        if ":" not in policy:
            raise KvboundError("install_kv_eviction: give a budget (heavy-hitter tokens kept per layer), or a spec "
                               "that gives the shape, such as 'h2o:sink=4,heavy=128,recent=124'")
        return parse_policy(policy, None, **defaults)  # a spec of its own size, as the README's 'snapkv:budget=512'
    n_recent = budget if n_recent is None else n_recent
    if policy == "h2o":
        return H2OPolicy(sink=n_sink, heavy=budget, recent=n_recent, evict_every=evict_every,
                         granularity=granularity or "kv-head", score=score)
    return parse_policy(policy, n_sink + budget + n_recent, **defaults)
