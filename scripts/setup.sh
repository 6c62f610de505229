#!/usr/bin/env bash
# One-step set-up in a virtual environment: never writes into the system Python.
#
#   bash scripts/setup.sh          -> .venv with stagebuf (editable) and its runtime dependencies
#   bash scripts/setup.sh test     -> the same, with the test and lint tools (the `test` extra)
#   bash scripts/setup.sh cuda,cli -> any extras, comma-separated
#
# The environment is ./.venv (STAGEBUF_VENV=dir picks another); an existing one is reused. It is made
# with --system-site-packages, so a torch already installed on the machine (GPU images ship one) is
# reused instead of downloaded; where there is none, the CPU wheel torch==2.13.0 is installed into it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${STAGEBUF_VENV:-.venv}
BASE=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating the virtual environment $VENV (reusing the system's packages, e.g. torch)"
  if ! "$BASE" -m venv --system-site-packages "$VENV"; then
    echo "setup: '$BASE -m venv' failed: install your distribution's venv package (python3-venv)" \
      "or point PYTHON at a Python that has it" >&2
    exit 1
  fi
else
  echo "setup: reusing the virtual environment $VENV"
fi
PY="$VENV/bin/python"
if "$PY" -c "import torch" 2>/dev/null; then
  echo "setup: reusing torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  echo "setup: no torch found, installing torch==2.13.0 into $VENV"
  "$PY" -m pip install -q torch==2.13.0
fi
extras=${1:-}
if [ -n "$extras" ]; then spec=".[${extras}]"; else spec="."; fi
"$PY" -m pip install -q -e "$spec"
echo "setup: done; run things with $PY (or: source $VENV/bin/activate)"
