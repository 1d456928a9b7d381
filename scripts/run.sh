#!/usr/bin/env bash
# The main job: set up (idempotent), fetch the real Qwen2.5-Coder pair on first use (hash-checked,
# converted once into ~/.cache/rsd/models), and answer a real generation with RSD-S.
# Extra args go to `rsd generate` (e.g. --tiny for a seconds-long smoke run, --temperature 0.7).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/rsd generate "$@"
