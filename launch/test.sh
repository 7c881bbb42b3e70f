#!/usr/bin/env bash
# The test command: set up .venv if needed, then run every test (unit, distributed gloo, e2e).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/launch/setup_env.sh" test
cd "$ROOT"
# two workers (pytest-xdist): much of an end-to-end test is waiting (launchers, rendezvous,
# timeouts), so two overlap well on 2 cores; MEGALITE_TEST_WORKERS=0 runs in one process
exec python -m pytest tests -q -n "${MEGALITE_TEST_WORKERS:-2}" --dist loadgroup "$@"
