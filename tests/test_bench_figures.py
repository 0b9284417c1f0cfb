"""The benchmarks' figures: ``benchmarks/figures.py`` records them with the commit they
were measured at, ``benchmarks/table.py`` renders them as ``docs/benchmarks.md`` and marks
a row stale when the code it measures changed after its commit, and the committed page is
such a table (no cluster, nothing timed; the staleness on a git repository of its own)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
RATIO = re.compile(r"^[\d.,]+( [kM])?x$")
HASH = re.compile(r"^[0-9a-f]{7,40}$")


@pytest.fixture
def bench(monkeypatch):
    """The benchmarks' ``figures`` and ``table`` modules, imported as the benchmarks
    import them (``benchmarks/`` on the path)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("figures"), importlib.import_module("table")


def rows(page: str) -> list[list[str]]:
    """The cells of every row of the page's table (header and rule left out)."""
    lines = [line for line in page.splitlines() if line.startswith("|")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines[2:]]


def test_record_writes_every_field(bench, tmp_path, monkeypatch, capsys):
    figures, _ = bench
    out = tmp_path / "figures.jsonl"
    monkeypatch.setenv(figures.ENV, str(out))
    monkeypatch.setattr("sys.argv", ["benchmarks/bench_fake.py"])
    figures.record("throughput 20.0x (target >= 10x)", what="no-op closures/s", ours=8000.0,
                   unit="closures/s", anchor="submit + gather", anchor_value=400.0,
                   target="≥ 10x", met=True)
    figures.record(None, what="the floor", ours=1.5, unit="ms", anchor="bare RPC",
                   anchor_value=1.0)
    assert capsys.readouterr().out == "throughput 20.0x (target >= 10x)\n"
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert set(first) == {f.name for f in dataclasses.fields(figures.Figure)}
    assert first["benchmark"] == "bench_fake"
    assert (first["ours"], first["unit"], first["anchor"], first["anchor_value"]) == (
        8000.0, "closures/s", "submit + gather", 400.0)
    assert first["ratio"] == pytest.approx(20.0)
    assert (first["target"], first["met"]) == ("≥ 10x", True)
    assert "core" in first["machine"] and DATE.match(first["date"])
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                          capture_output=True, check=True).stdout.strip()
    assert first["commit"] == head and isinstance(first["dirty"], bool)
    assert (second["target"], second["met"], second["ratio"]) == (None, None, 1.5)
    assert figures.Figure.from_json(lines[0]) == figures.Figure(**first)


def test_record_without_the_variable_only_prints(bench, tmp_path, monkeypatch, capsys):
    figures, _ = bench
    monkeypatch.delenv(figures.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    fig = figures.record("recovery 0.20 s", what="SIGKILL → done elsewhere", ours=0.2,
                         unit="s", anchor="the target's bound", anchor_value=1.0,
                         target="≤ 1 s", met=True)
    assert capsys.readouterr().out == "recovery 0.20 s\n"
    assert fig.ratio == pytest.approx(0.2)
    assert list(tmp_path.iterdir()) == []


def test_a_target_comes_with_whether_it_was_met(bench):
    figures, _ = bench
    with pytest.raises(ValueError):
        figures.record(None, what="x", ours=1.0, unit="s", anchor="a", anchor_value=1.0,
                       target="≤ 1 s")
    with pytest.raises(ValueError):
        figures.record(None, what="x", ours=1.0, unit="s", anchor="a", anchor_value=1.0,
                       met=True)


def test_table_renders_one_row_per_figure(bench, tmp_path, monkeypatch):
    figures, table = bench
    recorded = tmp_path / "figures.jsonl"
    monkeypatch.setenv(figures.ENV, str(recorded))
    monkeypatch.setattr("sys.argv", ["bench_fake.py"])
    for i in range(3):
        figures.record(None, what=f"figure {i} | piped", ours=2.0 * (i + 1), unit="ms",
                       anchor="anchor", anchor_value=1.0, target="≤ 5 ms" if i else None,
                       met=(2.0 * (i + 1) <= 5) if i else None)
    page = tmp_path / "benchmarks.md"
    assert table.main([str(recorded), "--out", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert text.startswith(table.HEADER) and "bash scripts/dev.sh bench" in text
    assert "| " + " | ".join(table.COLUMNS) + " |" in text
    got = rows(text)
    assert [r[1] for r in got] == [f"figure {i} \\| piped" for i in range(3)]
    assert [r[4] for r in got] == ["2.00x", "4.00x", "6.00x"]
    assert [(r[5], r[6]) for r in got] == [("— (context)", "—"), ("≤ 5 ms", "yes"),
                                           ("≤ 5 ms", "**no**")]
    assert all(len(r) == len(table.COLUMNS) and r[0] == "`bench_fake`" for r in got)
    commit, dirty = figures.revision()
    # a benchmark that declares no code it measures is never stale
    assert {r[9] for r in got} == {f"`{commit}`" + ("+" if dirty else "")}
    assert text.endswith(f"Stale marks checked at `{table.head()}`.\n")


def test_merge_remakes_one_benchmarks_rows_and_keeps_the_others(bench, tmp_path,
                                                                   monkeypatch):
    figures, table = bench
    recorded = tmp_path / "figures.jsonl"
    monkeypatch.setenv(figures.ENV, str(recorded))
    for name, n in (("bench_b", 2), ("bench_a", 1), ("bench_c", 1)):
        monkeypatch.setattr("sys.argv", [f"{name}.py"])
        for i in range(n):
            figures.record(None, what=f"{name} old {i}", ours=1.0, unit="ms", anchor="a",
                           anchor_value=1.0)
    page = tmp_path / "benchmarks.md"
    assert table.main([str(recorded), "--out", str(page)]) == 0
    again = tmp_path / "again.jsonl"
    monkeypatch.setenv(figures.ENV, str(again))
    monkeypatch.setattr("sys.argv", ["bench_b.py"])
    figures.record(None, what="bench_b new", ours=3.0, unit="ms", anchor="a",
                   anchor_value=1.0)
    assert table.main([str(again), "--out", str(page), "--merge"]) == 0
    got = rows(page.read_text(encoding="utf-8"))
    assert [(r[0], r[1], r[4]) for r in got] == [
        ("`bench_a`", "bench_a old 0", "1.00x"), ("`bench_b`", "bench_b new", "3.00x"),
        ("`bench_c`", "bench_c old 0", "1.00x")]


def test_table_leaves_the_page_when_nothing_was_recorded(bench, tmp_path):
    _, table = bench
    empty = tmp_path / "figures.jsonl"
    empty.write_text("")
    page = tmp_path / "benchmarks.md"
    assert table.main([str(empty), "--out", str(page)]) == 1
    assert not page.exists()


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=repo, text=True, capture_output=True, check=True).stdout.strip()


def _commit(repo: Path, message: str) -> str:
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", message)
    return _git(repo, "rev-parse", "--short", "HEAD")


def test_a_row_older_than_the_code_it_measures_is_marked_stale(bench, tmp_path,
                                                                  monkeypatch):
    """On a repository of its own: a change to the measured code after a row's commit
    marks it stale, naming the change; a change elsewhere, a rename and a declared move
    do not; a commit the repository does not have is said to be unknown."""
    _, table = bench
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "pkg" / "a.py").write_text("A = 1\n")
    (repo / "other.py").write_text("B = 1\n")
    measured = _commit(repo, "measured")
    (repo / "pkg" / "a.py").write_text("A = 2\n")
    changed = _commit(repo, "the measured code changes")
    (repo / "other.py").write_text("B = 2\n")
    _commit(repo, "other code changes")
    (repo / "pkg" / "sub").mkdir()
    _git(repo, "mv", "pkg/a.py", "pkg/sub/a.py")
    _commit(repo, "a rename")
    (repo / "pkg" / "sub" / "a.py").write_text("import os\nA = 2\n")
    moved = _commit(repo, "a move that rewrites imports")
    monkeypatch.setattr(table, "ROOT", repo)
    monkeypatch.setattr(table, "MEASURES", {"bench_x": ("pkg/sub",)})
    monkeypatch.setattr(table, "MOVES", frozenset({moved}))
    table.forget()
    try:
        assert table.commit_cell("bench_x", measured, False) == \
            f"`{measured}`, **stale**: `{changed}`"
        assert table.commit_cell("bench_x", changed, True) == f"`{changed}`+"
        assert table.commit_cell("bench_y", measured, False) == f"`{measured}`"
        assert table.commit_cell("bench_x", "0123abc", False) == \
            "`0123abc` (not in this repository)"
        assert table.commit_cell("bench_x", None, False) == "—"
        # a page's rows are checked again without being remade
        page = tmp_path / "page.md"
        line = "| `bench_x` | f | 1 ms | a: 1 ms | 1.00x | — (context) | — | m | 2026-01-01 |"
        page.write_text(table.HEADER + f"{line} `{changed}` |\n{line} `{measured}` |\n")
        assert table.main(["--flag", "--out", str(page)]) == 0
        got = [r[-1] for r in rows(page.read_text())]
        assert got == [f"`{changed}`", f"`{measured}`, **stale**: `{changed}`"]
        # undeclared, the move is a change like any other
        monkeypatch.setattr(table, "MOVES", frozenset())
        table.forget()
        assert table.commit_cell("bench_x", changed, False) == \
            f"`{changed}`, **stale**: `{moved}`"
    finally:
        table.forget()


def test_every_benchmark_declares_the_code_it_measures(bench):
    _, table = bench
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("bench_*.py")}
    assert set(table.MEASURES) == scripts
    missing = [p for paths in table.MEASURES.values() for p in paths if not table.files_at(p)]
    assert not missing, f"MEASURES names paths with no tracked file: {missing}"


def test_the_committed_page_is_one_table_of_current_figures(bench):
    _, table = bench
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert text.startswith(table.HEADER)
    assert text.count("| " + " | ".join(table.COLUMNS) + " |") == 1
    got = rows(text)
    assert len(got) >= 20
    checked = re.search(r"^Stale marks checked at `([0-9a-f]+)`\.$", text, re.M)
    assert checked and table.ancestors("HEAD") >= table.ancestors(checked.group(1))
    for row in got:
        cells = dict(zip(table.COLUMNS, row, strict=True))
        assert RATIO.match(cells["ratio"]), row
        assert "core" in cells["machine"], row
        assert DATE.match(cells["date"]), row
        # the commit it was measured at, one of this history's; a stale mark names a
        # change to the code it measures that the measured commit lacks (a later commit,
        # or one of a branch merged since), and the row is stale still
        m = re.match(r"^`([0-9a-f]+)`\+?(?:, \*\*stale\*\*: `([0-9a-f]+)`)?$",
                     cells["commit"])
        assert m and HASH.match(m.group(1)), row
        ancestors = table.ancestors(m.group(1))
        assert ancestors is not None and ancestors <= table.ancestors("HEAD"), row
        if m.group(2):
            since = table.ancestors(m.group(2))
            assert since <= table.ancestors("HEAD") and not since <= ancestors, row
            assert table.stale_since(cells["benchmark"].strip("`"), m.group(1)), row
