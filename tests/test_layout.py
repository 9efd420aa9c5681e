"""The package layout: imports point one way (cli -> eval -> engine -> cache -> kernels/models), no circles."""
import ast
import subprocess
import sys
from pathlib import Path

import kvbound

ROOT = Path(kvbound.__file__).parent
# what each subsystem may import from the others
LEAVES = {"errors", "version", "staging"}  # any subsystem may import these
ALLOWED = {
    "errors": set(),
    "version": set(),
    "staging": set(),
    "kernels": LEAVES,
    "models": LEAVES | {"kernels"},
    "cache": LEAVES | {"kernels"},
    "engine": LEAVES | {"kernels", "models", "cache"},
    "serve": LEAVES | {"kernels", "models", "cache", "engine"},
    "eval": LEAVES | {"kernels", "models", "cache", "engine"},
    "cli": LEAVES | {"kernels", "models", "cache", "engine", "eval", "serve"},
    "integrations": LEAVES | {"kernels", "cache"},
    "hf": {"integrations"},  # kvbound.hf, the short import of integrations.hf
}


def module_imports():
    """(module name, imported kvbound module name) for every import in the package, relative ones resolved."""
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        pkg = parts if path.name == "__init__.py" else parts[:-1]
        if path.name == "__init__.py":
            parts = parts[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = pkg[:len(pkg) - node.level + 1] if node.level else []
                target = base + (node.module.split(".") if node.module else [])
                names = [target] if node.module else [target + [a.name] for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name.split(".") for a in node.names]
            else:
                continue
            for t in names:
                if t and t[0] == "kvbound":
                    yield ".".join(parts), ".".join(t)


def subsystem(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_imports_point_one_way():
    bad = []
    for mod, target in module_imports():
        src, dst = subsystem(mod), subsystem(target)
        if src is None or src in ("__main__",) or dst is None or src == dst:
            continue
        if dst not in ALLOWED.get(src, set()):
            bad.append(f"{mod} imports {target}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_import_circles_between_modules():
    graph = {}
    for mod, target in module_imports():
        graph.setdefault(mod, set()).add(target)
    known = set(graph) | {t for ts in graph.values() for t in ts}

    def resolve(name):  # `from .x import y` may name a module x.y or an attribute y of x
        while name not in graph and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    edges = {m: {resolve(t) for t in ts if resolve(t) != m and not m.startswith(resolve(t) + ".")}
             for m, ts in graph.items()}
    state = {}

    def visit(m, path):
        if state.get(m) == 1:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(m):] + [m]))
        if state.get(m) == 2:
            return
        state[m] = 1
        for n in edges.get(m, ()):
            visit(n, path + [m])
        state[m] = 2

    for m in sorted(known):
        visit(m, [])


def test_public_api_and_python_m():
    from kvbound import LLM, SamplingParams, __version__  # noqa: F401
    assert __version__
    r = subprocess.run([sys.executable, "-m", "kvbound", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "generate" in r.stdout and "eval" in r.stdout


def test_readme_layout_table_names_every_module():
    readme = (ROOT.parent.parent / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    missing = [f"{p.parent.name}/{p.name}" for p in ROOT.glob("*/*.py")
               if p.name not in ("__init__.py", "__main__.py") and p.name not in layout]
    missing += [f"{d.name}/" for d in ROOT.iterdir() if d.is_dir() and (d / "__init__.py").exists()
                and f"`{d.name}/`" not in layout]
    assert not missing, f"README's layout table misses {missing}"
