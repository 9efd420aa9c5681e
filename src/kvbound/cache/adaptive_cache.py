"""KV cache of one sequence whose heads and layers keep different numbers of tokens (AdaKV, PyramidKV).

`KVCache` gives each KV head of a layer its own column of slots, all columns the same length, so a head holds
exactly its equal share. Here every (slot, column) place of a layer is an entry that any KV head may own: the
layout of `KVCache` ([slots, heads] places, K/V in a `store.KVStore`) plus an owner per place. A layer holds at
most heads x its budget per head (`policy.head_budgets`) after each eviction, however its heads share them.
Layers whose budgets differ (PyramidKV) share the store's rows: a layer that keeps more than the mean borrows
rows that layers keeping fewer never use (`stacked.layer_places`), so the store holds what a uniform budget's would,
in the engine's pool too. Each query head attends to its KV head's entries only (a mask over the layer's entries,
`steps.shared_piece`). Evicted entries become holes that new tokens fill, lowest first, so
nothing moves; the first tokens take slot j, column h for token j and head h, as in `KVCache`, which keeps a
protected prefix's blocks shareable. In the engine (a `PagedStore`) prefill pieces run batched as "places" groups
(`steps.shared_piece`, the step `attend` runs for one cache), and decodes as "shared" ones (`steps.shared_decode`),
below the budget too. With layers=global (KVzip's budgets) each layer's budget is planned once the prompt is scored
(`plan_layers`), its rows then borrowed as PyramidKV's are; in the engine, rows of stacked metadata hold each cache's
plan, so caches of different plans decode in one batch.
"""
from __future__ import annotations

from copy import copy

import torch

from ..errors import KvboundError
from .policies import pinned_count, refuse_prompt_scoring
from .reconstruct import check_scorable, prompt_kv
from .stacked import layer_places, place_slots, release
from .steps import keep_places, shared_piece
from .store import DenseStore


class AdaptiveKVCache:
    ring = None  # no mixed widths (`KVCache.ring`)

    def __init__(self, config, policy, device="cpu", dtype=torch.float32, kv_bits=None, rotate_keys=None,
                 store=None, stacked=None, **_):
        """dtype: the dtype K/V are stored in. store: where K/V live (default: a dense store of its own; the
        engine passes a PagedStore). stacked: (StackedMeta, row) holding this cache's owners, positions, scores
        and spare places, so that the engine's steady decodes of such caches run as one batch
        (`steps.shared_decode`). Quantized widths of its own and re-indexed positions live in `KVCache`."""
        if kv_bits is not None or rotate_keys is not None:
            raise KvboundError(f"{policy.name}: per-head budgets store K/V unquantized at stream positions "
                               "(no --kv-bits, no --reindex-positions)")
        self.cfg, self.device, self.heads = config, device, config.num_kv_heads
        self._lay_out(policy)
        self.store = store if store is not None else DenseStore(config.num_layers, self.store_rows, self.heads,
                                                                config.head_dim, device, dtype)
        self._hold(stacked)
        layers = config.num_layers
        self.steady = [False] * layers  # a layer that evicted one step's tokens: exactly its spare places are free
        self.filling = False  # a layer below its budget takes the next slot's places for each decode (`take_spare`)
        self.used = 0  # local slots [0, used) may hold entries
        self.held = [0] * layers  # entries each layer holds
        self.reach = 0  # the place rows this step's pieces reach in any layer: `used` after it
        self.seen = 0
        self.prompt_scored = False  # as `KVCache.prompt_scored`

    def _lay_out(self, policy):
        """The policy's budget of each layer (`policy.head_budgets`), the place rows it may use, and where they are in
        the store, which holds the mean layer's rows."""
        self.policy, self.bounded, self.budget, self.rotate_keys = policy, True, policy.budget, None
        layers = self.cfg.num_layers
        self.budgets = [policy.head_budgets(layer, layers) for layer in range(layers)]
        sure = min(s for s, _ in self.budgets)
        protected = pinned_count(policy.sink, policy.pinned) + policy.recent
        if protected > sure:
            raise KvboundError(f"{policy.name}: sinks, pinned spans and the recent window ({protected} tokens) do "
                               f"not fit the smallest per-head budget of this {layers}-layer model ({sure})")
        self.rows = [share + policy.evict_every for _, share in self.budgets]  # place rows each layer may use
        self.slots = max(self.rows)
        self.store_rows = -(-sum(self.rows) // layers)  # what the store holds per layer: the mean layer's rows
        # layers of different budgets: where each layer's place rows are (`layer_places`), as `StackedMeta.set_plan`
        self.places = layer_places(self.rows, self.device) if policy.layered else None

    def _hold(self, stacked):
        """Owners, positions, scores and spare places: views of a row of the policy's stacked metadata, or tensors of
        this cache's own (stacked None)."""
        self.stacked = stacked
        if stacked is not None:
            stacked[0].hold(stacked[1], self)
            self.owner.fill_(-1)
            self.pos.fill_(-1)
            self.score.zero_()
            return
        shape = (self.cfg.num_layers, self.slots, self.heads)
        self.owner = torch.full(shape, -1, dtype=torch.int16, device=self.device)  # each place's KV head, -1 free
        self.pos = torch.full(shape, -1, dtype=torch.int32, device=self.device)
        self.score = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.spare = torch.zeros((self.cfg.num_layers, self.heads), dtype=torch.long, device=self.device)

    def plan_layers(self, policy):
        """Lay this empty cache out for `policy`, whose layer budgets its prompt's scores planned (`H2OPolicy.plan`):
        the store's rows stay, the places move; in the engine its row of stacked metadata takes the plan, so that
        sequences of any plans batch together (`StackedMeta.set_plan`)."""
        store_rows = self.store_rows
        self._lay_out(policy)
        assert self.store_rows == store_rows, "a plan keeps the store's rows"
        if self.stacked is None:
            self._hold(None)
        else:
            self.stacked[0].set_plan(self.stacked[1], self.rows)

    @property
    def capacity(self) -> int:
        return self.store_rows

    def bind_stacked(self):
        """Point owner, pos, score and spare at this cache's row of its stacked metadata (again when rows grow)."""
        meta, row = self.stacked
        self.owner, self.pos, self.score, self.spare = (x[row] for x in (meta.owner, meta.pos, meta.score, meta.spare))

    def __len__(self) -> int:
        """Tokens held per head in the first layer, on average (read from the device: a cache's truth value is
        not its length, so test `cache is None`, never `not cache`)."""
        return int((self.owner[0] >= 0).sum()) // self.heads

    def next_positions(self, t: int) -> torch.Tensor:
        return torch.arange(self.seen, self.seen + t, device=self.device)

    def advance(self, t: int):
        self.seen += t
        self.used = max(self.used, self.reach)

    # --- used by the paged engine ---------------------------------------------------------------
    def step_kind(self, t: int) -> str | None:
        """On stacked rows: "shared" (a decode, each layer's spares free: `steps.shared_decode`) or "places" (a
        prefill piece: `steps.shared_piece`), both batched; None without a row (this cache's own `attend`)."""
        if self.stacked is None:
            return None
        return "shared" if t == 1 and (self.filling or all(self.steady)) else "places"

    @property
    def table_row(self) -> int:
        return self.store.row

    def slots_needed(self, t: int, layer: int = 0) -> int:
        return min(self.store_rows, self.used + t)

    def _room(self, layer: int, t: int) -> int:
        """Place rows the layer may fill this step: up to its own, within what `prepare` made the store hold
        (all of it before any row is borrowed)."""
        n = min(self.rows[layer], self.used + t)
        return n if self.store.capacity >= self.store_rows else min(n, self.store.capacity)

    def writable_from(self) -> int:
        return self.policy.protected_prefix

    def prepare(self, t: int):
        """Room for t more tokens' entries, and private copies of the shared blocks they may write."""
        if self.slots_needed(t) > self.store.capacity:
            self.store.grow(self.slots_needed(t))
        self.store.make_private(self.writable_from() // self.store.pool.block_size)

    def take_spare(self):
        """Before a decode in the paged engine: each layer that has not evicted yet (at its budget or below) takes
        the next slot's places as its heads' spares, where its own `attend` would write them, so that the cache's
        decodes join the batched "shared" group; a layer drops no place until it is full. Steady layers' spares
        come from the keep rule."""
        if self.stacked is not None and not self.filling and not all(self.steady):
            nxt = self.used * self.heads + torch.arange(self.heads, device=self.spare.device)
            for layer, steady in enumerate(self.steady):
                if not steady:
                    self.spare[layer] = nxt
            self.filling = True

    def decode_slots(self) -> int:
        """The local slots a decode attends over: those holding tokens and the new token's."""
        return min(self.used + 1, self.slots)

    def decoded(self):
        """Bookkeeping after a batched "shared" step: a cache filling up holds one more slot, and a layer whose rows
        are all in use evicted, so exactly its spares are free."""
        if self.filling:
            self.used += 1
            self.steady = [self.used >= rows for rows in self.rows]
            self.held = [self.heads * min(self.used, share) for _, share in self.budgets]
            self.filling = not all(self.steady)
        self.advance(1)

    def release(self):
        release(self)

    def snapshot(self) -> dict:
        return dict(slots=self.store.capacity, bytes=self.store.pool.read_blocks(self.store.blocks),
                    meta=[x.cpu() for x in (self.owner, self.pos, self.score, self.spare)], used=self.used,
                    seen=self.seen, steady=list(self.steady), filling=self.filling, held=list(self.held),
                    scored=self.prompt_scored)

    def restore(self, state: dict):
        if self.seen:
            raise KvboundError("restore: the cache already holds tokens")
        self.store.grow(state["slots"])
        self.store.pool.write_blocks(self.store.blocks, state["bytes"])
        for x, saved in zip((self.owner, self.pos, self.score, self.spare), state["meta"]):
            x[:, :saved.shape[1]].copy_(saved)  # stacked rows may have widened for another plan since
        self.used, self.seen, self.steady = state["used"], state["seen"], list(state["steady"])
        self.held = list(state["held"])
        self.filling = state["filling"]
        self.prompt_scored = state["scored"]

    def adopt_prefix(self, t: int):
        """Local slots [0, t) already hold tokens [0, t) in every head (a prefix-cache hit)."""
        if self.seen:
            raise KvboundError("adopt_prefix: the cache already holds tokens")
        if t > self.store.capacity:
            self.store.grow(t)
        self.owner[:, :t] = torch.arange(self.heads, dtype=self.owner.dtype, device=self.device)
        self.pos[:, :t] = torch.arange(t, dtype=self.pos.dtype, device=self.device)[:, None]
        self.used = self.seen = t
        self.held = [t * self.heads] * len(self.held)

    def fork(self) -> "AdaptiveKVCache":
        """A copy sharing this cache's blocks, with a stacked row of its own when one is free (`KVCache.fork`)."""
        child = copy(self)
        child.store = self.store.fork()
        child.steady, child.held = list(self.steady), list(self.held)
        child.stacked = None
        if self.stacked is not None:
            self.stacked[0].fork(self.stacked[1], child)
        if child.stacked is None:
            child.owner, child.pos, child.score, child.spare = (x.clone() for x in (self.owner, self.pos, self.score,
                                                                                     self.spare))
        return child

    # --- called by each attention layer -------------------------------------------------------
    def attend(self, layer: int, q, k, v, positions):
        """Attend the t new tokens over the layer's entries and themselves, fold this step's attention into the
        scores, keep the layer's budget if over it, and write the kept new tokens into free places: the batched step
        (`steps.shared_piece`) for this one cache."""
        if self.policy.reconstructs and not self.prompt_scored:
            refuse_prompt_scoring(self.policy, "a model forward over the cache")
        plan = self.piece_plan(layer, k.shape[0])  # (rows held, rows the piece may take: at least as many, evicts)
        storage, at, table = self.layer_table(layer, plan[1])
        rows = torch.zeros(1, dtype=torch.long, device=k.device)
        sure, share = self.budgets[layer]
        spares = plan[2] and self.policy.evict_every == 1  # evicting one step's tokens leaves its spares free
        meta = (x[layer][None] for x in (self.owner, self.pos, self.score))
        out = shared_piece(q[None], k[None], v[None], storage, at, table[None], rows, positions[None], *meta,
                           self.policy, sure, share, *plan, spare=self.spare[layer][None] if spares else None)
        self.after_piece(layer, k.shape[0], *plan)
        return out[0]

    def keep_scored(self, held, score: torch.Tensor):
        """`KVCache.keep_scored` with head budgets: each layer keeps its heads' shares of the n tokens the unbounded
        cache `held` holds by `score` [layers, n, H], as a prefill piece of them would (`steps.keep_places`)."""
        n, h = check_scorable(self, held), self.heads
        if self.policy.needs_plan:  # a sequence's own cache (the engine plans first, `LLMEngine._read_on`)
            self.plan_layers(self.policy.plan(score))
        rows = torch.zeros(1, dtype=torch.long, device=self.device)
        own = torch.arange(h, dtype=self.owner.dtype, device=self.device).repeat(n)[None]
        cand_pos = torch.arange(n, dtype=self.pos.dtype, device=self.device).repeat_interleave(h)[None]
        for layer in range(len(self.rows)):
            plan = self.piece_plan(layer, n)
            storage, at, table = self.layer_table(layer, plan[1])
            k, v = (x[None] for x in prompt_kv(held, layer))
            spares = plan[2] and self.policy.evict_every == 1
            meta = (x[layer][None] for x in (self.owner, self.pos, self.score))
            keep_places(storage, at, table[None], rows, *meta, self.policy, k, v, own, cand_pos,
                        score[layer].flatten()[None], 0, *self.budgets[layer], plan[1], plan[2],
                        spare=self.spare[layer][None] if spares else None)
            self.after_piece(layer, n, *plan)
        self.advance(n)
        self.prompt_scored = True

    def piece_plan(self, layer: int, t: int) -> tuple[int, int, bool]:
        """(place rows the layer's entries are in, place rows its new entries may take, whether it evicts) for a
        piece of t tokens: on the host, from the counts this cache keeps."""
        sure, share = self.budgets[layer]
        evict = self.held[layer] + t * self.heads > self.heads * (share + self.policy.evict_every - 1)
        room = self._room(layer, t)
        assert not evict or self.policy.evict_every > 1 or room == self.rows[layer], "an evicting layer fills its rows"
        return min(self.used, self.rows[layer]), room, evict

    def after_piece(self, layer: int, t: int, n: int, room: int, evict: bool):
        """Bookkeeping after a piece of t tokens in one layer (`piece_plan`'s figures): a layer that evicted holds its
        budget, and one evicting a step's tokens (evict_every 1) is steady, exactly its spares free."""
        self.filling = False  # its spares are not the next slot's once a piece wrote the lowest free places
        share = self.budgets[layer][1]
        self.held[layer] = self.heads * share if evict else self.held[layer] + t * self.heads
        self.reach = max(self.reach, room if evict else min(n + t, room))  # `used` once every layer ran (`advance`)
        if evict and self.policy.evict_every == 1:
            self.steady[layer] = True

    def pieced(self, t: int):
        """Bookkeeping after a batched piece of t tokens ("places" group) ran every layer."""
        plans = [self.piece_plan(layer, t) for layer in range(len(self.rows))]
        for layer, plan in enumerate(plans):
            self.after_piece(layer, t, *plan)
        self.advance(t)

    def layer_table(self, layer: int, n: int):
        """(storage, its layer, slots [n]) of the layer's first n place rows: the store's own layer where every layer
        keeps as many rows (as the engine's groups read them, `runner.layer_slots`), else slots of its view of every
        layer's slots (`all_layers`, layer 0), borrowed rows included (layers of different budgets)."""
        storage = self.store.storage
        local = self.store.slot_table(self.store_rows if n > self.store_rows else n)
        if self.places is None:
            return storage, layer, local[:n]
        at_layer, row = self.places[layer]
        return storage.all_layers(), 0, place_slots((at_layer[:n], row[:n]), local, storage)

    # --- introspection ------------------------------------------------------------------------
    def positions_held(self, layer: int) -> torch.Tensor:
        """Stream positions held by each head of a layer, [most held by a head, heads], -1 where a head holds fewer."""
        per_head = [self.kept_positions(layer, head) for head in range(self.heads)]
        width = max(map(len, per_head))
        return torch.tensor([p + [-1] * (width - len(p)) for p in per_head], dtype=torch.int32).T

    def kept_positions(self, layer: int, head: int) -> list[int]:
        return sorted(self.pos[layer][self.owner[layer] == head].tolist())

    def nbytes(self) -> dict:
        """KV bytes held (K, V, and per entry its position, score and owner), as `KVCache.nbytes` counts them."""
        live = self.owner >= 0
        entries = int(live.sum())
        d = self.cfg.head_dim
        total = sum(self.store.bytes_held(layer, live[layer]) for layer in range(len(live))) + entries * (4 + 4 + 2)
        bf16 = 2 * 2 * self.heads * d * self.seen * len(live)
        return {"held_bytes": total, "tokens_held": len(self), "full_bf16_bytes": bf16,
                "bytes_per_token_layer": self.store.bytes_per_token(),
                "compression": bf16 / total if total else float("inf")}
