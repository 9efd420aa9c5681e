"""One benchmark script on an earlier commit's code and on the current tree, alternately, in one run.

A change is checked for regressions side by side: figures move between runs and machines, so both
versions run on the same machine in the same call.

    python3 benchmarks/before_after.py export REV     # here: REV's src/ and benchmarks/ into .before/ (git-ignored)
    python3 benchmarks/before_after.py run --out $OUT [--rounds 1] -- SCRIPT.py ARGS...   # on the GPU machine

Each round runs the script of REV, then the current one, each in its own process with its own code on
PYTHONPATH and `--out $OUT/before_<round>` / `--out $OUT/after_<round>`.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEFORE = ROOT / ".before"


def export(rev: str):
    BEFORE.mkdir(exist_ok=True)  # git-ignored (.gitignore); carry it to the GPU machine
    archive = subprocess.run(["git", "archive", rev, "src", "benchmarks"], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(BEFORE)], input=archive.stdout, check=True)
    print(f"{rev} exported to {BEFORE}")


def run(out: str, rounds: int, script_args: list[str]):
    script, args = script_args[0], script_args[1:]
    for i in range(rounds):
        for name, base in (("before", BEFORE), ("after", ROOT)):
            env = dict(os.environ, PYTHONPATH=f"{base / 'src'}:{base / 'benchmarks'}", PYTHONUNBUFFERED="1")
            dest = os.path.join(out, f"{name}_{i}")
            os.makedirs(dest, exist_ok=True)
            print(f"=== {name} (round {i}): {script} {' '.join(args)}", flush=True)
            subprocess.run([sys.executable, str(base / "benchmarks" / script), *args, "--out", dest], env=env,
                           check=True)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("rev")
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--rounds", type=int, default=1)
    r.add_argument("script", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    if a.cmd == "export":
        export(a.rev)
    else:
        run(a.out, a.rounds, [x for x in a.script if x != "--"])


if __name__ == "__main__":
    main()
