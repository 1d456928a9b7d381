#!/usr/bin/env bash
# The main job: set up (idempotent), fetch the real Qwen2.5-Coder pair on first use (hash-checked,
# converted once into ~/.cache/rsd/models), start the local cluster as plain processes on loopback
# (redis-server when installed, else the gateway's embedded store; verifier; drafter; gateway),
# answer a real generation through the gateway with RSD-S, stop, then run the same generation through the
# target alone in one process and print both tokens/s (--compare-target-alone).
# Extra args go to `rsd cluster` (e.g. --tiny for a seconds-long smoke run, --keep-running).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/rsd cluster --compare-target-alone "$@"
