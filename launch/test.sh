#!/usr/bin/env bash
# The test command: set up .venv if needed, then run every test (unit, distributed gloo, e2e).
# Arguments that name tests replace the default `tests` (bash launch/test.sh tests/e2e/X.py
# runs X only); options alone (-x, -k EXPR) go with the whole suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/launch/setup_env.sh" test
cd "$ROOT"
# Cache the compiled modules: with PYTHONDONTWRITEBYTECODE set (these machines set it) every
# one of the suite's few hundred launched processes compiled megalite from source again,
# about 0.5 s each (a quarter of a subprocess-heavy e2e file's time).
unset PYTHONDONTWRITEBYTECODE
targets=(tests)
for arg in "$@"; do
  case "$arg" in
    -*) ;;
    *) if [ -e "${arg%%::*}" ]; then targets=(); break; fi ;;
  esac
done
exec python -m pytest "${targets[@]}" -q "$@"
