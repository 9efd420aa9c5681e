"""`kvbound eval` end to end on a tiny random model: ppl JSON format, sweeps with plots, needle report."""
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

transformers = pytest.importorskip("transformers")

WORDS = "the a cat dog sat on mat and ran far to best thing do in san francisco is eat sandwich park".split()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    cfg = transformers.LlamaConfig(vocab_size=len(WORDS) + 8, hidden_size=128, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    vocab = {"<unk>": 0, "<|u|>": 1, "<|a|>": 2, "<|e|>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|e|>",
        "chat_template": "{% for m in messages %}<|u|> {{ m['content'] }} <|e|>{% endfor %}"
                         "{% if add_generation_prompt %}<|a|> {% endif %}"}))
    text = d / "text"
    text.mkdir()
    gen = torch.Generator().manual_seed(1)
    for i in range(3):
        (text / f"t{i}.txt").write_text(" ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (300,), generator=gen)))
    return d


def run(*args, cwd=None):
    r = subprocess.run([sys.executable, "-m", "kvbound.cli", "eval", *args], capture_output=True, text=True,
                       timeout=300, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return r


def test_ppl_json_format_and_kv_bytes(tiny, tmp_path):
    out = tmp_path / "ppl.json"
    run("ppl", "--model", str(tiny), "--text", str(tiny / "text"), "--samples", "2", "--seq-len", "64",
        "--prefill", "8", "--budget", "16", "--strategies",
        "window,h2o-heavy,h2o-heavy+kv8,h2o-heavy+kv4,snapkv,adakv,pyramidkv,h2o:budget=16,score=observed,alpha=0.2",
        "--kv-group-size", "32", "--json", str(out), "--plot", str(tmp_path / "p.png"))
    res = json.loads(out.read_text())
    s = res["strategies"]
    assert list(s) == ["baseline", "window", "h2o-heavy", "h2o-heavy+kv8", "h2o-heavy+kv4", "snapkv", "adakv",
                       "pyramidkv", "h2o:budget=16,score=observed,alpha=0.2"]  # a spec keeps its own commas
    assert s["baseline"]["delta_pct"] == 0.0
    assert {"ppl", "delta_pct"} <= set(s["window"])
    held = {k: v["kv_held_bytes"] for k, v in s.items()}
    assert held["h2o-heavy+kv4"] < held["h2o-heavy+kv8"] < held["h2o-heavy"] < held["baseline"]
    for name in ("adakv", "pyramidkv"):  # the same tokens held as a uniform budget (each entry names its head)
        assert held["snapkv"] < held[name] <= held["snapkv"] * 1.01
    # adakv shares a layer's places by score mass, which this random model's near-uniform attention may split
    # evenly, as snapkv does, on some CPUs (its kept sets: test_policies' brute-force reference)
    assert s["pyramidkv"]["ppl"] != s["snapkv"]["ppl"]
    assert res["config"]["seq_len"] == 64 and (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.parametrize("over, values", [("seq-len", "32,48"), ("budget", "12,24")])
def test_sweep_writes_table_json_and_plot(tiny, tmp_path, over, values):
    r = run("sweep", "--over", over, "--values", values, "--model", str(tiny), "--text", str(tiny / "text"),
            "--samples", "1", "--seq-len", "48", "--prefill", "8", "--budget", "16",
            "--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png"))
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert list(rows) == values.split(",")
    assert f"over {over}" in r.stdout and (tmp_path / "s.png").stat().st_size > 1000


def test_sweep_through_the_engine_gives_the_harness_perplexities(tiny, tmp_path):
    """`eval sweep --engine`: each (sample, strategy) a teacher-forced request of one continuous batch, per value."""
    got = []
    for extra in ([], ["--engine"]):
        out = tmp_path / f"s{len(extra)}.json"
        run("sweep", "--over", "seq-len", "--values", "32,48", "--model", str(tiny), "--text", str(tiny / "text"),
            "--samples", "2", "--prefill", "8", "--budget", "16", "--strategies", "window,h2o-heavy,keydiff",
            "--json", str(out), *extra)
        got.append(json.loads(out.read_text())["rows"])
    for val in ("32", "48"):
        for name, res in got[0][val].items():
            assert got[1][val][name]["ppl"] == pytest.approx(res["ppl"], rel=1e-4), (val, name)


def test_budget_at_least_length_equals_baseline(tiny, tmp_path):
    out = tmp_path / "ppl.json"
    run("ppl", "--model", str(tiny), "--text", str(tiny / "text"), "--samples", "1", "--seq-len", "40",
        "--prefill", "8", "--budget", "64", "--json", str(out))
    s = json.loads(out.read_text())["strategies"]
    assert all(v["ppl"] == s["baseline"]["ppl"] for v in s.values())


def test_needle_runs_with_pinned_variant(tiny, tmp_path):
    r = run("needle", "--model", str(tiny), "--context", "96", "--depths", "0.5", "--budget-frac", "0.5",
            "--pin-question", "--max-tokens", "3", "--json", str(tmp_path / "n.json"),
            "--plot", str(tmp_path / "n.png"), cwd=tmp_path)
    res = json.loads((tmp_path / "n.json").read_text())["results"]
    assert {x["strategy"] for x in res} == {"baseline", "window", "h2o-heavy", "window+pin", "h2o-heavy+pin"}
    assert all(x["kv_held_bytes"] > 0 for x in res)
    assert "needle found" in r.stdout and (tmp_path / "n.png").stat().st_size > 1000


def test_batched_samples_match_one_at_a_time(tiny):
    """Several samples in one forward pass give each sample the perplexity it gets alone."""
    from kvbound.eval.perplexity import perplexity
    from kvbound.eval.strategies import CacheOptions, parse_strategies
    from kvbound.models import load
    model, _ = load(tiny)
    args = CacheOptions(kv_group_size=32)
    strategies = parse_strategies(["baseline", "window", "h2o-heavy", "h2o-heavy+kv8"], 16, args)
    gen = torch.Generator().manual_seed(3)
    samples = torch.randint(4, len(WORDS) + 4, (3, 40), generator=gen).tolist()
    one = perplexity(model, samples, strategies, args, 8, progress=False, samples_per_batch=1)
    batched = perplexity(model, samples, strategies, args, 8, progress=False, samples_per_batch=3)
    for name in strategies:
        assert batched[name]["ppl"] == pytest.approx(one[name]["ppl"], rel=1e-5)
        assert batched[name]["kv_held_bytes"] == one[name]["kv_held_bytes"]
    assert one["window"]["ppl"] != one["baseline"]["ppl"]


def test_samples_are_consecutive_windows_round_robin_across_files(tmp_path):
    from kvbound.eval.data import token_samples
    (tmp_path / "a.txt").write_text(" ".join(f"a{i}" for i in range(40)))
    (tmp_path / "b.txt").write_text(" ".join(f"b{i}" for i in range(25)))

    class Words:
        def encode(self, text):
            return text.split()
    samples, names = token_samples(Words(), [tmp_path / "a.txt", tmp_path / "b.txt"], 5, 10)
    assert [s[0] for s in samples] == ["a0", "b0", "a10", "b10", "a20"]
    assert all(len(s) == 10 for s in samples) and samples[2] == [f"a{i}" for i in range(10, 20)]
    one, _ = token_samples(Words(), [tmp_path / "a.txt"], 4, 10)  # one long file gives several samples
    assert [s[0] for s in one] == ["a0", "a10", "a20", "a30"]
    later, names = token_samples(Words(), [tmp_path / "a.txt", tmp_path / "b.txt"], 2, 10, offset=3)
    assert [s[0] for s in later] == ["b10", "a20"] and names[0].endswith("b.txt[10:20]")  # --sample-offset 3
    with pytest.raises(Exception, match="holds only 4 windows of 10 tokens"):
        token_samples(Words(), [tmp_path / "a.txt"], 5, 10)
    with pytest.raises(Exception, match="holds only 4 windows of 10 tokens; asked for 2 samples after the first 3"):
        token_samples(Words(), [tmp_path / "a.txt"], 2, 10, offset=3)


def test_binary_text_is_refused(tiny, tmp_path):
    (tmp_path / "x.bin").write_bytes(bytes(range(256)) * 8)
    r = subprocess.run([sys.executable, "-m", "kvbound.cli", "eval", "ppl", "--model", str(tiny), "--text",
                        str(tmp_path / "x.bin"), "--samples", "1", "--seq-len", "16"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "is not a UTF-8 text file" in r.stderr and "Traceback" not in r.stderr


def test_documented_defaults_run_on_a_fresh_machine_and_write_only_what_is_asked(tiny, tmp_path):
    """10 x 512 tokens from the text shipped in the package, from a folder with no ../shared beside it; the
    needle's haystack too; no file is written unless --json / --plot ask."""
    r = run("ppl", "--model", str(tiny), "--samples", "10", "--seq-len", "512", "--prefill", "508",
            "--strategies", "baseline", cwd=tmp_path)
    assert "10 x 512 tokens" in r.stdout
    r = run("needle", "--model", str(tiny), "--context", "400", "--depths", "0.5", "--budget-frac", "0.5",
            "--max-tokens", "2", cwd=tmp_path)
    assert "needle found" in r.stdout
    assert list(tmp_path.iterdir()) == []


def test_generate_past_the_context_only_with_reindexed_positions(tiny):
    """A 700-word prompt for a model of 512 positions: refused, naming both lengths, unless the user asks for
    positions re-indexed within a bounded cache (StreamingLLM)."""
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(700))

    def gen(args):
        return subprocess.run([sys.executable, "-m", "kvbound", "generate", "-", "--model", str(tiny),
                               "--max-tokens", "3", *args], input=prompt, capture_output=True, text=True, timeout=300)
    with ThreadPoolExecutor(2) as pool:  # CI's two cores: one process's imports beside another's arithmetic
        refused, ran, too_wide = pool.map(gen, [(), ("--policy", "window", "--budget", "64", "--prefill-chunk", "128",
                                                     "--reindex-positions"),
                                                ("--policy", "window", "--budget", "500", "--reindex-positions")])
    assert refused.returncode == 2
    assert "the prompt has 700 tokens, more than the model's context of 512" in refused.stderr
    assert ran.returncode == 0, ran.stderr
    assert "prompt: 700 tokens" in ran.stderr and "generation:" in ran.stderr
    assert too_wide.returncode == 2 and "pass the model's context of 512" in too_wide.stderr


@pytest.mark.parametrize("policy, shown", [("adakv", "alpha=0.2"), ("pyramidkv", "beta=20.0")])
def test_generate_runs_adaptive_budgets(tiny, policy, shown):
    """adakv and pyramidkv (layers of different budgets) through the engine: each generates and reports the
    policy it ran."""
    r = subprocess.run([sys.executable, "-m", "kvbound", "generate", "one two three four five six seven eight",
                        "--model", str(tiny), "--max-tokens", "4", "--policy", policy, "--budget", "8"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "generation:" in r.stderr and shown in r.stderr


def test_ruler_samples_hold_their_answers(smollm):
    """Every task's prompt fits its context and holds what a correct reply must say; the question is placed
    as asked; the same seed gives the same prompts."""
    import random
    import re
    from collections import Counter
    from kvbound.eval.ruler import TASKS, score, sized_prompt
    _, tok = smollm
    for task in TASKS:
        for i in range(3):
            sample, ids = sized_prompt(tok, task, 600, "after", random.Random(i))
            again = sized_prompt(tok, task, 600, "after", random.Random(i))[1]
            before = sized_prompt(tok, task, 600, "before", random.Random(i))[1]
            assert ids == again and 0.8 * 600 <= len(ids) <= 600, (task, len(ids))
            text = tok.decode(ids)
            assert text.count(sample.question) == 1 and tok.decode(before).count(sample.question) == 2
            if sample.needles is not None:
                assert all(a in text for a in sample.answers), task
            else:  # the answers are the list's most frequent words, strictly ahead of the rest
                body = text[text.index("Text:\n") + 6:text.index("\n\nQuestion:")]
                counts = Counter(re.findall(r"[a-z]+", body)).most_common()
                k = len(sample.answers)
                assert {w for w, _ in counts[:k]} == set(sample.answers) and counts[k - 1][1] > counts[k][1], task
            assert score(" ".join(sample.answers), sample.answers) == 1.0 and score("", sample.answers) == 0.0


def test_eval_ruler_cli(tiny, tmp_path):
    r = run("ruler", "--model", str(tiny), "--context", "160", "--samples", "1", "--tasks", "niah_single,cwe,qa",
            "--budget-frac", "0.25,0.5", "--max-tokens", "3", "--haystack", "noise", "--json",
            str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"), cwd=tmp_path)
    res = json.loads((tmp_path / "r.json").read_text())["results"]
    assert len(res) == 3 * 3 * 2 and all(0 <= x["score"] <= 1 for x in res)
    assert {x["strategy"] for x in res} == {"baseline", "window", "h2o-heavy"}
    full = [x["reply"] for x in res if x["strategy"] == "baseline"]
    assert full[0::2] == full[1::2]  # the full cache ran once per sample, whatever the budget
    assert "ruler score" in r.stdout and (tmp_path / "r.png").stat().st_size > 1000
    bad = subprocess.run([sys.executable, "-m", "kvbound.cli", "eval", "ruler", "--tasks", "niah_doubles",
                          "--model", str(tiny)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "niah_doubles" in bad.stderr and "Traceback" not in bad.stderr


def test_ruler_through_the_engine_gives_the_single_caches_replies(tiny):
    """`eval ruler --engine`: every (sample, strategy) one request of a continuous batch, the same greedy replies
    (so the same scores) as a single-sequence cache per run, packed widths included."""
    from kvbound.eval.ruler import ruler_runs
    from kvbound.eval.strategies import CacheOptions
    from kvbound.models import load
    model, tok = load(str(tiny))
    args = (model, tok, ["baseline", "window", "h2o-heavy", "keydiff", "snapkv+kv8"], [200], ["niah_single", "vt"],
            [0.25, 0.5], CacheOptions(prefill_chunk=64, kv_group_size=32), 2, "after", ["noise"], 4)
    alone, batched = ruler_runs(*args), ruler_runs(*args, engine=True)
    assert len(batched) == 2 * 2 * 2 * 5 and [r["reply"] for r in batched] == [r["reply"] for r in alone]
    assert any(r["reply"] for r in batched)


def test_ruler_runs_kvzip_alone_and_in_the_engine_and_ppl_refuses_it(tiny, tmp_path):
    """`--strategies kvzip` scores each context once (question apart) and answers, with the same replies through the
    engine; `eval ppl`, which would feed it piece by piece, refuses it in one line before any run."""
    replies = []
    for extra in ([], ["--engine"]):
        run("ruler", "--model", str(tiny), "--context", "160", "--samples", "1", "--tasks", "niah_single,qa",
            "--budget-frac", "0.5", "--max-tokens", "3", "--haystack", "noise", "--strategies", "kvzip,snapkv",
            "--prefill-chunk", "256", "--question-piece", "--json", str(tmp_path / "k.json"), *extra, cwd=tmp_path)
        res = json.loads((tmp_path / "k.json").read_text())["results"]
        assert {x["strategy"] for x in res} == {"baseline", "kvzip", "snapkv"}
        assert all(0 <= x["score"] <= 1 for x in res)
        replies.append([x["reply"] for x in res])
    assert replies[0] == replies[1]
    bad = subprocess.run([sys.executable, "-m", "kvbound.cli", "eval", "ppl", "--samples", "1", "--strategies",
                          "kvzip", "--model", str(tiny)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "kvzip scores a whole prompt at once" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


def test_ruler_question_piece_feeds_the_question_apart_in_both_paths(tiny):
    """`--question-piece`: the question is a prefill piece of its own, so the context is evicted without it; the engine
    gives the single caches' replies, the records say so, and the CLI's table names the protocol."""
    from kvbound.eval.ruler import ruler_runs
    from kvbound.eval.strategies import CacheOptions
    from kvbound.models import load
    model, tok = load(str(tiny))
    args = (model, tok, ["baseline", "snapkv"], [200], ["niah_single"], [0.25], CacheOptions(prefill_chunk=256), 2,
            "after", ["noise"], 4)
    alone, batched = ruler_runs(*args, question_piece=True), ruler_runs(*args, engine=True, question_piece=True)
    assert [r["reply"] for r in batched] == [r["reply"] for r in alone] and all(r["question_piece"] for r in alone)
    assert not any(r["question_piece"] for r in ruler_runs(*args))
    # its own process: the CLI flushes subnormals process-wide
    r = run("ruler", "--model", str(tiny), "--context", "160", "--samples", "1", "--tasks", "qa", "--budget-frac",
            "0.5", "--max-tokens", "2", "--haystack", "noise", "--strategies", "snapkv", "--prefill-chunk", "256",
            "--question-piece", "--budget-of", "context", "--keep-question")
    assert "question after the context, in a prefill piece of its own, kept in bounded policies' recent windows with " \
           "the reply; budget a fraction of the context, plus the question" in r.stdout
    assert "a cell is a mean over 1 instances: its 95% interval is up to +/-98 pp wide" in r.stdout


@pytest.mark.parametrize("budget_of", ["context", "peak"])
def test_ruler_budget_of_context_is_kvpress_cache_once_the_question_is_read(tiny, budget_of):
    """`--budget-of context`: a bounded run's budget is the fraction of the tokens before the closing question plus
    the question whole, per instance (kvpress's cache after the question) in whole 16-token blocks, in both paths
    alike; `peak` adds the reply's max_tokens (kvpress's cache at its largest); the records say which."""
    import random
    import zlib
    from kvbound.errors import KvboundError
    from kvbound.eval.ruler import haystack_ids, instance_budget, question_ids, ruler_runs, sized_prompt
    from kvbound.eval.strategies import CacheOptions
    from kvbound.models import load
    model, tok = load(str(tiny))
    reply = 3
    args = (model, tok, ["baseline", "window", "keydiff"], [200], ["niah_single", "qa"], [0.25, 0.5],
            CacheOptions(prefill_chunk=256), 2, "after", ["noise"], reply)
    alone = ruler_runs(*args, question_piece=True, budget_of=budget_of)
    batched = ruler_runs(*args, engine=True, question_piece=True, budget_of=budget_of)
    assert [r["reply"] for r in batched] == [r["reply"] for r in alone]
    filler = haystack_ids(tok, ["noise"], 200)
    for r in (r for r in alone if r["strategy"] != "baseline"):
        rng = random.Random(zlib.crc32(f"0/{r['task']}/200/{r['sample']}".encode()))
        sample, ids = sized_prompt(tok, r["task"], 200, "after", rng, filler)
        tail = len(question_ids(tok, sample)) + reply * (budget_of == "peak")
        assert r["budget"] == (int(r["budget_frac"] * (len(ids) - len(question_ids(tok, sample)))) + tail) // 16 * 16
        assert r["budget_of"] == budget_of
    assert instance_budget(0.5, 200, 180, 20, "prompt", 12) == 100
    assert instance_budget(0.5, 200, 180, 20, "context", 12) == 96
    assert instance_budget(0.5, 200, 180, 20, "peak", 12) == 112
    assert {r["budget_of"] for r in ruler_runs(*args)} == {"prompt"}
    with pytest.raises(KvboundError, match="--budget-of must be prompt, context or peak, got 'question'"):
        ruler_runs(*args, budget_of="question")


@pytest.mark.parametrize("engine", [False, True])
def test_ruler_hands_over_what_finished_as_it_goes(tiny, tmp_path, engine):
    """`finished` sees the records of the runs done so far after each run (the full cache's, shared by both budgets,
    count once), the last of them equal to the result; the CLI's `--json` keeps them on disk marked partial."""
    from kvbound.cli.eval_cmds import PartialJSON
    from kvbound.eval.ruler import ruler_runs
    from kvbound.eval.strategies import CacheOptions
    from kvbound.models import load
    model, tok = load(str(tiny))
    seen, path = [], tmp_path / "partial.json"
    save = PartialJSON(str(path), every=0)

    def finished(records_so_far):
        seen.append(records_so_far())
        save(records_so_far)
    results = ruler_runs(model, tok, ["baseline", "window"], [160], ["niah_single"], [0.25, 0.5],
                         CacheOptions(prefill_chunk=64), 2, "after", ["noise"], 2, engine=engine, finished=finished)
    assert len(seen) == 2 + 2 * 2  # runs: the full cache once per sample, the window per sample and budget
    assert [len(x) for x in seen] == sorted(len(x) for x in seen) and seen[-1] == results
    assert all(r in results for r in seen[0]) and len(seen[0]) in (1, 2)
    on_disk = json.loads(path.read_text())
    assert on_disk["partial"] and on_disk["results"] == results


def test_ruler_runs_instance_by_instance_across_tasks(tiny):
    """A run cut short holds the first instances of every task, not every instance of the first tasks."""
    from kvbound.eval.ruler import ruler_runs
    from kvbound.eval.strategies import CacheOptions
    from kvbound.models import load
    model, tok = load(str(tiny))
    seen = []
    ruler_runs(model, tok, ["baseline"], [160], ["niah_single", "vt"], [0.5], CacheOptions(), 2, "after", ["noise"],
               2, finished=lambda records_so_far: seen.append(records_so_far()))
    assert [(r["task"], r["sample"]) for r in seen[1]] == [("niah_single", 0), ("vt", 0)]


def test_needle_hands_over_what_finished_as_it_goes(tiny):
    from kvbound.eval.needle import needle_runs
    from kvbound.eval.strategies import CacheOptions
    from kvbound.models import load
    model, tok = load(str(tiny))
    seen = []
    results = needle_runs(model, tok, ["baseline", "window"], [160], [0.5], [0.5], CacheOptions(), max_tokens=2,
                          haystack=[str(tiny / "text")], finished=lambda records_so_far: seen.append(records_so_far()))
    assert [len(x) for x in seen] == [1, 2] and seen[-1] == results


def test_needle_of_ones_own_with_samples_over_depths(smollm, tmp_path):
    from kvbound.eval.needle import Needle, needle_prompt, spread_depths
    _, tok = smollm
    needle = Needle.custom("The secret password of the blue door is mandolin.", "What opens the blue door?",
                           "mandolin")
    ids, _ = needle_prompt(tok, 400, 0.5, None, needle)
    text = tok.decode(ids)
    assert "mandolin" in text and text.count("What opens the blue door?") == 2 and "San Francisco" not in text
    assert spread_depths(3) == [0.1, 0.5, 0.9] and spread_depths(1) == [0.5]
    def bad(args):
        return subprocess.run([sys.executable, "-m", "kvbound.cli", "eval", "needle", *args], capture_output=True,
                              text=True, timeout=120)
    with ThreadPoolExecutor(2) as pool:  # the refusals beside the run
        refusals = pool.map(bad, (["--needle", "x"], ["--samples", "2", "--depths", "0.5"]))
        run("needle", "--context", "300", "--samples", "2", "--budget-frac", "0.5", "--max-tokens", "4",
            "--needle", needle.text, "--question", needle.question, "--answer", "mandolin", "--strategies", "window",
            "--json", str(tmp_path / "n.json"), cwd=tmp_path)
        refusals = list(refusals)
    found = json.loads((tmp_path / "n.json").read_text())["found"]
    assert set(found) == {"baseline", "window"} and all(len(v) == 2 for v in found.values())
    for b in refusals:
        assert b.returncode == 2 and "Traceback" not in b.stderr, b.stderr


def test_perplexity_through_the_engine_equals_the_harness(tiny):
    """Teacher tokens through the serving engine (one continuous batch, paged pool, packed at +kv8 / +kv4)
    give the harness's perplexities, bounded and quantized strategies included (issue #17's quality check)."""
    from kvbound.errors import KvboundError
    from kvbound.eval.perplexity import engine_perplexity, perplexity
    from kvbound.eval.strategies import CacheOptions, parse_strategies
    from kvbound.models import load
    model, _ = load(tiny)
    args = CacheOptions(kv_group_size=32, prefill_chunk=8)
    strategies = parse_strategies(["baseline", "window", "h2o-heavy", "h2o-heavy+kv8", "h2o-heavy+kv4",
                                   "baseline+kv8", "adakv", "pyramidkv", "observed-merge"], 16, args)
    samples = torch.randint(4, len(WORDS) + 4, (3, 40), generator=torch.Generator().manual_seed(4)).tolist()
    harness = perplexity(model, samples, strategies, args, 8, progress=False)
    engine = engine_perplexity(model, samples, strategies, args, 8, progress=False)
    for name in strategies:
        assert engine[name]["ppl"] == pytest.approx(harness[name]["ppl"], rel=1e-4), name
    assert engine["h2o-heavy+kv4"]["kv_held_bytes"] < engine["h2o-heavy"]["kv_held_bytes"]
    mixed = parse_strategies(["h2o-heavy+kvmixed"], 16, args)  # heavy=4,recent=8 through the engine, its own attends
    got = engine_perplexity(model, samples, mixed, args, 8, progress=False)["h2o-heavy+kvmixed"]
    want = perplexity(model, samples, mixed, args, 8, progress=False)["h2o-heavy+kvmixed"]
    assert got["ppl"] == pytest.approx(want["ppl"], rel=1e-4)
    assert harness["h2o-heavy+kv4"]["ppl"] != want["ppl"] != harness["h2o-heavy+kv8"]["ppl"]
    assert engine["h2o-heavy+kv4"]["kv_held_bytes"] < got["kv_held_bytes"]  # the window's residuals count


def test_ruler_keep_question_grows_recent_windows_to_hold_the_question_and_reply(tiny):
    """`--keep-question`: windowed policies' recent windows grow, within the same budget, to the question plus the
    reply in whole 16-token blocks (never past the budget's heavy part; window and full unchanged); the engine's
    replies equal the single caches', and the records and the CLI's header say so."""
    from kvbound.cache.policies import KeyDiffPolicy, parse_policy
    from kvbound.eval.ruler import question_kept, ruler_runs
    from kvbound.eval.strategies import CacheOptions
    from kvbound.models import load
    pol = parse_policy("keydiff", 200)
    kept = question_kept(pol, 37, 32)
    assert (kept.recent, kept.budget, kept.sink) == (80, pol.budget, pol.sink) and isinstance(kept, KeyDiffPolicy)
    assert question_kept(pol, 5, 8) == pol  # the window already holds them
    assert question_kept(parse_policy("h2o:sink=4,heavy=10,recent=6"), 40, 32).recent == 16  # all but the sinks
    assert question_kept(parse_policy("window", 64), 40, 32) == parse_policy("window", 64)
    model, tok = load(str(tiny))
    args = (model, tok, ["baseline", "window", "keydiff", "h2o-heavy"], [200], ["niah_multiquery"], [0.5],
            CacheOptions(prefill_chunk=256), 2, "after", ["noise"], 3)
    alone = ruler_runs(*args, question_piece=True, budget_of="context", keep_question=True)
    batched = ruler_runs(*args, engine=True, question_piece=True, budget_of="context", keep_question=True)
    assert [r["reply"] for r in batched] == [r["reply"] for r in alone]
    assert {r["keep_question"] for r in alone} == {True}
    assert {r["keep_question"] for r in ruler_runs(*args)} == {False}


def test_peer_kvpress_report_pairs_the_best_rows_instances_in_a_bootstrap_interval():
    """peer_kvpress.py's verdict per family: the paired difference between the two sides' best rows and its 95%
    bootstrap interval, over the instances both ran; rows keyed as `ruler_table` names them; each kvbound row against
    kvpress's press of the same rule at the same keep, every family's instances pooled."""
    import contextlib
    import importlib.util
    import io
    import pathlib
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "peer_kvpress.py"
    spec = importlib.util.spec_from_file_location("peer_kvpress", path)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    same = {i: float(i % 2) for i in range(20)}
    assert peer.paired_interval(same, same) == (0.0, 0.0, 0.0)
    assert peer.paired_interval({i: 1.0 for i in range(20)}, {**dict.fromkeys(range(20), 0.0), 99: 5.0}) == \
        (1.0, 1.0, 1.0)  # 99: theirs alone, left out
    one_flip = {**same, 0: 1.0}  # ours wins one instance of 20: +5 pp, the interval from 0 to 15 pp
    mean, lo, hi = peer.paired_interval(one_flip, same)
    assert mean == pytest.approx(0.05) and lo == 0.0 and 0.05 <= hi <= 0.15
    results = [{"strategy": "kvbound window", "budget_frac": 0.5, "task": "vt", "sample": 3, "score": 0.4},
               {"strategy": "kvpress tova", "budget_frac": 0.25, "task": "qa", "sample": 0, "score": 1.0}]
    assert peer.instance_scores(results) == {"kvbound window@0.5": {"vt": {3: 0.4}},
                                             "kvpress tova@0.25": {"qa": {0: 1.0}}}
    scores = {"kvbound window (equal memory)@0.5": {"vt": {0: 1.0, 1: 0.0}, "qa": {0: 1.0}},
              "kvpress streaming_llm@0.5": {"vt": {0: 1.0, 1: 1.0}, "qa": {0: 1.0}},
              "kvpress streaming_llm@0.25": {"vt": {0: 0.0, 1: 0.0}}, "kvbound h2o-heavy@0.5": {"vt": {0: 1.0}},
              "kvbound knorm@0.5": {"vt": {0: 1.0}}}  # h2o-heavy's press absent, knorm has none: no lines
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):  # window against streaming_llm at 0.5 only: -1/3 over 3 pooled instances
        peer.print_paired(scores)
    lines = buf.getvalue().strip().splitlines()
    assert len(lines) == 2 and lines[1].split()[:3] == ["kvbound", "window", "(equal"]
    assert "-33.3 pp [-100.0, +0.0] over 3 instances" in lines[1]
    rows = ["kvbound a@0.5", "kvbound b (equal memory)@0.5", "kvbound baseline@0.5"]
    grid = [[0.2, 0.7], [0.5, 0.7], [1, 1]]
    assert peer.family_bests(rows, ["t1", "t2"], grid, "kvbound", "0.5") == [
        (0.5, ["b"], "kvbound b (equal memory)@0.5"), (0.7, ["a", "b"], "kvbound a@0.5")]
    assert peer.family_bests(rows, ["t1", "t2"], grid, "kvbound", "0.5", only="a") == [  # one strategy's row alone
        (0.2, ["a"], "kvbound a@0.5"), (0.7, ["a"], "kvbound a@0.5")]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):  # a alone against kvpress's best: t1 0.2 against 0.3, below
        peer.print_bests(rows + ["kvpress p@0.5"], ["t1", "t2"], grid + [[0.3, 0.1]], {"kvbound": 2, "kvpress": 2},
                         {"kvbound a@0.5": {"t1": {0: 0.2, 1: 0.2}, "t2": {0: 0.7, 1: 0.7}},
                          "kvpress p@0.5": {"t1": {0: 0.3, 1: 0.3}, "t2": {0: 0.1, 1: 0.1}}}, only="a")
    out = buf.getvalue()
    assert "kvbound's a against kvpress's best" in out and "t1" in out and " NO " in out
    assert "kvbound >= kvpress on 1 of 2 families; below beyond the interval on 1" in out
    nan = float("nan")  # a run of some tasks only: its other cells are NaN, and those families are left out
    top, who, row = peer.family_bests(rows[:1], ["t1", "t2"], [[nan, 0.7]], "kvbound", "0.5")[0]
    assert top != top and (who, row) == ([], None)


def test_peer_kvpress_names_a_folder_with_the_ggufs_tokenizer_for_kvzips_press():
    """kvpress's KVzip press loads a tokenizer by the model's name; `peer_kvpress.tokenizer_folder` saves the GGUF's
    own, which encodes as kvbound's and carries the chat template the press frames its instruction in."""
    import importlib.util
    import pathlib
    from transformers import AutoTokenizer
    from kvbound.models import load
    from kvbound.models.loader import default_model_path
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "peer_kvpress.py"
    spec = importlib.util.spec_from_file_location("peer_kvpress", path)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    gguf = str(default_model_path())
    tok = AutoTokenizer.from_pretrained(peer.tokenizer_folder(gguf))
    text = "Repeat the previous context exactly. VAR QPZ = 31415"
    assert tok.encode(text, add_special_tokens=False) == load(gguf)[1].encode(text)
    assert tok.chat_template


def test_peer_kvpress_report_counts_an_instance_two_files_ran_once(tmp_path):
    """Two kvbound JSON files that both ran an instance (each run's own baseline): the report keeps the first file's
    record, so the row's mean is not a mean over duplicates; `--first` drops later instances."""
    import importlib.util
    import json
    import pathlib
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "peer_kvpress.py"
    spec = importlib.util.spec_from_file_location("peer_kvpress", path)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)

    def rec(strategy, sample, score):
        return {"strategy": strategy, "budget_frac": 0.5, "task": "vt", "sample": sample, "score": score,
                "budget_of": "peak"}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"results": [rec("baseline", 0, 1.0), rec("keydiff", 0, 0.0)]}))
    b.write_text(json.dumps({"results": [rec("baseline", 0, 0.0), rec("baseline", 1, 1.0), rec("tova", 0, 1.0)]}))
    got = {(r["strategy"], r["sample"]): r["score"] for r in peer.kvbound_records([str(a), str(b)])}
    assert got == {("kvbound baseline (equal peak memory)", 0): 1.0, ("kvbound baseline (equal peak memory)", 1): 1.0,
                   ("kvbound keydiff (equal peak memory)", 0): 0.0, ("kvbound tova (equal peak memory)", 0): 1.0}
    assert len(peer.kvbound_records([str(a), str(b)], first=1)) == 3


def test_ruler_sample_offset_adds_the_next_instances(tiny):
    """`--sample-offset N`: the run's instances are those numbered N onwards, the same prompts and replies as a
    longer run from 0 gives them, so a later run extends an earlier one's JSON."""
    from kvbound.eval.ruler import ruler_runs
    from kvbound.eval.strategies import CacheOptions
    from kvbound.models import load
    model, tok = load(str(tiny))
    args = (model, tok, ["window"], [160], ["niah_single", "qa"], [0.5], CacheOptions(prefill_chunk=256))
    both = ruler_runs(*args, 2, "after", ["noise"], 3)
    later = ruler_runs(*args, 1, "after", ["noise"], 3, sample_offset=1)
    assert [(r["task"], r["sample"], r["reply"]) for r in later] == \
        [(r["task"], r["sample"], r["reply"]) for r in both if r["sample"] == 1]
    r = subprocess.run([sys.executable, "-m", "kvbound.cli", "eval", "ruler", "--model", str(tiny), "--sample-offset",
                        "-1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--sample-offset: must be >= 0, got -1" in r.stderr


def test_merge_prototype_rows_equal_eval_ppl_and_merging_changes_them(tiny, tmp_path, monkeypatch):
    """benchmarks/ppl_merge.py's own eviction loop: its full, window, observed and merge-rank / merge-mass rows give
    `eval ppl`'s baseline, window, observed and observed-merge / merge=count perplexities (K/V in bf16); every merge
    row moves away from observed. A merging strategy with mixed widths is refused in one line."""
    from pathlib import Path
    from kvbound.eval.data import token_samples
    from kvbound.models import load
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import ppl_merge
    model, tok = load(str(tiny))
    samples, _ = token_samples(tok, [str(tiny / "text")], 2, 64)
    got = ppl_merge.perplexities(model, samples, list(ppl_merge.MODES), budget=16, prefill=8)
    out = tmp_path / "ppl.json"
    run("ppl", "--model", str(tiny), "--text", str(tiny / "text"), "--samples", "2", "--seq-len", "64", "--prefill",
        "8", "--budget", "16", "--kv-dtype", "bfloat16", "--strategies",
        "window,observed,observed-merge,h2o:score=observed,merge=count", "--json", str(out))
    want = json.loads(out.read_text())["strategies"]
    for mode, name in (("full", "baseline"), ("window", "window"), ("observed", "observed"),
                       ("merge-rank", "observed-merge"), ("merge-mass", "h2o:score=observed,merge=count")):
        assert got[mode] == pytest.approx(want[name]["ppl"], rel=1e-5), mode
    assert len({round(got[m], 6) for m in ppl_merge.MODES[2:]}) == len(ppl_merge.MODES) - 2
