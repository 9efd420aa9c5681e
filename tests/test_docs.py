"""Every `kvbound` command in README.md and RESULTS.md runs, at small sizes, from a folder with no ../shared
beside it, so the docs cannot drift from the code. So does README's Python example."""
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvbound.eval.strategies import split_strategies

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SMALL = {"--max-tokens": "4", "--samples": "1", "--seq-len": "48", "--budget": "32", "--values": "16,32",
         "--context": "300", "--depths": "0.5", "--budget-frac": "0.5", "--pin-prefix": "8", "--num-prompts": "4",
         "--input-len": "16", "--output-len": "4", "--rate": "4", "--duration": "1", "--device": "cpu",
         "--tasks": "niah_single", "--model": None, "--text": None}  # None: dropped (the default model and the package's text)
ENSURE = {"generate": ["--max-tokens"], "chat": ["--max-tokens"], "ppl": ["--samples", "--seq-len"],
          "sweep": ["--samples", "--seq-len"], "needle": ["--depths", "--budget-frac", "--max-tokens"],
          "ruler": ["--samples", "--budget-frac", "--max-tokens", "--tasks"]}  # small even where not shown


def documented_commands():
    """(file, command line) of each `kvbound ...` line in a bash block, continuations joined, comments and
    optional [bracketed] parts removed."""
    for name in ("README.md", "RESULTS.md"):
        for block in re.findall(r"```bash\n(.*?)```", (ROOT / name).read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\[[^\]]*\]", "", line.split("  #")[0]).strip()
                if line.startswith("kvbound ") and not line.startswith("kvbound serve") and "--url" not in line:
                    # (the server's commands run in test_serve.py)
                    yield name, line


def shrink(line: str, tmp: Path) -> tuple[list[str], str | None]:
    """The command at small sizes, writing under tmp; and what to give it on stdin."""
    words = shlex.split(line.replace("< prompt.txt", ""))[1:]
    out, stdin, i = [], None, 0
    while i < len(words):
        w = words[i]
        if w in SMALL:
            if SMALL[w] is not None:
                out += [w, SMALL[w]]
            i += 2
            continue
        if w == "--strategies":  # the first two run; every name is parsed in the test
            out += [w, ",".join(split_strategies(words[i + 1])[:2])]
            i += 2
            continue
        if w in ("--json", "--plot"):
            out += [w, str(tmp / Path(words[i + 1]).name)]
            i += 2
            continue
        out.append("The capital of France is" if w == "..." else w)
        i += 1
    for flag in ENSURE.get(out[1] if out[0] == "eval" else out[0], []):
        if flag not in out:
            out += [flag, SMALL[flag]]
    if "seq-len" in out and "--values" in out:  # a length sweep: lengths past the default --prefill of 32
        out[out.index("--values") + 1] = "40,48"
    if out[:2] == ["generate", "-"]:
        stdin = "The capital of France is"
    if out[:1] == ["chat"]:
        stdin = "What is the capital of France?\n"
    return out, stdin


def distinct(commands):
    """Commands whose small forms differ in more than their output files: the same run twice, or once more without
    writing its JSON or plot, costs CI time and tests nothing new (of such runs, the one writing the most runs)."""
    runs = {}
    for doc, line in commands:
        args, _ = shrink(line, Path("out"))
        outputs = {i for i, a in enumerate(args) if a in ("--json", "--plot")}
        key = tuple(a for i, a in enumerate(args) if i not in outputs and i - 1 not in outputs)
        if key not in runs or len(outputs) > runs[key][0]:
            runs[key] = (len(outputs), doc, line)
    return [(doc, line) for _, doc, line in runs.values()]


ALL_COMMANDS = list(documented_commands())
COMMANDS = list(distinct(ALL_COMMANDS))


def test_docs_show_commands():
    assert len(COMMANDS) >= 10 and any(c.startswith("kvbound chat") for _, c in COMMANDS)
    from kvbound.eval.strategies import CacheOptions, parse_strategies
    for _, line in ALL_COMMANDS:  # those run once for several lines still have every line's names parsed
        words = shlex.split(line)
        if "--strategies" in words:
            parse_strategies(split_strategies(words[words.index("--strategies") + 1]), 64, CacheOptions())


@pytest.fixture(scope="module")
def command_runs(request, tmp_path_factory) -> dict:
    """Each selected documented command's small form and its finished process, two running at once: on CI's two
    cores one command's imports and Python overlap the other's arithmetic (a third less time than in turn)."""
    lines = [item.callspec.params["line"] for item in request.session.items
             if item.originalname == "test_documented_command_runs"]

    def run(line):
        tmp = tmp_path_factory.mktemp("doc")
        args, stdin = shrink(line, tmp)
        return args, subprocess.run([sys.executable, "-m", "kvbound", *args], input=stdin, capture_output=True,
                                    text=True, timeout=600, cwd=tmp)
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(lines, pool.map(run, lines)))


@pytest.mark.parametrize("doc, line", COMMANDS, ids=[c[:60] for _, c in COMMANDS])
def test_documented_command_runs(doc, line, command_runs):
    from kvbound.eval.strategies import CacheOptions, parse_strategies
    words = shlex.split(line)
    if "--strategies" in words:
        parse_strategies(split_strategies(words[words.index("--strategies") + 1]), 64, CacheOptions())
    args, r = command_runs[line]
    assert r.returncode == 0, f"{doc}: {line}\n{r.stderr[-2000:]}"
    assert "Traceback" not in r.stderr
    if args[0] in ("generate", "chat"):
        assert r.stdout.strip()
    if args[0] == "eval":
        assert "baseline" in r.stdout
    for flag in ("--json", "--plot"):
        if flag in args:
            assert Path(args[args.index(flag) + 1]).stat().st_size > 0


def test_readme_python_example_runs(tmp_path):
    code = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    code = code.replace("max_tokens=32", "max_tokens=4").replace("max_tokens=16", "max_tokens=4")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip()
