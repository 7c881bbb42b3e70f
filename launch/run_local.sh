#!/usr/bin/env bash
# Train a recipe on this machine: one process per GPU, or on CPU the recipe's smallest world
# (TP x CP x PP, and what the expert grid needs), unless NPROC says otherwise.
#
#   launch/run_local.sh launch/recipes/twins/llama3-405b.yaml --train-iters 20
#   NPROC=8 launch/run_local.sh launch/recipes/twins/gpt3-175b.yaml
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# -ge 1 ] || { echo "usage: $0 RECIPE.yaml [pretrain_gpt.py flags]" >&2; exit 2; }
RECIPE="$1"; shift
PYTHON="${MEGALITE_PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3)}"
cd "$ROOT"
if [ -z "${NPROC:-}" ]; then
  GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [ "$GPUS" -gt 0 ]; then NPROC=$GPUS
  else NPROC=$("$PYTHON" -m megalite.cli.recipes min-world "$RECIPE"); fi
fi
echo "[run_local] $NPROC process(es): $RECIPE $*"
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    pretrain_gpt.py --config "$RECIPE" "$@"
