"""The snippets in docs/ run, so the pages cannot drift from the code.

- `>>>` examples run as doctests, one test per page (expected output must match).
- Every other ```python block runs as a script in a fresh namespace, in a scratch directory. A block
  that shows part of a larger program starts with ``# excerpt of <path>``: then the file must exist and
  hold every quoted dict key (``"...":``) the excerpt shows, and the program itself is tested elsewhere.
  Listings that are not Python (signatures, trees) use ```text fences.
"""
from __future__ import annotations

import doctest
import pathlib
import re

import pytest
import torch

import sbp
from sbp.ops import clear_cache
from sbp.ops.table import TABLE

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
FENCED = re.compile(r"```python\n(.*?)```", re.S)


def _blocks() -> list[tuple[str, int, str]]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCED.finditer(text):
            if ">>>" not in m.group(1):
                out.append((page.name, text[:m.start()].count("\n") + 1, m.group(1)))
    return out


BLOCKS = _blocks()
DOCTEST_PAGES = [p for p in PAGES if ">>>" in p.read_text()]


def test_there_are_snippets_to_run():
    assert len(BLOCKS) >= 10 and len(DOCTEST_PAGES) >= 2


@pytest.mark.parametrize("page", DOCTEST_PAGES, ids=lambda p: p.name)
def test_doctest_examples(page: pathlib.Path):
    test = doctest.DocTestParser().get_doctest(page.read_text(), {"sbp": sbp, "torch": torch}, page.name,
                                               str(page), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    failures = []
    runner.run(test, out=failures.append)
    assert runner.failures == 0, "".join(failures)


@pytest.mark.parametrize("name, line, code", BLOCKS, ids=[f"{n}:{ln}" for n, ln, _ in BLOCKS])
def test_python_block_runs(name: str, line: int, code: str, tmp_path, monkeypatch, capsys):
    compiled = compile(code, f"docs/{name}:{line}", "exec")   # a listing that is not Python: use ```text
    first = code.splitlines()[0]
    if first.startswith("# excerpt of "):
        source = ROOT / first[len("# excerpt of "):].split()[0]
        assert source.is_file(), f"docs/{name}:{line}: {source} does not exist"
        text = source.read_text()
        missing = [k for k in re.findall(r'("[^"\n]+"):', code) if k not in text]
        assert not missing, f"docs/{name}:{line}: keys {missing} are not in {source.name}"
        return
    monkeypatch.chdir(tmp_path)
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    rules = dict(TABLE)
    try:
        exec(compiled, {"__name__": f"docs_{name}_{line}"})
    finally:
        left = {str(op) for op in TABLE.keys() ^ rules.keys()}
        TABLE.clear()
        TABLE.update(rules)     # a snippet that registers a rule must not change the table for other tests
        clear_cache()
    assert not left, f"docs/{name}:{line} leaves the rule table changed ({sorted(left)}): restore it as it shows"
