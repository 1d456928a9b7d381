#!/usr/bin/env bash
# The one test command: set up (idempotent), lint, run every test. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# Service tests need a real redis-server; they start their own on a free port.
if ! command -v redis-server >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test: installing redis-server" >&2
    apt-get install -y -q redis-server >/dev/null || (apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null)
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
    echo "test: pytest collected no tests: treating that as a failure" >&2
    exit 1
fi
exit "$rc"
