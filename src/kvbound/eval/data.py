"""Evaluation text: files of real text, cut into token samples; the needle test's haystack."""
from __future__ import annotations

from pathlib import Path

from ..errors import KvboundError

PACKAGE_TEXT = Path(__file__).parent / "data"
SHARED_DATA = Path("../shared/data")


def text_files(paths) -> list[Path]:
    """*.txt files under each path, round-robin across the top-level sources so samples mix corpora."""
    if not paths:
        paths = [SHARED_DATA] if SHARED_DATA.exists() else [PACKAGE_TEXT]
    groups = []
    for p in map(Path, paths):
        if not p.exists():
            raise KvboundError(f"--text: no such file or directory: {p}")
        if p.is_file():
            groups.append([p])
            continue
        for sub in sorted(p.iterdir()):
            files = sorted(sub.rglob("*.txt")) if sub.is_dir() else ([sub] if sub.suffix == ".txt" else [])
            if files:
                groups.append(files)
    out = []
    for i in range(max((len(g) for g in groups), default=0)):
        out += [g[i] for g in groups if i < len(g)]
    if not out:
        raise KvboundError(f"--text: no .txt files under {', '.join(map(str, paths))}")
    return out


def token_samples(tok, paths, n: int, seq_len: int) -> tuple[list[list[int]], list[str]]:
    samples, names = [], []
    for f in text_files(paths):
        ids = tok.encode(f.read_text(errors="replace"))
        if len(ids) >= seq_len:
            samples.append(ids[:seq_len])
            names.append(str(f))
        if len(samples) == n:
            break
    if len(samples) < n:
        raise KvboundError(f"only {len(samples)} text files hold {seq_len} tokens; asked for {n} samples")
    return samples, names
