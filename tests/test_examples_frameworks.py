"""examples/lightning_fit.py and examples/hf_trainer.py (SPEC §4.4): the user's module and
training function are the plain torchrun script's (examples/plain/) but for at most
three lines, each marked ``# daskdist``; and each example runs at a small size (its own
LocalCluster of worker processes) and commits every row of its epoch."""

from __future__ import annotations

import ast
import difflib
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
PAIRS = [("lightning_fit.py", ["Regression", "train"]),
         ("hf_trainer.py", ["make_model", "train"])]
MARK = "# daskdist"


def _defs(path: Path, names: list[str]) -> dict[str, list[str]]:
    source = path.read_text()
    tree = ast.parse(source)
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            out[node.name] = ast.get_source_segment(source, node).splitlines()
    assert set(out) == set(names), (path, sorted(out))
    return out


@pytest.mark.parametrize(("example", "names"), PAIRS)
def test_example_changes_at_most_three_marked_lines_of_the_plain_script(example, names):
    ours = EXAMPLES / example
    plain = EXAMPLES / "plain" / example
    marked = [line for line in ours.read_text().splitlines() if line.rstrip().endswith(MARK)]
    assert 1 <= len(marked) <= 3, marked
    mine, theirs = _defs(ours, names), _defs(plain, names)
    changed = 0
    for name in names:
        sm = difflib.SequenceMatcher(a=theirs[name], b=mine[name], autojunk=False)
        for op, a0, a1, b0, b1 in sm.get_opcodes():
            if op == "equal":
                continue
            lines = mine[name][b0:b1]
            assert all(line.rstrip().endswith(MARK) for line in lines), (name, op, lines)
            changed += max(a1 - a0, b1 - b0)  # a line replaced, added or dropped
    # the marked lines outside these definitions are the added imports
    assert changed + sum(MARK in line and "import" in line for line in marked) <= 3


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("example", "args"), [
    ("lightning_fit.py", ["--rows", "3000", "--workers", "2", "--kill"]),
    ("hf_trainer.py", ["--rows", "512", "--workers", "2"]),
])
def test_example_runs_and_commits_every_row(example, args, tmp_path, monkeypatch, capsys):
    """The example's ``main`` as its command line runs it, its own LocalCluster
    included, in this process: the workers fork from the tests' warm fork server (the
    example's functions travel by value, as from a notebook)."""
    pytest.importorskip("lightning" if "lightning" in example else "transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    main = runpy.run_path(str(EXAMPLES / example), run_name="example")["main"]
    summary = main(args)
    out = capsys.readouterr().out
    assert f"{summary}" in out  # the summary line the command prints
    assert summary["acknowledged"] == summary["total"] > 0
    assert summary["global_step"] > 0
    if "--kill" in args:
        assert "killed rank 0" in out
