"""The open-loop load generator as an HTTP client of any OpenAI-compatible server (kvbound's, vLLM's,
llama.cpp's): streaming /v1/completions requests on a Poisson clock or at a fixed concurrency, each piece's
arrival time recorded. `bench.serve_report` turns the records into the report."""
from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import aiohttp
from tqdm import tqdm

from ..errors import KvboundError
from .data import joined_text


def text_prompts(n: int, input_len: int, seed: int = 0) -> list[str]:
    """n prompts of about input_len tokens: runs of words from the package's text at random places (a client
    may have no tokenizer; the server's usage gives the true counts)."""
    words = joined_text().split()
    count = max(1, input_len * 3 // 4)  # about 4/3 tokens per English word
    if len(words) <= count:
        raise KvboundError(f"--input-len {input_len}: the package text has only {len(words)} words")
    rng = random.Random(seed)
    return [" ".join(words[s:s + count]) for s in (rng.randrange(len(words) - count) for _ in range(n))]


def file_prompts(path: str, n: int | None) -> list[str]:
    """A file of prompts: JSON lines with a "prompt" field, or one prompt per line."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    try:
        prompts = [json.loads(line)["prompt"] if line.lstrip().startswith("{") else line for line in lines]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise KvboundError(f"{path}: a JSON line without a \"prompt\" field") from None
    if not prompts:
        raise KvboundError(f"{path}: no prompts")
    return (prompts * (-(-n // len(prompts))))[:n] if n else prompts


def run_http(url: str, prompts: list, body: dict, arrivals: list[float] | None = None,
             concurrency: int | None = None, api_key: str | None = None, model: str | None = None,
             max_tokens: list[int] | None = None):
    """Send every prompt (with the fields of `body`; max_tokens[i] for prompt i where given) on the given
    arrival clock, or `concurrency` at a time.
    Returns (per request: {"arrival", "token_times", "tokens", "error"}; one record per gap between two
    streamed pieces: {"t", "ms", "running"}). aiohttp, as vLLM's benchmark: httpx's connection pool spends
    time quadratic in the connections open, and at 256 it, not the server, set the pace."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return asyncio.run(_run(url.rstrip("/"), headers, prompts, body, model, arrivals, concurrency, max_tokens))


async def _server_model(session, url) -> str:
    try:
        async with session.get(url + "/v1/models") as r:
            if r.status != 200:
                raise KvboundError(f"GET {url}/v1/models: {r.status} {(await r.text())[:200]}")
            return (await r.json())["data"][0]["id"]
    except aiohttp.ClientError as e:
        raise KvboundError(f"--url {url}: {e}") from None


async def _run(url, headers, prompts, body, model, arrivals, concurrency, max_tokens):
    reqs = [{"arrival": 0.0, "token_times": [], "tokens": None} for _ in prompts]
    gaps, inflight = [], [0]
    bar = tqdm(total=len(prompts), desc="serve", unit="req")
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    async with aiohttp.ClientSession(headers=headers, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        body = {**body, "model": model or await _server_model(session, url)}
        t0 = time.perf_counter()

        async def one(i):
            rec = reqs[i]
            rec["arrival"] = time.perf_counter() - t0
            inflight[0] += 1
            try:
                for attempt in (1, 2):  # a kept-alive connection the server has just closed: once more, anew
                    try:
                        own = {"prompt": prompts[i], **({} if max_tokens is None else {"max_tokens": max_tokens[i]})}
                        await _request(session, url, {**body, **own}, rec, gaps, inflight, t0)
                        break
                    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                        if rec["token_times"] or attempt == 2:
                            raise
                        rec["retried"] = f"{type(e).__name__}: {e}"
            except aiohttp.ClientError as e:
                rec["error"] = f"{type(e).__name__}: {e}"
            finally:
                inflight[0] -= 1
                bar.update(1)

        if concurrency:
            sem = asyncio.Semaphore(concurrency)

            async def gated(i):
                async with sem:
                    await one(i)
            await asyncio.gather(*(gated(i) for i in range(len(prompts))))
        else:
            tasks = []
            for i, a in enumerate(arrivals):
                await asyncio.sleep(max(0.0, t0 + a - time.perf_counter()))
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
    bar.close()
    return reqs, sorted(gaps, key=lambda g: g["t"])


async def _request(session, url, body, rec, gaps, inflight, t0):
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            rec["error"] = f"HTTP {r.status}: {(await r.text())[:200]}"
            return
        if not body.get("stream"):  # one whole response: its time is the only one
            data = await r.json()
            rec["token_times"].append(time.perf_counter() - t0)
            rec["tokens"] = data["usage"]["completion_tokens"]
            return
        async for raw in r.content:  # one SSE line at a time
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                rec["tokens"] = chunk["usage"].get("completion_tokens")
            choices = chunk.get("choices") or [{}]
            if choices[0].get("text"):
                now = time.perf_counter() - t0
                if rec["token_times"]:
                    gaps.append({"t": now, "ms": 1000 * (now - rec["token_times"][-1]), "running": inflight[0]})
                rec["token_times"].append(now)
            if "error" in chunk:
                rec["error"] = str(chunk["error"])
