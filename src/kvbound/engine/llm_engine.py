"""The serving engine: many requests at once over one paged KV pool, each with its own bounded cache.

`LLMEngine` runs steps: the scheduler picks (sequence, tokens) pairs, the runner feeds them to the model
as one flat batch (each sequence's cache attends its own tokens), and each sequence that finished its
piece samples its next token with its own sampling parameters. `llm.LLM` is the convenience front.
"""
from __future__ import annotations

import itertools
import numbers
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..cache import BlockPool, FullPolicy, KVCache, parse_policy, sequence_cache
from ..cache.kv_cache import recent_residuals
from ..cache.quant import MIXED, Fp8KV, check_mixed_policy
from ..cache.stacked import StackedMeta, stackable
from ..cache.store import PagedStore
from ..errors import KvboundError
from ..staging import to_device
from .cuda_graphs import DecodeGraphs
from .generate import SecondReading, check_question_start, read_pieces
from .runner import StepBatch, finish_step
from .sampling import SamplingParams, next_tokens, with_logprobs
from .scheduler import FINISHED, RUNNING, Rereading, Scheduler, Sequence


@dataclass
class CompletionOutput:
    """token_ids grows while the request runs; text is set when the request is done. logprobs: one
    {"logprob": ..., "top": [(token, logprob), ...]} per token when the request asked (`SamplingParams.logprobs`).
    tokens_evicted (tokens processed but no longer held, per layer) and peak_kv_bytes (the most pool blocks its
    cache held at once, shared prefix blocks included, plus mixed widths' window residuals) are set when it
    finishes."""
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[dict] | None = None
    tokens_evicted: int = 0
    peak_kv_bytes: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    arrival: float = 0.0
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Launched:
    """A step run on the device: its rows (`batch`), the sequences that drew a token and the draw, whose tokens
    stay on the device until read (`host_tokens`)."""

    def __init__(self, batch, seqs, logits, draw):
        self.batch, self.seqs, self.logits, self.draw = batch, seqs, logits, draw
        self.host, self.ready = None, None

    @property
    def tokens(self) -> torch.Tensor:
        return self.draw.tokens

    def copy_to_host(self):
        """Start the tokens' copy to the host, to be read later without stopping the GPU's queue."""
        if self.tokens.is_cuda:
            self.host = torch.empty(self.tokens.shape, dtype=self.tokens.dtype, pin_memory=True)
            self.host.copy_(self.tokens, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    def host_tokens(self) -> list[int]:
        self.draw.settle()
        if self.draw.redrawn or self.ready is None:  # drawn again after the copy started: read them now
            return self.tokens.tolist()
        self.ready.synchronize()
        return self.host.tolist()


def _plain(seq) -> bool:
    """Its token can stay on the device until the next step: it asked for no logprobs (read from the step's
    logits, which the next step overwrites). Draws see every earlier token: they run after the last step's
    tokens are read."""
    return seq.params.logprobs is None


FIRST_ROWS = 16  # stacked rows a policy's metadata starts with: per-request budgets each make a policy


class PoolCaches:
    """Makes the caches of admitted sequences over the engine's pool: a paged store from the prefix-cache hit
    blocks, and a row of the policy's stacked metadata when one is free. The scheduler holds it, and it holds
    nothing of the engine's, so a dropped engine is freed at once (no reference cycle waiting for the gc)."""

    def __init__(self, config, pool, device, kv_dtype, rows: int, mixed=None):
        """mixed: kv_bits heavy=4,recent=8 over a 4-bit pool; the caches' windows keep residuals beside it, in
        their stacked rows (or a row of their own)."""
        self.config, self.pool, self.device, self.kv_dtype, self.rows = config, pool, device, kv_dtype, rows
        self.mixed = mixed
        self.stacked: dict = {}  # policy -> StackedMeta of its bounded caches

    def stacked_meta(self, policy, grow: bool = True) -> StackedMeta:
        """The policy's stacked metadata, made on first use with FIRST_ROWS rows that grow as sequences come
        (`grow`), or all of them (a policy whose graphs are captured up front)."""
        policy = policy.unplanned  # a layers=global plan's caches hold rows of its policy's metadata
        if policy not in self.stacked:
            ring = (lambda rows: recent_residuals(self.config, policy, self.mixed, self.pool.packed.group, self.device,
                                                  rows)) if self.mixed else None
            self.stacked[policy] = StackedMeta(policy, self.config.num_layers, self.config.num_kv_heads, self.rows,
                                               self.device, ring, FIRST_ROWS if grow else None)
        return self.stacked[policy]

    def drop_idle(self, seen: set, keep) -> tuple[list, set]:
        """Drop the stacked metadata of policies idle now and in the last call's `seen` (the set it returned), other
        than `keep`'s: a server that meets many per-request budgets holds rows only for those in use, and one
        idle for a moment keeps them. Returns (the dropped policies' metadata, whose graphs the engine forgets;
        the policies idle now but kept)."""
        idle = {p for p, meta in self.stacked.items() if meta.idle and p != keep}
        return [self.stacked.pop(p) for p in idle & seen], idle - seen

    def __call__(self, policy, hits: list[int]) -> KVCache:
        stacked = None
        if stackable(policy):
            meta = self.stacked_meta(policy)
            row = meta.take()
            stacked = None if row is None else (meta, row)
        return sequence_cache(self.config, policy, device=self.device, dtype=self.kv_dtype,
                              store=PagedStore(self.pool, hits), stacked=stacked, kv_bits=self.mixed,
                              kv_group_size=self.pool.packed.group if self.mixed else 64)


class LLMEngine:
    def __init__(self, model, tokenizer=None, policy=None, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_tokens: int = 16384, max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
                 prefill_chunk: int = 512, kv_dtype=None, cuda_graphs: bool = True, graph_max_len: int = 8192,
                 kv_bits: int | None = None, kv_group_size: int = 64, kv_storage: str = "paged",
                 swap_space: float = 4.0, async_scheduling: bool | None = None, kv_offloading_size: float = 0.0):
        """policy: the default eviction policy of a request (a policy object; FullPolicy when None).
        The pool holds `num_blocks` blocks of `block_size` tokens (default: kv_cache_tokens / block_size).
        On CUDA, whole decode steps replay CUDA graphs for batch sizes up to max_num_seqs: those of unbounded
        caches up to `graph_max_len` tokens and of the default policy are captured here, those of longer
        unbounded caches (in doubling table widths, up to the model's context) and of other bounded policies
        when first seen (`cuda_graphs=False` runs them eagerly).
        kv_bits 8 or 4: the pool's blocks hold packed K/V (codes with an fp16 scale and bias per group of
        kv_group_size), quantized once as they are written; the same tokens then take a half or a quarter of
        the bf16 bytes, so kv_cache_tokens can grow in proportion for the same memory. kv_bits "fp8": float8
        e4m3 codes with a scale per token and head (vLLM's --kv-cache-dtype fp8).
        kv_storage "virtual": each sequence's cache is one contiguous range of reserved address space (a stripe
        of the pool), read by the decode kernel without a block table; physical pages back only the blocks in use
        (`cache.virtual.BlockPages`), and go back to the device whenever the engine falls idle. num_blocks then
        bounds the blocks in use at once. Prefix-cache hits and forks map the pages under their blocks into the new
        stripe (copy-on-write) and copy the rest (`BlockPool.adopt`).
        swap_space: GiB of host memory for preempted sequences' caches (vLLM's --swap-space): an unbounded
        one's full blocks, a bounded one's whole state, restored when it resumes instead of recomputed.
        0: recompute.
        kv_offloading_size: GiB of host memory for prefix-cache blocks whose pool memory is taken back (vLLM's
        --kv-offloading-size): a later request with that prefix copies them in instead of computing them. 0: off.
        async_scheduling (default: on CUDA): a step's tokens are read while the GPU runs the next step, so the
        host's work between steps overlaps the GPU's (see `step`)."""
        sizes = {"block_size": block_size, "num_blocks": num_blocks, "kv_cache_tokens": kv_cache_tokens,
                 "max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
                 "prefill_chunk": prefill_chunk, "graph_max_len": graph_max_len}
        for name, value in sizes.items():
            whole = isinstance(value, numbers.Integral) and not isinstance(value, bool)
            if value is not None and not (whole and value >= 1):
                raise KvboundError(f"{name} must be a positive integer, got {value!r}")
        for name, gib in (("swap_space", swap_space), ("kv_offloading_size", kv_offloading_size)):
            if not gib >= 0:
                raise KvboundError(f"{name} must be >= 0 GiB, got {gib}")
        cfg = model.config
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self.kv_dtype = kv_dtype or next(model.parameters()).dtype
        self.default_policy = policy or FullPolicy()
        num_blocks = num_blocks or max(1, kv_cache_tokens // block_size)
        mixed = kv_bits if isinstance(kv_bits, dict) else None
        if mixed is not None:
            if mixed != MIXED:
                raise KvboundError(f"kv_bits {kv_bits!r}: mixed widths are heavy=4,recent=8")
            if policy is not None:
                check_mixed_policy(policy)
            kv_bits = mixed["heavy"]
        if kv_bits is not None and kv_bits not in (8, 4, "fp8"):
            raise KvboundError(f"kv_bits {kv_bits!r}: the paged pool packs 8, 4 or 'fp8', or heavy=4,recent=8")
        self.mixed = mixed
        self.pool = BlockPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, block_size,
                              self.device, self.kv_dtype, kv_bits, kv_group_size, kv_storage, max_seqs=max_num_seqs + 1,
                              max_seq_blocks=-(-cfg.max_position_embeddings // block_size),
                              offload_bytes=int(kv_offloading_size * 2**30))
        self.caches = PoolCaches(cfg, self.pool, self.device, self.kv_dtype, max_num_seqs + 1, mixed)
        self.scheduler = Scheduler(self.pool, self.caches, max_num_batched_tokens, max_num_seqs, prefill_chunk,
                                   int(swap_space * 2**30))
        self.eos_ids = set(tokenizer.eos_ids) if tokenizer is not None else set()
        self.requests: dict[str, list[Sequence]] = {}
        self._ids = itertools.count()
        self._sampled: list[tuple] = []  # (sequence, token, logprob) of each token read in the last step() call
        self._inflight: Launched | None = None  # a step whose tokens are still on the device
        self._idle_policies: set = set()  # policies whose stacked metadata no cache held at the last step's start
        self.async_scheduling = self.device.type == "cuda" if async_scheduling is None else async_scheduling
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda":
            self.graphs = DecodeGraphs(model, self.pool, max_num_seqs, graph_max_len, cfg.max_position_embeddings)
            # its evict graphs (AdaKV's "shared" ones; and the chunk graphs of a cache evicting every e steps),
            # pre-warmed
            if stackable(self.default_policy):
                meta = self.caches.stacked_meta(self.default_policy, grow=False)
                self.graphs.capture_evict(meta, kind="shared" if self.default_policy.adapts else "evict")
                if self.default_policy.evict_every > 1:
                    self.graphs.capture_evict(meta, kind="chunk")

    def describe_pool(self) -> str:
        """The KV pool in one line: tokens it holds, at which width, in how many bytes."""
        p = self.pool
        width = ("fp8 e4m3" if isinstance(p.packed, Fp8KV) else f"{p.packed.bits}-bit packed"
                 if p.packed is not None else str(p.dtype).removeprefix("torch."))
        if self.mixed is not None:
            width += " (heavy=4,recent=8: each sequence's window and sinks keep 4-bit residuals of their own)"
        size = f"{p.num_blocks * p.block_bytes / 2**30:.2f} GiB"
        if p.pages is not None:
            size += f" at most, {p.committed_bytes / 2**30:.2f} GiB committed (virtual storage)"
        return (f"KV pool: {p.num_blocks:,} blocks x {p.block_size} = {p.num_blocks * p.block_size:,} tokens, "
                f"{width}, {size}")

    def close(self):
        """Free the pool, the stacked metadata and the CUDA graphs now; the engine takes no more requests."""
        pages = self.pool.pages if self.pool is not None else None
        self.graphs = self.pool = self.caches = self.scheduler = self._inflight = None
        if pages is not None:  # virtual storage: unmap and release now, after everything reading the pool is gone
            pages.close()
        self.requests.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _open(self):
        if self.scheduler is None:
            raise KvboundError("this engine is closed")

    # --- requests -------------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, policy=None,
                    request_id: str | None = None, question_start: int | None = None) -> str:
        """prompt: text (needs a tokenizer) or token ids. question_start: the prompt index where its question
        begins; a bounded cache then evicts before reading it (kvpress's protocol: the context compressed
        without the question). Returns the request id."""
        self._open()
        params = params or SamplingParams()
        if isinstance(policy, str):
            policy = parse_policy(policy)
        prompt = self._prompt_ids(prompt)
        if not prompt:
            raise KvboundError("the prompt is empty")
        vocab = self.model.config.vocab_size
        self.model.config.check_length(len(prompt), params.max_tokens)
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise KvboundError(f"prompt token ids must be in [0, {vocab}), got {min(prompt)}..{max(prompt)}")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise KvboundError(f"request id {request_id!r} is already in use")
        if params.stop and self.tokenizer is None:
            raise KvboundError("stop strings need a tokenizer")
        if self.mixed is not None:
            check_mixed_policy(policy or self.default_policy)
        check_question_start(question_start, len(prompt))
        seq = Sequence(request_id, 0, prompt, params, policy or self.default_policy, arrival=time.perf_counter(),
                       seed=self._seed(params, 0), question_start=question_start)
        self.scheduler.add(seq)
        self.requests[request_id] = [seq]
        return request_id

    def _prompt_ids(self, prompt) -> list[int]:
        """Token ids of a prompt given as text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}."""
        if isinstance(prompt, dict) and len(prompt) == 1 and ("prompt" in prompt or "prompt_token_ids" in prompt):
            prompt = next(iter(prompt.values()))
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise KvboundError("a text prompt needs a tokenizer; pass token ids instead")
            return self.tokenizer.encode(prompt)
        ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, numbers.Integral) for t in ids):
            raise KvboundError("a prompt is text, a list of integer token ids, or {'prompt': text} / "
                               f"{{'prompt_token_ids': ids}}, got {str(prompt)[:80]!r}")
        return [int(t) for t in ids]

    @staticmethod
    def _seed(params, index):
        """Completion `index` of a seeded request draws as a request seeded with seed + index would."""
        return None if params.seed is None else params.seed + index

    def new_tokens(self, request_ids) -> list[tuple[str, int, int, dict | None]]:
        """(request id, completion index, token, logprob) for each token that an unfinished completion of
        `request_ids` took in the last step() call (with async scheduling a call may read two steps' tokens):
        what a streaming caller sends on, in one flat list, without building RequestOutputs (a finished
        completion's last tokens come with its output from step())."""
        return [(s.request_id, s.index, tok, logprob) for s, tok, logprob in self._sampled
                if s.status != FINISHED and s.request_id in request_ids]

    def has_unfinished(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_unfinished()

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is (waiting, prefilling, decoding): its blocks are freed at once and its
        unfinished completions end with finish_reason "abort". Returns its last output (None if unknown)."""
        self._open()
        seqs = self.requests.get(request_id)
        if seqs is None:
            return None
        for s in seqs:
            if s.status != FINISHED:
                self.scheduler.abort(s)
        while len(seqs) < seqs[0].params.n:  # siblings not forked yet: none will be
            seqs.append(Sequence(request_id, len(seqs), seqs[0].prompt, seqs[0].params, seqs[0].policy,
                                 status=FINISHED, finish_reason="abort"))
        return self._output(request_id)

    def release_idle(self):
        """With nothing left to run, give back every idle policy's stacked rows and evict graphs now: a step drops
        them one step after they go idle, and an idle server takes no steps (a burst of per-request budgets would
        hold them until the next request). Two empty steps: the first reads any step still in flight."""
        if self.has_unfinished():
            raise RuntimeError("release_idle: requests are still running")
        if set(self.caches.stacked) <= {self.default_policy} and self._inflight is None:
            return
        for _ in range(2):
            self.step(only_finished=True)

    # --- one step -------------------------------------------------------------------------------
    def step(self, only_finished: bool = False) -> list[RequestOutput]:
        """Run one batch; returns the requests that got new tokens or finished (finished ones are dropped),
        or with `only_finished` just the finished ones (cheaper when nobody streams).
        With async scheduling a step's tokens stay on the device until the next call: that call first launches
        the step after it, feeding them there, and reads them while the GPU runs it (vLLM's async scheduling).
        A sequence that ended on a token read late has run one step more, whose token is dropped."""
        self._open()
        dropped, self._idle_policies = self.caches.drop_idle(self._idle_policies, self.default_policy)
        for meta in dropped if self.graphs is not None else ():
            self.graphs.drop(meta)
        launched, self._inflight = self._inflight, None
        self._sampled, touched = [], {}
        if launched is not None:
            batch = self.scheduler.schedule(run_ahead=True)  # pending tokens only come from `_plain` sequences
            if batch:  # the next step's forward goes first, then the last step's tokens are read, then its draw
                ran = self._forward_step(batch, launched)
                self._read(launched, only_finished, touched)
                self._publish(ran[0])
                self._keep_or_read(self._draw(*ran), only_finished, touched)
                self._read_on(self.scheduler.rereads, only_finished, touched)
                return self._outputs(touched, only_finished)
            self._read(launched, only_finished, touched)
        batch = self.scheduler.schedule()
        if batch:
            ran = self._forward_step(batch)
            self._publish(ran[0])
            self._keep_or_read(self._draw(*ran), only_finished, touched)
        self._read_on(self.scheduler.rereads, only_finished, touched)
        return self._outputs(touched, only_finished)

    def _forward_step(self, batch, launched: Launched | None = None) -> tuple:
        """Run the model on the batch: (its rows in order, the rows that draw a token, their logits). Rows whose
        token is still pending on the device take it from `launched` there."""
        batch, keys = StepBatch.order(batch)
        sampling = [i for i, (seq, t) in enumerate(batch) if seq.to_feed() == t]
        fill = None
        if launched is not None:
            row_of = {id(s): r for r, s in enumerate(launched.seqs)}
            rows = [i for i, (seq, _) in enumerate(batch) if seq.pending]
            src = to_device([row_of[id(batch[i][0])] for i in rows], self.device)

            def pending_tokens():
                """Called as late as the inputs allow: settling may wait for the last step's draw."""
                launched.draw.settle()
                return launched.tokens[src]
            fill = (rows, pending_tokens)
        logits = self._forward(batch, keys, sampling, fill)
        held = [i for i, (seq, _) in enumerate(batch) if seq.reading and seq.cache.seen == seq.context_end]
        if held:  # KVzip: their first draws wait for their contexts' second reading
            for i in held:
                self._start_reading(batch[i][0], logits[sampling.index(i)] if i in sampling else None)
            rows = [r for r, i in enumerate(sampling) if i not in held]
            sampling = [sampling[r] for r in rows]
            logits = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
        return batch, sampling, logits

    def _start_reading(self, seq: Sequence, logits):
        """KVzip (`policies.KVzipPolicy`): the sequence holds its whole context, which it now reads a second time, a
        piece a step (`_read_on`); its bounded cache takes the blocks `Scheduler._take` kept for it. `logits`: the
        full cache's last ones (None when a question follows), drawn from once the context is kept, as the
        sequence's own cache's prefill returns them (`engine.generate.scored_prefill`), so that forks copy the kept
        cache."""
        self.scheduler.publish(seq)  # its context's full blocks, as any full cache's, for the next such prompt
        self.pool.promised -= self.scheduler.scored_blocks(seq)
        bounded = self.caches(seq.policy, [])
        bounded.prepare(seq.context_end)
        ids = torch.tensor(seq.prompt[:seq.context_end], device=self.device)
        seq.rereading = Rereading(SecondReading(seq.cache, ids, self.scheduler.chunk, seq.policy), bounded, logits)

    def _read_on(self, seqs, only_finished: bool, touched: dict):
        """Each of `seqs` still reading its context again reads its next piece, all in one forward (one piece a
        step, counted in the step's token budget as a prefill piece is, so the others' decodes never wait for a whole
        context); one that has read it all keeps what that scores in its bounded cache, and its held blocks go back."""
        seqs = [seq for seq in seqs if seq.rereading is not None]  # not preempted since
        if seqs:
            read_pieces(self.model, [seq.rereading.reading for seq in seqs])
        for seq in seqs:
            held, rereading = seq.cache, seq.rereading
            if not rereading.reading.done:
                continue
            if rereading.bounded.policy.needs_plan:  # layers=global: this reading sets its layers' budgets
                self._plan_layers(seq)
            rereading.bounded.keep_scored(held, rereading.reading.best)
            seq.peak_blocks = max(seq.peak_blocks, len(held.store.blocks) + len(rereading.bounded.store.blocks))
            seq.cache, seq.rereading, seq.scored = rereading.bounded, None, True
            held.release()
            if rereading.logits is not None:  # its first token, read at once
                self._read(self._draw([(seq, 0)], [0], rereading.logits[None]), only_finished, touched)

    def _plan_layers(self, seq: Sequence):
        """A layers=global sequence whose context is read again: its policy becomes that reading's plan of layer
        budgets (`H2OPolicy.plan`), laid out in its bounded cache and its row of stacked metadata, which it keeps: it
        batches with sequences of any plan of its policy. Its blocks stay."""
        bounded = seq.rereading.bounded
        seq.policy = bounded.policy.plan(seq.rereading.reading.best)
        bounded.plan_layers(seq.policy)

    def _draw(self, batch, sampling, logits) -> Launched:
        """Each sampling row's next token, left on the device: a `sampling.Draw`, whose host check (top-p
        candidates) waits until the tokens are fed or read."""
        rows, seqs = [], []
        for row, i in enumerate(sampling):
            for s in [batch[i][0]] + self._fork(batch[i][0]):  # forks sample from their parent's logits
                rows.append(row)
                seqs.append(s)
        if len(rows) != len(sampling):
            logits = logits[torch.tensor(rows, device=logits.device)]
        draw = next_tokens(logits, [s.params for s in seqs], [s.prompt for s in seqs], [s.output for s in seqs],
                           [s.seed for s in seqs], self.eos_ids)
        return Launched(batch, seqs, logits, draw)

    def _keep_or_read(self, step: Launched, only_finished: bool, touched: dict):
        """Leave the step's tokens on the device for the next call to read, or read them now."""
        if self.async_scheduling and all(_plain(s) for s in step.seqs):
            step.copy_to_host()
            for s in step.seqs:
                s.pending += 1
            self._inflight = step
        else:
            self._read(step, only_finished, touched)

    def _read(self, step: Launched, only_finished: bool, touched: dict):
        """Take a launched step's tokens (waiting for them if need be)."""
        picked = step.host_tokens()
        picked = with_logprobs(step.logits, step.tokens, [s.params for s in step.seqs], picked)
        now = time.perf_counter()
        for s, (tok, logprob) in zip(step.seqs, picked):
            s.pending = max(0, s.pending - 1)  # a step read at once left nothing pending
            if s.status == FINISHED:  # it ended on an earlier token (or was aborted): this one is dropped
                continue
            if self._append(s, tok, logprob, now) or not only_finished:
                touched[s.request_id] = True
            self._sampled.append((s, tok, logprob))

    def _publish(self, batch):
        for seq, _ in batch:
            if seq.status != FINISHED:
                self.scheduler.publish(seq)

    def _outputs(self, touched: dict, only_finished: bool) -> list[RequestOutput]:
        outs = [out for out in map(self._output, touched) if out.finished or not only_finished]
        if not self.has_unfinished():
            self.pool.trim()  # idle: virtual storage gives its unmapped pages back to the device
        return outs

    def stream(self, request_id: str, on_step=None) -> Iterator[int]:
        """Token ids of the request's first completion as they are generated, stepping the engine (other
        requests run meanwhile; their outputs are not collected here). on_step() runs after every step."""
        sent = 0
        while True:
            outs = self.step()
            if on_step is not None:
                on_step()
            for out in outs:
                if out.request_id == request_id:
                    toks = out.outputs[0].token_ids
                    yield from toks[sent:]
                    sent = len(toks)
                    if out.finished:
                        return

    def _forward(self, batch, keys, sampling, fill=None) -> torch.Tensor:
        """fill: (rows, () -> their tokens on the device) of rows whose one token to feed is pending there."""
        if fill is not None and fill[0]:
            fill = (to_device(fill[0], self.device), fill[1])
        else:
            fill = None
        logits = self.graphs.run(batch, keys, fill) if self.graphs is not None else None
        if logits is not None:
            for (seq, _), key in zip(batch, keys):
                finish_step(seq.cache, key.kind, 1)
            return logits
        ids = torch.tensor([tok for seq, t in batch for tok in seq.feed(t)], device=self.device)
        ends = list(itertools.accumulate(t for _, t in batch))
        if fill is not None:  # a pending row feeds one token: its last
            ids[torch.tensor(ends, device=self.device)[fill[0]] - 1] = fill[1]()
        step = StepBatch(self.pool, batch, keys)
        logits_at = torch.tensor([ends[i] - 1 for i in sampling], dtype=torch.long, device=self.device)
        logits = self.model(ids, step.positions(), step, logits_at=logits_at)
        step.advance()
        return logits

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """At a request's first sampled token: its n - 1 siblings, sharing its blocks (copy-on-write)."""
        if seq.forked or seq.params.n == 1:
            return []
        seq.forked = True
        # a striped pool copies the parent's blocks into each fork's stripe, in the room `Scheduler._take` kept
        self.pool.promised = max(0, self.pool.promised - (seq.params.n - 1) * len(seq.cache.store.blocks))
        kids = []
        for i in range(1, seq.params.n):
            kid = Sequence(seq.request_id, i, seq.prompt, seq.params, seq.policy, arrival=seq.arrival,
                           status=RUNNING, cache=seq.cache.fork(), seed=self._seed(seq.params, i), forked=True,
                           question_start=seq.question_start, scored=seq.scored)
            self.scheduler.running.append(kid)
            self.requests[seq.request_id].append(kid)
            kids.append(kid)
        return kids

    def _append(self, seq: Sequence, tok: int, logprob: dict | None, now: float) -> bool:
        """Take one sampled token; returns True when the sequence finished."""
        p = seq.params
        if seq.first_token_time is None:
            seq.first_token_time = now
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            self.scheduler.finish(seq, "stop")
            return True
        seq.output.append(tok)
        seq.token_times.append(now)
        if logprob is not None:
            seq.logprobs.append(logprob)
        if p.stop and self._hit_stop_string(seq, tok):
            self.scheduler.finish(seq, "stop")
            return True
        if len(seq.output) >= p.max_tokens:
            self.scheduler.finish(seq, "length")
            return True
        return False

    def _hit_stop_string(self, seq: Sequence, tok: int) -> bool:
        """Detokenize incrementally; at the first stop string the text ends before it."""
        from ..models.tokenizer import StreamDecoder
        if seq.decoder is None:
            seq.decoder, seq.text = StreamDecoder(self.tokenizer), ""
        piece = seq.decoder.push(tok)
        if not piece:
            return False
        start = max(0, len(seq.text) - max(map(len, seq.params.stop)) + 1)  # a stop may begin in earlier text
        seq.text += piece
        hits = [at for at in (seq.text.find(stop, start) for stop in seq.params.stop) if at >= 0]
        if hits:
            seq.text = seq.text[:min(hits)]
        return bool(hits)

    def _output(self, request_id: str) -> RequestOutput:
        seqs = self.requests[request_id]
        done = all(s.status == FINISHED for s in seqs) and len(seqs) == seqs[0].params.n
        # token lists are the sequences' own (no copy per step); text is decoded once, when the request is done
        outs = [CompletionOutput(s.index, s.output, (s.text if s.text is not None else self.tokenizer.decode(s.output))
                                 if done and self.tokenizer else "", s.finish_reason,
                                 s.logprobs if s.params.logprobs is not None else None, s.tokens_evicted,
                                 s.peak_blocks * self.pool.block_bytes + s.ring_bytes) for s in seqs]
        first = seqs[0]
        out = RequestOutput(request_id, first.prompt, outs, done, first.arrival, first.first_token_time,
                            first.token_times, first.cached_tokens or 0)
        if done:
            del self.requests[request_id]
        return out
