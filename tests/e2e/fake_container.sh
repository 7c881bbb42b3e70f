#!/bin/bash
# A stand-in for `apptainer exec` in the SLURM tests: fake_container.sh --env K=V IMAGE CMD...
# Records the words it got (one per line) in $FAKE_CONTAINER_LOG, then runs CMD "inside the
# image": K=V exported and a python3 of the image's own (a wrapper of $FAKE_CONTAINER_PYTHON)
# first on PATH, so a host path handed in as the python would bypass it and show up.
set -euo pipefail
[ "$1" = --env ] || { echo "fake container: expected --env K=V first, got '$1'" >&2; exit 90; }
kv="${2?}"; image="${3?}"; shift 3
export "$kv"
bin="$(mktemp -d)"
printf '#!/bin/sh\nexec "%s" "$@"\n' "$FAKE_CONTAINER_PYTHON" > "$bin/python3"  # a link
chmod +x "$bin/python3"                                   # would lose the venv's packages
{ echo "image=$image"; echo "env=$kv"; printf 'arg=%s\n' "$@"; } >> "$FAKE_CONTAINER_LOG"
export PATH="$bin:$PATH"
exec "$@"
