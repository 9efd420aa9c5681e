"""RULER-style synthetic tasks, generated here (no downloads): what a bounded cache loses first is retrieval.

Each task builds a prompt of about `context` tokens and the answers a correct reply contains; a reply
scores the fraction of its answers it contains (case-insensitive). The question goes after the context
("after": compression cannot see it coming) or also before it ("before": a query-aware policy can), as
kvpress's query_aware does. With `question_piece` the question is a prefill piece of its own, so the
context's evictions never see it: kvpress's protocol (context compressed, then the question) when the pieces
hold the context. kvpress then keeps the question and its reply uncompressed; `keep_question` gives bounded
policies a recent window that holds both (`question_kept`). Haystacks: the package's text, files
(`--haystack`), or RULER's repeated noise sentences ("noise").

Tasks (RULER's families): niah_single, niah_multikey, niah_multivalue, niah_multiquery (needles in a
haystack), vt (variable tracking over chained assignments), cwe / fwe (common and frequent words
extraction), qa (a fact among distractor passages).
"""
from __future__ import annotations

import random
import zlib
from collections import Counter
from dataclasses import dataclass, replace

from tqdm import tqdm

from ..cache.policies import H2OPolicy
from ..engine import SamplingParams, generate_ids
from ..errors import KvboundError
from .data import chat_frame, joined_text, sentence_end
from .strategies import (CacheOptions, check_engine_strategies, engine_completions, fraction_budget,
                         make_cache, parse_strategies)

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
WORDS = ("apple river stone cloud maple tiger silver garden candle harbor violet meadow falcon copper lantern "
         "orchard pebble thunder willow saddle canyon ember glacier hollow island jasmine kettle lagoon marble "
         "nectar oyster prairie quartz rocket shadow tulip umbrella velvet walnut yonder zephyr anchor bramble "
         "cobalt dune fennel grotto heron ivory juniper kelp").split()
NAMES = ("Alma Bruno Celia Dario Edith Felix Greta Hugo Irene Jonas Kira Lorenzo Mara Nils Olga Pavel Quinn Rosa "
         "Soren Tilda Ugo Vera Wim Xenia Yusuf Zora").split()
CITIES = ("Lisbon Oslo Quito Hanoi Dakar Lima Perth Tunis Riga Bergen Cusco Malmo Ghent Split Porto Turku "
          "Lyon Graz Brno Cork").split()
TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa")
BUDGETS_OF = ("prompt", "context", "peak")  # what --budget-frac is a fraction of (`instance_budget`)


@dataclass
class Sample:
    """A task instance: the context's pieces to scatter in the haystack (None: the context is `body`),
    the question, the reply's opening words, and the answers a correct reply contains."""
    needles: list[str] | None
    body: str | None
    question: str
    answer_prefix: str
    answers: list[str]


def _number(rng) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _keys(rng, n) -> list[str]:
    return [f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-{rng.randint(10, 99)}" for _ in range(n)]


def make_sample(task: str, rng: random.Random, words_budget: int) -> Sample:
    """One instance of `task`; words_budget sizes the word-list tasks (cwe, fwe) to the context."""
    if task == "niah_single":
        key, value = _keys(rng, 1)[0], _number(rng)
        return Sample([f"The special magic number for {key} is: {value}."], None,
                      f"What is the special magic number for {key}?", f"The special magic number for {key} is",
                      [value])
    if task == "niah_multikey":
        keys = _keys(rng, 4)
        values = [_number(rng) for _ in keys]
        return Sample([f"The special magic number for {k} is: {v}." for k, v in zip(keys, values)], None,
                      f"What is the special magic number for {keys[0]}?",
                      f"The special magic number for {keys[0]} is", [values[0]])
    if task == "niah_multivalue":
        key, values = _keys(rng, 1)[0], [_number(rng) for _ in range(3)]
        return Sample([f"One of the special magic numbers for {key} is: {v}." for v in values], None,
                      f"What are all the special magic numbers for {key}?",
                      f"The special magic numbers for {key} are", values)
    if task == "niah_multiquery":
        keys = _keys(rng, 3)
        values = [_number(rng) for _ in keys]
        return Sample([f"The special magic number for {k} is: {v}." for k, v in zip(keys, values)], None,
                      f"What are the special magic numbers for {', '.join(keys)}?",
                      f"The special magic numbers for {', '.join(keys)} are", values)
    if task == "vt":
        names = [f"{rng.choice('QWXYZ')}{rng.choice('JKLMN')}{rng.randint(100, 999)}" for _ in range(4)]
        value = str(rng.randint(10000, 99999))
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        return Sample(chain, None, f"Find all variables that are assigned the value {value}.",
                      f"Variables assigned the value {value}:", names)
    if task == "cwe":
        common = rng.sample(WORDS, 5)
        rare = [w for w in WORDS if w not in common]
        each = max(3, words_budget // 10)
        items = common * each + [rng.choice(rare) for _ in range(max(0, words_budget - 5 * each))]
        rng.shuffle(items)
        answers = _most_common(items, 5)  # (may add to the list: first)
        body = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        return Sample(None, body, "What are the 5 most common words in the list above?",
                      "The 5 most common words in the list are", answers)
    if task == "fwe":
        vocab = rng.sample(WORDS, 12)
        weights = [1 / (r + 1) ** 1.2 for r in range(len(vocab))]  # Zipf-like: the first three dominate
        items = rng.choices(vocab, weights, k=max(30, words_budget))
        answers = _most_common(items, 3)
        return Sample(None, " ".join(items), "What are the 3 most frequently used words in the text above?",
                      "The 3 most frequently used words are", answers)
    if task == "qa":
        people = rng.sample(NAMES, 6)
        cities = rng.sample(CITIES, 6)
        facts = [f"{p} was born in {c} and still lives there." for p, c in zip(people, cities)]
        return Sample(facts, None, f"In which city was {people[0]} born?", f"{people[0]} was born in",
                      [cities[0]])
    raise KvboundError(f"unknown ruler task {task!r} (choose from {', '.join(TASKS)})")


def _most_common(items: list[str], k: int) -> list[str]:
    """The k most frequent items; a tie across the k-th place makes the question ambiguous, so it is broken
    by adding one more of the k-th (the list stays a fair count of what it asks)."""
    counts = Counter(items)
    ranked = counts.most_common()
    while len(ranked) > k and ranked[k - 1][1] == ranked[k][1]:
        items.append(ranked[k - 1][0])
        counts = Counter(items)
        ranked = counts.most_common()
    return [w for w, _ in ranked[:k]]


class TooLong(KvboundError):
    """A word-list context longer than the prompt's room: make a shorter one."""

    def __init__(self, have: int, room: int):
        super().__init__(f"{have} tokens for a room of {room}")
        self.have, self.room = have, room


def haystack_ids(tok, haystack, need: int) -> list[int]:
    """At least `need` tokens of filler: "noise" (RULER's repeated sentences), or text files (default: the
    package's text), repeated if short."""
    if haystack == ["noise"]:
        text = NOISE * (need // 8 + 2)
    else:
        text = joined_text(haystack, "--haystack")
    ids = tok.encode(text)
    if not ids:
        raise KvboundError("ruler: the haystack is empty")
    return (ids * (need // len(ids) + 1))[:need]


def build_prompt(tok, sample: Sample, context: int, query: str, rng, filler: list[int]) -> list[int]:
    """The chat prompt of about `context` tokens: instruction (+ question when query="before"), the context
    with the needles at random sentence ends of `filler` (haystack tokens), the question, then the answer's
    opening words."""
    ask = f"Answer the question: {sample.question}\n\n" if query == "before" else ""
    pre = tok.encode(chat_frame(tok)[0] + f"Read the text below and answer the question after it. {ask}Text:\n")
    post = question_ids(tok, sample)
    room = context - len(pre) - len(post)
    if sample.needles is None:
        body = tok.encode(sample.body)
        if len(body) > room:
            raise TooLong(len(body), room)
    else:
        needles = [tok.encode(" " + n + " ") for n in sample.needles]
        fill = room - sum(map(len, needles))
        if fill < 16:
            raise KvboundError(f"ruler: context {context} is too short for its needles")
        hay = filler[:fill]
        period = tok.encode(".")[0]
        cuts = sorted(rng.randrange(len(hay)) for _ in needles)
        body, last = [], 0
        for cut, needle in zip(cuts, needles):
            cut = max(last, sentence_end(hay, cut, period))  # a needle glued into a word is no fair test
            body += hay[last:cut] + needle
            last = cut
        body += hay[last:]
    return pre + body + post


def question_ids(tok, sample: Sample) -> list[int]:
    """The prompt's tail: the question and the reply's opening words (kvpress's `question`, after the context)."""
    return tok.encode(f"\n\nQuestion: {sample.question}{chat_frame(tok)[1]}{sample.answer_prefix}")


def sized_prompt(tok, task, context, query, rng, filler=None) -> tuple[Sample, list[int]]:
    """A sample of `task` and its prompt; word-list tasks shrink until their list fits the context whole.
    filler: haystack tokens (default: the package's text)."""
    filler = filler if filler is not None else haystack_ids(tok, None, context)
    words = context
    while True:
        sample = make_sample(task, rng, words)
        try:
            return sample, build_prompt(tok, sample, context, query, rng, filler)
        except TooLong as e:
            if words <= 8:
                raise KvboundError(f"ruler: context {context} is too short for {task}") from None
            words = min(words - 1, int(words * e.room / e.have * 0.97))


def score(reply: str, answers: list[str]) -> float:
    low = reply.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


def ruler_runs(model, tok, names, contexts, tasks, budget_fracs, options: CacheOptions, samples=20,
               query="after", haystack=None, max_tokens=32, device="cpu", dtype=None, seed=0, engine=False,
               finished=None, question_piece=False, budget_of="prompt", keep_question=False, sample_offset=0,
               **policy_defaults) -> list[dict]:
    """Every strategy on `samples` instances of every task, context and budget fraction (the same instances
    for every strategy). One record per run: its score, the reply, the budget. `engine`: every run is a
    request of one continuous batch (`engine_replies`) instead of a single-sequence cache after another.
    `finished(records_so_far)`, if given, is called as each run ends; records_so_far() builds the records of
    every run done so far (a caller that saves them now and then keeps them when a long run is cut short).
    question_piece: the question is fed as a prefill piece of its own (see the module's docstring).
    budget_of: what a budget fraction is of (`instance_budget`): "prompt", "context" or "peak". keep_question:
    bounded policies' recent windows hold the closing question and the reply (`question_kept`). sample_offset: the
    instances are those numbered sample_offset onwards, so a later run adds instances to an earlier one's instead of
    repeating them."""
    if query not in ("before", "after"):
        raise KvboundError(f"--query must be before or after, got {query!r}")
    if budget_of not in BUDGETS_OF:
        raise KvboundError(f"--budget-of must be {', '.join(BUDGETS_OF[:-1])} or {BUDGETS_OF[-1]}, got {budget_of!r}")
    for task in tasks:
        make_sample(task, random.Random(0), 10)  # unknown names fail before any run
    jobs = []
    filler = haystack_ids(tok, haystack, max(contexts))  # tokenized once for every prompt
    for context in contexts:
        model.config.check_length(context, max_tokens)
        # instance by instance across the tasks: a run cut short holds the first instances of every task
        for i, task in ((i, task) for i in range(sample_offset, sample_offset + samples) for task in tasks):
            rng = random.Random(zlib.crc32(f"{seed}/{task}/{context}/{i}".encode()))  # same in every run
            sample, ids = sized_prompt(tok, task, context, query, rng, filler)
            tail = len(question_ids(tok, sample))
            start = len(ids) - tail if question_piece else None
            for frac in budget_fracs:
                budget = instance_budget(frac, context, len(ids) - tail, tail, budget_of, max_tokens)
                strategies = parse_strategies(names, budget, options, **policy_defaults)
                if keep_question:
                    strategies = {name: (question_kept(pol, tail, max_tokens), bits)
                                  for name, (pol, bits) in strategies.items()}
                if engine:
                    check_engine_strategies(strategies, options)
                jobs += [(context, task, i, frac, name, pol, bits, ids, start, sample)
                         for name, (pol, bits) in strategies.items()]
    once = {(c, t, i, n): j for j, (c, t, i, _, n, pol, *_) in enumerate(jobs) if not pol.bounded}
    # the full cache does not depend on the budget: each of its runs is made once
    first = [once.get((c, t, i, n), j) if not pol.bounded else j for j, (c, t, i, _, n, pol, *_) in enumerate(jobs)]
    todo = [j for j in range(len(jobs)) if first[j] == j]
    if budget_of != "prompt":  # budgets vary by instance: the engine serves one budget's runs together
        todo.sort(key=lambda j: jobs[j][5].budget or 0)
    text: dict[int, str] = {}

    def done(k, reply_ids):  # the k-th run of `todo` ended
        text[todo[k]] = tok.decode(reply_ids)
        if finished is not None:
            finished(lambda: _records(jobs, first, text, query, budget_of, keep_question))
    if engine:
        engine_replies(model, tok, [jobs[j][5:9] for j in todo], options, max_tokens, done=done)
    else:
        for k, j in enumerate(tqdm(todo, desc="ruler")):
            pol, bits, ids, start = jobs[j][5:9]
            cache = make_cache(model, pol, bits, options, device, dtype)
            done(k, list(generate_ids(model, ids, SamplingParams(max_tokens=max_tokens), cache, tok.eos_ids,
                                      options.prefill_chunk, start)))
    return _records(jobs, first, text, query, budget_of, keep_question)


def question_kept(policy, question: int, max_tokens: int):
    """`policy` with its recent window grown, at its heavy hitters' expense (the budget stays), to hold the closing
    question and a reply of `max_tokens` in whole 16-token blocks, as kvpress keeps both uncompressed. Policies
    without a window of their own (full, window) come back as they are."""
    if not isinstance(policy, H2OPolicy):
        return policy
    window = min(policy.heavy + policy.recent, -(-(question + max_tokens) // 16) * 16)
    if window <= policy.recent:
        return policy
    return replace(policy, heavy=policy.heavy + policy.recent - window, recent=window)


def instance_budget(frac: float, context: int, before_question: int, question: int, budget_of: str,
                    reply: int = 0) -> int:
    """A bounded run's budget: `frac` of the `context`-token prompt ("prompt"); or ("context") `frac` of the
    tokens before the closing question plus the question whole, which is kvpress's cache once it has read the
    question; or ("peak") that plus a `reply`-token reply, kvpress's cache at its largest, what a server reserves
    for the request in either engine. In whole 16-token pool blocks, rounded down: kvbound never holds more than
    kvpress's cache at that point."""
    if budget_of == "prompt":
        return fraction_budget(frac, context)
    after = question + reply if budget_of == "peak" else question  # what follows the context, kept whole
    return max(16, (fraction_budget(frac, before_question) + after) // 16 * 16)


def _records(jobs, first, text, query, budget_of, keep_question) -> list[dict]:
    """One record per job whose run (`first[j]`, shared by the full cache's budgets) has a reply in `text`."""
    results = []
    for j, (context, task, i, frac, name, pol, bits, ids, start, sample) in enumerate(jobs):
        if first[j] not in text:
            continue
        reply = text[first[j]]
        results.append({"strategy": name, "context": context, "task": task, "sample": i, "budget_frac": frac,
                        "budget": pol.budget, "budget_of": budget_of, "query": query,
                        "question_piece": start is not None, "keep_question": keep_question,
                        "score": score(reply, sample.answers),
                        "answers": sample.answers, "reply": reply.strip()})
    return results


def engine_replies(model, tok, runs, options: CacheOptions, max_tokens: int, pool_tokens: int = 1 << 19,
                   progress=True, done=None) -> list[list[int]]:
    """Greedy replies to `runs` [(policy, kv bits, prompt ids, question start or None)] through the serving engine
    (`strategies.engine_completions`), each width's pool holding what its runs need, at most `pool_tokens`;
    `done(index, reply ids)` as each one ends."""
    params = SamplingParams(max_tokens=max_tokens)
    bar = tqdm(total=len(runs), desc="ruler (engine)", disable=not progress)

    def sizing(mine):
        need = sum(len(ids) + max_tokens if pol.budget is None else pol.capacity + options.prefill_chunk
                   for pol, _, ids, *_ in mine)
        return dict(kv_cache_tokens=min(pool_tokens, need + 64), max_num_seqs=256,
                    max_num_batched_tokens=max(8192, options.prefill_chunk))
    def ended(j, completion):
        bar.update()
        if done is not None:
            done(j, list(completion.token_ids))
    completions = engine_completions(model, tok, [(pol, bits, ids, params, start) for pol, bits, ids, start in runs],
                                     options, sizing, ended)
    bar.close()
    return [list(c.token_ids) for c in completions]


def ruler_table(results) -> tuple[list[str], list[str], list[list[float]]]:
    """(rows: strategy@budget fraction, tasks, mean score of each cell)."""
    rows = list(dict.fromkeys(f"{r['strategy']}@{r['budget_frac']:g}" for r in results))
    tasks = list(dict.fromkeys(r["task"] for r in results))
    grid = []
    for row in rows:
        cells = []
        for t in tasks:
            xs = [r["score"] for r in results if f"{r['strategy']}@{r['budget_frac']:g}" == row and r["task"] == t]
            cells.append(sum(xs) / len(xs) if xs else float("nan"))
        grid.append(cells)
    return rows, tasks, grid
