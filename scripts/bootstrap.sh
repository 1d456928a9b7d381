#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: .venv with torch 2.13.0 (pinned first, so pip takes the CPU
# wheel on disk and never fetches a CUDA build), then the project with its dev tools, then the
# generated gRPC code (rsd_proto/, git-ignored). A rerun with unchanged pyproject.toml and protos does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.rsd-bootstrap
want=$(cat pyproject.toml scripts/bootstrap.sh $(ls protos/rsd_proto/v1/*.proto 2>/dev/null) | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "bootstrap: installing into .venv" >&2
    .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
    .venv/bin/pip install -q --disable-pip-version-check -e ".[dev]"
    # Put the checkout itself on the venv's path, so the generated rsd_proto/ package (made below,
    # once grpcio-tools is installed) imports like every other top-level package here.
    site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    pwd > "$site/rsd-checkout.pth"
    .venv/bin/python scripts/gen_protos.py
    echo "$want" > "$stamp"
fi
