#!/usr/bin/env bash
# The device checks in one run, on a lent GPU machine (no network; see
# ../shared/device/README.md): Dask and what else the image lacks travel as wheels in
# .whl/ (git-ignored). Each stage has its own time limit so that one slow stage cannot
# take the others' figures; logs go to $OUT (or ./gpu-logs).
#
# .whl/ holds ../shared/device/*.whl (dask, distributed and theirs) and, for Python 3.12
# manylinux, `pip download --only-binary=:all: bokeh dask-jobqueue nbclient nbformat
# ipykernel` with their requirements, less those the image has (numpy, pandas, pyyaml,
# jinja2, psutil, ...: two versions of a package stop the install).
#
#   bash scripts/gpu_check.sh [SECONDS]     # all stages end within SECONDS (560)
#
# Order: the GPU benchmark and the GPU-marked tests (nothing CUDA had run before), then
# the real-process scale benchmark at 2/16/24 workers on a quiet machine, then the whole
# suite under pytest-xdist with the time left (SIGINT at the end: pytest still prints
# its summary of what ran).
set -u
OUT="${OUT:-gpu-logs}"
mkdir -p "$OUT"
DEADLINE="${1:-560}"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD"
stage() {  # stage NAME SECONDS COMMAND...: run, log to $OUT/NAME.log, print its tail
  local name=$1 secs=$2
  shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${secs}s)"
  timeout -s INT -k 20 "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-25}" "$OUT/$name.log"
  echo "=== $name: rc=$rc in $((SECONDS - t0))s"
}
nvidia-smi -L; nproc
python3 -c "import torch, dask, distributed, bokeh, pyarrow; print('torch', torch.__version__,
'cuda', torch.cuda.is_available(), 'dask', dask.__version__, 'pyarrow', pyarrow.__version__)"
TAIL=30 stage bench_gpu 130 python3 benchmarks/bench_gpu.py
TAIL=15 stage gpu_tests 90 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests
TAIL=30 stage bench_scale 170 python3 benchmarks/bench_scale.py --part real --workers 2 16 24
TAIL=60 stage suite $((DEADLINE - SECONDS - 25)) python3 -m pytest -q -p no:cacheprovider -n 8 \
  -m "not gpu" -rfE --durations=10 tests
