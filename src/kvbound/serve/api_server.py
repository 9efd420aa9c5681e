"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics. Each request may carry its own KV policy and budget; the server's is the default.

Handlers only parse, tokenize and format: the engine belongs to `EngineLoop`'s thread. Bad input is a 4xx
with an OpenAI error object naming the field; a client that goes away aborts its request."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from ..cache import parse_policy
from ..engine.chat import with_pinned_system
from ..errors import KvboundError
from .engine_loop import EngineClient, EngineGone, Mailbox, QueueFull
from .protocol import BadField, ChatRequest, CompletionRequest, RequestBase
from .responses import Choice, chat_logprobs, completion_logprobs, kv_report, usage

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    policy_spec: str = "full"  # the default policy, as given on the command line
    budget: int | None = None
    policy_defaults: dict = field(default_factory=dict)  # score, ema_decay, ... applied to request specs too
    max_waiting: int = 256


def error_body(message: str, kind: str, param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def _field_of(loc) -> str | None:
    parts = [str(p) for p in loc[1:] if not str(p).startswith(("function-", "list[", "str", "int"))]
    return ".".join(parts) or None


class Server:
    """The state behind the routes: the engine's loop, its tokenizer and model config, the defaults."""

    def __init__(self, client: EngineClient, config: ServerConfig):
        self.loop, self.config = client, config
        self.tokenizer, self.model_config = client.info["tokenizer"], client.info["config"]
        self.default_policy = client.info["default_policy"]
        self.created = int(time.time())

    # --- request -> engine ----------------------------------------------------------------------
    def policy_for(self, body: RequestBase):
        if body.kv_policy is None and body.kv_budget is None and not body.pin:
            return self.default_policy
        spec = body.kv_policy or self.config.policy_spec
        budget = body.kv_budget or (None if body.kv_policy else self.config.budget)
        try:
            policy = parse_policy(spec, budget, pinned=tuple(map(tuple, body.pin or ())), exact=bool(body.kv_budget),
                                  **self.config.policy_defaults)
        except KvboundError as e:
            field = ("pin" if body.pin and "pinned" in str(e) else "kv_budget" if str(e).startswith("budget ")
                     else "kv_policy" if body.kv_policy else "kv_budget")
            raise BadField(field, str(e)) from None
        if not policy.bounded and (body.kv_budget or body.pin):
            name = "kv_budget" if body.kv_budget else "pin"
            raise BadField(name, f"{name} has no effect with the unbounded policy {spec!r}: ask for a bounded "
                                 "kv_policy (window, h2o)")
        return policy

    def max_tokens(self, asked: int | None, default: int | None, prompt_len: int, policy) -> int:
        """What was asked, or the default: a fixed number, or (None) all the room the context and pool leave."""
        if asked is not None:
            return asked
        room = self.model_config.max_position_embeddings - prompt_len
        if not policy.bounded:
            room = min(room, self.loop.info["pool_tokens"] - prompt_len)
        if room < 1:
            raise BadField("messages", f"the prompt ({prompt_len} tokens) leaves no room to generate in the model's "
                                       f"context ({self.model_config.max_position_embeddings}) or the KV pool")
        return room if default is None else min(default, room)

    def check_model(self, name: str | None):
        if name is not None and name != self.config.model_name:
            raise HTTPException(404, f"The model `{name}` does not exist (this server serves "
                                     f"`{self.config.model_name}`)")

    async def submit(self, prompts: list[list[int]], params: list, policy, stream: bool) -> tuple[Mailbox, list[str]]:
        """Hand every prompt to the engine (as requests of their own); on a refusal, withdraw the others."""
        updates = Mailbox()
        ids = []
        try:
            for i, ids_i in enumerate(prompts):
                rid = uuid.uuid4().hex
                ids.append(rid)
                await self.loop.submit(rid, ids_i, params[i], policy, updates, tag=i, stream=stream)
        except BaseException:
            for rid in ids:
                self.loop.abort(rid)
            raise
        return updates, ids


def build_app(engine, config: ServerConfig) -> FastAPI:
    """engine: an EngineClient (`kvbound serve` starts the engine in a process of its own), or an LLMEngine
    to be stepped by a thread of this process."""
    client = engine if isinstance(engine, EngineClient) else EngineClient.thread(engine, config.max_waiting)
    server = Server(client, config)

    @asynccontextmanager
    async def lifespan(app):
        server.loop.start(asyncio.get_running_loop())
        yield
        await asyncio.get_running_loop().run_in_executor(None, server.loop.stop)

    app = FastAPI(title="kvbound", lifespan=lifespan)
    app.state.server = server

    async def require_key(request: Request, call_next):
        if request.url.path != "/health" and request.headers.get("authorization", "") != f"Bearer {config.api_key}":
            return error_response(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                                  code="invalid_api_key")
        return await call_next(request)
    if config.api_key:  # (a middleware costs every request a little, so only where it has work)
        app.middleware("http")(require_key)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = _field_of(err.get("loc", ()))
        if err.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {err.get('msg')}", param=None)
        return error_response(400, f"{param or 'body'}: {err.get('msg')}", param=param)

    @app.exception_handler(BadField)
    async def bad_field(request, exc: BadField):
        return error_response(400, str(exc), param=exc.param)

    @app.exception_handler(QueueFull)
    async def full(request, exc: QueueFull):
        return error_response(429, str(exc), kind="rate_limit_exceeded", code="rate_limit_exceeded")

    @app.exception_handler(EngineGone)
    async def gone(request, exc: EngineGone):
        return error_response(503, str(exc), kind="service_unavailable")

    @app.exception_handler(KvboundError)
    async def refused(request, exc: KvboundError):
        return error_response(400, str(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail), code="model_not_found" if exc.status_code == 404 else None)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if server.loop.alive() else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(await server.loop.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": server.created,
                                            "owned_by": "kvbound",
                                            "max_model_len": server.model_config.max_position_embeddings}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.refuse_unsupported()
        server.check_model(body.model)
        tok = server.tokenizer
        raw = body.prompts()
        prompts = [p if isinstance(p, list) else tok.encode(p) for p in raw]
        echoes = [(p if isinstance(p, str) else tok.decode(p)) if body.echo else "" for p in raw]
        policy = server.policy_for(body)

        def params_of(n):
            return body.sampling_params(server.max_tokens(body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, n, policy),
                                        body.logprobs)
        return await run(request, body, prompts, params_of, policy, echoes, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        body.refuse_unsupported()
        server.check_model(body.model)
        messages = [m.as_dict() for m in body.messages]
        text = server.tokenizer.apply_chat_template(messages)
        prompt = server.tokenizer.encode(text)
        policy = server.policy_for(body)
        if body.pin_system_prompt:
            policy = with_pinned_system(policy, server.tokenizer, messages)

        def params_of(n):
            return body.sampling_params(server.max_tokens(body.length_limit, None, n, policy), body.logprobs_count)
        return await run(request, body, [prompt], params_of, policy, [""], chat=True)

    async def run(request, body, prompts, params_of, policy, echoes, chat: bool):
        params = [params_of(len(p)) for p in prompts]  # bad parameters fail before anything reaches the engine
        updates, ids = await server.submit(prompts, params, policy, body.stream)
        longest_stop = max(map(len, params[0].stop), default=0)
        from ..models.tokenizer import StreamDecoder
        choices = {(i, j): Choice(i * body.n + j, StreamDecoder(server.tokenizer) if body.stream else None,
                                  max(0, longest_stop - 1), echoes[i]) for i in range(len(prompts))
                   for j in range(body.n)}
        state = {"cached": 0, "left": len(prompts)}
        meta = {"id": ("chatcmpl-" if chat else "cmpl-") + ids[0], "created": int(time.time()),
                "model": config.model_name}
        if body.stream:
            return StreamingResponse(stream(updates, ids, choices, state, meta, body, prompts, policy, chat),
                                     media_type="text/event-stream")
        waiter = asyncio.ensure_future(collect(updates, choices, state))
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait([waiter, gone], return_when=asyncio.FIRST_COMPLETED)
            if not waiter.done():
                return Response(status_code=499)
            error = waiter.result()
            if error:
                return error_response(500, error, kind="server_error")
        finally:
            waiter.cancel()
            gone.cancel()
            for rid in ids:
                server.loop.abort(rid)
        ordered = [choices[k] for k in sorted(choices)]
        return JSONResponse({**meta, "object": "chat.completion" if chat else "text_completion",  # plain JSON
                             "choices": [whole_choice(c, chat) for c in ordered],  # types: no encoder pass
                             "usage": usage(list(map(len, prompts)), ordered, state["cached"]),
                             "kv": kv_report(policy, ordered)})

    def whole_choice(c: Choice, chat: bool) -> dict:
        if chat:
            lp = chat_logprobs(server.tokenizer, c.logprobs, c.token_ids) if c.logprobs else None
            return {"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                    "finish_reason": c.finish_reason}
        lp = completion_logprobs(server.tokenizer, c.logprobs, c.token_ids, len(c.prefix)) if c.logprobs else None
        return {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}

    async def collect(updates, choices, state) -> str | None:
        """Fold updates until every prompt's request finished; returns an engine error, if one came."""
        while state["left"]:
            ups = await updates.take()
            error = next((up.error for up in ups if up.error), None)
            if error:
                return error
            fold(ups, choices, state)
        return None

    def fold(ups, choices, state) -> list[tuple[Choice, str, list[int], list[dict]]]:
        """Apply updates; returns (choice, new text, new tokens, new logprob entries) per completion that
        changed, merged over the updates (one streamed piece each)."""
        news: dict = {}
        for up in ups:
            for d in up.completions:
                c = choices[(up.key, d.index)]
                _, text, toks, lps = news.get(c.index, (c, "", [], []))
                n_lp = len(c.logprobs)
                news[c.index] = (c, text + c.take(d), toks + d.token_ids, lps + c.logprobs[n_lp:])
            if up.finished:
                state["left"] -= 1
                state["cached"] += up.cached_tokens
        return list(news.values())

    async def disconnected(request: Request):
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    async def stream(updates, ids, choices, state, meta, body, prompts, policy, chat):
        obj = "chat.completion.chunk" if chat else "text_completion"
        tok = server.tokenizer

        def chunk(choice_list, **last):
            body_obj = {**meta, "object": obj, "choices": choice_list}
            if body.include_usage:
                body_obj.update({"usage": None, **last})
            return f"data: {json.dumps(body_obj)}\n\n"
        try:
            if chat:
                yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for c in choices.values()])
            else:
                for c in choices.values():
                    if c.prefix:
                        yield chunk([{"index": c.index, "text": c.prefix, "logprobs": None, "finish_reason": None}])
            while state["left"]:
                ups = await updates.take()
                error = next((up.error for up in ups if up.error), None)
                if error:
                    yield f"data: {json.dumps(error_body(error, 'server_error'))}\n\n"
                    return
                for c, text, toks, lps in fold(ups, choices, state):
                    if not (text or c.finish_reason or lps):
                        continue
                    if chat:
                        lp = chat_logprobs(tok, lps, toks) if lps else None
                        item = {"index": c.index, "delta": {"content": text} if text else {}, "logprobs": lp,
                                "finish_reason": c.finish_reason}
                    else:
                        lp = completion_logprobs(tok, lps, toks) if lps else None
                        item = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
                    yield chunk([item])
            ordered = [choices[k] for k in sorted(choices)]
            if body.include_usage:
                yield chunk([], usage=usage(list(map(len, prompts)), ordered, state["cached"]),
                            kv=kv_report(policy, ordered))
            yield "data: [DONE]\n\n"
        finally:  # a client that went away: its requests stop and free their blocks
            for rid in ids:
                server.loop.abort(rid)

    return app


def serve(engine, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"):
    """Run until SIGINT/SIGTERM: uvicorn stops accepting, lets in-flight requests finish (up to 30 s), then
    the engine loop aborts what is left."""
    import uvicorn
    uvicorn.run(build_app(engine, config), host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=30)
