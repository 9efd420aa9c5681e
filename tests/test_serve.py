"""`kvbound serve` with real clients against a live server on 127.0.0.1: the official `openai` package, raw
HTTP (httpx) for disconnects, floods and fuzzed bodies, and the README's commands."""
import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbound import LLM, SamplingParams, parse_policy
from kvbound.engine import LLMEngine
from kvbound.serve import ServerConfig, build_app

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
NAME = "smollm2"
PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time", "The largest planet is",
           "Water boils at", "The opposite of hot is", "import numpy as", "My favourite colour is"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    """A uvicorn server in a thread of this process; stop() shuts it down as SIGINT would."""

    def __init__(self, engine, **config):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = build_app(engine, ServerConfig(NAME, **config))
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive()

    def client(self, **kw):
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        assert m, f"{name} not in /metrics"
        return float(m.group(1))


def engine_of(smollm, **kw):
    model, tok = smollm
    args = dict(kv_cache_tokens=8192, max_num_seqs=40, max_num_batched_tokens=512, prefill_chunk=64)
    return LLMEngine(model, tok, **{**args, **kw})


@pytest.fixture(scope="module")
def live(smollm):
    server = Live(engine_of(smollm))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline(smollm):
    """Greedy reference outputs of the offline LLM, one prompt at a time."""
    model, tok = smollm
    with LLM(model, tokenizer=tok, kv_cache_tokens=4096) as llm:
        def run(prompt, max_tokens=8, policy=None, chat=False):
            params = SamplingParams(max_tokens=max_tokens)
            if chat:
                return llm.chat(prompt, params, [policy], use_tqdm=False)[0].outputs[0].text
            return llm.generate(prompt, params, [policy], use_tqdm=False)[0].outputs[0].text
        yield run


def test_completion_and_chat_equal_the_offline_engine(live, offline):
    async def go():
        async with live.client() as c:
            r = await c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0)
            msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
            ch = await c.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0)
            models = await c.models.list()
            return r, ch, msgs, models
    r, ch, msgs, models = asyncio.run(go())
    assert r.choices[0].text == offline(PROMPTS[0])
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    assert ch.choices[0].message.content == offline(msgs, chat=True)
    assert ch.choices[0].message.role == "assistant"
    assert [m.id for m in models.data] == [NAME]


def test_streaming_equals_the_whole_response_with_usage(live):
    async def go():
        async with live.client() as c:
            whole = await c.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0)
            stream = await c.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
            chunks = [ch async for ch in stream]
            chat = await c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=6, temperature=0, stream=True)
            chat_chunks = [ch async for ch in chat]
            return whole, chunks, chat_chunks
    whole, chunks, chat_chunks = asyncio.run(go())
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert chat_chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_n_seed_and_stop(live):
    async def go():
        async with live.client() as c:
            kw = dict(model=NAME, prompt=PROMPTS[2], max_tokens=10, temperature=1.0, seed=7)
            a = await c.completions.create(n=2, **kw)
            b = await c.completions.create(n=2, **kw)
            stopped = await c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                                 stop=[" is", "."])
            streamed = await c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                                  stop=[" is", "."], stream=True)
            return a, b, stopped, "".join([ch.choices[0].text async for ch in streamed])
    a, b, stopped, streamed = asyncio.run(go())
    assert [ch.index for ch in a.choices] == [0, 1]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]  # seeded: reproducible
    assert a.choices[0].text != a.choices[1].text  # completion i draws with seed + i
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == " Paris" and streamed == " Paris"  # the greedy text is " Paris. ..."


def test_logprobs(live):
    async def go():
        async with live.client() as c:
            r = await c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=3)
            ch = await c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
            return r, ch
    r, ch = asyncio.run(go())
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and "".join(lp.tokens) == r.choices[0].text
    for mine, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and mine <= 0 and abs(mine - max(top.values())) < 1e-5  # greedy: the top token
    content = ch.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-5 for t in content)


def test_concurrent_requests_each_with_its_own_budget(live):
    """Requests in flight together, each with a budget of its own (a policy each, with stacked rows of its own in the
    engine): every reply equals the one its request gets alone, none mixed up with another's."""
    texts = [" ".join(PROMPTS[i:] + PROMPTS[:i]) * 3 for i in range(5)]
    specs = [f"h2o:sink=4,heavy={h},recent=24" for h in (16, 20, 24, 28, 32)]

    async def go(together):
        async with live.client() as c:
            calls = [lambda t=t, s=s: c.completions.create(model=NAME, prompt=t, max_tokens=6, temperature=0,
                                                           extra_body={"kv_policy": s}) for t, s in zip(texts, specs)]
            if together:
                return await asyncio.gather(*(call() for call in calls))
            return [await call() for call in calls]
    alone, together = asyncio.run(go(False)), asyncio.run(go(True))
    assert [r.model_extra["kv"]["policy"] for r in together] == [parse_policy(spec).describe() for spec in specs]
    assert [r.choices[0].text for r in together] == [r.choices[0].text for r in alone]
    assert len({r.choices[0].text for r in alone}) > 1  # a mix-up would show


def test_per_request_kv_policy(live, offline):
    text = " ".join(PROMPTS * 6)
    spec = "h2o:sink=4,heavy=24,recent=36"

    ada = "adakv:sink=4,heavy=24,recent=36,alpha=0.2"
    pyr = "pyramidkv:sink=4,heavy=24,recent=36,beta=4"
    zipped = "kvzip:sink=4,heavy=24,recent=36"

    async def go():
        async with live.client() as c:
            bounded = await c.completions.create(model=NAME, prompt=text, max_tokens=6, temperature=0,
                                                 extra_body={"kv_policy": spec})
            shared = await c.completions.create(model=NAME, prompt=text, max_tokens=6, temperature=0,
                                                extra_body={"kv_policy": ada})
            layered = await c.completions.create(model=NAME, prompt=text, max_tokens=6, temperature=0,
                                                 extra_body={"kv_policy": pyr})
            read_twice = await c.completions.create(model=NAME, prompt=text, max_tokens=6, temperature=0,
                                                    extra_body={"kv_policy": zipped})
            full = await c.completions.create(model=NAME, prompt=text, max_tokens=6, temperature=0)
            again = await c.completions.create(model=NAME, prompt=text, max_tokens=6, temperature=0)
            return bounded, shared, layered, read_twice, full, again
    bounded, shared, layered, read_twice, full, again = asyncio.run(go())
    assert read_twice.choices[0].text == offline(text, 6, parse_policy(zipped))  # KVzip: the prompt read twice
    assert shared.choices[0].text == offline(text, 6, parse_policy(ada))  # heads sharing a budget, served
    assert layered.choices[0].text == offline(text, 6, parse_policy(pyr))  # layers of different budgets
    assert bounded.model_extra["kv"]["policy"] == parse_policy(spec).describe()
    assert bounded.model_extra["kv"]["tokens_evicted"] > 0 and full.model_extra["kv"]["tokens_evicted"] == 0
    assert bounded.model_extra["kv"]["peak_kv_bytes"] < full.model_extra["kv"]["peak_kv_bytes"]
    assert bounded.choices[0].text == offline(text, 6, parse_policy(spec))
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the full run's blocks, from the prefix cache
    assert again.choices[0].text == full.choices[0].text


def test_32_concurrent_streams_each_get_their_own_text(live, offline):
    prompts = [f"{p} (request {i})" for i, p in enumerate(PROMPTS * 4)]
    expected = [offline(p, 6) for p in prompts]

    async def one(c, p):
        stream = await c.completions.create(model=NAME, prompt=p, max_tokens=6, temperature=0, stream=True)
        return "".join([ch.choices[0].text async for ch in stream])

    async def go():
        async with live.client() as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))
    assert asyncio.run(go()) == expected


def test_disconnected_clients_free_their_blocks(live):
    body = {"model": NAME, "prompt": PROMPTS[3], "max_tokens": 200, "temperature": 0, "stream": True}

    async def go():
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as c:
            for _ in range(3):
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for _line in r.aiter_lines():
                        break  # the first chunk arrived: the request runs; now go away
            # a whole (non-streaming) request whose client gives up
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/v1/completions", json={**body, "stream": False}, timeout=0.5)
    asyncio.run(go())
    deadline = time.time() + 30
    while live.metric("kvbound:kv_blocks_used") or live.metric("kvbound:num_requests_running"):
        assert time.time() < deadline, "blocks still in use after the clients went away"
        time.sleep(0.1)
    assert live.metric('kvbound:request_success_total{finished_reason="abort"}') >= 4
    assert live.metric("kvbound:kv_committed_bytes") > 0  # a paged pool: all of it, all the time
    assert live.metric("kvbound:swapped_out_blocks_total") == live.metric("kvbound:swapped_in_blocks_total") == 0


def test_flood_past_max_waiting_gets_200_or_429_and_nothing_mixed(smollm, offline):
    server = Live(engine_of(smollm, max_num_seqs=2), max_waiting=2)
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} #{i}" for i in range(16)]
    try:
        async def one(c, p):
            r = await c.post("/v1/completions", json={"prompt": p, "max_tokens": 4, "temperature": 0})
            return r.status_code, r.json()

        async def go():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
                return await asyncio.gather(*(one(c, p) for p in prompts))
        results = asyncio.run(go())
        assert server.metric("kvbound:requests_rejected_total") == sum(s == 429 for s, _ in results)
    finally:
        server.stop()
    codes = [s for s, _ in results]
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes
    for p, (status, body) in zip(prompts, results):
        if status == 200:
            assert body["choices"][0]["text"] == offline(p, 4)
        else:
            assert body["error"]["type"] == "rate_limit_exceeded"


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": 10 ** 30}, 400, None),
    ({"prompt": "x" * 40000, "max_tokens": 4}, 400, None),
    ({"prompt": [1, 2, 10 ** 9]}, 400, None),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": "x", "logit_bias": {"5": 1}}, 400, "logit_bias"),
    ({"prompt": "x", "kv_policy": "h2o:sink=4,heavy=8,recnt=4"}, 400, "kv_policy"),
    ({"prompt": "x", "kv_budget": 64}, 400, "kv_budget"),
    ({"prompt": "x", "kv_policy": "h2o:sink=4,heavy=4,recent=8", "kv_budget": 64}, 400, "kv_budget"),
    ({"prompt": "x", "kv_policy": "pyramidkv:budget=64,beta=0.5"}, 400, "kv_policy"),
    ({"prompt": "x", "kv_policy": "window:budget=64", "pin": [[5, 2]]}, 400, "pin"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "n": 10 ** 6}, 400, "n"),
    ({"prompt": "x", "model": "gpt-4"}, 404, None),
    ({"messages": []}, 400, "messages"),
    ({"prompt": "x", "max_tokens": 4, "kv_policy": "window:budget=512", "unknown_field": 1}, 200, None),
])
def test_bad_fields_get_an_openai_error_naming_them(live, body, status, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(live.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    if status != 200:
        err = r.json()["error"]
        assert err["message"] and (param is None or err["param"] == param), err


def test_a_request_that_can_never_fit_the_pool_is_400(smollm):
    server = Live(engine_of(smollm, kv_cache_tokens=64))
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 70}, timeout=60)
        ok = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 70, "ignore_eos": True,
                                                             "kv_policy": "window:budget=32"}, timeout=120)
    finally:
        server.stop()
    assert r.status_code == 400 and "pool" in r.json()["error"]["message"]
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 70
    assert ok.json()["kv"]["tokens_evicted"] > 0


JSON = st.recursive(st.none() | st.booleans() | st.integers(-10 ** 30, 10 ** 30) | st.floats() | st.text(max_size=20),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                    max_leaves=12)
FIELDS = st.sampled_from(["prompt", "messages", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "logprobs",
                          "stream", "kv_policy", "kv_budget", "pin", "top_k", "min_p", "echo", "stream_options"])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.dictionaries(FIELDS, JSON, max_size=5), cut=st.integers(0, 200), chat=st.booleans())
def test_fuzzed_bodies_get_4xx_and_the_server_stays_up(live, body, cut, chat):
    raw = json.dumps({**body, "max_tokens": 2} if "prompt" in body or "messages" in body else body)
    if cut < len(raw):
        raw = raw[:cut]  # truncated JSON
    r = httpx.post(live.url + ("/v1/chat/completions" if chat else "/v1/completions"), content=raw.encode(),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert r.json()["error"]["message"]
    assert httpx.get(live.url + "/health").status_code == 200


def test_shutdown_lets_in_flight_requests_finish(smollm):
    """Stopping (what SIGINT / SIGTERM do) refuses new connections but finishes the streams under way."""
    server = Live(engine_of(smollm))
    stopper = threading.Thread(target=server.stop)
    body = {"prompt": PROMPTS[4], "max_tokens": 12, "ignore_eos": True, "temperature": 0, "stream": True}

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                lines = []
                async for line in r.aiter_lines():
                    if not lines:
                        stopper.start()
                    lines.append(line)
                return lines
    lines = asyncio.run(go())
    stopper.join(60)
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health")


def test_a_stopped_engine_answers_503_at_once(smollm):
    server = Live(engine_of(smollm))
    try:
        server.app.state.server.loop.stop()  # the engine's loop ends (as if its process died)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["message"]
        assert httpx.get(server.url + "/health").status_code == 503
    finally:
        server.stop()


def test_bench_serve_over_http(live, tmp_path):
    out = tmp_path / "s.json"
    r = subprocess.run([sys.executable, "-m", "kvbound", "bench", "serve", "--url", live.url, "--max-concurrency", "3",
                        "--num-prompts", "4", "--input-len", "32", "--output-len", "4", "--policy", "window",
                        "--budget", "64", "--goodput", "ttft:60000", "--json", str(out), "--plot",
                        str(tmp_path / "s.png")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["requests"] == 4 and res["failed"] == 0 and res["slo_met"] == 4
    assert all(q["tokens"] == 4 for q in res["per_request"]) and (tmp_path / "s.png").stat().st_size > 0
    from kvbound.eval.http_bench import run_http
    reqs, _ = run_http(live.url, [PROMPTS[0], PROMPTS[1]], {"temperature": 0, "ignore_eos": True, "stream": True,
                                                           "stream_options": {"include_usage": True}},
                       arrivals=[0.0, 0.0], max_tokens=[2, 3])  # a burst, each request with its own length
    assert [r["tokens"] for r in reqs] == [2, 3] and not any(r.get("error") for r in reqs)
    bad = subprocess.run([sys.executable, "-m", "kvbound", "bench", "serve", "--url", live.url, "--block-size", "8"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--block-size" in bad.stderr and "Traceback" not in bad.stderr


def test_api_key(smollm):
    server = Live(engine_of(smollm), api_key="sekrit")
    try:
        async def go():
            async with server.client(api_key="wrong") as bad, server.client(api_key="sekrit") as good:
                with pytest.raises(openai.AuthenticationError):
                    await bad.completions.create(model=NAME, prompt="x", max_tokens=1)
                return await good.completions.create(model=NAME, prompt="x", max_tokens=1)
        assert asyncio.run(go()).usage.completion_tokens == 1
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/metrics").status_code == 401
    finally:
        server.stop()


def test_readme_serve_commands(tmp_path):
    """README's server block: start `kvbound serve`, call it with curl and with the openai client, then SIGINT
    ends it cleanly."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(kvbound serve.*?)```", readme, re.S).group(1)
    lines = [l.split("  #")[0].strip() for l in block.replace("\\\n", " ").splitlines() if l.strip()]
    port = str(free_port())
    serve_line = lines[0].replace("8000", port)
    proc = subprocess.Popen([sys.executable, "-m", "kvbound", *serve_line.split()[1:], "--device", "cpu"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() else "timeout"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.ConnectError:
                time.sleep(0.3)
        for line in lines[1:]:
            if line.startswith("kvbound bench serve"):  # the load generator, at a small size
                line = re.sub(r"--(duration|num-prompts) \d+", r"--\1 2", line) + " --output-len 3"
            r = subprocess.run(line.replace("8000", port), shell=True, capture_output=True, text=True, timeout=300,
                               cwd=tmp_path)
            assert r.returncode == 0, (line, r.stdout, r.stderr)
            if line.startswith("curl"):
                assert json.loads(r.stdout)["choices"][0]["text"], r.stdout
            else:
                assert "0 failed" in r.stdout and "Traceback" not in r.stderr, r.stdout
        code = re.search(r"```python\n(from openai.*?)```", readme, re.S).group(1).replace("8000", port)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip(), r.stderr
    finally:
        proc.send_signal(2)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0 and "Traceback" not in out, out[-2000:]


def test_serve_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        cases = [(["--port", port], "cannot listen on 127.0.0.1:" + port),
                 (["--port", "0"], "--port"),
                 (["--model", str(tmp_path / "missing.gguf"), "--port", str(free_port())], "does not exist")]
        for args, words in cases:
            r = subprocess.run([sys.executable, "-m", "kvbound", "serve", *args], capture_output=True, text=True,
                               timeout=120, cwd=tmp_path)
            assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_prompt_forms_echo_pins_and_length_fields(live, offline, smollm):
    _, tok = smollm
    ids = tok.encode(PROMPTS[0])

    def post(path, **body):
        r = httpx.post(live.url + path, json={"temperature": 0, **body}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()
    by_ids = post("/v1/completions", prompt=ids, max_tokens=5)
    assert by_ids["choices"][0]["text"] == offline(PROMPTS[0], 5)
    many = post("/v1/completions", prompt=[PROMPTS[0], PROMPTS[2]], max_tokens=4, n=2)
    assert [c["index"] for c in many["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in many["choices"]] == [offline(PROMPTS[0], 4)] * 2 + [offline(PROMPTS[2], 4)] * 2
    assert many["usage"]["prompt_tokens"] == len(ids) + len(tok.encode(PROMPTS[2]))
    echoed = post("/v1/completions", prompt=PROMPTS[0], max_tokens=3, echo=True)
    assert echoed["choices"][0]["text"] == PROMPTS[0] + offline(PROMPTS[0], 3)
    first = tok.encode(offline(PROMPTS[0], 1))[0]  # the greedy first token
    stopped = post("/v1/completions", prompt=ids, max_tokens=8, stop_token_ids=[first])
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == 0
    pinned = post("/v1/completions", prompt=" ".join(PROMPTS * 4), max_tokens=3, kv_policy="window:budget=40,sink=4",
                  pin=[[0, 20]])
    assert pinned["kv"]["pinned"] == [[0, 20]] and pinned["kv"]["tokens_evicted"] > 0
    msgs = [{"role": "system", "content": "You answer briefly. " * 6}, {"role": "user", "content": "Hi"}]
    chat = post("/v1/chat/completions", messages=msgs, max_completion_tokens=3, kv_policy="window:budget=48,sink=4")
    unpinned = post("/v1/chat/completions", messages=msgs, max_completion_tokens=3,
                    kv_policy="window:budget=48,sink=4", pin_system_prompt=False)
    assert chat["usage"]["completion_tokens"] <= 3
    assert chat["kv"]["pinned"] and chat["kv"]["pinned"][0][0] == 0 and unpinned["kv"]["pinned"] == []
