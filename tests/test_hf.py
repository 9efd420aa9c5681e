"""kvbound.hf: eviction inside transformers' own generate(), against the unpatched model and kvbound's cache."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvbound.hf as kh  # noqa: E402
from kvbound.cache import parse_policy, sequence_cache  # noqa: E402
from kvbound.cache.policies import H2OPolicy  # noqa: E402
from kvbound.errors import KvboundError  # noqa: E402
from kvbound.models.config import ModelConfig  # noqa: E402
from kvbound.models.loader import build_model  # noqa: E402

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)


def configs():
    t = transformers
    return {
        "llama": t.LlamaConfig(**COMMON),
        "mistral": t.MistralConfig(**COMMON, sliding_window=None),
        "qwen2": t.Qwen2Config(**COMMON),
        "qwen3": t.Qwen3Config(**COMMON, head_dim=16),
        "gemma3": t.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, sliding_window=8,
                                     layer_types=["sliding_attention", "full_attention"] * 2),
        "deepseek_v3": t.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, q_lora_rank=None, kv_lora_rank=16,
                                          qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                                          n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                          first_k_dense_replace=1, n_group=1, topk_group=1),
    }


def model_of(name, seed=0, **config):
    torch.manual_seed(seed)
    cfg = configs()[name]
    for key, value in config.items():
        setattr(cfg, key, value)
    m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # sharper logits (greedy choices are not near-ties); norms that differ per channel
        m.lm_head.weight.mul_(4)
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
    return m


def ids_of(n, seed=1, batch=1):
    return torch.randint(3, 97, (batch, n), generator=torch.Generator().manual_seed(seed))


def greedy(m, ids, n=24, **kw):
    return m.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n, **kw)


@pytest.mark.parametrize("name", list(configs()))
def test_budget_over_length_is_the_unpatched_model_and_remove_restores_it(name):
    m, ids = model_of(name), ids_of(20)
    want, logits = greedy(m, ids), m(ids).logits
    kh.install_kv_eviction(m, budget=64)
    assert torch.equal(greedy(m, ids), want)
    torch.testing.assert_close(m(ids).logits, logits, atol=1e-5, rtol=1e-5)  # DeepSeek's narrower values too
    kh.remove_kv_eviction(m)
    assert m.config._attn_implementation != "kvbound"
    assert torch.equal(greedy(m, ids), want)


@pytest.mark.parametrize("name", list(configs()))
def test_every_bounded_layer_stays_within_budget_plus_evict_every(name):
    m, ids = model_of(name), ids_of(30)
    kh.install_kv_eviction(m, budget=6, n_sink=2, n_recent=4, evict_every=3)
    cache = transformers.DynamicCache(config=m.config)
    out = m(ids, past_key_values=cache)
    for step in range(20):
        out = m(out.logits[:, -1:].argmax(-1), past_key_values=cache)
        for i, layer in enumerate(cache.layers):
            held = layer.keys.shape[-2]
            if isinstance(layer, kh.EvictingLayer):
                assert held <= 6 + 2 + 4 + 3 - 1
            else:  # Gemma 3's sliding layers keep their own window
                assert getattr(layer, "is_sliding", False) and held <= 8, (i, held)
        assert cache.get_seq_length() == 30 + step + 1  # tokens processed, not held
    assert sum(isinstance(x, kh.EvictingLayer) for x in cache.layers) == (2 if name == "gemma3" else 2)


def kept_by_kvbound(cache, cfg):
    return [[cache.kept_positions(layer, h) for h in range(cfg.num_key_value_heads)]
            for layer in range(cfg.num_hidden_layers)]


def evicting(cache):
    return [layer for layer in cache.layers if isinstance(layer, kh.EvictingLayer)]  # not Gemma 3's sliding ones


def kept_by_hf(cache, row=0):
    return [[sorted(p for p in layer.pos[row, :, h].tolist() if p >= 0) for h in range(layer.pos.shape[2])]
            for layer in evicting(cache)]


def counts_by_kvbound(cache, cfg):
    """Each layer's (position, tokens it stands for) pairs, every head's in turn (merging policies)."""
    n = len(cache.n)
    return [sorted((int(p), float(c)) for h in range(cfg.num_key_value_heads)
                   for p, c in zip(cache.positions_held(layer)[:, h].tolist(), cache.count[layer, :, h].tolist())
                   if p >= 0) for layer in range(n)]


def counts_by_hf(cache):
    return [sorted((int(p), float(c)) for h in range(layer.pos.shape[2])
                   for p, c in zip(layer.pos[0, :, h].tolist(), layer.count[0, :, h].tolist()) if p >= 0)
            for layer in cache.layers]


@pytest.mark.parametrize("spec", ["h2o:sink=2,heavy=6,recent=6", "h2o:sink=2,heavy=6,recent=6,score=observed",
                                  "h2o:sink=2,heavy=6,recent=6,granularity=layer,evict_every=3",
                                  "window:budget=14,sink=2", "tova:sink=2,heavy=12", "knorm:sink=2,heavy=6,recent=6",
                                  "snapkv:sink=2,heavy=6,recent=6,window=4,kernel=3",
                                  "keydiff:sink=2,heavy=6,recent=6",
                                  "h2o:sink=2,heavy=6,recent=6,score=observed,merge=rank",
                                  "h2o:sink=2,heavy=6,recent=6,granularity=layer,merge=count",
                                  "knorm:sink=2,heavy=6,recent=6,merge=count",
                                  "h2o:sink=2,heavy=6,recent=6,score=observed,merge=rank,evict_every=3",
                                  "pyramidkv:sink=2,heavy=6,recent=6,window=4,beta=3"])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_kept_tokens_at_every_step_and_outputs_equal_kvbounds_own_cache(name, spec):
    """The same policy fed the same attention, step by step: kvbound's own model and KVCache on the same
    weights keep the same positions in every layer and head and pick the same tokens (so RoPE positions
    kept counting the tokens processed after eviction); generate() gives those tokens too. Merging policies
    merge the same tokens into the same kept ones (the logits see the merged keys and their log counts)."""
    same_steps_as_kvbounds_own_cache(name, parse_policy(spec), 16)


@pytest.mark.parametrize("chunk,block", [(512, 0), (7, 0), (7, 10)])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_kvzip_reads_the_prompt_again_and_keeps_what_kvbounds_own_cache_keeps(name, chunk, block, monkeypatch):
    """KVzip in generate(): the forward that feeds the prompt holds it whole, a hook reads it again through the
    decoder (whole, or in pieces of 7 tokens, in KVzip's blocks of 10 too) storing nothing, and each layer keeps its
    choice by that reading's scores: the same positions in every layer and head as kvbound's own cache
    (`engine.generate.prefill`), after the prompt and at every step after it, the same logits, and generate() gives
    those tokens."""
    monkeypatch.setattr("kvbound.integrations.hf.READ_CHUNK", chunk)
    same_steps_as_kvbounds_own_cache(name, parse_policy(f"kvzip:sink=2,heavy=6,recent=6,chunk={block}"), 12, chunk)


def same_steps_as_kvbounds_own_cache(name, policy, steps: int, chunk: int = 512):
    """A 24-token prompt, then `steps` - 1 greedy tokens, through kvbound.hf and through kvbound's own model and
    KVCache on the same weights (its prompt prefilled in `chunk` pieces): after each step, the same kept positions in
    every layer and head (and merged counts), the same logits and the same count of tokens processed; generate()
    gives those tokens."""
    from kvbound.engine.generate import prefill
    # float64: a kept set follows near-ties (KNorm ranks single key norms), which two implementations' float32
    # summation orders can flip (transformers 5.23's Qwen3 did at one step)
    m, ids = model_of(name, seed=2).double(), ids_of(24, seed=3)
    hf_cfg = {**m.config.to_dict(), "architectures": [type(m).__name__]}
    ours = build_model(ModelConfig.from_hf(hf_cfg), m.state_dict(), dtype=torch.float64)
    kv = sequence_cache(ours.config, policy, dtype=torch.float64)  # PyramidKV's: its layers' budgets differ
    kh.install_kv_eviction(m, policy)
    hf_cache = transformers.DynamicCache(config=m.config)
    x, toks = ids, []
    with torch.no_grad():
        for step in range(steps):
            if step == 0:
                want = prefill(ours, kv, x[0], chunk)[None]
            else:
                want = ours(x[0], kv.next_positions(1), kv)
                kv.advance(1)
            got = m(x, past_key_values=hf_cache).logits[0]
            assert kept_by_hf(hf_cache) == kept_by_kvbound(kv, m.config), f"step {step}"
            if policy.merge:  # the merged keys stand for the same tokens
                assert counts_by_hf(hf_cache) == counts_by_kvbound(kv, m.config), f"step {step}"
            assert hf_cache.get_seq_length() == 24 + step  # tokens processed (KVzip's second reading not counted)
            torch.testing.assert_close(got[-1].double(), want[-1].double(), atol=1e-4, rtol=1e-4)
            toks.append(int(want[-1].argmax()))
            x = torch.tensor([toks[-1:]])
    assert greedy(m, ids, steps)[0, 24:].tolist() == toks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention and the key-score kernel run on CUDA")
@pytest.mark.parametrize("name,spec", [("llama", "h2o:sink=4,heavy=512,recent=512"), ("llama", "snapkv"),
                                       ("llama", "kvzip:sink=4,heavy=60,recent=60"),
                                       ("deepseek_v3", "h2o:sink=4,heavy=512,recent=512"),
                                       ("deepseek_v3", "kvzip:sink=4,heavy=60,recent=60")])
def test_prefill_on_cuda_scores_through_flashattention_as_in_fp32_blocks(name, spec, monkeypatch):
    """On CUDA in bf16 a 300-token prompt's one-pass prefill, and KVzip's second reading, run as kvbound's own
    prefill pieces (FlashAttention and the key-score kernel; DeepSeek's narrower values zero-padded): the same
    scores as SDPA with fp32 blocks of queries (the path without them), to bf16's precision, and the same logits."""
    m, ids = model_of(name).to("cuda", torch.bfloat16), ids_of(300).cuda()
    keep_read, runs = kh.EvictingLayer.keep_read, []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr("kvbound.integrations.hf.flash_ok", lambda q: False)
        read = []  # KVzip: each layer's reading scores, before its keep
        monkeypatch.setattr(kh.EvictingLayer, "keep_read", lambda self: (read.append(self.best.clone()),
                                                                          keep_read(self))[1])
        kh.install_kv_eviction(m, parse_policy(spec, 1024))
        cache = transformers.DynamicCache(config=m.config)
        with torch.no_grad():
            logits = m(ids, past_key_values=cache).logits.float()
        runs.append((logits, [layer.score for layer in cache.layers], read))
        kh.remove_kv_eviction(m)
    (fast, fast_scores, fast_read), (slow, slow_scores, slow_read) = runs
    torch.testing.assert_close(fast, slow, atol=2e-2, rtol=2e-2)
    assert len(fast_read) == (2 if spec.startswith("kvzip") else 0) == len(slow_read)
    for a, b in zip(fast_scores + fast_read, slow_scores + slow_read):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-2)


def test_kvzip_reads_gemma3s_prompt_again_as_transformers_reads_it_twice(monkeypatch):
    """Gemma 3: the sliding-window layers read each piece over their window of the prompt and are put back as they
    were. Each full-attention layer's reading scores equal transformers' own eager attention over the prompt
    followed by each 12-token piece of it in turn (the most each prompt token draws from a piece's queries, over
    its KV head's query heads), and the sliding layers hold what the unpatched model's prompt forward leaves them."""
    ids, n = ids_of(30), 30
    ref = model_of("gemma3")
    ref.set_attn_implementation("eager")
    plain = transformers.DynamicCache(config=ref.config)
    with torch.no_grad():
        pieces = [ref(torch.cat([ids, ids[:, at:at + 12]], 1), output_attentions=True).attentions
                  for at in range(0, n, 12)]
        ref(ids, past_key_values=plain)
    m, read = model_of("gemma3"), []
    keep_read = kh.EvictingLayer.keep_read
    monkeypatch.setattr(kh.EvictingLayer, "keep_read", lambda self: (read.append(self.best.clone()),
                                                                      keep_read(self))[1])
    monkeypatch.setattr("kvbound.integrations.hf.READ_CHUNK", 12)  # three pieces, the sliding window 8
    kh.install_kv_eviction(m, "kvzip:sink=2,heavy=6,recent=4")
    cache = transformers.DynamicCache(config=m.config)
    with torch.no_grad():
        m(ids, past_key_values=cache)
    full = [i for i, kind in enumerate(m.config.layer_types) if kind == "full_attention"]
    assert len(read) == len(full) == 2
    for got, i in zip(read, full):
        heads = torch.stack([p[i][0, :, n:, :n].amax(1) for p in pieces]).amax(0)  # [query heads, keys]
        want = heads.view(m.config.num_key_value_heads, -1, n).amax(1).T
        torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)
    for i, (layer, alone) in enumerate(zip(cache.layers, plain.layers)):
        if i not in full:
            assert layer.cumulative_length == alone.cumulative_length == n
            torch.testing.assert_close(layer.keys, alone.keys, atol=1e-5, rtol=1e-5)  # SDPA against eager


def test_kvzip_refuses_prompts_without_token_ids():
    m = model_of("llama")
    kh.install_kv_eviction(m, "kvzip", budget=4)
    with pytest.raises(KvboundError, match="kvzip reads the prompt's token ids again: pass input_ids"):
        m(inputs_embeds=m.get_input_embeddings()(ids_of(30)), use_cache=True)


@pytest.mark.parametrize("name,policy", [("llama", "h2o"), ("llama", "observed-merge"),
                                         ("deepseek_v3", "observed-merge"), ("llama", "kvzip"),
                                         ("llama", "kvzip:chunk=12"), ("deepseek_v3", "kvzip:chunk=12"),
                                         ("gemma3", "kvzip")])
def test_left_padded_batch_gives_each_sequence_what_it_gets_alone(name, policy, monkeypatch):
    """Left padding is never kept over a real token, nor merged into one (DeepSeek's values are narrower than its
    keys: merging averages each at its own width). KVzip reads each prompt again in pieces aligned to its own first
    token (8 tokens here); the 9-token prompt, within the room, keeps its own scores though the batch reads it.
    Gemma 3's sliding layers (a 16-token window here, past the 13-token prompt) keep each row's padding out of
    their window as they read."""
    monkeypatch.setattr("kvbound.integrations.hf.READ_CHUNK", 8)
    m = model_of(name, seed=4, **({"sliding_window": 16} if name == "gemma3" else {}))
    kh.install_kv_eviction(m, policy, budget=5, n_sink=2, n_recent=4)
    prompts = [ids_of(n, seed=10 + n)[0] for n in (9, 13, 25)]
    alone = [greedy(m, p[None], 20, return_dict_in_generate=True) for p in prompts]
    width = max(map(len, prompts))
    batch = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]) for p in prompts]).long()
    together = greedy(m, batch, 20, attention_mask=mask, pad_token_id=0, return_dict_in_generate=True)
    for row, (p, a) in enumerate(zip(prompts, alone)):
        assert a.sequences[0, len(p):].tolist() == together.sequences[row, width:].tolist()
        assert kept_by_hf(a.past_key_values) == kept_by_hf(together.past_key_values, row)  # in every layer and head
        for one, many in zip(evicting(a.past_key_values), evicting(together.past_key_values)):  # same scores
            real = many.pos[row, :, 0] >= 0
            torch.testing.assert_close(many.score[row, real], one.score[0], atol=1e-4, rtol=1e-4)


def test_sampling_with_budget_over_length_is_the_unpatched_models():
    m, ids = model_of("mistral", seed=11), ids_of(16, seed=12)
    torch.manual_seed(0)
    want = m.generate(ids, max_new_tokens=12, do_sample=True, top_p=0.9, num_return_sequences=2)
    kh.install_kv_eviction(m, budget=64)
    torch.manual_seed(0)
    assert torch.equal(m.generate(ids, max_new_tokens=12, do_sample=True, top_p=0.9, num_return_sequences=2), want)


def test_sampling_with_a_seed_and_several_return_sequences():
    m, ids = model_of("qwen2", seed=5), ids_of(16, seed=6)
    kh.install_kv_eviction(m, "tova", budget=6, n_sink=2, n_recent=0)
    torch.manual_seed(0)
    a = m.generate(ids, max_new_tokens=12, do_sample=True, num_return_sequences=3, temperature=0.9)
    torch.manual_seed(0)
    b = m.generate(ids, max_new_tokens=12, do_sample=True, num_return_sequences=3, temperature=0.9)
    assert a.shape == (3, 28) and torch.equal(a, b)


def test_the_classic_rope_bug_positions_count_tokens_not_the_held_length():
    """A forward without position_ids after eviction: transformers asks the cache for its length, which must be
    the tokens processed; the physical length would rotate the new token as if it came much earlier."""
    m, ids = model_of("llama", seed=7), ids_of(30, seed=8)
    kh.install_kv_eviction(m, budget=4, n_sink=2, n_recent=4)
    cache = transformers.DynamicCache(config=m.config)
    logits = m(ids, past_key_values=cache).logits
    nxt = logits[:, -1:].argmax(-1)
    assert cache.layers[0].keys.shape[-2] == 10 and cache.get_seq_length() == 30
    implicit = m(nxt, past_key_values=cache).logits  # positions from the cache
    cache2 = transformers.DynamicCache(config=m.config)
    m(ids, past_key_values=cache2)
    explicit = m(nxt, past_key_values=cache2, position_ids=torch.tensor([[30]])).logits
    wrong_cache = transformers.DynamicCache(config=m.config)
    m(ids, past_key_values=wrong_cache)
    wrong = m(nxt, past_key_values=wrong_cache, position_ids=torch.tensor([[10]])).logits
    torch.testing.assert_close(implicit, explicit)
    assert not torch.allclose(implicit, wrong, atol=1e-3)


def test_kvbound_cache_as_past_key_values_and_reset():
    m, ids = model_of("llama", seed=9), ids_of(20, seed=9)
    kh.install_kv_eviction(m, budget=5, n_sink=2, n_recent=4)
    want = greedy(m, ids)
    kh.remove_kv_eviction(m)
    cache = kh.KVBoundCache(m, budget=5, n_sink=2, n_recent=4)
    assert torch.equal(greedy(m, ids, past_key_values=cache), want)
    kh.install_kv_eviction(m, budget=5, n_sink=2, n_recent=4)
    greedy(m, ids_of(20, seed=1))  # an unrelated generation first
    kh.reset_eviction_scores(m)
    assert torch.equal(greedy(m, ids), want)
    pyramid = kh.KVBoundCache(m, "pyramidkv:sink=2,heavy=6,recent=6,window=4,beta=3")  # each layer its own budget
    greedy(m, ids, past_key_values=pyramid)
    assert [layer.keys.shape[2] for layer in pyramid.layers] == [2 + 10 + 6, 2 + 2 + 6]


def test_unsupported_attention_and_bad_arguments_are_named():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(KvboundError, match="GPT2Attention"):
        kh.install_kv_eviction(gpt2, budget=8)
    m = model_of("llama")
    with pytest.raises(KvboundError, match="budget"):
        kh.install_kv_eviction(m)
    with pytest.raises(KvboundError, match="unknown policy"):
        kh.install_kv_eviction(m, "nope", budget=8)
    with pytest.raises(KvboundError, match="policy must be a kvbound Policy or a spec string such as 'h2o', got 5"):
        kh.install_kv_eviction(m, 5, budget=8)
    with pytest.raises(KvboundError, match="install_kv_eviction needs a transformers model, got str"):
        kh.install_kv_eviction("HuggingFaceTB/SmolLM2-135M", budget=8)
    with pytest.raises(KvboundError, match="adakv gives each KV head of a layer a budget of its own"):
        kh.install_kv_eviction(m, "adakv", budget=8)
    with pytest.raises(KvboundError, match="merge=rank weighs tokens by attention, which knorm does not gather"):
        kh.install_kv_eviction(m, "knorm:merge=rank", budget=8)
    with pytest.raises(KvboundError, match="give a budget .* or a spec that gives the shape"):
        kh.install_kv_eviction(m, "snapkv")
    assert kh.install_kv_eviction(m, "snapkv:budget=12,window=4").budget == 12  # the README's form: no budget=
    assert kh.install_kv_eviction(m, "observed-merge", budget=8).merge == "rank"
    assert isinstance(kh.install_kv_eviction(m, budget=8), H2OPolicy)


def test_readme_example_runs(tmp_path):
    """The README's transformers example, with a tiny local model in place of the Hub's."""
    import re
    from pathlib import Path
    from tokenizers import Tokenizer, models, pre_tokenizers
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", readme, re.S) if "kvbound.hf" in c)
    model_of("llama").save_pretrained(tmp_path)
    words = "The capital of France is Paris".split()
    tk = Tokenizer(models.WordLevel({"<unk>": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>").save_pretrained(tmp_path)
    exec(compile(code.replace('"HuggingFaceTB/SmolLM2-135M-Instruct"', repr(str(tmp_path))), "README", "exec"), {})


def test_hf_generate_benchmark_gives_a_row_per_context_and_policy(tmp_path):
    """benchmarks/hf_generate.py at a tiny shape on the CPU: each --policies entry runs beside the unpatched model,
    and each holds its bound (the unpatched cache: the prompt and the new tokens fed back, all but the last)."""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "hf_generate.py"), "--shape", "tiny", "--device",
                        "cpu", "--contexts", "48", "--budget", "8", "--new-tokens", "4", "--policies",
                        "h2o,observed-merge,kvzip", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(root / "src")})
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "hf_generate_tiny.json").read_text())["rows"]
    assert [(x["context"], x["policy"]) for x in rows] == [(48, "h2o"), (48, "observed-merge"), (48, "kvzip")]
    assert all(x["kvbound"]["held_tokens"] == 4 + 8 + 8 and x["unpatched"]["held_tokens"] == 48 + 3 for x in rows)
    assert "kvzip" in r.stdout.splitlines()[-1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two GPUs (a CPU entry in a device_map is offload: it "
                    "executes on the GPU)")
def test_device_map_across_two_gpus_keeps_each_layers_scores_on_its_device(tmp_path):
    """The second layer on a second GPU: each layer's scores live on its device, outputs as on one GPU."""
    other = "cuda:1"
    ids = ids_of(30, seed=14)
    model_of("llama", seed=13).save_pretrained(tmp_path)
    one = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map={"": 0})
    kh.install_kv_eviction(one, budget=6, n_sink=2, n_recent=4)
    want = greedy(one, ids.cuda(), 16).cpu()
    where = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": other,
             "model.norm": other, "lm_head": other}
    two = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map=where)
    kh.install_kv_eviction(two, budget=6, n_sink=2, n_recent=4)
    out = two.generate(ids.cuda(), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                       return_dict_in_generate=True)
    assert [str(layer.score.device) for layer in out.past_key_values.layers] == ["cuda:0", other]
    assert torch.equal(out.sequences.cpu(), want)
