"""The benchmarks' figures: ``benchmarks/figures.py`` records them, ``benchmarks/table.py``
renders them as ``docs/benchmarks.md``, and the committed page is such a table (no
cluster, nothing timed)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
RATIO = re.compile(r"^[\d.,]+( [kM])?x$")


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


def test_the_committed_page_is_one_table_of_current_figures(bench):
    _, table = bench
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert text.startswith(table.HEADER)
    assert text.count("| " + " | ".join(table.COLUMNS) + " |") == 1
    got = rows(text)
    assert len(got) >= 20
    for row in got:
        cells = dict(zip(table.COLUMNS, row, strict=True))
        assert RATIO.match(cells["ratio"]), row
        assert "core" in cells["machine"], row
        assert DATE.match(cells["date"]), row
