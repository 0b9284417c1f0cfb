"""Render recorded benchmark figures (JSON lines from ``figures.record``) as the page
``docs/benchmarks.md``: a short header and one table, one row per figure, each with the
commit it was measured at, marked stale where the code it measures changed since.

    python benchmarks/table.py FIGURES.jsonl [--out docs/benchmarks.md] [--merge]
    python benchmarks/table.py --flag [--out docs/benchmarks.md]

``--merge`` remakes only the rows of the benchmarks in FIGURES (one benchmark run alone)
and keeps the page's rows of the others; ``--flag`` remakes no row. Either way every row
is checked against the code as it is now: a row is stale when its commit is older than
the last commit that changed the code its benchmark measures (:data:`MEASURES`; each
file followed through its renames; :data:`MOVES` do not count).
"""

from __future__ import annotations

import argparse
import functools
import re
import subprocess
import sys
from pathlib import Path

from figures import Figure

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("benchmark", "figure", "ours", "anchor", "ratio", "target", "met?", "machine",
           "date", "commit")

# The code each benchmark measures: paths of the repository (a folder: every file under
# it); a file's history is followed through its renames, so a path names the code where
# it lives now.
MEASURES: dict[str, tuple[str, ...]] = {
    "bench_async": ("daskdist/asynchronous", "daskdist/core/asynchronous",
                    "daskdist/plugins/scheduler/asynchronous",
                    "daskdist/client/asynchronous.py", "daskdist/core/leases/table.py",
                    "daskdist/plugins/worker/services.py", "daskdist/collective/step",
                    "daskdist/collective/state/elastic.py"),
    "bench_checkpoint": ("daskdist/collective/state", "daskdist/collective/bootstrap.py",
                         "daskdist/collective/group.py",
                         "daskdist/plugins/scheduler/groups.py"),
    "bench_closures": ("daskdist/client/closures.py", "daskdist/client/coordinator.py",
                       "daskdist/core/queue.py", "daskdist/core/protocol.py",
                       "daskdist/core/membership.py", "daskdist/core/nest.py",
                       "daskdist/plugins/scheduler/closures.py",
                       "daskdist/plugins/scheduler/state.py",
                       "daskdist/plugins/scheduler/plugin.py",
                       "daskdist/plugins/scheduler/stats.py",
                       "daskdist/plugins/worker/runner.py",
                       "daskdist/plugins/worker/services.py",
                       "daskdist/plugins/worker/plugin.py", "daskdist/session/scope.py",
                       "daskdist/session/resources.py", "daskdist/session/counters.py",
                       "daskdist/context.py"),
    "bench_collections": ("daskdist/data/collections", "daskdist/data/leased",
                          "daskdist/data/files", "daskdist/data/loader.py",
                          "daskdist/data/convert.py", "daskdist/data/batching.py",
                          "daskdist/data/plans.py", "daskdist/data/sources.py",
                          "daskdist/core/leases", "daskdist/plugins/scheduler/datasets.py",
                          "daskdist/plugins/scheduler/locality.py",
                          "daskdist/plugins/worker/services.py",
                          "daskdist/client/datasets.py"),
    "bench_collective": ("daskdist/collective/bootstrap.py", "daskdist/collective/group.py",
                         "daskdist/collective/replicas.py", "daskdist/collective/state",
                         "daskdist/collective/step", "daskdist/core/gang.py",
                         "daskdist/core/backends.py", "daskdist/core/leases/commits.py",
                         "daskdist/plugins/scheduler/groups.py",
                         "daskdist/plugins/scheduler/gangs.py",
                         "daskdist/plugins/worker/plugin.py",
                         "daskdist/plugins/worker/runner.py"),
    "bench_data": ("daskdist/data/loader.py", "daskdist/data/batching.py",
                   "daskdist/data/convert.py", "daskdist/data/prefetch.py",
                   "daskdist/data/plans.py", "daskdist/data/sharding.py",
                   "daskdist/data/sources.py", "daskdist/data/files",
                   "daskdist/data/leased", "daskdist/core/leases",
                   "daskdist/plugins/scheduler/datasets.py",
                   "daskdist/plugins/worker/services.py"),
    "bench_frameworks": ("daskdist/integrations", "daskdist/collective/state",
                         "daskdist/collective/step", "daskdist/collective/group.py",
                         "daskdist/collective/replicas.py", "daskdist/data/loader.py"),
    "bench_goodput": ("daskdist/collective/bootstrap.py", "daskdist/collective/group.py",
                      "daskdist/collective/replicas.py", "daskdist/collective/state",
                      "daskdist/collective/step", "daskdist/core/gang.py",
                      "daskdist/core/leases", "daskdist/data/leased",
                      "daskdist/data/loader.py", "daskdist/plugins/scheduler/groups.py",
                      "daskdist/plugins/scheduler/gangs.py",
                      "daskdist/plugins/scheduler/state.py",
                      "daskdist/plugins/worker/plugin.py",
                      "daskdist/plugins/worker/runner.py"),
    "bench_gpu": ("daskdist/data/staging.py", "daskdist/data/loader.py",
                  "daskdist/data/convert.py", "daskdist/data/prefetch.py",
                  "daskdist/data/files", "daskdist/collective/bootstrap.py",
                  "daskdist/collective/device.py", "daskdist/collective/group.py",
                  "daskdist/core/backends.py", "daskdist/core/gpus.py",
                  "daskdist/plugins/gpu_pin.py"),
    "bench_infer": ("daskdist/inference", "daskdist/client/inference.py",
                    "daskdist/core/inference.py", "daskdist/plugins/scheduler/inference",
                    "daskdist/core/leases", "daskdist/data/files", "daskdist/data/leased",
                    "daskdist/data/collections", "daskdist/data/convert.py",
                    "daskdist/data/sources.py", "daskdist/plugins/worker/services.py"),
    "bench_leases": ("daskdist/core/leases/table.py", "daskdist/core/leases/units.py",
                     "daskdist/core/leases/epochs.py", "daskdist/core/leases/datasets.py",
                     "daskdist/core/leases/tail.py", "daskdist/core/intervals.py"),
    "bench_life": ("daskdist/client/closures.py", "daskdist/client/coordinator.py",
                   "daskdist/client/notices.py", "daskdist/plugins/scheduler/closures.py",
                   "daskdist/plugins/scheduler/names.py",
                   "daskdist/plugins/scheduler/plugin.py",
                   "daskdist/plugins/scheduler/state.py",
                   "daskdist/plugins/worker/runner.py",
                   "daskdist/plugins/worker/services.py",
                   "daskdist/plugins/worker/plugin.py", "daskdist/session/resources.py",
                   "daskdist/context.py"),
    "bench_observe": ("daskdist/observe/phases.py", "daskdist/observe/steptimes.py",
                      "daskdist/observe/recorder.py", "daskdist/collective/step",
                      "daskdist/collective/state/elastic.py", "daskdist/data/loader.py"),
    "bench_preemption": ("daskdist/collective/state/deadline.py",
                         "daskdist/collective/state/checkpoint.py",
                         "daskdist/collective/state/elastic.py",
                         "daskdist/plugins/worker/deadlines.py",
                         "daskdist/plugins/scheduler/lifetime", "daskdist/core/lifetime",
                         "daskdist/client/lifetime.py", "daskdist/session/preemption.py"),
    "bench_scale": ("daskdist/plugins/scheduler", "daskdist/core/queue.py",
                    "daskdist/core/membership.py", "daskdist/core/gang.py",
                    "daskdist/core/leases", "daskdist/core/protocol.py",
                    "daskdist/core/intervals.py", "daskdist/observe/book.py",
                    "daskdist/observe/stragglers.py", "daskdist/observe/steptimes.py"),
    "bench_sharded": ("daskdist/collective/sharded", "daskdist/collective/state",
                      "daskdist/core/resharding.py", "daskdist/collective/bootstrap.py",
                      "daskdist/plugins/scheduler/groups.py"),
    "bench_soak": ("daskdist/client/closures.py", "daskdist/client/coordinator.py",
                   "daskdist/client/datasets.py", "daskdist/core/queue.py",
                   "daskdist/core/leases", "daskdist/core/membership.py",
                   "daskdist/core/protocol.py", "daskdist/plugins/scheduler/closures.py",
                   "daskdist/plugins/scheduler/datasets.py",
                   "daskdist/plugins/scheduler/state.py",
                   "daskdist/plugins/worker/runner.py",
                   "daskdist/plugins/worker/services.py", "daskdist/data/leased",
                   "daskdist/data/loader.py", "daskdist/data/files"),
    "bench_state": ("daskdist/collective/state/snapshot.py", "daskdist/data/staging.py"),
    "bench_stop": ("daskdist/cli.py", "daskdist/client/coordinator.py",
                   "daskdist/client/closures.py", "daskdist/plugins/worker/runner.py",
                   "daskdist/plugins/worker/plugin.py",
                   "daskdist/plugins/worker/services.py"),
}

# Commits that moved the package's files (and rewrote the imports that name them)
# without changing what the code does: not a change of the code a benchmark measures.
MOVES = frozenset({"6c25e78"})

HEADER = """\
# Benchmarks

The latest figure of every benchmark in `benchmarks/`, one row per figure: ours, its
anchor, their ratio, the target, whether it is met, and the machine, date and commit it
was measured on. Rows come from different runs: `bash scripts/dev.sh bench` remakes every
row from one run of every benchmark, and `python benchmarks/table.py FIGURES --merge`
remakes one benchmark's rows and keeps the others (each benchmark reports its figures
through `benchmarks/figures.py`, and `benchmarks/table.py` renders them); earlier figures
are in `git log -p docs/benchmarks.md`. Run a benchmark alone for its full output and
flags: `python benchmarks/bench_closures.py --help`.

The commit column says which code a figure describes (`+`: the tree had uncommitted
changes). A commit marked **stale** is older than the last commit that changed the code
its benchmark measures (named beside it; `MEASURES` in `benchmarks/table.py` says which
code, and a commit that only moved files does not count): the code has changed since the
figure was taken, so the figure may no longer hold. The line under the table says at which
commit the marks were checked; `python benchmarks/table.py --flag` checks them again.

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

COMMIT = re.compile(r"^`([0-9a-f]{7,40})`(\+?)")


# -- which code changed since a commit -------------------------------------------------------
def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@functools.cache
def files_at(path: str) -> tuple[str, ...]:
    """The tracked files at ``path`` (a file, or every file under a folder)."""
    return tuple(_git("ls-files", "--", path).stdout.split())


@functools.cache
def last_changes() -> dict[str, str]:
    """Every tracked file's newest change (full hash): the newest commit that changed it
    under its name or a name it had before (renames followed); a commit in
    :data:`MOVES`, or one that only renamed the file, does not count."""
    log = _git("log", "-M", "--name-status", "--format=%x00%H").stdout
    name_of = {f: f for f in _git("ls-files").stdout.split()}  # a past path -> the file now
    last: dict[str, str] = {}
    for entry in log.split("\0")[1:]:
        commit, *changes = entry.strip().splitlines()
        moved = any(commit.startswith(m) for m in MOVES)
        for change in filter(None, changes):
            status, *paths = change.split("\t")
            file = name_of.get(paths[-1])
            if file is None:
                continue
            if not moved and status != "R100":
                last.setdefault(file, commit)
            if status.startswith("R"):  # older history is under the old name
                name_of[paths[0]] = file
            if status.startswith(("A", "R")):
                del name_of[paths[-1]]
    return last


@functools.cache
def ancestors(commit: str) -> frozenset[str] | None:
    """``commit`` and its ancestors (full hashes); ``None`` when it is not a commit here."""
    out = _git("rev-list", commit, "--")
    return frozenset(out.stdout.split()) if out.returncode == 0 else None


@functools.cache
def _time(commit: str) -> int:
    return int(_git("log", "-1", "--format=%ct", commit).stdout.strip() or 0)


@functools.cache
def stale_since(benchmark: str, commit: str) -> str | None:
    """The newest commit (short) that changed the code ``benchmark`` measures and is not
    ``commit`` or one of its ancestors; ``""`` when none did; ``None`` when ``commit`` is
    unknown here."""
    seen = ancestors(commit)
    if seen is None:
        return None
    changes = last_changes()
    later = {changes[f] for path in MEASURES.get(benchmark, ()) for f in files_at(path)
             if f in changes and changes[f] not in seen}
    return max(later, key=_time)[:len(commit)] if later else ""


def forget() -> None:
    """Forget what git said (the repository changed since)."""
    for cached in (files_at, last_changes, ancestors, _time, stale_since):
        cached.cache_clear()


def commit_cell(benchmark: str, commit: str | None, dirty: bool) -> str:
    """A row's commit, with its mark: stale since which commit, or unknown here."""
    if not commit:
        return "—"
    cell = f"`{commit}`" + ("+" if dirty else "")
    since = stale_since(benchmark, commit)
    if since is None:
        return cell + " (not in this repository)"
    return cell + (f", **stale**: `{since}`" if since else "")


def head() -> str:
    """The commit the marks are checked at."""
    return _git("rev-parse", "--short", "HEAD").stdout.strip() or "?"


# -- the page --------------------------------------------------------------------------------
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
        commit_cell(fig.benchmark, fig.commit, fig.dirty),
    ]


def _line(row: list[str]) -> str:
    return "| " + " | ".join(c.strip() for c in row) + " |"


def _split(line: str) -> list[str]:
    """A row line's cells, as written (escaped pipes kept)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]


def _reflagged(line: str) -> str:
    """A page's row line with its commit's mark checked again."""
    row = _split(line)
    m = COMMIT.match(row[-1])
    if m is not None:
        row[-1] = commit_cell(row[0].strip("`"), m.group(1), bool(m.group(2)))
    return _line(row)


def _page(rows: list[str]) -> str:
    lines = [HEADER, _line(list(COLUMNS)), "|" + "---|" * len(COLUMNS), *rows, "",
             f"Stale marks checked at `{head()}`."]
    return "\n".join(lines) + "\n"


def render(figures: list[Figure]) -> str:
    """The whole page: the header and one table, one row per figure."""
    return _page([_line([c.replace("|", "\\|") for c in cells(fig)]) for fig in figures])


def _rows(page: str) -> list[str]:
    return [line for line in page.splitlines() if line.startswith("| `")]


def merge(page: str, figures: list[Figure]) -> str:
    """The page with the rows of the benchmarks in ``figures`` remade from them, every
    other benchmark's rows kept; rows ordered by benchmark, each one's in its order."""
    fresh = _rows(render(figures))
    names = {f"`{fig.benchmark}`" for fig in figures}
    kept = [_reflagged(line) for line in _rows(page) if _split(line)[0] not in names]
    by_bench: dict[str, list[str]] = {}
    for line in kept + fresh:
        by_bench.setdefault(_split(line)[0], []).append(line)
    return _page([line for name in sorted(by_bench) for line in by_bench[name]])


def reflag(page: str) -> str:
    """The page with every row's mark checked again (no row remade)."""
    return _page([_reflagged(line) for line in _rows(page)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("figures", nargs="?",
                    help="the JSON-lines file the benchmarks recorded into")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--merge", action="store_true",
                    help="remake only these benchmarks' rows, keep the page's others")
    ap.add_argument("--flag", action="store_true",
                    help="remake no row: check every row's commit against the code again")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.flag:
        if args.figures or not out.exists():
            ap.error("--flag takes no figures, and checks a page that exists (--out)")
        page = reflag(out.read_text(encoding="utf-8"))
        out.write_text(page, encoding="utf-8")
        stale = [r for r in _rows(page) if "**stale**" in _split(r)[-1]]
        print(f"table.py: {len(stale)} of {len(_rows(page))} rows stale -> {args.out}")
        return 0
    if not args.figures:
        ap.error("give the figures file (or --flag)")
    figures = load(args.figures)
    if not figures:  # a run that recorded nothing leaves the page as it was
        print(f"table.py: no figures in {args.figures}; {args.out} left as it was",
              file=sys.stderr)
        return 1
    page = merge(out.read_text(encoding="utf-8"), figures) \
        if args.merge and out.exists() else render(figures)
    out.write_text(page, encoding="utf-8")
    print(f"table.py: {len(figures)} figures -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
