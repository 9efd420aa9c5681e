"""Continuous batching: which sequences run in the next step, and how many tokens each feeds.

Every step (vLLM v1's order): running decodes first, one token each; then prefill chunks of running
sequences; then waiting sequences are admitted in arrival order while the per-step token budget
(`max_num_batched_tokens`), the sequence limit and free blocks allow. A decode that needs a block when
none is free preempts the newest running sequence: its blocks are freed and it goes back to the front of
the queue. While `swap_bytes` allow (vLLM's --swap-space) its cache is first copied to host memory: an
unbounded sequence's full blocks, which come back as prefix-cache hits when it is admitted again (those still
cached are taken as they are), so only its last, partial block is computed again; a bounded sequence's whole
state (blocks, positions, scores), restored as it was. Without room there it is recomputed. A request that
could never fit in the pool is refused when it is added.

A KVzip sequence (`Sequence.reading`) runs as an unbounded one while its context comes in; the step that feeds the
context's last piece keeps room for its bounded cache. The engine then reads the context again, a piece a step
(`Sequence.rereading`, counted in the step's token budget), and the bounded cache keeps what that scores.

Chunk boundaries of a bounded (evicting) sequence are fixed by the sequence alone: its prompt is fed in
pieces ending at multiples of `prefill_chunk` (and where its question starts, if the request says), and
tokens it generated (replayed after a preemption) one at a time, as its decode fed them. Eviction runs at
the end of each piece, so the kept set - and the output - never depend on what else was in the batch.
Unbounded sequences keep every token, so any split gives the same result; they take whatever the token budget
leaves.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..cache import KVCache
from ..cache.policies import FullPolicy
from ..cache.block_pool import block_hash
from ..errors import KvboundError
from .generate import SecondReading, piece_end

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass
class Rereading:
    """A KVzip sequence's second reading under way (`LLMEngine._start_reading`): the reading of its held context,
    the bounded cache that keeps its choice, and the full cache's last logits, its first draw's (None when a question
    follows)."""
    reading: SecondReading
    bounded: KVCache
    logits: object = None


HELD = FullPolicy()  # the cache of a KVzip sequence's context until it is scored (`Sequence.reading`)


def peak_blocks(policy, context: int, total: int, block_size: int) -> int:
    """Blocks one request needs at its largest, alone in the pool: a bounded cache's room (beside a KVzip context
    held whole until it is read again), or all `total` tokens of an unbounded one."""
    blocks = lambda tokens: -(-tokens // block_size)  # noqa: E731
    if not policy.bounded:
        return blocks(total)
    return blocks(policy.capacity) + (blocks(context) if policy.reads_again(context) else 0)


@dataclass
class Sequence:
    """One completion: its prompt, what it generated, its policy, and (while admitted) its cache."""
    request_id: str
    index: int  # which of the request's n completions
    prompt: list[int]
    params: object  # sampling.SamplingParams
    policy: object
    arrival: float = 0.0
    output: list[int] = field(default_factory=list)
    status: str = WAITING
    cache: KVCache | None = None
    seed: int | None = None  # of this completion's draws (the request's seed + its index)
    finish_reason: str | None = None
    preemptions: int = 0
    published: int = 0  # leading blocks published to the prefix cache
    last_hash: int | None = None
    forked: bool = False  # the n - 1 siblings have been made
    hit_tokens: int = 0  # prompt tokens found in the prefix cache at the last admission
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache at the first admission
    peak_blocks: int = 0  # the most pool blocks its cache held at once
    ring_bytes: int = 0  # mixed widths: its window residuals' bytes, beside the pool
    tokens_evicted: int = 0  # tokens processed but no longer held (per layer), when its cache was last dropped
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)  # per generated token, when the request asks for them
    text: str | None = None  # the output text so far, kept when the request has stop strings
    decoder: object = None  # its incremental detokenizer (models.tokenizer.StreamDecoder)
    swapped: tuple | None = None  # while preempted: (blocks, their bytes / a bounded cache's snapshot) on the host
    seen_at_preemption: int = 0  # tokens its cache had processed when it was last preempted
    pending: int = 0  # tokens sampled on the device and not yet read here (the engine's run-ahead)
    question_start: int | None = None  # a bounded prefill piece ends here (generate.piece_end)
    scored: bool = False  # False while a KVzip sequence's context is still to be read again (`reading`)
    rereading: Rereading | None = None  # KVzip: its context's second reading, while under way

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def token_slice(self, a: int, b: int) -> list[int]:
        """tokens[a:b] without building the whole list (a step feeds a few tokens of a long sequence)."""
        p = len(self.prompt)
        if b <= p:
            return self.prompt[a:b]
        if a >= p:
            return self.output[a - p:b - p]
        return self.prompt[a:] + self.output[:b - p]

    @property
    def context_end(self) -> int:
        """Where its context ends: its question's start, or its prompt's end."""
        return self.question_start or len(self.prompt)

    @property
    def reading(self) -> bool:
        """A KVzip sequence (`policy.reconstructs`) holding its context whole in an unbounded cache, until the
        engine has read it a second time and a bounded cache keeps what that reading scores
        (`LLMEngine._start_reading`); meanwhile it runs as an unbounded sequence."""
        return self.policy.reconstructs and not self.scored

    @property
    def bounded(self) -> bool:
        return self.policy.bounded and not self.reading

    @property
    def cache_policy(self):
        """The policy of the cache it is admitted with: a full one while it reads its context."""
        return HELD if self.reading else self.policy

    def drop_cache(self):
        """Give the cache's blocks back (finished, preempted, or not admitted this step)."""
        self.peak_blocks = max(self.peak_blocks, len(self.cache.store.blocks))
        self.ring_bytes = 0 if self.cache.ring is None else self.cache.ring.bytes_per_row()
        self.tokens_evicted = self.cache.seen - len(self.cache)
        self.cache.release()
        self.cache = None
        if self.rereading is not None:
            self.rereading.bounded.release()
            self.rereading = None

    def to_feed(self) -> int:
        """Tokens not yet in the cache (the last sampled token included, even while it is pending)."""
        return len(self.prompt) + len(self.output) + self.pending - (self.cache.seen if self.cache is not None else 0)

    def feed(self, t: int) -> list[int]:
        """The next t tokens to feed; one still pending on the device reads 0 here (the engine fills it in there)."""
        a = self.cache.seen
        known = self.token_slice(a, min(a + t, len(self.prompt) + len(self.output)))
        return known + [0] * (t - len(known))

    @property
    def finishing(self) -> bool:
        """Its pending token reaches max_tokens: it ends once that token is read, whatever it is."""
        return self.pending > 0 and len(self.output) + self.pending >= self.params.max_tokens

    def next_piece(self, room: int, chunk: int) -> int:
        """How many tokens to feed now, given `room` left in this step's token budget (0 = wait). An
        unbounded sequence feeds up to `chunk` tokens, fewer where the room ends (pieces of any lengths
        attend as one batch); a bounded one whole chunks, whose ends its evictions follow."""
        seen, left = (self.cache.seen if self.cache is not None else 0), self.to_feed()
        if not self.bounded:
            piece = min(left, chunk, self.context_end - seen if self.reading else left)
            return min(piece, room)
        if seen >= len(self.prompt):  # replaying generated tokens: one per step, as decoding fed them
            return 1 if room >= 1 else 0
        piece = piece_end(seen, len(self.prompt), chunk, self.question_start) - seen
        return piece if piece <= room else 0


class Scheduler:
    def __init__(self, pool, make_cache, max_num_batched_tokens: int = 512, max_num_seqs: int = 256,
                 prefill_chunk: int = 512, swap_bytes: int = 0):
        if max_num_batched_tokens < prefill_chunk:
            raise KvboundError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= prefill_chunk "
                               f"({prefill_chunk}): a bounded sequence's prefill pieces are whole chunks")
        self.pool = pool
        self.make_cache = make_cache  # (policy, prefix-cache hit blocks) -> KVCache
        self.max_tokens_per_step = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.chunk = prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swap_left = swap_bytes  # host memory left for preempted sequences' blocks
        self.rereads: list[Sequence] = []  # KVzip: the sequences whose next second-reading piece this step counts
        self.stats = dict(preemptions=0, prompt_tokens=0, prefix_hit_tokens=0, steps=0, swapped_out_blocks=0,
                          swapped_in_blocks=0, recomputed_tokens=0, host_hit_tokens=0)

    # --- requests -------------------------------------------------------------------------------
    def add(self, seq: Sequence):
        if seq.params.n > self.max_num_seqs:
            raise KvboundError(f"request {seq.request_id}: n={seq.params.n} completions, but at most "
                               f"{self.max_num_seqs} sequences run at once (max_num_seqs)")
        need = peak_blocks(seq.policy, seq.context_end, len(seq.prompt) + seq.params.max_tokens, self.pool.block_size)
        usable = self.pool.usable_blocks
        if need > usable:
            what = (f"its cache bound ({seq.policy.budget} tokens)" if seq.policy.bounded else
                    f"prompt ({len(seq.prompt)}) + max_tokens ({seq.params.max_tokens})")
            verb = "needs"
            if seq.policy.reads_again(seq.context_end):
                what = f"its context ({seq.context_end} tokens, held whole until it is read again) and {what}"
                verb = "need"
            raise KvboundError(f"request {seq.request_id}: {what} {verb} {need} blocks of "
                               f"{self.pool.block_size} tokens, but the pool has only {usable}")
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step -------------------------------------------------------------------------------
    def schedule(self, run_ahead: bool = False) -> list[tuple[Sequence, int]] | None:
        """Pick this step's (sequence, tokens to feed); reserves blocks for them. run_ahead: some sequences'
        last tokens are still pending on the device, so nothing may be preempted (a preempted sequence must know
        its tokens); None when a decode's blocks do not fit without preempting (blocks reserved for the decodes
        before it stay theirs: reserving again takes none)."""
        batch: list[tuple[Sequence, int]] = []
        room = self.max_tokens_per_step
        self.pool.promised = 0  # room for the last step's forks was taken by them
        prefills, self.rereads = [], []
        for seq in list(self.running):  # decodes first
            if seq.rereading is not None:  # KVzip: its context's next piece is read again in this step
                room -= seq.rereading.reading.piece
                self.rereads.append(seq)
                continue
            if seq.status != RUNNING or seq.finishing:  # its last token is drawn: no step more
                continue
            if seq.to_feed() != 1:
                prefills.append(seq)
                continue
            while not self._take(seq, 1):
                if run_ahead:
                    return None
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status == RUNNING:
                batch.append((seq, 1))
                room -= 1
        for seq in prefills:  # then prefills (and replays) already under way
            if room <= 0:
                break
            if seq.status == RUNNING:
                t = seq.next_piece(room, self.chunk)
                if t and self._take(seq, t):
                    batch.append((seq, t))
                    room -= t
        while self.waiting and room > 0 and len(self.running) + self._members(self.waiting[0]) <= self.max_num_seqs:
            seq = self.waiting[0]
            if seq.cache is None:
                self._attach_cache(seq)
                if seq.cache is None:  # its swapped-out blocks do not fit yet: it waits for room, in order
                    break
            t = seq.next_piece(room, self.chunk)
            if not t or not self._reading_fits(seq) or not self._take(seq, t):
                if not self.running:  # nothing will free blocks: must not happen when `add` checked
                    raise KvboundError(f"request {seq.request_id} cannot be scheduled in an empty pool")
                seq.drop_cache()
                break
            self.waiting.popleft()
            if seq.preemptions:  # tokens processed before that neither the swap nor the prefix cache gave back
                self.stats["recomputed_tokens"] += max(0, seq.seen_at_preemption - seq.cache.seen)
                self._drop_swap(seq)
            if seq.preemptions == 0:  # counted once: recomputation after a preemption is no hit (vLLM #25780)
                self.stats["prompt_tokens"] += len(seq.prompt)
                self.stats["prefix_hit_tokens"] += seq.hit_tokens
                seq.cached_tokens = seq.hit_tokens
            seq.status = RUNNING
            self.running.append(seq)
            batch.append((seq, t))
            room -= t
        waits = any(s.rereading is None for s in self.running)
        if not batch and waits and not run_ahead:  # running prefills all wait for blocks: free some, retry
            self.preempt(self.running[-1])
            return self.schedule()
        if batch or not run_ahead:
            self.stats["steps"] += 1
        return batch

    def _reading_fits(self, seq: Sequence) -> bool:
        """A KVzip sequence starts only when the rest of its peak (its context held whole, then its bound) fits beside
        the rest of the peaks of those already reading: contexts that together overfill the pool would preempt one
        another before any is read again, and be computed again and again."""
        if not seq.reading:
            return True
        return sum(map(self._left_to_read, [*self.running, seq])) <= self.pool.num_free

    def _left_to_read(self, seq: Sequence) -> int:
        """Blocks a sequence still reading its context takes before its peak (none once its second reading is under
        way: its bounded cache has its blocks)."""
        if not seq.reading or seq.rereading is not None:
            return 0
        peak = peak_blocks(seq.policy, seq.context_end, 0, self.pool.block_size)
        return max(0, peak - len(seq.cache.store.blocks))

    @staticmethod
    def _members(seq: Sequence) -> int:
        """Sequences it counts for against max_num_seqs: its n completions until they are forked."""
        return 1 if seq.forked else seq.params.n

    def fork_blocks(self, seq: Sequence, t: int) -> int:
        """Blocks the forks of a sequence drawing its first token after t more take in a striped pool, where
        each copies its parent's blocks (a paged pool shares them)."""
        if not self.pool.striped or seq.forked or seq.params.n == 1 or seq.to_feed() != t:
            return 0
        return (seq.params.n - 1) * -(-max(seq.cache.store.capacity, seq.cache.slots_needed(t)) // self.pool.block_size)

    def _take(self, seq: Sequence, t: int) -> bool:
        """Reserve the blocks (new and copy-on-write) that feeding t tokens needs, if there are enough."""
        cache = seq.cache
        scoring = self.scored_blocks(seq) if seq.reading and cache.seen + t == seq.context_end else 0
        if t == 1 and not seq.bounded and not scoring:  # the common decode: room left in a private last block
            n, bs = len(cache), self.pool.block_size
            if n < cache.store.capacity and self.pool.ref[cache.store.blocks[n // bs]] == 1:
                return True
        if t == 1 and seq.bounded:
            cache.take_spare()
            if cache.store.private and cache.slots_needed(1) <= cache.store.capacity:
                return True  # a bounded decode within its blocks, none of them shared
        forks = self.fork_blocks(seq, t)
        if self._blocks_needed(seq, t) + forks + scoring > self.pool.num_free:
            return False
        seq.cache.prepare(t)
        self.pool.promised += forks + scoring
        return True

    def scored_blocks(self, seq: Sequence) -> int:
        """Blocks a KVzip sequence's bounded cache takes once its context is in (kept for it from the step that feeds
        the context's last piece, as `LLMEngine._start_reading` takes them)."""
        return -(-seq.policy.capacity // self.pool.block_size)

    def _blocks_needed(self, seq: Sequence, t: int) -> int:
        cache = seq.cache
        store = cache.store
        shared = sum(self.pool.ref[b] > 1 for b in store.blocks[cache.writable_from() // self.pool.block_size:])
        return store.blocks_for(cache.slots_needed(t)) + shared

    def _attach_cache(self, seq: Sequence):
        """A fresh cache for an admitted sequence, starting from every cached block of its prompt it may
        share: all full blocks but the one holding the last prompt token (which must be computed to give
        logits), and for a bounded sequence only blocks inside its protected prefix (it never writes those)."""
        bs = self.pool.block_size
        if seq.swapped is None:  # (again, after a preemption recomputes it)
            seq.scored = not seq.policy.reads_again(seq.context_end)
        if seq.swapped is not None and seq.bounded:
            if not self._restore(seq):
                return
            held = 0
        else:
            tokens = seq.prompt if seq.swapped is None else seq.tokens
            limit = (len(tokens) - 1) // bs
            if seq.bounded:
                limit = min(limit, seq.policy.protected_prefix // bs)
            if seq.reading:  # its context's last piece is computed: the step that feeds it scores the context
                limit = min(limit, (seq.context_end - 1) // bs)
            hits = self.pool.match_prefix(tokens, limit)
            hashes = [self.pool.block_info[b][0] for b in hits]
            seq.cache = self.make_cache(seq.cache_policy, hits)
            seq.cache.prompt_scored = seq.scored
            kept = len(seq.cache.store.blocks)  # a striped pool keeps the hits it had room for
            chain = hashes[kept - 1] if kept else None  # the hash chain goes on from the last one kept
            if seq.swapped is not None and not self._swap_in(seq, tokens, kept, limit, chain):
                seq.cache.release()
                seq.cache = None
                return
            if seq.swapped is None and self.pool.host:
                self._from_host(seq, tokens, kept, limit, chain)
            held = len(seq.cache.store.blocks)
            if held:
                seq.cache.adopt_prefix(held * bs)
        seq.published, seq.last_hash = 0, None
        seq.hit_tokens = held * bs

    def _swap_in(self, seq: Sequence, tokens: list[int], first: int, limit: int, chain: int | None) -> bool:
        """A swapped-out sequence's full blocks after its `first` prefix-cache hits, up to `limit`, back in its
        cache; False while the pool has no room for all of them."""
        full, host = seq.swapped
        bs = self.pool.block_size
        n = min(full, limit) - first
        if n <= 0:
            return True
        if not self._write_in(seq, tokens, first, [x[:, first * bs:(first + n) * bs] for x in host], chain):
            return False
        self.stats["swapped_in_blocks"] += n
        return True

    def _from_host(self, seq: Sequence, tokens: list[int], first: int, limit: int, chain: int | None):
        """The prompt's blocks after its `first` prefix-cache hits that the pool's host tier holds, back in its
        cache while the pool has room: copied in, not computed again."""
        hashes = self.pool.host_match(tokens, first, limit, chain)[:self.pool.num_free]
        if hashes and self._write_in(seq, tokens, first, self.pool.take_host(hashes), chain):
            self.stats["host_hit_tokens"] += len(hashes) * self.pool.block_size

    def _write_in(self, seq: Sequence, tokens: list[int], first: int, host: list, chain: int | None) -> bool:
        """Host bytes of full blocks (`BlockPool.read_blocks`' layout) into the cache's next blocks after its
        `first`, published under their hashes, whose chain goes on from `chain`; False without room for them."""
        bs, store = self.pool.block_size, seq.cache.store
        n = host[0].shape[1] // bs
        if n > self.pool.num_free:
            return False
        store.grow((first + n) * bs)
        blocks = store.blocks[first:first + n]
        self.pool.write_blocks(blocks, host)
        h = chain
        for i, b in enumerate(blocks, first):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = block_hash(h, chunk)
            self.pool.publish(b, h, chunk)
        return True

    def _restore(self, seq: Sequence) -> bool:
        """A swapped-out bounded sequence's cache back as it was, once the pool has room for its blocks."""
        blocks, state = seq.swapped
        if blocks > self.pool.num_free:
            return False
        seq.cache = self.make_cache(seq.policy, [])
        seq.cache.restore(state)
        self.stats["swapped_in_blocks"] += blocks
        return True

    def _swap_out(self, seq: Sequence):
        """Copy a preempted sequence's cache to host memory, if the swap space has room: an unbounded one's full
        blocks, a bounded one's whole state."""
        blocks = len(seq.cache.store.blocks) if seq.bounded else len(seq.cache) // self.pool.block_size
        need = blocks * self.pool.block_bytes
        if not blocks or need > self.swap_left:
            return
        if seq.bounded:
            seq.swapped = (blocks, seq.cache.snapshot())
        else:
            seq.swapped = (blocks, self.pool.read_blocks(seq.cache.store.blocks[:blocks]))
        self.swap_left -= need
        self.stats["swapped_out_blocks"] += blocks

    def _drop_swap(self, seq: Sequence):
        if seq.swapped is not None:
            self.swap_left += seq.swapped[0] * self.pool.block_bytes
            seq.swapped = None

    def preempt(self, seq: Sequence):
        self.running.remove(seq)
        self._swap_out(seq)
        seq.seen_at_preemption = seq.cache.seen
        seq.drop_cache()
        seq.status = WAITING
        seq.preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str):
        seq.status, seq.finish_reason = FINISHED, reason
        self.running.remove(seq)
        seq.drop_cache()

    def abort(self, seq: Sequence):
        """Drop a sequence wherever it is (waiting or running); its blocks are freed at once."""
        if seq.status == RUNNING:
            self.finish(seq, "abort")
        elif seq.status == WAITING:
            self.waiting.remove(seq)
            self._drop_swap(seq)
            if seq.cache is not None:
                seq.drop_cache()
            seq.status, seq.finish_reason = FINISHED, "abort"

    def publish(self, seq: Sequence):
        """Publish the sequence's full blocks that it will never write again: every full block of an
        unbounded sequence (it only appends), the blocks of a bounded one's protected prefix."""
        bs, cache = self.pool.block_size, seq.cache
        limit = cache.seen if not seq.bounded else min(cache.seen, seq.policy.protected_prefix)
        if cache.ring is not None:  # mixed widths: the sinks' residuals live in the cache, not in the blocks
            limit = 0
        while (seq.published + 1) * bs <= limit:
            i = seq.published
            chunk = seq.token_slice(i * bs, (i + 1) * bs)
            seq.last_hash = block_hash(seq.last_hash, chunk)
            self.pool.publish(cache.store.blocks[i], seq.last_hash, chunk)
            seq.published += 1
