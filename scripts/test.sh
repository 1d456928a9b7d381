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
# Tests run in process on one torch thread (tests/conftest.py), so one pytest process leaves cores idle:
# xdist spreads whole files over one worker a core (at most 4; RSD_TEST_WORKERS overrides, 0 = none).
workers=${RSD_TEST_WORKERS:-$(n=$(nproc); echo $((n < 4 ? n : 4)))}
set +e
.venv/bin/python -m pytest -m "not ray" -n "$workers" --dist loadfile "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
    echo "test: pytest collected no tests: treating that as a failure" >&2
    exit 1
fi
# Ray tests (marker `ray`, tests/e2e/test_ray_pool.py) start a real local Ray cluster. Ray binds to the
# machine's routable address even when told 127.0.0.1, so they run in a private network namespace
# with only loopback up (needs root or user namespaces); the module skips itself outside one.
if [ "${RSD_SKIP_RAY_TESTS:-0}" = 1 ]; then
    echo "test: RSD_SKIP_RAY_TESTS=1: not running the ray tests" >&2
    exit "$rc"
fi
if ! unshare -n true 2>/dev/null; then
    echo "test: cannot make a network namespace (unshare -n) for the ray tests; RSD_SKIP_RAY_TESTS=1 skips them" >&2
    exit 1
fi
set +e
unshare -n sh -c 'ip link set lo up && exec env RSD_NETNS=1 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 "$@"' \
    sh .venv/bin/python -m pytest -m ray "$@"
ray_rc=$?
set -e
names_tests=0
for arg in "$@"; do case "$arg" in -*) ;; *) names_tests=1 ;; esac; done
if [ "$ray_rc" = 5 ] && [ "$names_tests" = 1 ]; then
    ray_rc=0  # the arguments named other tests only (flags alone such as -q must still collect them)
elif [ "$ray_rc" = 5 ]; then
    echo "test: pytest collected no ray tests: treating that as a failure" >&2
    ray_rc=1
fi
[ "$rc" = 0 ] && exit "$ray_rc"
exit "$rc"
