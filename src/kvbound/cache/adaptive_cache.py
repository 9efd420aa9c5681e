"""KV cache of one sequence whose heads and layers keep different numbers of tokens (AdaKV, PyramidKV).

`KVCache` gives each KV head of a layer the same slots, so a head holds exactly its equal share. Here a layer's
tokens are entries, each owned by one KV head: K and V [E, head_dim] with an owner, a stream position and a
score per entry. A layer holds at most heads x its budget per head (`policy.head_budgets`) after each eviction,
however its heads share them, so its memory is that of a uniform cache of that budget. Each query head
attends to its KV head's entries only (a mask over the layer's entries; the PyTorch route). The engine's
kernels read one budget per head, so these policies run on single-sequence caches.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import KvboundError
from ..kernels import fold_scores
from .policies import _pinned_count
from .steps import fresh_scores, rescored


class AdaptiveKVCache:
    def __init__(self, config, policy, device="cpu", dtype=torch.float32, kv_bits=None, rotate_keys=None, **_):
        """dtype: the dtype K/V are stored in. Quantized widths and re-indexed positions live in `KVCache`."""
        if kv_bits is not None or rotate_keys is not None:
            raise KvboundError(f"{policy.name}: per-head budgets store K/V unquantized at stream positions "
                               "(no --kv-bits, no --reindex-positions)")
        self.cfg, self.policy, self.device, self.dtype = config, policy, device, dtype
        self.bounded, self.budget, self.rotate_keys = True, policy.budget, None
        layers, self.heads = config.num_layers, config.num_kv_heads
        self.budgets = [policy.head_budgets(layer, layers) for layer in range(layers)]
        protected = _pinned_count(policy.sink, policy.pinned) + policy.recent
        if protected > min(sure for sure, _ in self.budgets):
            raise KvboundError(f"{policy.name}: sinks, pinned spans and the recent window ({protected} tokens) do "
                               f"not fit the smallest per-head budget of this {layers}-layer model "
                               f"({min(sure for sure, _ in self.budgets)})")
        d = config.head_dim
        self.k = [torch.zeros(0, d, device=device, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(0, d, device=device, dtype=dtype) for _ in range(layers)]
        self.owner = [torch.zeros(0, dtype=torch.uint8, device=device) for _ in range(layers)]
        self.pos = [torch.zeros(0, dtype=torch.int32, device=device) for _ in range(layers)]
        self.score = [torch.zeros(0, dtype=torch.float32, device=device) for _ in range(layers)]
        self.seen = 0

    @property
    def capacity(self) -> int:
        return self.policy.capacity

    def __len__(self) -> int:
        """Tokens held per head in the first layer, on average."""
        return len(self.pos[0]) // self.heads

    def next_positions(self, t: int) -> torch.Tensor:
        return torch.arange(self.seen, self.seen + t, device=self.device)

    def advance(self, t: int):
        self.seen += t

    def attend(self, layer: int, q, k, v, positions):
        """Attend the t new tokens over the layer's entries and themselves, fold this step's attention into the
        scores, and keep the layer's budget if over it."""
        t, h, d = k.shape
        own = torch.cat([self.owner[layer], torch.arange(h, device=k.device, dtype=torch.uint8).repeat(t)])
        pos = torch.cat([self.pos[layer], positions.to(torch.int32).repeat_interleave(h)])
        ks = torch.cat([self.k[layer], k.reshape(t * h, d).to(self.dtype)])
        vs = torch.cat([self.v[layer], v.reshape(t * h, d).to(self.dtype)])
        out, step = self._attention(q, ks, vs, own, pos, positions)
        score = self._folded(layer, step, own, pos, ks, fresh_scores(self.policy, k, self.score[layer]).flatten(), t)
        sure, share = self.budgets[layer]
        keep = None
        if len(pos) > h * (share + self.policy.evict_every - 1):
            keep = self.policy.keep_entries(pos, score, own, h, sure, h * share)
        for name, x in (("k", ks), ("v", vs), ("owner", own), ("pos", pos), ("score", score)):
            getattr(self, name)[layer] = x if keep is None else x[keep]
        return out

    def _attention(self, q, ks, vs, own, pos, positions):
        """Each query head over its KV head's entries at positions up to its own: out [t, Hq, D], and each
        entry's attention summed over the last `policy.score_window` queries of its owner's group [E] (None
        for a policy that needs no attention; "normalized" weighs each query by the keys it sees)."""
        t, hq, d = q.shape
        group = torch.arange(hq, device=q.device) // (hq // self.heads)
        mask = (own[None, None, :] == group[None, :, None]) & (pos[None, None, :] <= positions[:, None, None])
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], ks.to(q.dtype)[None, None],
                                             vs.to(q.dtype)[None, None], attn_mask=mask.transpose(0, 1)[None],
                                             enable_gqa=True)[0].transpose(0, 1)
        if self.policy.fold is None:
            return out, None
        first = t - min(t, self.policy.score_window or t)
        seen = mask[first:]
        logits = (q[first:].float() @ ks.float().T[None]) * d ** -0.5  # [tq, Hq, E]
        probs = logits.masked_fill(~seen, float("-inf")).softmax(-1)
        if self.policy.fold == "normalized":
            probs = probs * seen.sum(-1, keepdim=True)
        return out, probs.sum(dim=(0, 1))

    def _folded(self, layer, step, own, pos, ks, fresh, t):
        """The entries' scores after this step, from the held ones' and the new ones' `fresh`: a decode step's
        attention folds in; a prefill piece's goes through the policy's `piece_scores` one head at a time
        (SnapKV pools along each head's stream order); KeyDiff rescores each head's keys."""
        score = torch.cat([self.score[layer], fresh])
        if step is not None and t == 1:
            score = fold_scores(score, step, self.policy.fold, self.policy.fold_decay)
            step = None
        if step is None and not self.policy.rescores:
            return score
        out = torch.empty_like(score)
        for head in range(self.heads):
            mine = (own == head).nonzero()[:, 0]
            one = score[mine, None] if step is None else self.policy.piece_scores(score[mine, None], step[mine, None],
                                                                                  pos[mine, None])
            out[mine] = rescored(self.policy, one, ks[mine, None], pos[mine, None])[:, 0]
        return out

    def positions_held(self, layer: int) -> torch.Tensor:
        """Stream positions held by each head of a layer, [most held by a head, heads], -1 where a head holds fewer."""
        per_head = [self.pos[layer][self.owner[layer] == head].sort().values for head in range(self.heads)]
        width = max(len(p) for p in per_head)
        return torch.stack([F.pad(p, (0, width - len(p)), value=-1) for p in per_head], 1)

    def kept_positions(self, layer: int, head: int) -> list[int]:
        return sorted(self.pos[layer][self.owner[layer] == head].tolist())

    def nbytes(self) -> dict:
        """KV bytes held (K, V, and per entry its position, score and owner), as `KVCache.nbytes` counts them."""
        entries = sum(len(p) for p in self.pos)
        d = self.cfg.head_dim
        total = entries * (2 * d * self.k[0].element_size() + 4 + 4 + 1)
        bf16 = 2 * 2 * self.heads * d * self.seen * len(self.pos)
        return {"held_bytes": total, "tokens_held": len(self), "full_bf16_bytes": bf16,
                "bytes_per_token_layer": 2 * self.heads * d * self.k[0].element_size(),
                "compression": bf16 / total if total else float("inf")}
