"""One owner of the engine: a thread that steps `LLMEngine` and nothing else touches it.

Requests arrive through a queue (add, abort, stop), are answered through an asyncio future on the server's
event loop, and each request's new tokens are routed back to the mailbox it came with: all of a step's
updates in one hand-over to the event loop. A mailbox keeps what its reader has not taken yet, so a busy
server sends fewer, larger pieces instead of falling behind (vLLM merges outputs the same way). Between
two steps the thread takes everything that arrived; with nothing to run it sleeps on the queue."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from ..errors import KvboundError

log = logging.getLogger("kvbound.serve")


class QueueFull(KvboundError):
    """More requests wait than --max-waiting allows (429)."""


@dataclass
class CompletionDelta:
    """What one completion gained since the last update. text and the kv figures are set once it finishes."""
    index: int
    token_ids: list[int]
    logprobs: list[dict] | None
    finish_reason: str | None
    text: str | None = None
    tokens_evicted: int = 0
    peak_kv_bytes: int = 0


@dataclass
class Update:
    tag: object  # the submitter's label (which prompt of a request)
    completions: list[CompletionDelta]
    finished: bool
    cached_tokens: int = 0
    error: str | None = None


class Mailbox:
    """One HTTP request's updates, waiting for its handler (lives on the event loop)."""

    def __init__(self):
        self.items: list[Update] = []
        self.ready = asyncio.Event()

    def deliver(self, update: Update):
        self.items.append(update)
        self.ready.set()

    async def take(self) -> list[Update]:
        """Everything that arrived since the last take (waits for at least one)."""
        await self.ready.wait()
        self.ready.clear()
        items, self.items = self.items, []
        return items


@dataclass
class Route:
    """Where a request's updates go, and what was sent already."""
    loop: asyncio.AbstractEventLoop
    mailbox: Mailbox
    tag: object
    arrival: float
    sent: dict  # completion index -> tokens sent


def _deliver_all(batch):
    for mailbox, update in batch:
        mailbox.deliver(update)


def post(routes_updates):
    """Hand (route, update) pairs to their event loops: one call per loop."""
    by_loop: dict = {}
    for route, update in routes_updates:
        by_loop.setdefault(route.loop, []).append((route.mailbox, update))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver_all, batch)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass


def _settle(loop, fut, result=None, error=None):
    """Resolve an asyncio future from the engine thread, unless its waiter gave up (cancelled)."""
    def settle():
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass


class EngineLoop:
    def __init__(self, engine, metrics, max_waiting: int):
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.routes: dict[str, Route] = {}
        self.thread = threading.Thread(target=self._run, name="kvbound-engine", daemon=True)

    def start(self):
        self.thread.start()

    def stop(self, timeout: float = 30.0):
        """Abort what is still running and end the thread."""
        if self.thread.is_alive():
            self.inbox.put(("stop",))
            self.thread.join(timeout)

    # --- called from the event loop -------------------------------------------------------------
    async def submit(self, request_id: str, prompt: list[int], params, policy, mailbox: Mailbox, tag=None):
        """Hand a request to the engine; returns once it is queued there. Raises QueueFull or the engine's
        KvboundError (a prompt past the context, a request that can never fit the pool)."""
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        route = Route(loop, mailbox, tag, time.perf_counter(), {})
        self.inbox.put(("add", request_id, prompt, params, policy, route, accepted))
        await accepted

    def abort(self, request_id: str):
        self.inbox.put(("abort", request_id))

    # --- the engine thread ----------------------------------------------------------------------
    def _run(self):
        while True:
            msgs = [self.inbox.get()] if not self.engine.has_unfinished() else []
            while True:
                try:
                    msgs.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            for msg in msgs:
                if msg[0] == "stop":
                    self._abort_all("the server is shutting down")
                    self.engine.close()
                    return
                getattr(self, "_" + msg[0])(*msg[1:])
            if self.engine.has_unfinished():
                self._step()
            self._gauges()

    def _add(self, request_id, prompt, params, policy, route: Route, accepted):
        sched = self.engine.scheduler
        free_rows = max(0, sched.max_num_seqs - len(sched.running))
        if len(sched.waiting) - free_rows >= self.max_waiting:
            self.metrics.rejected.inc()
            return _settle(route.loop, accepted, error=QueueFull(
                f"too many requests waiting (--max-waiting {self.max_waiting}); retry later"))
        try:
            self.engine.add_request(prompt, params, policy, request_id=request_id)
        except KvboundError as e:
            return _settle(route.loop, accepted, error=e)
        self.metrics.prompt_tokens.inc(len(prompt))
        self.routes[request_id] = route
        _settle(route.loop, accepted, True)

    def _abort(self, request_id):
        route = self.routes.get(request_id)
        out = self.engine.abort(request_id)
        if out is not None and route is not None:
            post([(route, self._update(out, route))])

    def _step(self):
        try:
            outs = self.engine.step()
        except Exception as e:  # a bug or an out-of-memory: fail the running requests, keep serving
            log.exception("engine step failed")
            self._abort_all(f"the engine failed: {type(e).__name__}: {e}")
            return
        post([(self.routes[o.request_id], self._update(o, self.routes[o.request_id])) for o in outs
              if o.request_id in self.routes])

    def _update(self, out, route: Route) -> Update:
        """The request's news since its last update; a finished request leaves the routes."""
        deltas, now = [], time.perf_counter()
        for c in out.outputs:
            sent = route.sent.get(c.index, 0)
            new = c.token_ids[sent:]
            route.sent[c.index] = len(c.token_ids)
            self.metrics.generation_tokens.inc(len(new))
            done = c.finish_reason is not None and out.finished
            deltas.append(CompletionDelta(c.index, list(new), None if c.logprobs is None else c.logprobs[sent:],
                                          c.finish_reason if out.finished else None,
                                          c.text if done else None, c.tokens_evicted, c.peak_kv_bytes))
        if out.finished:
            self.metrics.finished(out, route.arrival, now)
            del self.routes[out.request_id]
        return Update(route.tag, deltas, out.finished, out.cached_tokens)

    def _abort_all(self, why: str):
        for request_id in list(self.routes):
            try:
                self.engine.abort(request_id)
            except Exception:  # an engine left broken by a failed step: the routes still get their answer
                log.exception("abort failed")
        post([(route, Update(route.tag, [], True, error=why)) for route in self.routes.values()])
        self.routes.clear()

    def _gauges(self):
        sched = self.engine.scheduler
        running = {s.request_id for s in sched.running}
        waiting = {s.request_id for s in sched.waiting} - running
        self.metrics.after_step(self.engine, len(running), len(waiting))
