"""Short runs of the real default checkpoint (SmolLM2-135M-Instruct, GGUF)."""
import json
import math
import subprocess
import sys

import pytest
import torch

from kvbound.cache import KVCache, MultiCache
from kvbound.engine import SamplingParams, generate_ids
from kvbound.cache.policies import WindowPolicy
from kvbound.errors import KvboundError

pytestmark = pytest.mark.slow


def _ppl_full(model, ids):
    cache = KVCache(model.config)
    logits = model(torch.tensor(ids), cache.next_positions(len(ids)), cache)
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])))


@pytest.mark.parametrize("policy", [[], ["--policy", "observed-merge", "--budget", "5"]], ids=["full", "merge"])
def test_cli_generate_paris(smollm, policy):
    """The full cache, and a merging policy whose budget the prompt outgrows, so merged keys answer too."""
    out = subprocess.run([sys.executable, "-m", "kvbound.cli", "generate", "The capital of France is",
                          "--max-tokens", "8", *policy], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_chat_and_sampling_are_seeded(smollm):
    model, tok = smollm
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name a colour."}]))
    assert ids[:2] == tok.encode("<|im_start|>system")  # the special token is one id, not split

    def run(seed):
        p = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=seed)
        return list(generate_ids(model, ids, p, KVCache(model.config), tok.eos_ids))
    assert run(1) == run(1)
    assert len(run(2)) <= 6


@pytest.fixture(scope="module")
def hf_smollm():
    """transformers' own reading of the shipped GGUF (float32), loaded once: it dequantizes for ~14 s."""
    transformers = pytest.importorskip("transformers")
    from kvbound.models import default_model_path
    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def test_perplexity_matches_transformers_on_same_gguf(smollm, hf_smollm, shared_data):
    """Full-cache PPL of the first 1024 tokens of Aristotle.txt vs transformers reading the same GGUF file."""
    model, tok = smollm
    ids = tok.encode((shared_data / "wikipedia" / "Aristotle.txt").read_text())[:1024]
    ours = _ppl_full(model, ids)
    hf = hf_smollm
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    theirs = math.exp(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])))
    assert abs(ours / theirs - 1) < 0.01, (ours, theirs)
    assert 15 < ours < 25


class CacheLengthPositions(KVCache):
    """The classic bug: RoPE offset = physical cache length instead of tokens processed."""

    def next_positions(self, t):
        return torch.arange(len(self), len(self) + t)


def test_rope_offset_counts_tokens_not_cache_length(smollm, shared_data):
    model, tok = smollm
    ids = tok.encode((shared_data / "wikipedia" / "Aristotle.txt").read_text())[:160]
    pol = WindowPolicy(budget=48, sink=4)
    caches = [KVCache(model.config, pol), CacheLengthPositions(model.config, pol)]
    multi = MultiCache(caches)
    x = torch.tensor(ids)
    logits = model(x[:32].repeat(2), multi.positions([32, 32]), multi, logits_at=torch.tensor([31, 63]))
    multi.advance()
    nll = [0.0, 0.0]
    for i in range(32, len(ids)):
        lp = torch.log_softmax(logits, -1)[:, ids[i]]
        nll = [a - b for a, b in zip(nll, lp.tolist())]
        if i + 1 < len(ids):
            logits = model(x[i:i + 1].repeat(2), multi.positions([1, 1]), multi)
            multi.advance()
    good, bad = (math.exp(v / (len(ids) - 32)) for v in nll)
    assert caches[0].seen == len(ids) - 1 and len(caches[0]) == 48
    print(f"window-48 PPL: positions = tokens processed {good:.1f}, = cache length {bad:.1f}")
    assert bad > good * 1.3, (good, bad)


def test_eval_ppl_cli_small(tmp_path, smollm, shared_data):
    out = tmp_path / "ppl.json"
    r = subprocess.run([sys.executable, "-m", "kvbound.cli", "eval", "ppl", "--samples", "1", "--seq-len", "64",
                        "--prefill", "16", "--budget", "24", "--json", str(out), "--text",
                        str(shared_data / "wikipedia")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert set(res["strategies"]) == {"baseline", "window", "h2o-balanced", "h2o-heavy"}
    assert res["strategies"]["baseline"]["delta_pct"] == 0
    assert all(v["ppl"] > 1 for v in res["strategies"].values())
    assert res["config"]["budget"] == 24


def test_bench_serve_cli_sized_run(tmp_path):
    """`kvbound bench serve` on the real model at a low rate: a few seconds, JSON report and timeline plot."""
    import json
    import subprocess
    import sys
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    r = subprocess.run([sys.executable, "-m", "kvbound.cli", "bench", "serve", "--rate", "3", "--duration", "2",
                        "--input-len", "16", "--output-len", "6", "--policy", "window", "--budget", "12",
                        "--json", str(out), "--plot", str(png)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["requests"] == len(res["per_request"]) > 0
    assert set(res["phases"]) == {"ramp", "steady", "tail"}
    assert all(q["tokens"] == 6 and q["ttft"] > 0 for q in res["per_request"])
    assert res["ttft_p50"] <= res["ttft_p99"] and res["steps"] > 0
    assert png.stat().st_size > 1000 and "TTFT p50" in r.stdout


def test_bench_throughput_cli(tmp_path):
    import json
    import subprocess
    import sys
    out = tmp_path / "t.json"
    r = subprocess.run([sys.executable, "-m", "kvbound.cli", "bench", "throughput", "--num-prompts", "4",
                        "--input-len", "7", "--output-len", "6", "--num-blocks", "3", "--block-size", "8",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["requests"] == 4 and res["output_tokens_per_s"] > 0 and res["preemptions"] > 0


def test_chat_session_keeps_its_cache_and_feeds_only_new_text(smollm):
    """Two turns: the second feeds only its own text, and the cache then holds what a cold run of the whole
    conversation feeds; under a bounded policy the system prompt stays pinned through eviction."""
    from kvbound.cache import parse_policy
    from kvbound.engine.chat import ChatSession
    model, tok = smollm
    params = SamplingParams(max_tokens=12)
    s = ChatSession(model, tok, None, "You are a terse geography assistant.", params)
    first = "".join(s.send("What is the capital of France?"))
    seen_after_first = s.cache.seen
    second = "".join(s.send("And of Italy?"))
    assert "Paris" in first and "Rome" in second
    rendered = tok.apply_chat_template(s.messages[:-1])  # everything up to the second user turn
    reply = tok.encode(s.messages[-1]["content"], add_bos=False)
    fed_reply = reply if len(reply) < params.max_tokens else reply[:-1]
    assert s.cache.seen == len(tok.encode(rendered)) + len(fed_reply)
    assert s.cache.seen - seen_after_first < len(tok.encode(rendered))  # the second turn did not re-feed the first
    bounded = ChatSession(model, tok, parse_policy("h2o:sink=4,heavy=8,recent=8"), "You are a terse assistant.",
                          SamplingParams(max_tokens=8))
    (_, end), = bounded.cache.policy.pinned
    assert end > 4
    for question in ("Name a colour.", "Name a fruit.", "Name a city."):
        "".join(bounded.send(question))
    assert bounded.cache.seen > 40 and len(bounded.cache) <= 4 + 8 + 8 + end
    for h in range(model.config.num_kv_heads):
        assert set(range(end)) <= set(bounded.cache.kept_positions(0, h))


def test_cli_chat_answers_each_line(smollm):
    r = subprocess.run([sys.executable, "-m", "kvbound", "chat", "--system", "You are a terse geography assistant.",
                        "--max-tokens", "12", "--policy", "h2o", "--budget", "64"],
                       input="What is the capital of France?\nAnd of Italy?\n", capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and "Paris" in lines[0] and "Rome" in lines[1]


def test_llm_chat_and_stream_text(smollm):
    from kvbound import LLM
    from kvbound.cache import parse_policy
    from kvbound.engine.chat import with_pinned_system
    model, tok = smollm
    llm = LLM(model, tokenizer=tok, num_blocks=64)
    conv = [{"role": "system", "content": "You are a terse geography assistant."},
            {"role": "user", "content": "What is the capital of France?"}]
    outs = llm.chat([conv, conv[1:]], SamplingParams(max_tokens=12), use_tqdm=False)
    assert len(outs) == 2 and all("Paris" in o.outputs[0].text for o in outs)
    pol = with_pinned_system(parse_policy("h2o:sink=4,heavy=28,recent=32"), tok, conv)
    system_tokens = len(tok.encode(tok.apply_chat_template(conv[:1], add_generation_prompt=False)))
    assert pol.pinned == ((0, system_tokens),)
    assert with_pinned_system(parse_policy("h2o:sink=4,heavy=28,recent=32"), tok, conv[1:]).pinned == ()
    p = "The capital of France is"
    text = "".join(llm.stream_text(p, SamplingParams(max_tokens=8)))
    assert text == tok.decode(llm.generate(p, SamplingParams(max_tokens=8), use_tqdm=False)[0].outputs[0].token_ids)


def test_llm_takes_prompts_and_policies_as_vllm_users_write_them(smollm):
    """vLLM's prompt dicts and a policy spec string give what token ids and a parsed policy give; what is not a
    prompt, a message or a sampling field is one KvboundError naming it."""
    from kvbound import LLM
    from kvbound.cache import parse_policy
    model, tok = smollm
    llm = LLM(model, tokenizer=tok, num_blocks=64)
    params, spec = SamplingParams(max_tokens=6), "h2o:sink=4,heavy=4,recent=8"
    ids = tok.encode("The capital of France is")
    want = llm.generate(ids, params, parse_policy(spec), use_tqdm=False)[0].outputs[0].token_ids
    for prompt in ({"prompt": "The capital of France is"}, {"prompt_token_ids": ids}, torch.tensor(ids)):
        assert llm.generate(prompt, params, spec, use_tqdm=False)[0].outputs[0].token_ids == want
    for bad, needle in (([1.5, 2.0], "a prompt is text, a list of integer token ids"), (None, "got 'None'"),
                        ({"text": "x"}, "a prompt is text")):
        with pytest.raises(KvboundError, match=needle):
            llm.generate(bad, params, use_tqdm=False)
    with pytest.raises(KvboundError, match="a chat message is a dict with 'role' and 'content' strings"):
        llm.chat([{"role": "user"}], params, use_tqdm=False)
    for kw, needle in (({"stop": 5}, "stop must be a string or a list"), ({"seed": "a"}, "seed must be an integer"),
                       ({"stop_token_ids": ["a"]}, "stop_token_ids must be a list of integer token ids"),
                       ({"temperature": "hot"}, "temperature must be a number")):
        with pytest.raises(KvboundError, match=needle):
            SamplingParams(**kw)
    for kw in ({"num_blocks": 0}, {"max_num_seqs": 0}, {"block_size": -16}):
        with pytest.raises(KvboundError, match=f"{next(iter(kw))} must be a positive integer"):
            LLM(model, tokenizer=tok, **kw)
    assert not llm.engine.has_unfinished()


def test_stop_strings_across_tokens_end_the_text_at_the_right_character(smollm):
    from kvbound import LLM
    model, tok = smollm
    llm = LLM(model, tokenizer=tok, num_blocks=64)
    p = "The capital of France is"
    free = llm.generate(p, SamplingParams(max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert free.text.startswith(" Paris.\n\nThe")
    stopped = llm.generate(p, SamplingParams(max_tokens=12, stop=("is.\n\nTh", "zzz")), use_tqdm=False)[0].outputs[0]
    assert stopped.text == " Par" and stopped.finish_reason == "stop"
    assert len(stopped.token_ids) < len(free.token_ids)


def test_stream_decoder_pieces_add_up_to_the_whole_decode(smollm):
    """The incremental decoder (a short window per token) gives the text decode() gives, piece by piece."""
    import random
    from kvbound.models.tokenizer import StreamDecoder
    _, tok = smollm
    rng = random.Random(0)
    cases = [tok.encode("Hello, wörld! 日本語 🎉🎉  two  spaces\n\nend"), tok.encode("def f(x):\n    return x**2")]
    cases += [[rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))] for _ in range(100)]
    for ids in cases:
        d = StreamDecoder(tok)
        pieces = "".join(d.push(i) for i in ids)
        whole = tok.decode(ids)
        assert whole.startswith(pieces) and (pieces == whole or whole.endswith("\ufffd")), ids


def test_transformers_under_kvbound_hf_gives_kvbounds_perplexity(smollm, hf_smollm, shared_data):
    """SmolLM2 read by transformers from the shipped GGUF, bounded by `kvbound.hf.install_kv_eviction`: its
    token-by-token perplexity under h2o-heavy and observed-merge (budget 128, 160 tokens) equals `kvbound eval
    ppl`'s."""
    transformers = pytest.importorskip("transformers")
    import kvbound.hf as kh
    from kvbound.cache import parse_policy
    from kvbound.eval.perplexity import perplexity
    from kvbound.eval.strategies import CacheOptions
    model, tok = smollm
    ids = tok.encode((shared_data / "wikipedia" / "Aristotle.txt").read_text())[:160]
    prefill = 128  # the budget: every eviction happens token by token, as in a decode
    policies = {name: parse_policy(name, prefill) for name in ("h2o-heavy", "observed-merge")}  # scored: the hard case
    ours = perplexity(model, [ids], {"baseline": (parse_policy("full"), None),
                                     **{n: (p, None) for n, p in policies.items()}}, CacheOptions(), prefill,
                      progress=False)
    hf = hf_smollm
    x = torch.tensor([ids])
    for name, policy in policies.items():
        kh.install_kv_eviction(hf, policy)
        cache = transformers.DynamicCache(config=hf.config)
        with torch.no_grad():
            logits = hf(x[:, :prefill], past_key_values=cache).logits[0, -1]
            nll = 0.0
            for i in range(prefill, len(ids)):
                nll -= torch.log_softmax(logits, -1)[ids[i]].item()
                if i + 1 < len(ids):
                    logits = hf(x[:, i:i + 1], past_key_values=cache).logits[0, -1]
        kh.remove_kv_eviction(hf)
        theirs = math.exp(nll / (len(ids) - prefill))
        assert cache.layers[0].keys.shape[-2] == prefill
        assert abs(theirs / ours[name]["ppl"] - 1) < 1e-3, (name, theirs, ours[name]["ppl"])


def test_kvzip_in_transformers_generate_gives_kvbounds_tokens(smollm, hf_smollm, shared_data):
    """SmolLM2 read by transformers from the shipped GGUF under `kvbound.hf` with kvzip (a 300-token passage,
    budget 64): the prompt read again through transformers' decoder keeps what kvbound's own cache keeps, and
    generate() gives kvbound's greedy tokens."""
    import kvbound.hf as kh
    from kvbound.cache import KVCache, parse_policy
    from kvbound.engine.generate import generate_ids
    from kvbound.engine.sampling import SamplingParams
    model, tok = smollm
    ids = tok.encode((shared_data / "wikipedia" / "Aristotle.txt").read_text())[:300]
    policy = parse_policy("kvzip", 64)
    ours = list(generate_ids(model, ids, SamplingParams(max_tokens=8, temperature=0.0), KVCache(model.config, policy),
                             (), 512))
    kh.install_kv_eviction(hf_smollm, policy)
    try:
        theirs = hf_smollm.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    finally:
        kh.remove_kv_eviction(hf_smollm)
    assert theirs[0, len(ids):].tolist() == ours
