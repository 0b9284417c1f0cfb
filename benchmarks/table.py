"""Render recorded benchmark figures (JSON lines from ``figures.record``) as the page
``docs/benchmarks.md``: a short header and one table, one row per figure.

The page holds one run's figures and nothing else; git keeps the earlier ones.

    python benchmarks/table.py FIGURES.jsonl [--out docs/benchmarks.md] [--merge]

``--merge`` remakes only the rows of the benchmarks in FIGURES (one benchmark run alone)
and keeps the page's rows of the others as they are.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from figures import Figure

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("benchmark", "figure", "ours", "anchor", "ratio", "target", "met?", "machine",
           "date")

HEADER = """\
# Benchmarks

The current figure of every benchmark in `benchmarks/`, one row per figure: ours, its
anchor, their ratio, the target, whether it is met, and the machine and date it was
measured on. `bash scripts/dev.sh bench` remakes the page from one run of every
benchmark (each reports its figures through `benchmarks/figures.py`, and
`benchmarks/table.py` renders them); the page keeps no earlier figures
(`git log -p docs/benchmarks.md` has them). Run a benchmark alone for its full output
and flags: `python benchmarks/bench_closures.py --help`.

Each figure is set beside its anchor from the same run on the same machine: the other
system (plain Dask, torch.distributed, torchrun, a hand-written loader, Ray Data) where
there is one, otherwise the target's bound. The ratio is always ours / anchor. A row
without a target is shown for context. The machine column ends with the 1-minute load
average when the figure was taken: where the machine is loaded (a load above its cores,
such as other test runs beside the benchmarks), the figures spread from run to run, by
15–30% on a shared 2-core VM, so read a ratio near its target as within that spread. A
benchmark that needs hardware the machine lacks (`bench_gpu.py` without CUDA) adds no
row.
"""


def load(path: str | Path) -> list[Figure]:
    """The figures of a JSON-lines file, in the order they were recorded."""
    with open(path, encoding="utf-8") as f:
        return [Figure.from_json(line) for line in f if line.strip()]


def number(v: float) -> str:
    """A figure to three significant digits, thousands as k and millions as M."""
    a = abs(v)
    if a >= 1e5:
        return f"{_digits(v / 1e6)} M" if a >= 1e6 else f"{_digits(v / 1e3)} k"
    if a >= 100:
        return f"{v:,.0f}"
    return _digits(v)


def _digits(v: float) -> str:
    return f"{v:#.3g}".rstrip(".")


def cells(fig: Figure) -> list[str]:
    """A figure's row, column by column."""
    machine = fig.machine if fig.load is None else f"{fig.machine}, load {fig.load:.1f}"
    met = "—" if fig.met is None else ("yes" if fig.met else "**no**")
    return [
        f"`{fig.benchmark}`",
        fig.what,
        "—" if fig.ours is None else f"{number(fig.ours)} {fig.unit}",
        fig.anchor if fig.anchor_value is None
        else f"{fig.anchor}: {number(fig.anchor_value)} {fig.unit}",
        "—" if fig.ratio is None else f"{number(fig.ratio)}x",
        fig.target or "— (context)",
        met,
        machine,
        fig.date,
    ]


def render(figures: list[Figure]) -> str:
    """The whole page: the header and one table, one row per figure."""
    lines = [HEADER, "| " + " | ".join(COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for fig in figures:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells(fig)) + " |")
    return "\n".join(lines) + "\n"


def merge(page: str, figures: list[Figure]) -> str:
    """The page with the rows of the benchmarks in ``figures`` remade from them, every
    other benchmark's rows kept; rows ordered by benchmark, each one's in its order."""
    fresh = render(figures).splitlines()[-len(figures):]
    names = {f"`{fig.benchmark}`" for fig in figures}
    kept = [line for line in page.splitlines()
            if line.startswith("| `") and line.split("|")[1].strip() not in names]
    by_bench: dict[str, list[str]] = {}
    for line in kept + fresh:
        by_bench.setdefault(line.split("|")[1].strip(), []).append(line)
    lines = [HEADER, "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += [line for name in sorted(by_bench) for line in by_bench[name]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("figures", help="the JSON-lines file the benchmarks recorded into")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--merge", action="store_true",
                    help="remake only these benchmarks' rows, keep the page's others")
    args = ap.parse_args(argv)
    figures = load(args.figures)
    if not figures:  # a run that recorded nothing leaves the page as it was
        print(f"table.py: no figures in {args.figures}; {args.out} left as it was",
              file=sys.stderr)
        return 1
    out = Path(args.out)
    page = merge(out.read_text(encoding="utf-8"), figures) \
        if args.merge and out.exists() else render(figures)
    out.write_text(page, encoding="utf-8")
    print(f"table.py: {len(figures)} figures -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
