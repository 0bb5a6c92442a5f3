"""Run every benchmark in benchmarks/ and write docs/performance.md: their tables, the machine, and a chart.

Each benchmark runs as a subprocess (``python benchmarks/NAME.py``); its printed tables are kept as they
are. Ratio columns are read back for the chart (sbp / DTensor per case; below 1: sbp is faster or
smaller): ``ratio`` and ``mem ratio`` are sbp / DTensor, ``greedy/sbp`` and ``graph/sbp`` (planning time,
DTensor over sbp) are inverted. The chart (``docs/performance.png``) needs matplotlib (the ``bench``
extra: ``pip install -e ".[bench]"``); without it the page says so and keeps the tables.

    python benchmarks/report.py [--only tp_step.py] [--timeout 1800] [--out docs/performance.md]
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
BENCHMARKS = ("plan_speed.py", "redistribute.py", "dispatch.py", "tp_step.py", "dynamic_shapes.py")
# ratio columns: header text -> True when the value is DTensor / sbp (inverted for the chart)
RATIO_COLUMNS = {"mem ratio": False, "ratio": False, "sbp/DT": False, "sbp/DTensor": False, "greedy/sbp": True,
                 "graph/sbp": True, "DT/sbp": True, "DTensor/sbp": True}


@dataclass
class Run:
    name: str
    present: bool
    seconds: float = 0.0
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""


@dataclass(frozen=True)
class Ratio:
    benchmark: str
    case: str
    column: str
    value: float  # sbp / DTensor


def run(name: str, timeout: float) -> Run:
    path = HERE / name
    if not path.exists():
        return Run(name, present=False)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        return Run(name, True, time.perf_counter() - t0, proc.returncode, proc.stdout, proc.stderr)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return Run(name, True, time.perf_counter() - t0, None, out, f"timed out after {timeout:g} s")


def ratios(benchmark: str, text: str) -> list[Ratio]:
    """Ratio cells of every table in `text`: a header line naming a ratio column and an ``sbp`` column,
    then rows until a blank line. A cell is the row's token under the header's column text.

    >>> table = "case  sbp ms  DT ms  ratio\\nbig     2.0    4.0   0.50\\n"
    >>> ratios("x.py", table)
    [Ratio(benchmark='x.py', case='big', column='ratio', value=0.5)]
    """
    lines, out = text.splitlines(), []
    for i, head in enumerate(lines):
        columns = _ratio_columns(head)
        first = re.search(r"(?<!\S)sbp\b", head)
        if not columns or first is None or first.start() == 0:
            continue
        for row in lines[i + 1:]:
            if not row.strip():
                break
            case = _case(row, first.span())
            for name, (start, end), inverted in columns:
                cell = next((m.group() for m in re.finditer(r"\S+", row) if m.start() < end and m.end() > start), None)
                try:
                    value = float(cell.rstrip("x")) if cell else None
                except ValueError:
                    value = None
                if value and case:
                    out.append(Ratio(benchmark, case, name, 1 / value if inverted else value))
    return out


def _case(row: str, sbp_span: tuple[int, int]) -> str:
    """The case label of a row: its tokens left of the first sbp column's value, without trailing numbers
    (the header word may sit over either end of a right-aligned cell, so the value is found by overlap)."""
    tokens = list(re.finditer(r"\S+", row))
    value = next((t for t in tokens if t.start() < sbp_span[1] and t.end() > sbp_span[0]), None)
    words = [t.group() for t in tokens if value is None or t.end() < value.start()]
    while words and re.fullmatch(r"[-+]?[\d.,]+[x%]?|/", words[-1]):
        words.pop()
    return " ".join(words)


def _ratio_columns(head: str) -> list[tuple[str, tuple[int, int], bool]]:
    taken: list[tuple[int, int]] = []
    found = []
    for name in sorted(RATIO_COLUMNS, key=len, reverse=True):
        for m in re.finditer(rf"(?<![\w/]){re.escape(name)}(?![\w/])", head):
            if all(m.end() <= a or m.start() >= b for a, b in taken):
                taken.append(m.span())
                found.append((name, m.span(), RATIO_COLUMNS[name]))
    return sorted(found, key=lambda c: c[1])


def machine() -> dict[str, str]:
    import torch

    cpu = platform.processor() or "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"CPU": cpu, "cores": str(os.cpu_count()), "torch": torch.__version__,
            "python": platform.python_version(), "OS": f"{platform.system()} {platform.release()}",
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M")}


def chart(found: list[Ratio], path: pathlib.Path) -> str | None:
    """Write the chart; returns why it was skipped, or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e \".[bench]\"), so there is no chart"
    if not found:
        return "no ratio columns were found in the benchmarks' output, so there is no chart"
    names = {"mem ratio": " (memory)", "greedy/sbp": " (vs DTensor greedy)", "graph/sbp": " (vs DTensor graph)"}
    labels = [f"{r.benchmark.removesuffix('.py')}: {r.case}{names.get(r.column, '')}" for r in found]
    values = [r.value for r in found]
    fig, ax = plt.subplots(figsize=(9, 1.5 + 0.28 * len(found)))
    colours = ["tab:green" if v <= 1 else "tab:red" for v in values]
    ax.barh(range(len(values)), values, color=colours)
    ax.set_yticks(range(len(values)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("sbp / DTensor (log scale; below 1: sbp faster or smaller)")
    ax.set_title("sbp against DTensor, per case")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write(runs: list[Run], out: pathlib.Path) -> None:
    found = [r for run_ in runs if run_.present for r in ratios(run_.name, run_.stdout)]
    png = out.with_suffix(".png")
    skipped = chart(found, png)
    lines = ["# Performance", "",
             "Written by `python benchmarks/report.py`, which runs every benchmark in `benchmarks/` and keeps "
             "their printed tables. Ratios are sbp / DTensor measured in the same run (below 1: sbp is faster "
             "or smaller). Timings on a small shared machine are noisy; byte counts are exact.", "",
             "## Machine", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in machine().items()]
    lines += ["", "## sbp / DTensor per case", ""]
    lines += [f"(no chart: {skipped})" if skipped else f"![sbp / DTensor per case]({png.name})", ""]
    for r in runs:
        lines += [f"## {r.name}", ""]
        if not r.present:
            lines += [f"`benchmarks/{r.name}` does not exist yet; nothing was run.", ""]
            continue
        status = "ok" if r.returncode == 0 else "timed out" if r.returncode is None else f"exit code {r.returncode}"
        lines += [f"`python benchmarks/{r.name}`: {r.seconds:.0f} s, {status}.", "", "```text",
                  r.stdout.rstrip() or "(no output)", "```", ""]
        if r.returncode != 0:
            lines += ["Last lines of stderr:", "", "```text", "\n".join(r.stderr.strip().splitlines()[-15:]), "```", ""]
    out.write_text("\n".join(lines))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", action="append", help="run only this benchmark (repeatable), e.g. tp_step.py")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per benchmark (default 1800)")
    p.add_argument("--out", default=str(ROOT / "docs" / "performance.md"))
    args = p.parse_args(argv)
    names = args.only or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; valid: {', '.join(BENCHMARKS)}")
    runs = []
    for name in names:
        print(f"running {name} ...", flush=True)
        runs.append(run(name, args.timeout))
        r = runs[-1]
        print(f"  {'missing' if not r.present else f'{r.seconds:.0f} s, exit {r.returncode}'}", flush=True)
    out = pathlib.Path(args.out)
    write(runs, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
