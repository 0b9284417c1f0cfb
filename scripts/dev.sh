#!/usr/bin/env bash
# Set up (idempotently) and run: `bash scripts/dev.sh demo` or `bash scripts/dev.sh test`.
# Creates .venv if missing, installs the CPU build of torch first (pinned, so no CUDA
# build is downloaded), then the project with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
STAMP="$VENV/.daskdist-installed"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "torch==2.13.0"
  # torch pinned again: no other requirement may swap in a different (CUDA) build
  "$PY" -m pip install -q -e ".[test,dataframe]" "torch==2.13.0"
  touch "$STAMP"
fi
cmd="${1:-test}"
[ $# -gt 0 ] && shift
case "$cmd" in
  # four test processes (a file's tests stay together: they share its clusters), handed
  # the files in the order tests/conftest.py gives them (those with slow tests first);
  # no test runs twice, except one marked may_rerun(reason=...), whose first failure's
  # traceback is shown in the summary; then the 15 slowest tests. Arguments are
  # pytest's (`-n 0` runs the tests serially).
  test) exec "$PY" -m pytest -n 4 --dist loadfile --no-loadscope-reorder -rR \
          --rerun-show-tracebacks --durations=15 "$@" ;;
  demo) exec "$VENV/bin/daskdist" demo "$@" ;;
  bench)
    # every benchmark records its figures into one file; table.py makes docs/benchmarks.md
    figures="$(mktemp "${TMPDIR:-/tmp}/daskdist-figures.XXXXXX")"
    trap 'rm -f "$figures"' EXIT
    failed=()
    for b in benchmarks/bench_*.py; do
      echo "== $b"
      DASKDIST_BENCH_FIGURES="$figures" "$PY" "$b" "$@" || failed+=("$b")
    done
    "$PY" benchmarks/table.py "$figures"
    if [ ${#failed[@]} -gt 0 ]; then
      echo "exited non-zero (a missed target or an error): ${failed[*]}" >&2
      exit 1
    fi ;;
  *) echo "usage: bash scripts/dev.sh [test|demo|bench] [args...]" >&2; exit 2 ;;
esac
