"""Import layering of sbp, by package prefix: every module is checked, none is listed by hand.

The layers, each importing only the ones before it (and its own package):

    values -> planning -> runtime -> tensor -> ops -> nn;   io, tools, testing beside them, on top

Also: no import cycles between files (one allowed: the GlobalTensor class and its autograd functions),
no module imports another module's ``_private`` name, no sbp import inside a function (the lazy loaders
listed in LAZY excepted), and the pure layers (values, planning) never import torch -- checked on the
source and in a fresh interpreter. The last tests feed the checkers bad trees, so a checker that stopped
looking fails.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

SBP = pathlib.Path(__file__).resolve().parents[1] / "sbp"
while not (SBP / "__init__.py").exists():  # the test may sit deeper in tests/
    SBP = SBP.parents[1] / "sbp"

ORDER = ("values", "planning", "runtime", "tensor", "ops", "nn")
SIDE = ("io", "tools", "testing")          # beside the layers: may import any layer, not each other
PURE = ("values", "planning")              # no torch at all
TOP = ("sbp", "sbp.__main__")              # the package root: assembles the public names
ALLOWED_CYCLES = ({"sbp.tensor.global_tensor", "sbp.tensor.autograd"},)
# modules that import on first use, and why (anything else importing inside a function fails)
LAZY = {"sbp": "the torch layers load on first use, so the planning CLI never imports torch",
        "sbp.testing": "the Hypothesis strategies need hypothesis, a dev extra"}


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str
    target: str          # the sbp module imported from (or the module itself)
    name: str | None     # the name taken from it (`from target import name`), None for a plain import
    line: int
    in_function: bool


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules(root: pathlib.Path = SBP) -> dict[str, pathlib.Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> list[Import]:
    """Every import a module's source makes (torch and sbp alike), with its line and whether it runs
    inside a function. ``from pkg import sub`` of a submodule targets the submodule. Imports under
    ``if TYPE_CHECKING:`` never run and are skipped; ``importlib.import_module("literal")`` counts."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, in_function)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(module, alias.name, None, node.lineno, in_function))
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                if node.level else node.module
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    found.append(Import(module, sub, None, node.lineno, in_function))
                else:
                    found.append(Import(module, base, alias.name, node.lineno, in_function))
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                found.append(Import(module, node.args[0].value, None, node.lineno, in_function))
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return found


def package_of(module: str) -> str | None:
    """The layer package of an sbp module (``sbp.planning.search`` -> ``planning``); None for the root."""
    return None if module in TOP else module.split(".")[1]


def rank(package: str) -> int:
    return ORDER.index(package) if package in ORDER else len(ORDER)


def owner(target: str, modules: dict[str, pathlib.Path]) -> str | None:
    """The sbp module a dotted import target lives in (None outside sbp)."""
    while target not in modules and "." in target:
        target = target.rpartition(".")[0]
    return target if target in modules else None


def check(root: pathlib.Path = SBP) -> dict[str, list[str]]:
    """Every rule, over every module under `root`: {rule: [violations]}."""
    modules = all_modules(root)
    problems: dict[str, list[str]] = {k: [] for k in ("unknown", "upward", "private", "function", "torch", "cycle")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m, path in modules.items():
        mine = package_of(m)
        if mine is not None and mine not in ORDER + SIDE:
            problems["unknown"].append(f"{m}: package {mine!r} is not a layer (known: {ORDER + SIDE})")
        for imp in imports_of(m, path, modules):
            if mine in PURE and (imp.target == "torch" or imp.target.startswith("torch.")):
                problems["torch"].append(f"{m}:{imp.line} imports {imp.target}")
            target = owner(imp.target, modules)
            if target is None or target == m:
                continue
            graph[m].add(target)
            where = f"{m}:{imp.line} -> {target}"
            if imp.name and imp.name.startswith("_") and not imp.name.startswith("__"):
                problems["private"].append(f"{where}.{imp.name}")
            if imp.in_function and m not in LAZY:
                problems["function"].append(where)
            theirs = package_of(target)
            if mine is None or theirs is None or theirs == mine:
                continue
            if rank(theirs) > rank(mine) or (mine in SIDE and theirs in SIDE):
                problems["upward"].append(f"{where} ({mine} may import only {ORDER[:rank(mine)]})")
    for component in strongly_connected(graph):
        if len(component) > 1 and set(component) not in ALLOWED_CYCLES:
            problems["cycle"].append(" <-> ".join(sorted(component)))
    return problems


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of the import graph (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    out.append(component)
    return out


# ---- the rules, on sbp -------------------------------------------------------------------------------
REPORT = check()


@pytest.mark.parametrize("rule", list(REPORT))
def test_rule_holds(rule):
    assert REPORT[rule] == [], f"{rule}:\n" + "\n".join(REPORT[rule])


def test_every_layer_exists_and_has_modules():
    packages = {package_of(m) for m in all_modules()} - {None}
    assert set(ORDER + SIDE) <= packages


def test_no_package_is_named_like_a_public_function():
    import sbp
    for package in ORDER + SIDE:
        assert not callable(getattr(sbp, package, None)), package


# ---- run time: the pure layers in a fresh interpreter ------------------------------------------------
RUNNER = textwrap.dedent("""
    import importlib, json, sys
    pure = sys.argv[1].split(",")
    for m in pure:
        importlib.import_module(m)
    print(json.dumps({"torch": sorted(k for k in sys.modules if k == "torch" or k.startswith("torch.")),
                      "sbp": sorted(k for k in sys.modules if k.startswith("sbp"))}))
""")


def run_isolated(root: pathlib.Path, modules: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-I", "-c", RUNNER, ",".join(modules)], capture_output=True, text=True,
                          cwd=root.parent, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pure_layers_load_without_torch():
    pure = [m for m in all_modules() if package_of(m) in PURE]
    assert len(pure) >= 8
    report = run_isolated(SBP, ["sbp"] + pure)
    assert report["torch"] == []
    assert [m for m in report["sbp"] if package_of(m) not in PURE + (None,)] == []  # nothing above them


# ---- the checkers can fail -----------------------------------------------------------------------
def fake_tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "sbp"
    for rel, body in {"__init__.py": "", "values/__init__.py": "", "values/errors.py": "class E(Exception): ...\n",
                      "runtime/__init__.py": "", "runtime/comm.py": "X = 1\n_Y = 2\n", "ops/__init__.py": "",
                      **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body))
    return root


BAD_TREES = {
    "upward": {"values/bad.py": "from ..runtime.comm import X\n"},
    "private": {"runtime/bad.py": "from .comm import _Y\n"},
    "function": {"runtime/bad.py": "def f():\n    from . import comm\n    return comm\n"},
    "torch": {"values/bad.py": "import torch.distributed\n"},
    "cycle": {"runtime/a.py": "from . import b\n", "runtime/b.py": "from .a import X\n"},
    "unknown": {"misc/__init__.py": "", "misc/bad.py": "X = 1\n"},
}


@pytest.mark.parametrize("rule", list(BAD_TREES))
def test_checker_flags(tmp_path, rule):
    report = check(fake_tree(tmp_path, BAD_TREES[rule]))
    assert report[rule], report
    assert all(v == [] for k, v in report.items() if k != rule), report


def test_checker_passes_clean_and_type_checking_imports(tmp_path):
    report = check(fake_tree(tmp_path, {
        "runtime/ok.py": "from typing import TYPE_CHECKING\nfrom ..values.errors import E\nif TYPE_CHECKING:\n"
                         "    from ..ops import rules\n",
        "ops/ok.py": "import torch\nfrom ..runtime.comm import X\n"}))
    assert all(v == [] for v in report.values()), report


def test_checker_flags_a_dynamic_import(tmp_path):
    report = check(fake_tree(tmp_path, {"values/bad.py": "import importlib\nm = importlib.import_module('sbp.ops')\n"}))
    assert report["upward"], report
