"""Needle in a haystack: a fact hidden at a depth of an essay context, asked for at the end."""
from __future__ import annotations

from dataclasses import dataclass

from tqdm import tqdm

from ..engine import SamplingParams, generate_ids
from ..errors import KvboundError
from .data import chat_frame, read_text, sentence_end, text_files
from .strategies import CacheOptions, fraction_budget, make_cache, parse_strategies

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco?"
NEEDLE_KEYS = ("dolores park", "sandwich")


@dataclass(frozen=True)
class Needle:
    """The fact to hide, the question that asks for it, the words a reply opens with, and the words that count
    as finding it (any one, case-insensitive)."""
    text: str = NEEDLE
    question: str = QUESTION
    answer_prefix: str = "The best thing to do in San Francisco is"
    answers: tuple = NEEDLE_KEYS

    @classmethod
    def custom(cls, text=None, question=None, answer=None) -> "Needle":
        """--needle / --question / --answer: all three or none (a needle of one's own needs its question and
        the word that shows it was found)."""
        given = [x is not None for x in (text, question, answer)]
        if not any(given):
            return cls()
        if not all(given):
            raise KvboundError("--needle, --question and --answer go together: give all three")
        if not answer.strip() or answer.strip().lower() not in text.lower():
            raise KvboundError(f"--answer {answer!r} must be a word of --needle {text!r}: a reply is found when it "
                               "contains the answer")
        return cls(text, question, "", (answer.strip(),))


def needle_prompt(tok, context: int, depth: float, haystack=None, needle: Needle = Needle()) -> tuple[list[int], int]:
    """Chat prompt of about `context` tokens: instruction + question, the haystack text (files or folders,
    default the package's text) with the needle at `depth`, then the question again. Returns (ids, length
    of the instruction span to pin)."""
    text_ids: list[int] = []
    for f in text_files(haystack, "--haystack"):
        text_ids += tok.encode(read_text(f, "--haystack"))
        if len(text_ids) > context:
            break
    head, end = chat_frame(tok)
    instruction = (f"Read the document below, then answer this question: {needle.question}\n\nDocument:\n")
    tail_text = f"\n\nAnswer the question using the document. {needle.question}"
    pre_ids = tok.encode(head + instruction)
    post_ids = tok.encode(tail_text + end + needle.answer_prefix)
    needle_ids = tok.encode(" " + needle.text + " ")
    room = context - len(pre_ids) - len(post_ids) - len(needle_ids)
    if room < 16:
        raise KvboundError(f"needle: context {context} is too short")
    if len(text_ids) < room:
        raise KvboundError(f"needle: the haystack holds {len(text_ids)} tokens, context {context} needs {room}: "
                           "give more text with --text")
    hay = text_ids[:room]
    at = sentence_end(hay, int(len(hay) * depth), tok.encode(".")[0])
    return pre_ids + hay[:at] + needle_ids + hay[at:] + post_ids, len(pre_ids)


def needle_runs(model, tok, names, contexts, depths, budget_fracs, options: CacheOptions, pin_question=False,
                max_tokens=24, device="cpu", dtype=None, haystack=None, needle: Needle = Needle(), finished=None,
                **policy_defaults) -> list[dict]:
    """Every strategy on every (context, budget fraction, depth), and with `pin_question` each bounded one
    again with the instruction + question span pinned. One record per run: found or not, the answer, KV bytes.
    `finished(records_so_far)` as in `ruler.ruler_runs`."""
    for context in contexts:
        model.config.check_length(context, max_tokens)
    variants = [False, True] if pin_question else [False]
    jobs = []
    for context in contexts:  # every prompt and policy first, so bad settings fail before any run
        for frac in budget_fracs:
            for depth in depths:
                ids, pin_len = needle_prompt(tok, context, depth, haystack, needle)
                for pin in variants:
                    strategies = parse_strategies(names, fraction_budget(frac, context), options,
                                                  pinned=((0, pin_len),) if pin else (), **policy_defaults)
                    jobs += [(context, depth, frac, pin, name, pol, bits, ids)
                             for name, (pol, bits) in strategies.items() if pol.bounded or not pin]
    results = []
    for context, depth, frac, pin, name, pol, bits, ids in tqdm(jobs, desc="needle"):
        cache = make_cache(model, pol, bits, options, device, dtype)
        out = list(generate_ids(model, ids, SamplingParams(max_tokens=max_tokens), cache, tok.eos_ids,
                                options.prefill_chunk))
        answer = tok.decode(out)
        mem = cache.nbytes()
        results.append({"strategy": name + ("+pin" if pin else ""), "context": context, "depth": depth,
                        "budget_frac": frac, "budget": pol.budget,
                        "found": any(k.lower() in answer.lower() for k in needle.answers), "answer": answer.strip(),
                        "kv_held_bytes": mem["held_bytes"], "kv_full_bf16_bytes": mem["full_bf16_bytes"]})
        if finished is not None:
            finished(lambda: list(results))
    return results


def spread_depths(samples: int) -> list[float]:
    """`samples` depths spread evenly over the haystack, ends excluded (0.1, 0.5, 0.9 for 3)."""
    return [round(0.1 + 0.8 * i / (samples - 1), 4) for i in range(samples)] if samples > 1 else [0.5]


def found_lists(results) -> dict:
    """Per strategy, whether each of its runs found the needle (in run order)."""
    out: dict = {}
    for r in results:
        out.setdefault(r["strategy"], []).append(r["found"])
    return out


def needle_grid(results) -> tuple[list[str], list[tuple], list[list[float]]]:
    """(strategies, (context, budget fraction) columns, the fraction of depths found in each cell)."""
    strategies = list(dict.fromkeys(r["strategy"] for r in results))
    cols = list(dict.fromkeys((r["context"], r["budget_frac"]) for r in results))
    grid = []
    for s in strategies:
        row = []
        for c, f in cols:
            hits = [r["found"] for r in results if r["strategy"] == s and r["context"] == c and r["budget_frac"] == f]
            row.append(sum(hits) / len(hits) if hits else float("nan"))
        grid.append(row)
    return strategies, cols, grid
