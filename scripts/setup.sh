#!/usr/bin/env bash
# One-step set-up: reuse an installed torch, else install the CPU wheel, then this package.
#   bash scripts/setup.sh          -> runtime install
#   bash scripts/setup.sh test     -> with the test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if "$PY" -c "import torch" 2>/dev/null; then
  echo "setup: reusing torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  echo "setup: no torch found, installing the CPU wheel torch==2.13.0"
  "$PY" -m pip install -q torch==2.13.0
fi
extras=${1:-}
if [ -n "$extras" ]; then spec=".[${extras}]"; else spec="."; fi
"$PY" -m pip install -q -e "$spec"
