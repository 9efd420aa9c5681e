"""Evaluation text: files of real text, cut into token samples; the needle test's haystack.

By default the public-domain text shipped inside the package (`eval/data/`: excerpts of Natsume's
"Botchan" and of Shakespeare, about 33k SmolLM2 tokens), so every documented command runs on a fresh
machine; `--text` names other files or folders."""
from __future__ import annotations

from pathlib import Path

from ..errors import KvboundError

PACKAGE_TEXT = Path(__file__).parent / "data"


def text_files(paths, flag: str = "--text") -> list[Path]:
    """*.txt files under each path, round-robin across the top-level sources so samples mix corpora; errors name
    `flag`, the option the paths came from."""
    if not paths:
        paths = [PACKAGE_TEXT]
    groups = []
    for p in map(Path, paths):
        if not p.exists():
            raise KvboundError(f"{flag}: no such file or directory: {p}")
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
        raise KvboundError(f"{flag}: no .txt files under {', '.join(map(str, paths))}")
    return out


def read_text(path: Path, flag: str = "--text") -> str:
    """A file's text; binary input is refused rather than scored."""
    data = path.read_bytes()
    try:
        if b"\x00" in data:
            raise UnicodeDecodeError("utf-8", data, 0, 1, "NUL byte")
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise KvboundError(f"{flag}: {path} is not a UTF-8 text file") from None


def joined_text(paths=None, flag: str = "--text") -> str:
    """The text of every file under `paths` (default: the package's), one after another."""
    return " ".join(read_text(f, flag) for f in text_files(paths, flag))


def sentence_end(ids: list[int], at: int, period: int, reach: int = 64) -> int:
    """`at` moved forward to just after a sentence end (at most `reach` tokens), so that text inserted there is
    not glued into a word; 0 and len(ids) stay."""
    start = at
    while 0 < at < len(ids) and ids[at - 1] != period and at - start < reach:
        at += 1
    return at


def chat_frame(tok) -> tuple[str, str]:
    """The model's chat template around one user turn: (the text before its content, the text after it, up to
    where the reply begins)."""
    head, end = tok.apply_chat_template([{"role": "user", "content": "\u0000"}]).split("\u0000")
    return head, end


def token_samples(tok, paths, n: int, seq_len: int, offset: int = 0) -> tuple[list[list[int]], list[str]]:
    """n samples of seq_len tokens: consecutive, non-overlapping windows of each file, taken round-robin
    across the files (the first window of every file, then the second, ...), after the first `offset` of them.
    Returns (samples, names)."""
    files = text_files(paths)
    ids = {}
    samples, names = [], []
    window, want = 0, offset + n
    while len(samples) < want:
        before = len(samples)
        for f in files:
            if f not in ids:
                ids[f] = tok.encode(read_text(f))
            if len(ids[f]) >= (window + 1) * seq_len:
                a = window * seq_len
                samples.append(ids[f][a:a + seq_len])
                names.append(f"{f}[{a}:{a + seq_len}]")
                if len(samples) == want:
                    break
        if len(samples) == before:
            raise KvboundError(f"--text: {', '.join(map(str, paths or [PACKAGE_TEXT]))} holds only {len(samples)} "
                               f"windows of {seq_len} tokens; asked for {n} samples"
                               + (f" after the first {offset}" if offset else ""))
        window += 1
    return samples[offset:], names[offset:]
