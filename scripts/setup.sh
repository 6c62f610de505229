#!/usr/bin/env bash
# One-step set-up in a virtual environment: never writes into the system Python.
#
#   bash scripts/setup.sh          -> .venv with stagebuf (editable) and its runtime dependencies
#   bash scripts/setup.sh test     -> the same, with the test and lint tools (requirements/test.txt)
#   bash scripts/setup.sh cuda,cli -> any of the package's extras and of requirements/NAME.txt (bench,
#                                     test, docs, dev: what a checkout needs), comma-separated
#
# The environment is ./.venv (STAGEBUF_VENV=dir picks another); an existing one is reused. It is made
# with --system-site-packages, so a torch already installed on the machine (GPU images ship one) is
# reused instead of downloaded. Where there is none, torch==2.13.0 is installed, and STAGEBUF_TORCH says
# which build: cpu (torch==2.13.0+cpu from PyTorch's CPU index, https://download.pytorch.org/whl/cpu;
# on macOS the package index's, a CPU build), cuda (the package index's torch: on Linux, PyPI's is a
# CUDA build), or auto (the default: cuda where nvidia-smi lists a GPU, else cpu). pip's own
# configuration (an index, a mirror, --find-links) applies as always.
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
LOG="$VENV/setup-pip.log"
# pip, quietly: its output goes to $LOG. A failure prints it; a success prints nothing of pip's but one
# line where pip reported conflicts among packages the system already had (--system-site-packages
# shows them to pip; they are not stagebuf's), and its warnings (an unreachable index or find-links
# folder of the machine's own pip configuration) stay in the log.
pip_install() {
  local out rc=0
  out=$("$PY" -m pip install "$@" 2>&1) || rc=$?
  printf '%s\n' "$out" >> "$LOG"
  if [ "$rc" -ne 0 ]; then
    printf '%s\n' "$out" >&2
    echo "setup: pip install $* failed (exit $rc); its output is above and in $LOG" >&2
    exit "$rc"
  fi
  if grep -q "dependency conflicts" <<< "$out"; then
    echo "setup: note: pip reports version conflicts among packages this machine already had, outside" \
      "$VENV (pip's text: $LOG)"
  fi
}
if "$PY" -c "import torch" 2>/dev/null; then
  echo "setup: reusing torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  build=${STAGEBUF_TORCH:-auto}
  if [ "$build" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then build=cuda; else build=cpu; fi
  fi
  case "$build" in
    cpu)
      echo "setup: no torch found; installing torch==2.13.0, the CPU build (STAGEBUF_TORCH=cuda for a" \
        "CUDA build)"
      if [ "$(uname -s)" = Darwin ]; then  # macOS wheels on the package index are CPU builds
        pip_install -q torch==2.13.0
      else  # +cpu: only PyTorch's CPU index has it; then torch's dependencies, from the usual index.
        # One try, no retries: where that index cannot be reached, pip goes on to its other sources at
        # once instead of printing five retry warnings
        pip_install -q --no-deps --retries 0 --timeout 10 torch==2.13.0+cpu \
          --extra-index-url https://download.pytorch.org/whl/cpu
        pip_install -q torch==2.13.0+cpu
      fi ;;
    cuda)
      echo "setup: no torch found; installing torch==2.13.0 from the package index (on Linux a CUDA" \
        "build; STAGEBUF_TORCH=cpu for the CPU build)"
      pip_install -q torch==2.13.0 ;;
    *)
      echo "setup: STAGEBUF_TORCH=$build is not a torch build; allowed: auto, cpu, cuda" >&2
      exit 2 ;;
  esac
fi
# the package's extras, as pyproject.toml lists them
known=$(sed -n '/^\[project.optional-dependencies\]/,/^\[/p' pyproject.toml | sed -n 's/^\([a-z0-9_-]*\) = .*/\1/p')
extras=() reqs=() names=()
IFS=, read -r -a names <<< "${1:-}"
for name in ${names[@]+"${names[@]}"}; do
  if [ -f "requirements/$name.txt" ]; then
    reqs+=(-r "requirements/$name.txt")
  elif printf '%s\n' $known | grep -qx -- "$name"; then
    extras+=("$name")
  else
    allowed="$(printf '%s ' $known)$(cd requirements && ls -- *.txt | sed 's/\.txt$//' | tr '\n' ' ')"
    echo "setup: '$name' is neither an extra nor a requirements file; allowed: ${allowed% }" >&2
    exit 2
  fi
done
spec=.
if [ ${#extras[@]} -gt 0 ]; then spec=".[$(IFS=,; echo "${extras[*]}")]"; fi
pip_install -q -e "$spec" ${reqs[@]+"${reqs[@]}"}
echo "setup: done; run things with $PY (or: source $VENV/bin/activate)"
