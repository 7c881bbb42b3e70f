#!/usr/bin/env bash
# The test command: set up .venv if needed, then run every test (unit, distributed gloo, e2e).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/launch/setup_env.sh" test
cd "$ROOT"
exec python -m pytest tests -q "$@"
