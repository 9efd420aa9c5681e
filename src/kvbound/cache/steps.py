"""The attention steps of a cache layer, written once for B sequences at a time.

A single sequence's cache (`KVCache.attend`) runs them as a batch of one; the engine's row groups
(`engine.runner`) run them for many sequences in one call per layer. Each step reads and writes a
`store.SlotStorage` through slot tables [B, slots] (local slot j of sequence b lives at table[b, j]) and
updates the layer's metadata: stream positions and scores [R, cap, H] and spare slots [R, H], at rows
`rows` [B] (a single cache passes its own tensors as one row).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from ..kernels import (causal_attention_batch, contiguous_slots, decode_attention, decode_with_scores, flash_ok,
                       fold_scores, layer_sum, varlen_attention_lse)
from ..kernels.packing import head_dim
from .merge import attention_bias, merge_into_kept, merge_mode, merge_weight
from .store import EACH_HEAD

if TYPE_CHECKING:
    from .quant import RecentResiduals


def _per_layer(policy, step: torch.Tensor) -> torch.Tensor:
    """With granularity "layer" every head gets the sum over the layer's heads: all keep the same tokens."""
    return layer_sum(step) if by_layer(policy) else step


def policy_fold(policy, old: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """`old` scores after one decode step's probabilities `step` (both [..., M, H])."""
    return fold_scores(old, _per_layer(policy, step), policy.fold, policy.fold_decay)


def piece_fold(policy, old: torch.Tensor, step: torch.Tensor | None, pos: torch.Tensor) -> torch.Tensor:
    """`old` scores after a prefill piece (`policy.piece_scores`); unchanged without probabilities."""
    return old if step is None else policy.piece_scores(old, _per_layer(policy, step), pos)


def fresh_scores(policy, k: torch.Tensor, like: torch.Tensor, storage=None, layer: int = 0) -> torch.Tensor:
    """New tokens' starting scores, [..., t, H] for keys k [..., t, H, D]: zeros, or the policy's score of
    each key as `storage` reads it back (a quantized store scores what it will attend with)."""
    if not policy.scores_keys:
        return like.new_zeros(k.shape[:-1])
    held = k if storage is None else storage.roundtrip(layer, k)
    return _per_layer(policy, policy.key_score(held).to(like.dtype))


def rescored(policy, score: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """`score` [..., M, H], or, for a policy that scores each key against all of them (KeyDiff), every held
    key's score recomputed from the keys k [..., M, H, D] held at positions `pos` (-1: none, score kept)."""
    if not policy.rescores:
        return score
    held = pos >= 0
    return torch.where(held, _per_layer(policy, policy.rescore(k, held).to(score.dtype)), score)


def piece_attention(q, k, v, policy, old: torch.Tensor | None, pos: torch.Tensor, bias: torch.Tensor | None = None):
    """A prefill piece's causal attention, q [B, t, Hq, D] over k, v [B, n + t, H, D] (the t new last), and
    the n + t keys' scores after it: `old` [B, n, H] and the new keys' starting scores, folded. bias [B, n + t, H]:
    merged keys' logits (`merge.attention_bias`)."""
    out, step = causal_attention_batch(q, k, v, None if old is None else policy.fold, policy.score_window, bias)
    if old is None:
        return out, None
    t = q.shape[1]
    scores = torch.cat([old, fresh_scores(policy, k[:, -t:], old)], 1)
    if t == 1 and step is not None:  # a one-token piece is a decode step, wherever it runs
        return out, policy_fold(policy, scores, step)
    return out, rescored(policy, piece_fold(policy, scores, step, pos), k, pos)


class WindowRead(NamedTuple):
    """What a step reads of mixed widths' residuals: the `quant.RecentResiduals`, the caches' rows [B] (of it and
    of `pos`), the step's first positions [B], and the layer's positions [R, cap, H]."""
    residuals: RecentResiduals
    rows: torch.Tensor
    first: torch.Tensor
    pos: torch.Tensor

    def kernel_args(self, layer):
        return self.residuals.kernel_args(layer, self.rows, self.first, self.pos)


def read_kv(storage, layer, table, ring: WindowRead | None = None):
    """K, V at slots `table` [B, M] (local slots [0, M)) as attention reads them: with mixed widths (`ring`) the
    window's tokens and the sinks with their residuals."""
    k, v = storage.gather(layer, table)
    if ring is None:
        return k, v
    return ring.residuals.add(layer, ring.rows, k, v, ring.pos, ring.first)


def kernel_reads(storage, layer, q, policy) -> tuple | None:
    """The storage's kernel arguments where the decode kernel can serve this step: on the GPU it takes
    power-of-two head sizes. None: gather, then attend."""
    d = q.shape[-1]
    if q.is_cuda and d & (d - 1):
        return None
    return storage.kernel_args(layer)


def by_layer(policy) -> bool:
    """Whether a policy's scores are a layer's (granularity "layer"): the kernels then fold in the heads' sum."""
    return policy is not None and policy.granularity == "layer"


def table_attention(q, storage, layer, table, lens, policy=None, score=None, contiguous=False,
                    ring: WindowRead | None = None, count: torch.Tensor | None = None):
    """One new query per sequence, q [B, Hq, D], over its keys at table[b, :lens[b]]. `score` [B, M, H]
    (a policy's, with the policy) folds in this step's probabilities of the valid keys. contiguous: key j is
    at slot table[b, 0] + j, and only column 0 is read (virtual storage's stripes). ring: mixed widths' residuals
    (`read_kv`), which the kernel reads too. count [B, M, H]: the tokens each key stands for, its log added to its
    logits (merged keys, `merge`)."""
    mode = None if score is None else policy.fold
    score = None if mode is None else score
    args = kernel_reads(storage, layer, q, policy)
    if args is not None:
        k_pool, v_pool, quant = args
        return decode_attention(q, k_pool, v_pool, table, lens, score=score, quant=quant, score_mode=mode,
                                ema_decay=policy.fold_decay if policy is not None else 0.95, contiguous=contiguous,
                                resid=None if ring is None else ring.kernel_args(layer), layer=by_layer(policy),
                                count=count)
    if contiguous:
        table = contiguous_slots(table, lens)
    k, v = read_kv(storage, layer, table.long(), ring)
    out, step = decode_with_scores(q, k, v, lens, mode, attention_bias(count))
    if step is not None:
        valid = torch.arange(table.shape[1], device=q.device)[None, :, None] < lens.to(q.device)[:, None, None]
        score.copy_(torch.where(valid, policy_fold(policy, score, step), score))
    return out


def evict_one(pos, spare, score, rows, policy, lens=None, victim=None, keep_pos=False):
    """Every slot of rows `rows` is live: pick each head's victim (`policy.victim`, unless given [B, H]), mark its
    position free and make its slot the head's spare slot, which the next decoded token is written into. lens [B]:
    the live slots of each row; a row with fewer than pos.shape[1] evicts nothing, its next free slot becomes the
    spare. keep_pos: the victim keeps its position, for a merge that follows (`bulk_evict_decode`)."""
    if victim is None:
        victim = policy.victim(pos[rows], None if score is None else score[rows])
    if lens is not None:  # a free slot's position is -1 already
        victim = torch.where(lens[:, None] < pos.shape[1], lens[:, None].to(victim.dtype), victim)
    heads = torch.arange(victim.shape[1], device=victim.device)[None, :]
    if not keep_pos:
        pos[rows[:, None], victim, heads] = pos.new_full((), -1)  # device scalars: graph capture allows no host copies
    spare[rows] = victim


def evict_merged(storage, layer, table, rows, pos, spare, score, count, policy, lens=None,
                 ring: WindowRead | None = None):
    """`evict_one`, each head's victim first merged into its most similar kept key (`merge`) when `count` [R, cap, H]
    (the tokens each slot stands for) is given: the target's K/V are rewritten and its count grows. A row below its
    budget (lens[b] < table.shape[1]) merges nothing. On CUDA, with a protection the kernels know, the merge is one
    kernel (`kernels.triton_merge`), over any pool format. ring: mixed widths' residuals, read from the decode's
    position (`read_kv`); a target in the window gets its new value's residual."""
    if count is None:
        return evict_one(pos, spare, score, rows, policy, lens)
    m = table.shape[1]
    held, cnt = pos[rows, :m], count[rows, :m]
    sc = None if score is None else score[rows, :m]
    victim = policy.victim(held, sc)
    fused = policy.fused_protection()
    args = storage.kernel_args(layer) if table.is_cuda and fused is not None else None
    d = None if args is None else head_dim(args[0], args[2])
    if d is not None and d & (d - 1) == 0:  # the kernel's tiles: a power of two
        from ..kernels.triton_merge import merge_victims
        full = torch.full((table.shape[0],), m, dtype=torch.int32, device=table.device) if lens is None else lens
        merge_victims(args[0], args[1], table, rows, pos, score, count, victim, full, fused[0], merge_mode(policy),
                      newest=None if ring is None else ring.first, quant=args[2],
                      resid=None if ring is None else ring.kernel_args(layer))
        return evict_one(pos, spare, score, rows, policy, lens, victim)
    raw = storage.gather(layer, table.long())
    k, v = raw if ring is None else ring.residuals.add(layer, ring.rows, *raw, ring.pos, ring.first)
    ok = policy.mergeable(held).scatter(1, victim[:, None], False)
    k, v, cnt, target, merged, _ = merge_into_kept(k, v, cnt, merge_weight(policy, held, sc, cnt), victim[:, None],
                                                   ok)
    if lens is not None:
        full = lens.to(cnt.device)[:, None] == table.shape[1]
        merged, cnt = merged & full[:, None], torch.where(full[:, :, None], cnt, count[rows, :m])
    target = torch.where(merged, target, victim[:, None])[:, 0]  # [B, H]; no merge: the victim's own, as it is
    at = target[:, None, :, None].expand(-1, -1, -1, k.shape[-1])
    k_t, v_t = (torch.where(merged[..., None], x.gather(1, at), r.gather(1, at))[:, 0]  # as stored where unmerged
                for x, r in zip((k, v), raw))
    storage.write(layer, table.gather(1, target).long(), k_t, v_t, EACH_HEAD)
    if ring is not None:
        ring.residuals.rewrite(layer, rows, held.gather(1, target[:, None]), k_t[:, None], v_t[:, None], merged,
                               ring.first)
    count[rows, :m] = cnt
    evict_one(pos, spare, score, rows, policy, lens, victim)


def evict_decode(q, k, v, storage, layer, table, lens, rows, positions, pos, spare, score, policy, ring=None,
                 count=None, merge=True):
    """Decode of B bounded caches whose local slots [0, lens[b]) hold their tokens and one free spare slot per head:
    each head's new token goes into its spare slot, attends over the lens[b] slots in place while this step's
    probabilities fold into the scores, and the head's victim's slot becomes the next spare. A cache still below
    its budget (lens[b] < table.shape[1]; its spare is slot lens[b] - 1 in every head) evicts nothing: slot lens[b]
    becomes the next spare. Nothing else moves. On CUDA, a protection the kernels know runs as five fused kernels,
    six for KeyDiff (`kernels.triton_decode.evict_decode`; packed pools are written quantized), the same steps as
    below.
    ring: the caches' mixed-width residuals (`quant.RecentResiduals`, rows `rows`); the new token's goes in first.
    count [R, cap, H]: the tokens each slot stands for, with a merging policy: each victim merges into its most
    similar kept key (`evict_merged`; after the fused kernels, `kernels.triton_merge`); merge=False leaves each
    victim at its position in the spare slot, for `bulk_evict_decode`'s merge of several."""
    fused = policy.fused_protection()
    args = kernel_reads(storage, layer, q, policy)
    read = None if ring is None else WindowRead(ring, rows, positions, pos)
    keys_read = policy.rank_source.startswith("key")  # the kernels read keys without the window's residuals
    if q.is_cuda and fused is not None and args is not None and not (keys_read and ring is not None):
        from ..kernels.triton_decode import evict_decode as fused_step  # the store writes the residuals too
        out = fused_step(q, k, v, args[0], args[1], table, lens, rows, positions, pos, spare, score, policy.fold,
                         policy.fold_decay, *fused, quant=args[2],
                         resid=None if read is None else read.kernel_args(layer), layer=by_layer(policy),
                         rank=policy.rank_source, count=count)
        if count is not None and merge:  # each victim, still at its position, merges, then leaves
            from ..kernels.triton_merge import merge_victims
            merge_victims(args[0], args[1], table, rows, pos, score, count, spare, lens, fused[0], merge_mode(policy),
                          newest=positions, free=True, quant=args[2],
                          resid=None if read is None else read.kernel_args(layer))
        return out
    if ring is not None:
        ring.write(layer, rows, positions[:, None], k[:, None], v[:, None])
    r, heads = rows[:, None], torch.arange(k.shape[1], device=k.device)[None, :]
    slot = spare[rows]  # [B, H]: the local slot each head writes
    storage.write(layer, table.gather(1, slot).long(), k, v, EACH_HEAD)
    pos[r, slot, heads] = positions[:, None].to(pos.dtype)
    step_score, step_count = None, None
    if score is not None:
        score[r, slot, heads] = fresh_scores(policy, k, score, ring or storage, layer)
        step_score = score[rows]
    if count is not None:
        count[r, slot, heads] = count.new_ones(())  # a device scalar: graph capture allows no host copies
        step_count = count[rows, :table.shape[1]]
    out = table_attention(q, storage, layer, table, lens, policy, step_score, ring=read, count=step_count)
    if score is not None:
        keys = read_kv(storage, layer, table.long(), read)[0] if policy.rescores else None
        score[rows] = rescored(policy, step_score, keys, pos[rows])
    if count is not None and not merge:
        evict_one(pos, spare, score, rows, policy, lens, keep_pos=True)
    else:
        evict_merged(storage, layer, table, rows, pos, spare, score, count, policy, lens, read)
    return out


def bulk_decode_ok(policy, storage, ring) -> bool:
    """Whether the decode that fills the room of caches evicting every e steps can run `bulk_evict_decode`: on CUDA,
    with a protection the kernels know (with mixed widths' residuals, a rank that is not read from keys, as
    `evict_decode` fuses); a merging policy's heads a power of two in size (the merge's tiles)."""
    d = storage.head_dim
    keys_read = policy.rank_source.startswith("key")
    return (storage.device.type == "cuda" and policy.evict_every > 1 and policy.fused_protection() is not None
            and not (ring is not None and keys_read) and (not policy.merge or d & (d - 1) == 0))


def bulk_evict_decode(q, k, v, storage, layer, table, lens, rows, positions, pos, spare, score, policy, count=None,
                      ring=None):
    """The decode that fills the room of B caches evicting every e steps (local slots [0, lens[b] - 1) held, the
    last one of the table each head's spare): `evict_decode` writes the new token, attends and evicts each head's
    lowest-ranked token, then the e - 1 next go too, a merging policy's e merge into the kept keys at once (count
    [R, cap, H]: the tokens each slot stands for), and the kept tokens past the budget move into the evicted slots
    below it, stored bytes as they are (`kernels.triton_compact`). Slots [0, budget) then hold what `chunk_attend`
    and `keep_and_rewrite` keep, and slot `budget` is every head's spare. `bulk_decode_ok` says when it applies.
    ring: mixed widths' residuals (rows `rows`), which the new token's joins; they are found by position, so the
    moves leave them where they are, and a merge reads and rewrites them as `evict_merged` does."""
    from ..kernels.triton_compact import compact
    out = evict_decode(q, k, v, storage, layer, table, lens, rows, positions, pos, spare, score, policy, ring=ring,
                       count=count, merge=False)
    resid = None if ring is None or count is None else WindowRead(ring, rows, positions, pos).kernel_args(layer)
    compact([t[layer] for t in storage.raw], table, pos, score, spare, rows, positions, policy.budget,
            *policy.fused_protection(), policy.rank_source == "age", count=count,
            merge=None if count is None else (storage.kernel_args(layer), merge_mode(policy)), resid=resid)
    return out


def owner_attention(q, ks, vs, mask, policy, first: int = 0):
    """Queries q [B, T, Hq, D] over places ks, vs [B, E, D] that KV heads own (AdaKV), each query head seeing
    the places `mask` [B, T, Hq, E] allows (its KV head's, at positions up to its own): out [B, T, Hq, D], and
    each place's attention summed over queries [first, T) and heads, [B, E] (None for a policy that needs no
    attention; "normalized" weighs each query by the places it sees). PyTorch, masked."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), ks[:, None], vs[:, None], attn_mask=mask.transpose(1, 2), enable_gqa=True).transpose(1, 2)
    if policy.fold is None:
        return out, None
    seen = mask[:, first:]
    logits = (q[:, first:].float() @ ks.float()[:, None].transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, T', Hq, E]
    probs = logits.masked_fill(~seen, float("-inf")).softmax(-1)
    if policy.fold == "normalized":
        probs = probs * seen.sum(-1, keepdim=True)
    return out, probs.sum(dim=(1, 2))


def owned_attention(q, ks, vs, own, heads: int, score_mode: str | None, first: int = 0):
    """`owner_attention` of a prefill piece without its [B, T, Hq, E] mask: each (cache, KV head) becomes a varlen
    sequence of the places it owns, in order (a stable sort by owner), so each head attends to its own places
    only: one FlashAttention call on CUDA, and the scores from its LSE (`triton_prefill.key_scores`). ks, vs
    [B, E, D] end with the piece's t tokens, token-major (own [B, E]: the owning KV head, -1 free); every held
    place is older than the piece, so the causal mask is each sequence's bottom-right one. Returns out
    [B, T, Hq, D] and each place's probability summed over queries [first, T) and its group's heads, [B, E]."""
    b, t, hq, d = q.shape
    e, g = ks.shape[1], hq // heads
    key = torch.where(own < 0, heads, own).long()  # free places last
    order = torch.sort(key, dim=1, stable=True).indices
    counts = torch.zeros(b, heads + 1, dtype=torch.int32, device=q.device).scatter_add_(
        1, key, torch.ones_like(key, dtype=torch.int32))[:, :heads]
    base = e * torch.arange(b, device=q.device, dtype=torch.int32)[:, None]
    starts = counts.cumsum(1, dtype=torch.int32) - counts + base
    cu_k = torch.cat([starts.flatten(), starts.new_full((1,), b * e)])
    cu_q = torch.arange(0, b * heads * t + 1, t, device=q.device, dtype=torch.int32)
    qs = q.view(b, t, heads, g, d).transpose(1, 2).reshape(b * heads * t, g, d)
    ks_s, vs_s = (x.gather(1, order[..., None].expand(-1, -1, d)).view(b * e, 1, d) for x in (ks, vs))
    out, lse = varlen_attention_lse(qs, ks_s, vs_s, cu_q, cu_k, t, e, counts.flatten())
    out = out.view(b, heads, t, g, d).transpose(1, 2).reshape(b, t, hq, d)
    if score_mode is None:
        return out, None
    from ..kernels.triton_prefill import key_scores
    step = key_scores(qs.view(b * heads, t, g, d), ks_s, lse, first, score_mode == "normalized", starts.flatten(),
                      counts.flatten(), e)
    return out, torch.zeros(b, e, device=q.device).scatter_(1, order, step.view(b, e))


def shared_store(k, v, storage, layer, table, rows, positions, owner, pos, spare, score, policy):
    """Head h's new token k, v [B, H, D] into its spare place spare[b, h] (slot * heads + column, any column), which
    it then owns, with its position and starting score."""
    bsz, h, d = k.shape
    r, heads = rows[:, None], torch.arange(h, device=k.device)
    place = spare[rows]
    slot, col = place // h, place % h
    storage.write(layer, table.gather(1, slot).reshape(-1, 1).long(), k.reshape(-1, 1, d), v.reshape(-1, 1, d),
                  col.reshape(-1, 1))
    owner[r, slot, col] = heads.to(owner.dtype)
    pos[r, slot, col] = positions[:, None].to(pos.dtype)
    score[r, slot, col] = fresh_scores(policy, k, score, storage, layer)


def rescored_places(policy, score, ks, own, held, heads: int) -> torch.Tensor:
    """A rescoring policy's (KeyDiff's) scores of places ks [B, E, D] that KV heads own (`own` [B, E], -1: free;
    `held` their positions): each head's places against its own anchor, as `AdaptiveKVCache` scores them."""
    out = score
    for head in range(heads):
        mine = own == head
        got = rescored(policy, score[..., None], ks[:, :, None], torch.where(mine, held, -1)[..., None])[..., 0]
        out = torch.where(mine, got, out)
    return out


def shared_decode(q, k, v, storage, layer, table, rows, positions, owner, pos, spare, score, policy, sure: int,
                  lens=None, widths=None):
    """Steady-state decode of B caches whose heads share a layer's places (AdaKV; `AdaptiveKVCache`): head h's
    new token goes into the row's spare place spare[b, h] (slot * heads + column, any column), each query head
    attends to its KV head's places, this step's attention folds into the scores (KeyDiff instead rescores every
    place, `rescored_places`), and the places the keep rule drops become the next spares (`Policy.entry_victims`;
    `sure`: each head's guaranteed places in this layer). lens [B]: the slots each row holds with the new token's; a
    row with fewer than its width (the table's, or widths [B]: rows of different plans, each padded with free places)
    (a cache below its budget, its tokens in slots [0, lens)) drops nothing, and the next slot's places become its
    spares.
    No host sync. On CUDA, a protection the kernels know runs as four Triton kernels (`kernels.triton_shared`);
    otherwise masked SDPA and sorts in PyTorch, the same steps."""
    bsz, h, _ = k.shape
    fused = policy.fused_protection()
    args = kernel_reads(storage, layer, q, policy)
    if q.is_cuda and fused is not None and args is not None and (args[2] or {}).get("bits") != "fp8":
        from ..kernels import triton_shared
        if triton_shared.fits(table.shape[1] * h):
            return triton_shared.shared_decode(q, k, v, args[0], args[1], table, rows, positions, owner, pos, spare,
                                               score, policy.fold, policy.fold_decay, *fused, sure, quant=args[2],
                                               rank=policy.rank_source, lens=lens, widths=widths)
    shared_store(k, v, storage, layer, table, rows, positions, owner, pos, spare, score, policy)
    kc, vc = storage.gather(layer, table.long())
    ks, vs = kc.flatten(1, 2).to(q.dtype), vc.flatten(1, 2).to(q.dtype)  # [B, E, D]
    width = table.shape[1]  # the layer's place rows (fewer than the metadata's in PyramidKV's smaller layers)
    own, held = owner[rows, :width].flatten(1), pos[rows, :width].flatten(1)
    group = torch.arange(q.shape[1], device=q.device) // (q.shape[1] // h)
    mask = own[:, None, None, :] == group[None, None, :, None]  # [B, 1, Hq, E]
    out, step = owner_attention(q[:, None], ks, vs, mask, policy)
    folded = score[rows, :width].flatten(1)
    if step is not None:
        folded = fold_scores(folded, step, policy.fold, policy.fold_decay)
    if policy.rescores:
        folded = rescored_places(policy, folded, ks, own, held, h)
    score[rows, :width] = folded.view(bsz, -1, h)
    victim = policy.entry_victims(held, folded, own, h, sure)
    if lens is not None:  # the next slot's places are free already
        nxt = lens[:, None].long() * h + torch.arange(h, device=lens.device)
        victim = torch.where(lens[:, None] < (width if widths is None else widths[:, None]), nxt, victim)
    r, vslot, vcol = rows[:, None], victim // h, victim % h
    owner[r, vslot, vcol] = owner.new_full((), -1)
    pos[r, vslot, vcol] = pos.new_full((), -1)
    spare[rows] = victim
    return out[:, 0]


def marked_first(mask: torch.Tensor, dim: int) -> torch.Tensor:
    """Indices along `dim` of the marked entries in order, then the others in order (a stable sort, no host sync)."""
    return torch.sort(mask.to(torch.int8), dim=dim, descending=True, stable=True).indices


def shared_piece(q, k, v, storage, layer, table, rows, positions, owner, pos, score, policy, sure: int, share: int,
                 n: int, room: int, evict: bool, spare=None):
    """Prefill pieces of t tokens of B caches whose heads share a layer's places (AdaKV, PyramidKV; a cache's own
    `attend` with B = 1), each holding its entries in its first n place rows (table [B, >= max(n, room)]: the storage
    slot of each place row; owner/pos/score the layer's [R, cap, H] metadata at rows `rows`): each query head attends
    to its KV head's entries and the piece (q [B, t, Hq, D], k, v [B, t, H, D], positions [B, t]), the scores fold
    (`piece_places`), the keep rule keeps heads x share entries if `evict`, and the kept new tokens fill the lowest
    free places of the first `room` rows (`fill_places`). spare [R, H]: after an eviction, each cache's free places
    (one per head's worth) become its spares. Returns out [B, t, Hq, D]. No host sync."""
    bsz, t, h, _ = k.shape
    e = n * h
    kc, vc = storage.gather(layer, table[:, :n].long())  # [B, n, H, D]
    own_c, pos_c, score_c = (x[rows, :n].flatten(1) for x in (owner, pos, score))  # [B, E]
    own = torch.cat([own_c, torch.arange(h, device=k.device, dtype=owner.dtype).repeat(t).expand(bsz, -1)], 1)
    cand_pos = torch.cat([pos_c, positions[:, :, None].expand(-1, -1, h).flatten(1).to(pos.dtype)], 1)
    ks = torch.cat([kc.flatten(1, 2).to(q.dtype), storage.roundtrip(layer, k).flatten(1, 2).to(q.dtype)], 1)
    vs = torch.cat([vc.flatten(1, 2).to(q.dtype), storage.roundtrip(layer, v).flatten(1, 2).to(q.dtype)], 1)
    first = t - min(t, policy.score_window or t)
    if flash_ok(q):
        out, step = owned_attention(q, ks, vs, own, h, policy.fold, first)
    else:
        group = torch.arange(q.shape[2], device=q.device) // (q.shape[2] // h)
        mask = (own[:, None, None, :] == group[None, None, :, None]) & (cand_pos[:, None, None, :]
                                                                          <= positions[:, :, None, None])
        out, step = owner_attention(q, ks, vs, mask, policy, first)
    cand_score = torch.cat([score_c, fresh_scores(policy, k, score).flatten(1)], 1)
    folded = piece_places(policy, step, own, cand_pos, ks, cand_score, t, h)
    keep_places(storage, layer, table, rows, owner, pos, score, policy, k, v, own, cand_pos, folded, n, sure, share,
                room, evict, spare)
    return out


def keep_places(storage, layer, table, rows, owner, pos, score, policy, k, v, own, cand_pos, folded, n: int, sure: int,
                share: int, room: int, evict: bool, spare=None):
    """`shared_piece`'s keep: of the n place rows' entries and the piece's t tokens k, v [B, t, H, D] (candidates
    `own`, `cand_pos`, `folded` [B, n * H + t * H], the piece's token-major), the keep rule keeps heads x share if
    `evict`, the dropped places are freed and the kept new tokens fill the lowest free places (`fill_places`);
    spare [R, H]: then each cache's first free places."""
    h = k.shape[2]
    e = n * h
    own_c, pos_c, score_c = (x[rows, :n].flatten(1) for x in (owner, pos, score))
    held = own >= 0
    keep = policy.keep_entries(cand_pos, folded, own, h, sure, h * share) if evict else held
    drop = held[:, :e] & ~keep[:, :e]
    shape = (k.shape[0], n, h)
    owner[rows, :n] = torch.where(drop, -1, own_c).view(shape).to(owner.dtype)
    pos[rows, :n] = torch.where(drop, -1, pos_c).view(shape)
    score[rows, :n] = torch.where(held[:, :e], folded[:, :e], score_c).view(shape)
    fill_places(storage, layer, table, rows, owner, pos, score, k, v, keep[:, e:],
                (own[:, e:], cand_pos[:, e:], folded[:, e:]), room)
    if spare is not None:
        free = owner[rows, :room].flatten(1) < 0
        spare[rows] = marked_first(free, 1)[:, :h]


def piece_places(policy, step, own, pos, ks, score, t: int, heads: int) -> torch.Tensor:
    """Candidates' scores [B, E] after a piece of t tokens whose attention is `step` [B, E] (None without): a decode's
    fold in; a prefill piece's through the policy's `piece_scores`, every head's column at once (SnapKV pools along
    each head's stream order, the other heads' entries standing aside at position -1); KeyDiff rescores each head's
    keys against its own anchor."""
    if step is not None and t == 1:
        score = fold_scores(score, step, policy.fold, policy.fold_decay)
        step = None
    if step is None and not policy.rescores:
        return score
    mine = own[..., None] == torch.arange(heads, device=own.device, dtype=own.dtype)  # [B, E, H]
    held = torch.where(mine, pos[..., None], -1)  # each head's column: its entries at their positions
    if step is not None:
        cols = policy.piece_scores(score[..., None].expand(held.shape), step[..., None].expand(held.shape), held)
        score = torch.where(own >= 0, cols.gather(-1, own.long().clamp(min=0)[..., None])[..., 0], score)
    for head in range(heads if policy.rescores else 0):
        got = rescored(policy, score[..., None], ks[:, :, None], held[..., head:head + 1])[..., 0]
        score = torch.where(mine[..., head], got, score)
    return score


def fill_places(storage, layer, table, rows, owner, pos, score, k, v, kept, new_meta, room: int):
    """The kept new entries (token-major `kept` [B, t * heads]; their owners, positions and scores `new_meta`) into
    the lowest free places of each cache's first `room` place rows, in order, as a cache fills its holes. Rows
    keeping fewer entries than others repeat their first write (the same bytes to the same place), or, keeping
    none, write a free place that stays free: every row writes as many, with no host sync."""
    bsz, t, h, d = k.shape
    free = owner[rows, :room].flatten(1) < 0
    m = min(t * h, room * h)
    at_free = marked_first(free, 1)[:, :m]  # free places, lowest first
    at_new = marked_first(kept, 1)[:, :m]  # kept entries, in order
    count = kept.sum(1, keepdim=True)
    i = torch.arange(m, device=k.device)[None]
    first = torch.where(i < count, i, 0)
    ok = first < count
    place, entry = at_free.gather(1, first), at_new.gather(1, first)
    slot, col = place // h, place % h
    ks, vs = (x.flatten(1, 2).gather(1, entry[..., None].expand(-1, -1, d)) for x in (k, v))
    storage.write(layer, table.gather(1, slot).reshape(-1, 1).long(), ks.reshape(-1, 1, d), vs.reshape(-1, 1, d),
                  col.reshape(-1, 1))
    r = rows[:, None]
    own, new_pos, new_score = (x.gather(1, entry) for x in new_meta)
    owner[r, slot, col] = torch.where(ok, own, -1).to(owner.dtype)
    pos[r, slot, col] = torch.where(ok, new_pos, -1).to(pos.dtype)
    score[r, slot, col] = torch.where(ok, new_score, score[r, slot, col])


def chunk_attend(q, k, v, storage, layer, table, n, rows, positions, pos, score, policy, ring=None, count=None):
    """Prefill pieces of t tokens of B bounded caches holding n tokens each (slots table[:, :n]): each
    piece attends over its cache plus itself. Returns (out [B*t, Hq, D], and the n + t candidates of each
    sequence: K and V [B, n + t, H, D] as the storage reads them back, positions, folded scores or None, the
    tokens each stands for or None). ring: the caches' mixed-width residuals (rows `rows`; `read_kv`).
    count [R, cap, H]: the tokens each slot stands for, with a merging policy (`merge`)."""
    bsz = table.shape[0]
    q, k, v = (x.unflatten(0, (bsz, -1)) for x in (q, k, v))  # [B, t, H, D]
    read = None if ring is None else WindowRead(ring, rows, positions.view(bsz, -1)[:, 0], pos)
    kc, vc = read_kv(storage, layer, table[:, :n].long(), read)
    back = ring or storage
    cand_k = torch.cat([kc, back.roundtrip(layer, k).to(kc.dtype)], 1)
    cand_v = torch.cat([vc, back.roundtrip(layer, v).to(vc.dtype)], 1)
    new_pos = positions.view(bsz, -1, 1).expand(-1, -1, k.shape[2]).to(pos.dtype)
    cand_pos = torch.cat([pos[rows, :n], new_pos], 1)
    cand_count = None if count is None else torch.cat([count[rows, :n], torch.ones_like(new_pos, dtype=count.dtype)], 1)
    out, cand_score = piece_attention(q, cand_k, cand_v, policy, None if score is None else score[rows, :n],
                                      cand_pos, attention_bias(cand_count))
    return out.flatten(0, 1), cand_k, cand_v, cand_pos, cand_score, cand_count


def merge_dropped(policy, keep, cand_k, cand_v, cand_pos, cand_score, cand_count):
    """Each head's candidates that `keep` [B, M, H] drops (all held: M - budget a head) merged into the kept ones
    (`merge`): the candidates' K, V and counts after it, and which candidates took tokens [B, M, H]."""
    dropped = marked_first(~keep, -2)[:, :cand_pos.shape[1] - policy.budget]
    weight = merge_weight(policy, cand_pos, cand_score, cand_count)
    k, v, count, _, _, took = merge_into_kept(cand_k, cand_v, cand_count, weight, dropped,
                                              keep & policy.mergeable(cand_pos))
    return k, v, count, took


def kept_order(policy, cand_pos, cand_score, keep=None):
    """The candidates each head keeps (`keep`, else the policy's keep mask), as indices in stream order:
    [..., budget, H] of [..., M, H]."""
    keep = policy.keep_mask(cand_pos, cand_score) if keep is None else keep
    order = marked_first(keep, -2)
    return order.narrow(-2, 0, policy.budget)


def keep_and_rewrite(storage, layer, table, n, rows, pos, score, policy, cand_k, cand_v, cand_pos, cand_score,
                     cand_count=None, new=None, count=None):
    """After `chunk_attend`: each head's kept candidates, in stream order, are gathered and written to local
    slots [0, budget) in a few whole-tensor operations (no per-head loop, no host sync). The protected prefix
    [0, P) is its own gather, so those slots (possibly blocks shared with other sequences) are not written.
    A storage that does not read back exactly what was written (a packed pool) moves its stored form instead:
    the cached tokens' packed bytes and the new tokens `new` = (k, v) [B, t, H, D] packed once, so no kept
    token is ever quantized twice. count [R, cap, H] (a merging policy's, with `cand_count`): each head's evicted
    candidates are first merged into kept ones (`merge`), which an exact storage then writes; returns the merged
    candidates' K, V and which took tokens [B, M, H] (mixed widths rewrite their residuals), else None."""
    b = policy.budget
    keep = policy.keep_mask(cand_pos, cand_score)
    took = None
    if count is not None:
        cand_k, cand_v, cand_count, took = merge_dropped(policy, keep, cand_k, cand_v, cand_pos, cand_score, cand_count)
    order = kept_order(policy, cand_pos, cand_score, keep)  # [B, b, H]
    first = min(policy.protected_prefix, n)
    if storage.exact:
        cands = [cand_k, cand_v]
    else:
        cached = storage.gather_raw(layer, table[:, :n].long())
        cands = [torch.cat([c, p], 1) for c, p in zip(cached, storage.pack(*new))]
        if took is not None:  # a key that took tokens is a new value, packed once; the others keep their bytes
            cands = [torch.where(took[..., None], r, c) for c, r in zip(cands, storage.pack(cand_k, cand_v))]
    kept = [c.gather(1, order[:, first:, :, None].expand(-1, -1, -1, c.shape[3])) for c in cands]
    if storage.exact:
        storage.write(layer, table[:, first:b].long(), *kept)
    else:
        storage.write_raw(layer, table[:, first:b].long(), kept)
    pos[rows, :b] = cand_pos.gather(1, order)
    pos[rows, b:] = pos.new_full((), -1)
    if score is not None:
        score[rows, :b] = cand_score.gather(1, order)
    if count is not None:
        count[rows, :b] = cand_count.gather(1, order)
    return None if took is None else (cand_k, cand_v, took)
