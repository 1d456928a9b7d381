#!/usr/bin/env bash
# The GPU check in one command, for a machine with CUDA (issue 29): the device-parametrised tests on CUDA,
# then rsd_bench.gpu_check (every step path with random-weight models of the real pair's shapes; tree vs
# one-token forward cost; pipelined vs plain vs the target alone), writing
# $RSD_RESULTS_DIR/gpu-DATE.json and .md (default benchmarks/results/). Sized for about 8 minutes of an H200.
#
#   bash scripts/gpu_check.sh              # tests + the full preset (bfloat16 and float32)
#   bash scripts/gpu_check.sh --quick      # tests + the quick preset (bfloat16, 2 methods, 32 tokens)
#   RSD_SKIP_TESTS=1 bash scripts/gpu_check.sh --dtypes float32    # extra args go to rsd_bench.gpu_check
#
# Which Python: $RSD_PYTHON if set; else .venv's if its torch sees CUDA; else the machine's python3 if its
# torch sees CUDA (a GPU image with torch and transformers preinstalled and no package index: the checkout is
# put on PYTHONPATH, nothing is installed; those tests need torch, transformers, tokenizers, grpcio, pytest,
# hypothesis); else, with no .venv yet, scripts/bootstrap.sh makes one (its torch==2.13.0 from PyPI is a CUDA
# build on Linux x86-64). Other knobs: RSD_TEST_TIMEOUT_S (default 200), RSD_TEST_WORKERS (pytest-xdist
# workers where it is installed; default 8), RSD_GPU_BUDGET_S (the measurements' wall-time bound; default 180,
# 100 with --quick), RSD_GPU_CHECK_NAME (default gpu-DATE), RSD_GIT_COMMIT (where the checkout has no .git).
set -euo pipefail
cd "$(dirname "$0")/.."

sees_cuda() { "$1" -c 'import sys, torch, transformers; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

if [ -n "${RSD_PYTHON:-}" ]; then
    PY=$RSD_PYTHON
elif [ -x .venv/bin/python ] && sees_cuda .venv/bin/python; then
    PY=.venv/bin/python
elif command -v python3 >/dev/null && sees_cuda "$(command -v python3)"; then
    PY=$(command -v python3)
elif [ ! -x .venv/bin/python ]; then
    bash scripts/bootstrap.sh
    PY=.venv/bin/python
else
    PY=.venv/bin/python
fi
if ! sees_cuda "$PY"; then
    echo "gpu_check: $PY has no CUDA torch (or no transformers), or this machine no GPU:" \
        "$("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1)." \
        "Set RSD_PYTHON to a Python whose torch sees CUDA; without a GPU, the smoke run is" \
        "'python -m rsd_bench.gpu_check --device cpu --tiny'." >&2
    exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
"$PY" -c 'import torch; print("gpu_check: python", __import__("sys").version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "on", torch.cuda.get_device_name())'

quick=0
for arg in "$@"; do [ "$arg" = --quick ] && quick=1; done
results=${RSD_RESULTS_DIR:-benchmarks/results}
name=${RSD_GPU_CHECK_NAME:-gpu-$(date -u +%Y-%m-%d)}
budget=${RSD_GPU_BUDGET_S:-$([ "$quick" = 1 ] && echo 100 || echo 180)}
mkdir -p "$results"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

test_args=()
if [ "${RSD_SKIP_TESTS:-0}" != 1 ]; then
    tests=(tests/rsd_runtime/test_device.py tests/rsd_runtime/test_gguf_model.py tests/rsd/test_random.py tests/rsd/test_acceptance.py tests/rsd/test_statistical.py)
    workers=()
    if "$PY" -c 'import xdist' 2>/dev/null && [ "${RSD_TEST_WORKERS:-8}" -gt 1 ]; then
        workers=(-n "${RSD_TEST_WORKERS:-8}")
    fi
    command=(env RSD_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider "${workers[@]}" "${tests[@]}")
    echo "gpu_check: ${command[*]}" >&2
    set +e
    timeout "${RSD_TEST_TIMEOUT_S:-200}" "${command[@]}" --junitxml="$work/junit.xml"
    test_rc=$?
    set -e
    [ "$test_rc" = 124 ] && echo "gpu_check: the tests ran past ${RSD_TEST_TIMEOUT_S:-200} s and were stopped" >&2
    test_args=(--tests-junit "$work/junit.xml" --tests-rc "$test_rc" --tests-command "${command[*]}")
else
    test_rc=0
fi

set +e
"$PY" -m rsd_bench.gpu_check --device cuda --out "$results/$name.json" --budget-s "$budget" "${test_args[@]}" "$@"
bench_rc=$?
set -e
echo "gpu_check: wrote $results/$name.json and .md (tests rc $test_rc, bench rc $bench_rc)" >&2
[ "$test_rc" = 0 ] && [ "$bench_rc" = 0 ]
