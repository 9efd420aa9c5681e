"""Named evaluation strategies: a policy plus an optional KV width each, and their caches."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import parse_kv_bits, parse_policy, sequence_cache
from ..cache.quant import MIXED, check_mixed_policy
from ..errors import KvboundError

DEFAULT_STRATEGIES = ["baseline", "window", "h2o-balanced", "h2o-heavy"]
KV_SUFFIXES = {"kv8": 8, "kv4": 4, "kvmixed": MIXED, "kvmixed48": MIXED}  # kvmixed48: its earlier name


@dataclass
class CacheOptions:
    """How each strategy's cache is built and fed (the CLI's KV-cache flags)."""
    kv_dtype: torch.dtype | None = None  # unquantized K/V dtype; None: the model's
    kv_bits: object = None  # default width of strategies without a +kv suffix (`parse_kv_bits`)
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    prefill_chunk: int = 512


def split_strategies(text: str) -> list[str]:
    """The comma-separated strategies of --strategies, where a spec's own options stay with it:
    "window,h2o:sink=4,heavy=124,recent=128,alpha=0.2,observed" -> window, the h2o spec, observed (a piece with
    '=' and no ':' continues the spec before it; named strategies have neither)."""
    out: list[str] = []
    for piece in filter(None, (x.strip() for x in text.split(","))):
        if "=" in piece and ":" not in piece and out and ":" in out[-1]:
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


def fraction_budget(frac: float, context: int) -> int:
    """The budget that keeps `frac` of a `context`-token prompt (at least 16 tokens); a fraction outside (0, 1]
    would keep nothing or more than the prompt, so it is refused."""
    if not 0 < frac <= 1:
        raise KvboundError(f"--budget-frac must be in (0, 1], got {frac:g}")
    return max(16, int(frac * context))


def parse_strategies(names: list[str], budget: int, options: CacheOptions, pinned=(), **policy_defaults) -> dict:
    """name[+kv8|+kv4|+kvmixed (heavy=4,recent=8)] -> (policy, kv_bits). policy_defaults: score, ema_decay, granularity,
    evict_every for the named policies that take them."""
    out = {}
    for name in names:
        base, _, quant = name.partition("+")
        bits = parse_kv_bits(options.kv_bits)
        if quant:
            if quant not in KV_SUFFIXES:
                raise KvboundError(f"strategy {name!r}: unknown suffix +{quant} (use +kv8, +kv4, +kvmixed)")
            bits = KV_SUFFIXES[quant]
        policy = parse_policy(base, budget, pinned=pinned, **policy_defaults)
        if isinstance(bits, dict):
            check_mixed_strategy(name, policy, from_flag=not quant)
        out[name] = (policy, bits)
    return out


def check_mixed_strategy(name: str, policy, from_flag: bool):
    """Mixed widths serve h2o policies; others are refused before any model loads. With --kv-bits as every
    strategy's width (the baseline's too), the way out is a +kvmixed suffix on the h2o strategies alone."""
    try:
        check_mixed_policy(policy)
    except KvboundError as e:
        hint = ("; --kv-bits sets every strategy's width: give +kvmixed to the h2o strategies instead" if from_flag
                else "")
        raise KvboundError(f"strategy {name!r}: {e}{hint}") from None


def make_cache(model, policy, bits, options: CacheOptions, device, dtype):
    return sequence_cache(model.config, policy, device=device, dtype=options.kv_dtype or dtype, kv_bits=bits,
                          kv_group_size=options.kv_group_size, quantized_kv_start=options.quantized_kv_start)


def with_baseline(names):
    """The full cache first: every table reports its change against it."""
    return names if names[0] in ("baseline", "full") else ["baseline"] + names


def check_engine_strategies(strategies: dict, options: CacheOptions):
    """--engine runs every strategy in the serving engine's pool, one KV width per pool: --quantized-kv-start
    stays on single-sequence caches."""
    if options.quantized_kv_start:
        raise KvboundError("--quantized-kv-start runs on single-sequence caches; drop --engine")



def kv_widths(bits) -> list:
    """The distinct KV widths among `bits`, in order of first use (mixed widths are a dict, so no set)."""
    out = []
    for b in bits:
        if b not in out:
            out.append(b)
    return out


def engine_completions(model, tok, runs, options: CacheOptions, sizing, done=None) -> list:
    """The completions of `runs` [(policy, kv bits, prompt ids, SamplingParams[, question start])] through the
    serving engine: every run one request of a continuous batch, one engine per KV width (in the runs' order), sized
    by `sizing(runs of that width)` -> LLMEngine keyword arguments; done(index, completion) as each finishes."""
    from ..engine import LLMEngine
    out: list = [None] * len(runs)
    for width in kv_widths(run[1] for run in runs):
        mine = [j for j, run in enumerate(runs) if run[1] == width]
        engine = LLMEngine(model, tok, prefill_chunk=options.prefill_chunk, kv_dtype=options.kv_dtype, kv_bits=width,
                           kv_group_size=options.kv_group_size, **sizing([runs[j] for j in mine]))
        with engine:
            owner = {engine.add_request(runs[j][2], runs[j][3], policy=runs[j][0],
                                        question_start=runs[j][4] if len(runs[j]) > 4 else None): j for j in mine}
            while engine.has_unfinished():
                for finished in engine.step(only_finished=True):
                    j = owner[finished.request_id]
                    out[j] = finished.outputs[0]
                    if done is not None:
                        done(j, out[j])
    return out
