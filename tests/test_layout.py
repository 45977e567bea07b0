"""The house rules a contributor must keep (docs/design.md, "The parts and the arrows"), read from
the code's own imports: the packages import only downward, no module imports itself back
through others, imports stand at the top of a module unless a heavy optional dependency needs
them lazy (named below, with the reason), no recipe file can shadow a package, every recipe
runs by path from any folder with the installed draftsmith, and every name the scripts import from
draftsmith (benchmarks and GPU checks no test runs) is where they look for it."""

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("trainer", "export", "recipes")
# Standalone scripts run by vLLM's Python (they import vllm, which draftsmith's environment does
# not have, after parsing their arguments), and the vLLM plugin, a distribution of its own
# installed beside vLLM: outside draftsmith's import graph.
OUTSIDE = ("trainer/vllm/runners/", "trainer/vllm/plugin/")
# What a package may import, besides the standard library and third-party packages: the floors.
MAY_IMPORT = {"trainer": {"trainer"}, "export": {"trainer", "export"}, "recipes": {"trainer", "export", "recipes"}}
# Imports allowed inside a function, and why (everything else is imported at the top).
LAZY = {
    "quark": "AMD Quark's first import compiles an extension (30-70 s): only an FP8 export pays it",
    "tensorboard": "optional (the dev extra): training logs to it only when it is installed",
}


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith(OUTSIDE):
                continue
            name = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            out[name] = path
    return out


def imports(path: Path, top_only: bool = False) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every import statement of a file."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0:
                found.extend((f"{child.module}.{a.name}", child.lineno, in_function) for a in child.names)
            visit(child, inner)

    visit(tree, False)
    return [f for f in found if not (top_only and f[2])]


def test_the_packages_import_only_downward():
    """trainer imports neither export nor recipes; export imports no recipes; vLLM's wing
    (trainer/vllm) is reached by the recipes, never through export."""
    wrong = []
    for name, path in modules().items():
        floor = name.split(".")[0]
        for imported, line, _ in imports(path):
            top = imported.split(".")[0]
            if top in PACKAGES and top not in MAY_IMPORT[floor]:
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {imported}")
            if floor == "export" and imported.startswith("trainer.vllm"):
                wrong.append(f"{path.relative_to(REPO)}:{line} reaches vLLM's wing: {imported}")
    assert not wrong, wrong


def test_no_module_imports_itself_back():
    """The project's import graph has no cycle, counting imports inside functions too (they would
    hide one). `from P import name` depends on the module P.name where there is one, else on P's
    __init__ (which then must not import the importer); the packages Python runs on the way to a
    module count too, but a module's own packages do not (they are being imported already)."""
    mods = modules()
    edges = {}
    for name, path in mods.items():
        deps = set()
        for imported, _, _ in imports(path):
            targets = [imported] if imported in mods else [imported.rpartition(".")[0] or imported]
            for target in targets:
                parts = target.split(".")
                for k in range(1, len(parts) + 1):
                    dep = ".".join(parts[:k])
                    own_package = name.startswith(dep + ".") and k < len(parts)
                    if dep in mods and dep != name and not own_package:
                        deps.add(dep)
        edges[name] = deps
    state, cycle = {}, []

    def walk(node, stack):
        state[node] = "open"
        for dep in sorted(edges[node]):
            if state.get(dep) == "open":
                cycle.append(" -> ".join([*stack[stack.index(dep):], dep]))
            elif dep not in state:
                walk(dep, [*stack, dep])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            walk(node, [node])
    assert not cycle, cycle


def test_imports_stand_at_the_top():
    lazy = []
    for path in modules().values():
        for imported, line, in_function in imports(path):
            if in_function and imported.split(".")[0] not in LAZY:
                lazy.append(f"{path.relative_to(REPO)}:{line} imports {imported} inside a function")
    assert not lazy, lazy


def test_no_recipe_file_shadows_a_package():
    """`python recipes/X.py` puts recipes/ first on sys.path: a file there named like a package
    (ours, the standard library's, or any installed distribution's) would be imported instead."""
    taken = set(PACKAGES) | set(sys.stdlib_module_names) | set(metadata.packages_distributions())
    stems = [p.stem for p in (REPO / "recipes").glob("*.py") if p.stem != "__init__"]
    assert stems and not sorted(set(stems) & taken), sorted(set(stems) & taken)
    runner_stems = [p.stem for p in (REPO / "trainer" / "vllm" / "runners").glob("*.py")]
    assert not sorted(set(runner_stems) & (taken | {"vllm"})), runner_stems  # run by path in vLLM's env too


# vLLM's runners run in vLLM's environment, which has none of draftsmith's own dependencies: what they
# may import (docs/design.md, "The parts and the arrows"), besides the standard library and each other.
RUNNER_THIRD_PARTY = {"vllm", "torch", "safetensors", "ray"}
RUNNER_MAY_IMPORT = {"trainer.data.shards": "the shard writer (capture, producer)",
                     "trainer.data.wire": "the online wire format (producer)"}


def test_the_runners_import_only_what_vllms_environment_has():
    """The runners import only vllm, torch, safetensors, Ray, the standard library, one another and
    of draftsmith only the modules that define a wire format; those modules, and everything they
    reach in draftsmith (its packages' __init__ files too), import nothing vLLM's environment lacks."""
    runner_dir = REPO / "trainer" / "vllm" / "runners"
    runners = {p.stem for p in runner_dir.glob("*.py")}
    mods, wrong, reached = modules(), [], []
    for path in sorted(runner_dir.glob("*.py")):
        for imported, line, _ in imports(path):
            top = imported.split(".")[0]
            where = f"{path.relative_to(REPO)}:{line} imports {imported}"
            if top in PACKAGES:
                module = imported if imported in mods else imported.rpartition(".")[0]
                if module in RUNNER_MAY_IMPORT:
                    reached.append(module)
                else:
                    wrong.append(f"{where} (of draftsmith only {', '.join(RUNNER_MAY_IMPORT)})")
            elif top not in RUNNER_THIRD_PARTY | runners | set(sys.stdlib_module_names):
                wrong.append(f"{where}: not in vLLM's environment")
    assert sorted(set(reached)) == sorted(RUNNER_MAY_IMPORT), reached  # each allowance is used
    seen = set()
    while reached:  # what those modules reach, and the packages Python runs on the way
        name = reached.pop()
        for k in range(1, name.count(".") + 2):
            package = ".".join(name.split(".")[:k])
            if package in mods and package not in seen:
                seen.add(package)
                for imported, line, _ in imports(mods[package]):
                    top = imported.split(".")[0]
                    if top in PACKAGES:
                        reached.append(imported if imported in mods else imported.rpartition(".")[0])
                    elif top not in RUNNER_THIRD_PARTY | set(sys.stdlib_module_names):
                        wrong.append(f"{mods[package].relative_to(REPO)}:{line} imports {imported}, which a runner "
                                     "reaches in vLLM's environment")
    assert not wrong, wrong


RECIPES = ["prepare", "capture", "train", "eval", "compare", "export_draft", "upload", "demo"]


def test_every_recipe_runs_by_path_from_anywhere(tmp_path):
    """From another folder, with no PYTHONPATH, by path and under `accelerate launch`: the
    installed draftsmith's recipe runs (all started at once: each pays its imports)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    accelerate = Path(sys.executable).parent / "accelerate"
    commands = {name: [sys.executable, str(REPO / "recipes" / f"{name}.py"), "--help"] for name in RECIPES}
    commands["accelerate launch train"] = [str(accelerate), "launch", "--num_processes", "1", "--cpu",
                                           str(REPO / "recipes" / "train.py"), "--help"]
    procs = {name: subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for name, cmd in commands.items()}
    for name, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and "usage:" in out, (name, err[-2000:])


def _script_imports():
    """(file, line, module, name) for each `from <draftsmith package> import name` in scripts/: the
    Python files' (at any depth: the benchmarks import lazily) and the Python heredocs of the shell
    scripts (the GPU checks, which no CI machine runs)."""
    found = []
    for path in sorted((REPO / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                found += [(path.name, node.lineno, node.module, a.name) for a in node.names]
    roots = "|".join(PACKAGES)
    pattern = re.compile(rf"^\s*from ((?:{roots})[\w.]*) import ([\w, ]+)$")
    for path in sorted((REPO / "scripts").glob("*.sh")):
        for n, text in enumerate(path.read_text().splitlines(), 1):
            if m := pattern.match(text):
                found += [(path.name, n, m.group(1), name.strip()) for name in m.group(2).split(",")]
    return found


def test_every_name_the_scripts_import_from_draftsmith_exists():
    """A function moved between modules breaks the scripts no test runs (benchmarks, GPU checks) only
    when someone runs them: every name they import from draftsmith must be found where they look."""
    found, missing = _script_imports(), []
    for where, line, module, name in found:
        mod = importlib.import_module(module)
        submodule = hasattr(mod, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None
        if not hasattr(mod, name) and not submodule:
            missing.append(f"scripts/{where}:{line}: {module} has no {name}")
    assert any(w.endswith(".sh") for w, *_ in found) and len(found) > 20, found  # the scan sees them
    assert not missing, missing
