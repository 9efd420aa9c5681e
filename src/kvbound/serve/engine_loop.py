"""One owner of the engine: a loop that steps `LLMEngine` and nothing else touches it, in a process of its
own (the server's default: tokenizing, detokenizing and writing responses then never hold up a step) or in
a thread of the server's process (an engine built by the caller, e.g. sharing a model in tests).

The server's side (`EngineClient`) sends commands (add, abort, metrics, stop); the loop answers with one
message per iteration: the adds it accepted or refused, every request's news of that step (streamed
requests' new tokens each step as one flat list, and one update for each request that finished) and, when
asked, the Prometheus text. A reader thread hands each message to the event loop in one call, where each request's
updates wait in its mailbox; a handler takes everything waiting as one piece, so a busy server sends
fewer, larger pieces instead of falling behind (vLLM merges outputs the same way)."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import queue
import signal
import sys
import threading
import time
from typing import Callable, NamedTuple

from prometheus_client import generate_latest

from ..errors import KvboundError
from .metrics import ServerMetrics

log = logging.getLogger("kvbound.serve")


class QueueFull(KvboundError):
    """More requests wait than --max-waiting allows (429)."""


class EngineGone(KvboundError):
    """The engine's loop has stopped (shutting down, or its process died): 503."""


class CompletionDelta(NamedTuple):
    """What one completion gained since the last update. text and the kv figures come once it finishes."""
    index: int
    token_ids: list
    logprobs: list | None
    finish_reason: str | None = None
    text: str | None = None
    tokens_evicted: int = 0
    peak_kv_bytes: int = 0


class Update(NamedTuple):
    key: object  # the request id from the engine; in a mailbox, the handler's tag (which of its prompts)
    completions: list
    finished: bool
    cached_tokens: int = 0
    error: str | None = None


# --- the engine's side ------------------------------------------------------------------------------
class EngineLoop:
    """Steps the engine, taking commands from `receive(block)` and answering through `send(message)`."""

    def __init__(self, engine, receive: Callable, send: Callable, max_waiting: int):
        self.engine, self.receive, self.send, self.max_waiting = engine, receive, send, max_waiting
        self.metrics = ServerMetrics()
        self.routes: dict[str, tuple[float, bool, dict]] = {}  # request id -> (arrival, streamed, tokens sent)
        self.streaming: set[str] = set()

    def info(self) -> dict:
        """What the server's side needs to know of the engine: tokenizer, model config, pool size."""
        pool = self.engine.pool
        return {"tokenizer": self.engine.tokenizer, "config": self.engine.model.config,
                "pool_tokens": (pool.num_blocks - pool.reserved) * pool.block_size,
                "default_policy": self.engine.default_policy}

    def run(self):
        while True:
            idle = not self.engine.has_unfinished()
            if idle:
                self.engine.release_idle()  # per-request budgets' rows and graphs go back before the wait
            msgs = [self.receive(True)] if idle else []
            while (msg := self.receive(False)) is not None:
                msgs.append(msg)
            out = {"accepted": [], "updates": [], "tokens": []}
            for msg in msgs:
                if msg[0] == "stop":
                    self._abort_all("the server is shutting down", out)
                    self.send(out)
                    self.engine.close()
                    return
                getattr(self, "_" + msg[0])(out, *msg[1:])
            if self.engine.has_unfinished():
                self._step(out)
            if out["accepted"] or out["updates"] or out["tokens"] or "metrics" in out:
                self.send(out)

    def _add(self, out, request_id, prompt, params, policy, stream, arrival):
        sched = self.engine.scheduler
        free_rows = max(0, sched.max_num_seqs - len(sched.running))
        if len(sched.waiting) - free_rows >= self.max_waiting:
            self.metrics.rejected.inc()
            out["accepted"].append((request_id, "queue_full", f"too many requests waiting (--max-waiting "
                                                             f"{self.max_waiting}); retry later"))
            return
        try:
            self.engine.add_request(prompt, params, policy, request_id=request_id)
        except KvboundError as e:
            out["accepted"].append((request_id, "refused", str(e)))
            return
        self.metrics.prompt_tokens.inc(len(prompt))
        self.routes[request_id] = (arrival, stream, {})
        if stream:
            self.streaming.add(request_id)
        out["accepted"].append((request_id, None, None))

    def _abort(self, out, request_id):
        done = self.engine.abort(request_id) if request_id in self.routes else None
        if done is not None:
            out["updates"].append(self._last(done))

    def _metrics(self, out):
        self._gauges()  # read when scraped: nothing per step
        out["metrics"] = generate_latest(self.metrics.registry)

    def _step(self, out):
        try:
            start = time.perf_counter()
            finished = self.engine.step(only_finished=True)
            self.metrics.step_time.observe(time.perf_counter() - start)
        except Exception as e:  # a bug or an out-of-memory: fail the running requests, keep serving
            log.exception("engine step failed")
            self._abort_all(f"the engine failed: {type(e).__name__}: {e}", out)
            return
        news = [self._last(o) for o in finished if o.request_id in self.routes]
        fresh = self.engine.new_tokens(self.streaming) if self.streaming else []  # a flat tuple per token
        for rid, index, _, _ in fresh:
            sent = self.routes[rid][2]
            sent[index] = sent.get(index, 0) + 1
        self.metrics.generation_tokens.inc(len(fresh) + sum(len(d.token_ids) for up in news for d in up.completions))
        out["updates"] += news
        out["tokens"] += fresh

    def _last(self, done) -> Update:
        """A finished (or aborted) request's last news; it leaves the routes."""
        arrival, _, sent = self.routes.pop(done.request_id)
        self.streaming.discard(done.request_id)
        self.metrics.finished(done, arrival, time.perf_counter())
        deltas = [_delta(sent, c.index, c.token_ids, c.logprobs, c.finish_reason, c.text, c.tokens_evicted,
                         c.peak_kv_bytes) for c in done.outputs]
        return Update(done.request_id, deltas, True, done.cached_tokens)

    def _abort_all(self, why: str, out):
        for request_id in list(self.routes):
            try:
                self.engine.abort(request_id)
            except Exception:  # an engine left broken by a failed step: the requests still get their answer
                log.exception("abort failed")
            out["updates"].append(Update(request_id, [], True, error=why))
        self.routes.clear()
        self.streaming.clear()

    def _gauges(self):
        sched = self.engine.scheduler
        if sched is None:
            return
        running = {s.request_id for s in sched.running}
        waiting = {s.request_id for s in sched.waiting} - running
        self.metrics.read_engine(self.engine, len(running), len(waiting))


def _delta(sent: dict, index, token_ids, logprobs, *end) -> CompletionDelta:
    start = sent.get(index, 0)
    sent[index] = len(token_ids)
    return CompletionDelta(index, token_ids[start:], None if logprobs is None else logprobs[start:], *end)


def _queue_receive(q: queue.SimpleQueue):
    def receive(block):
        try:
            return q.get(block)
        except queue.Empty:
            return None
    return receive


def _conn_receive(conn):
    def receive(block):
        return conn.recv() if block or conn.poll() else None
    return receive


def _sender(conn) -> tuple[Callable, threading.Thread]:
    """send(message) that never blocks: a thread writes to the pipe, however slowly the other side reads. A
    full pipe (64 KiB) would otherwise stall the engine's step, or the server's whole event loop while the
    engine is busy stepping."""
    outbox: queue.SimpleQueue = queue.SimpleQueue()

    def write():
        while (msg := outbox.get()) is not None:
            try:
                conn.send(msg)
            except (BrokenPipeError, OSError):  # the server went away
                return
    thread = threading.Thread(target=write, name="kvbound-engine-sender", daemon=True)
    thread.start()
    return outbox.put, thread


def _engine_process(make_engine, make_args, commands, answers, max_waiting):
    """The engine process: build the engine, say it is ready (or why not), then loop. Ctrl-C reaches the
    whole process group; the server decides (it lets in-flight requests finish), so this one ignores it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = make_engine(make_args)
    except BaseException as e:  # the parent prints it: a bad --model path is one line, not a traceback
        answers.send(("failed", f"{type(e).__name__}: {e}" if not isinstance(e, KvboundError) else str(e)))
        return
    send, sender = _sender(answers)
    loop = EngineLoop(engine, _conn_receive(commands), send, max_waiting)
    send(("ready", loop.info()))
    try:
        loop.run()
    except (KeyboardInterrupt, EOFError, BrokenPipeError):  # the server went away
        pass
    send(None)
    sender.join(30)


# --- the server's side ------------------------------------------------------------------------------
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


class EngineClient:
    """The server's handle on the engine loop: `submit` requests, `abort` them, ask for `metrics_text`.
    `EngineClient.thread(engine)` runs the loop in a thread of this process; `EngineClient.process(
    make_engine, args)` in a process of its own, where `make_engine(args)` (picklable) builds the engine."""

    def __init__(self, send: Callable, receive: Callable, info: dict, alive: Callable, join: Callable):
        self._send, self._receive, self.info, self.alive, self._join = send, receive, info, alive, join
        self.mailboxes: dict[str, tuple[Mailbox, object]] = {}  # request id -> (mailbox, tag)
        self.pending: dict[str, asyncio.Future] = {}
        self.metrics_waiters: list[asyncio.Future] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.reader = threading.Thread(target=self._read, name="kvbound-engine-reader", daemon=True)

    @classmethod
    def thread(cls, engine, max_waiting: int) -> "EngineClient":
        commands, answers = queue.SimpleQueue(), queue.SimpleQueue()
        loop = EngineLoop(engine, _queue_receive(commands), answers.put, max_waiting)
        worker = threading.Thread(target=loop.run, name="kvbound-engine", daemon=True)
        worker.start()
        return cls(commands.put, answers.get, loop.info(), worker.is_alive, worker.join)

    @classmethod
    def process(cls, make_engine, make_args, max_waiting: int, timeout: float = 600) -> "EngineClient":
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: CUDA cannot be forked
        cmd_read, cmd_write = ctx.Pipe(duplex=False)
        ans_read, ans_write = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_engine_process, args=(make_engine, make_args, cmd_read, ans_write, max_waiting),
                           name="kvbound-engine", daemon=True)
        proc.start()
        cmd_read.close()
        ans_write.close()
        if not ans_read.poll(timeout):
            proc.kill()
            raise KvboundError(f"the engine process did not start within {timeout:.0f} s")
        try:
            kind, info = ans_read.recv()
        except EOFError:
            raise KvboundError(f"the engine process exited (code {proc.join(5) or proc.exitcode})") from None
        if kind == "failed":
            proc.join(5)
            raise KvboundError(info)
        send, _ = _sender(cmd_write)
        return cls(send, ans_read.recv, info, proc.is_alive, proc.join)

    def start(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        # the reader thread must not wait 5 ms (Python's default) for the GIL while responses are written,
        # or the engine's answers pile up unread
        sys.setswitchinterval(0.0005)
        self.reader.start()

    def stop(self, timeout: float = 60):
        """Abort what is still running and end the loop (called off the event loop)."""
        if self.alive():
            try:
                self._send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self._join(timeout)

    # --- called on the event loop ---------------------------------------------------------------
    async def submit(self, request_id: str, prompt: list[int], params, policy, mailbox: Mailbox, tag=None,
                     stream: bool = True):
        """Hand a request to the engine; returns once it is queued there. Raises QueueFull, or KvboundError
        for what the engine refuses (a prompt past the context, a request that can never fit the pool)."""
        if not self.alive():
            raise EngineGone("the engine is not running (the server is shutting down or its engine process died)")
        accepted = self.loop.create_future()
        self.pending[request_id] = accepted
        self.mailboxes[request_id] = (mailbox, tag)
        self._send(("add", request_id, prompt, params, policy, stream, time.perf_counter()))
        try:
            await accepted
        except BaseException:
            self.mailboxes.pop(request_id, None)
            raise
        finally:
            self.pending.pop(request_id, None)

    def abort(self, request_id: str):
        if request_id in self.mailboxes or request_id in self.pending:
            self._send(("abort", request_id))

    async def metrics_text(self) -> bytes:
        waiter = self.loop.create_future()
        self.metrics_waiters.append(waiter)
        self._send(("metrics",))
        return await waiter

    # --- the reader thread, and what it hands to the event loop ---------------------------------
    def _read(self):
        while True:
            try:
                msg = self._receive()
            except (EOFError, OSError):
                msg = None
            try:
                self.loop.call_soon_threadsafe(self._dispatch, msg)
            except RuntimeError:  # the event loop is closed
                return
            if msg is None or not self.alive():
                return

    def _dispatch(self, msg):
        if msg is None:  # the engine is gone: nobody waits forever
            for box, tag in self.mailboxes.values():
                box.deliver(Update(tag, [], True, error="the engine stopped"))
            self.mailboxes.clear()
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(EngineGone("the engine stopped"))
            return
        for rid, kind, why in msg["accepted"]:
            fut = self.pending.get(rid)
            if kind is not None:
                self.mailboxes.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(None) if kind is None else fut.set_exception(
                    QueueFull(why) if kind == "queue_full" else KvboundError(why))
        for rid, index, token, logprob in msg["tokens"]:  # a streamed token of an unfinished completion
            entry = self.mailboxes.get(rid)
            if entry is not None:
                entry[0].deliver(Update(entry[1], [CompletionDelta(index, [token], None if logprob is None
                                                                   else [logprob])], False))
        for up in msg["updates"]:
            entry = self.mailboxes.get(up.key)
            if entry is not None:
                entry[0].deliver(up._replace(key=entry[1]))
                if up.finished:
                    del self.mailboxes[up.key]
        if "metrics" in msg:
            for waiter in self.metrics_waiters:
                if not waiter.done():
                    waiter.set_result(msg["metrics"])
            self.metrics_waiters.clear()
