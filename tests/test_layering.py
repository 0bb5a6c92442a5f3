"""Import layering: the pure modules never reach torch.distributed, and data flows one way only.

Two independent checks: the modules' source is parsed with `ast` (catches lazy imports inside functions
too), and the modules are imported in a fresh interpreter with import hooks (catches dynamic imports).
The last tests feed the checkers a bad module, so a checker that stopped looking would fail.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

SBP = pathlib.Path(__file__).resolve().parents[1] / "sbp"

# No torch at all: pure Python values and maths.
STRICT = ("placement", "mesh", "layout", "steps", "transfer", "pieces", "errors")
# May import torch (e.g. for dtypes), but never torch.distributed; checked when they exist.
OPTIONAL_PURE = ("planner", "cost", "simulate")
# Layers above the pure ones: a pure module never imports from them.
UPPER = ("sbp.tensor.global_tensor", "sbp.ops", "sbp.nn", "sbp.runtime.backends", "sbp.runtime.executor", "sbp.testing")


def pure_modules() -> list[str]:
    found = []
    for name in STRICT + OPTIONAL_PURE:
        if (SBP / f"{name}.py").exists() or (SBP / name / "__init__.py").exists():
            found.append(name)
    return found


def source_files(name: str, root: pathlib.Path = SBP) -> list[pathlib.Path]:
    """The file of module `name`, or every file of package `name`."""
    if (root / f"{name}.py").exists():
        return [root / f"{name}.py"]
    return sorted((root / name).rglob("*.py"))


def module_name(path: pathlib.Path, root: pathlib.Path = SBP) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module a source imports at run time: `import a.b` gives a and a.b; `from .x import y` gives
    the resolved package.x and package.x.y; `importlib.import_module("m")` / `__import__("m")` give m.
    Imports under `if TYPE_CHECKING:` are skipped: they never run."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()

    def add(dotted: str) -> None:
        parts = dotted.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                if node.level else node.module
            add(base)
            for alias in node.names:
                if alias.name != "*":
                    add(f"{base}.{alias.name}")
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                add(node.args[0].value)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return names


def violations(names: set[str], strict: bool) -> list[str]:
    bad = []
    for name in sorted(names):
        if name == "torch.distributed" or name.startswith("torch.distributed."):
            bad.append(name)
        elif strict and (name == "torch" or name.startswith("torch.")):
            bad.append(name)
        elif any(name == up or name.startswith(up + ".") for up in UPPER):
            bad.append(name)
    return bad


# ---- static check ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", pure_modules())
def test_pure_module_imports(name):
    files = source_files(name)
    assert files, f"sbp.{name} has no source"
    for path in files:
        names = imported_names(path.read_text(), module_name(path), is_package=path.name == "__init__.py")
        assert violations(names, strict=name in STRICT) == [], f"{path.relative_to(SBP.parent)} imports them"


def test_strict_modules_exist():
    assert set(STRICT) <= set(pure_modules())


# ---- run-time check in a fresh interpreter ---------------------------------------------------------
RUNNER = textwrap.dedent('''
    import builtins, importlib, importlib.abc, importlib.util, json, sys
    root, mode, modules = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    upper = {upper!r}
    pure = {{"sbp." + m for m in modules}}
    caught = []

    def forbidden(name, strict):
        if name == "torch.distributed" or name.startswith("torch.distributed."):
            return True
        if strict and (name == "torch" or name.startswith("torch.")):
            return True
        return any(name == u or name.startswith(u + ".") for u in upper)

    class Guard(importlib.abc.MetaPathFinder):
        """Refuses to load a forbidden module, whoever asks. Strict mode: torch itself (and so
        torch.distributed); pure mode: the upper sbp layers only, since torch loads torch.distributed."""
        def find_spec(self, name, path=None, target=None):
            if forbidden(name, True) if mode == "strict" else name.startswith("sbp.") and forbidden(name, False):
                caught.append(name)
                raise ImportError(f"pure sbp modules must not import {{name}}")
            return None

    sys.meta_path.insert(0, Guard())

    # `import torch` itself loads torch.distributed, so for modules allowed to import torch, watch the
    # import statements that the pure modules execute (their globals name the importer), cached or not.
    real_import, real_import_module = builtins.__import__, importlib.import_module

    def watched(name, globals=None, locals=None, fromlist=(), level=0):
        importer = (globals or {{}}).get("__name__", "")
        if importer in pure:
            base = importlib.util.resolve_name("." * level + name, globals.get("__package__")) if level else name
            for target in [base] + [base + "." + f for f in (fromlist or ()) if f != "*"]:
                if forbidden(target, False):
                    caught.append(target)
                    raise ImportError(f"{{importer}} must not import {{target}}")
        return real_import(name, globals, locals, fromlist, level)

    def watched_module(name, package=None):
        importer = sys._getframe(1).f_globals.get("__name__", "")
        if importer in pure and forbidden(importlib.util.resolve_name(name, package) if name.startswith(".") else name, False):
            caught.append(name)
            raise ImportError(f"{{importer}} must not import {{name}}")
        return real_import_module(name, package)

    builtins.__import__, importlib.import_module = watched, watched_module

    # Load the sbp package object without running sbp/__init__.py (which pulls in every layer).
    spec = importlib.util.spec_from_file_location("sbp", root + "/__init__.py", submodule_search_locations=[root])
    sys.modules["sbp"] = importlib.util.module_from_spec(spec)
    errors = {{}}
    for m in modules:
        try:
            real_import_module("sbp." + m)
        except ImportError as e:
            errors[m] = str(e)
    torch_loaded = "torch" in sys.modules
    print(json.dumps({{"caught": caught, "errors": errors, "torch_loaded": torch_loaded,
                       "sbp_loaded": sorted(k for k in sys.modules if k.startswith("sbp."))}}))
''').format(upper=UPPER)


def run_isolated(root: pathlib.Path, mode: str, modules: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-I", "-c", RUNNER, str(root), mode, ",".join(modules)],
                          capture_output=True, text=True, cwd=root.parent, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_strict_modules_load_without_torch():
    report = run_isolated(SBP, "strict", list(STRICT))
    assert report["errors"] == {} and report["caught"] == []
    assert not report["torch_loaded"]
    assert set(report["sbp_loaded"]) <= {f"sbp.{m}" for m in STRICT}  # nothing above the pure layers


def test_pure_modules_never_import_torch_distributed():
    modules = pure_modules()
    report = run_isolated(SBP, "pure", modules)
    assert report["errors"] == {} and report["caught"] == []
    assert [m for m in report["sbp_loaded"] if any(m == u or m.startswith(u + ".") for u in UPPER)] == []


# ---- the checkers can fail -------------------------------------------------------------------------
BAD_SOURCES = {
    "import torch.distributed as dist": ["torch", "torch.distributed"],
    "from torch import distributed": ["torch", "torch.distributed"],
    "def f():\n    import torch\n    return torch": ["torch"],
    "import importlib\nd = importlib.import_module('torch.distributed')": ["torch", "torch.distributed"],
    "from .tensor import GlobalTensor": ["sbp.tensor.global_tensor", "sbp.tensor.global_tensor.GlobalTensor"],
    "from . import ops": ["sbp.ops"],
    "from sbp.runtime.backends.gloo import X": ["sbp.runtime.backends", "sbp.runtime.backends.gloo", "sbp.runtime.backends.gloo.X"],
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch": [],
    "from .layout import block\nimport math": [],
}


@pytest.mark.parametrize("source, expected", list(BAD_SOURCES.items()))
def test_static_checker_flags(source, expected):
    assert violations(imported_names(source, "sbp.values.placement"), strict=True) == expected


def test_static_checker_non_strict_allows_torch():
    assert violations(imported_names("import torch\nfrom torch import dtype", "sbp.planning.search"), strict=False) == []
    assert violations(imported_names("import torch.distributed", "sbp.planning.search"), strict=False) == ["torch.distributed"]


def _fake_package(tmp_path: pathlib.Path, body: str) -> pathlib.Path:
    root = tmp_path / "sbp"
    root.mkdir()
    (root / "__init__.py").write_text("raise RuntimeError('the package __init__ must not run')\n")
    (root / "errors.py").write_text("class SbpError(ValueError):\n    pass\n")
    (root / "bad.py").write_text(body)
    (root / "tensor.py").write_text("X = 1\n")
    return root


def test_runtime_checker_strict_catches_torch(tmp_path):
    root = _fake_package(tmp_path, "from .errors import SbpError\nimport torch\n")
    report = run_isolated(root, "strict", ["errors", "bad"])
    assert report["caught"] == ["torch"] and "bad" in report["errors"] and "errors" not in report["errors"]
    assert not report["torch_loaded"]


def test_runtime_checker_catches_upper_layer(tmp_path):
    root = _fake_package(tmp_path, "def later():\n    pass\nfrom . import tensor\n")
    report = run_isolated(root, "strict", ["bad"])
    assert report["caught"] == ["sbp.tensor.global_tensor"] and "bad" in report["errors"]


def test_runtime_checker_catches_torch_distributed_after_torch(tmp_path):
    # Outside strict mode torch is allowed, and `import torch` loads torch.distributed itself; an import of
    # torch.distributed by the pure module is still caught.
    root = _fake_package(tmp_path, "import torch\nfrom torch import distributed\n")
    (root / "ok.py").write_text("import torch\nfrom torch import dtype\n")
    report = run_isolated(root, "pure", ["ok", "bad"])
    assert report["torch_loaded"]
    assert report["caught"] == ["torch.distributed"]
    assert list(report["errors"]) == ["bad"]
