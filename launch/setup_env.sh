#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install megalite into it.
# torch is pinned to 2.13.0 first: on these machines that is the CPU wheel on disk, while a
# looser spec would pull a multi-GB CUDA build. On a GPU machine install your CUDA torch first
# and set MEGALITE_VENV to an existing environment.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGALITE_VENV:-$ROOT/.venv}"
EXTRAS="${1:-test}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
stamp="$VENV/.megalite-installed-$EXTRAS"
if [ ! -f "$stamp" ] || [ "$ROOT/setup.py" -nt "$stamp" ]; then
  # one line per step: pip -q is silent for the ~40 s a fresh machine takes
  if python -c "import torch" 2>/dev/null; then
    echo "[setup] torch $(python -c 'import torch; print(torch.__version__)') already installed"
  else
    echo "[setup] installing torch 2.13.0 (CPU wheel)..."
    pip install -q "torch==2.13.0"
  fi
  if [[ ",$EXTRAS," == *",test,"* ]]; then   # the parity tests' oracle, without its CUDA extras
    echo "[setup] installing megatron-core and einops (the parity tests' reference)..."
    pip install -q --no-deps megatron-core einops
  fi
  echo "[setup] installing megalite with extras [$EXTRAS] (pip install -e)..."
  pip install -q -e "$ROOT[$EXTRAS]"
  touch "$stamp"
  echo "[setup] done: $VENV"
fi
