#!/usr/bin/env bash
# The full bench (python -m benchmarks) on a GPU machine, the bench stage of scripts/gpu.sh. The committed
# run is benchmarks/results/h200.json (+ h200-*.png); docs/BENCHMARKS.md's tables are made from it with
# python -m benchmarks.render_docs.
#
#   OUT=/path/to/dir bash scripts/gpu_bench.sh [more bench options]
#
# Writes under $OUT (default ./out):
#   bench.json   the report: medians, samples, ratios with pass/fail, versions, commit, command
#   bench-*.png  one figure per workload: µs per step against size, one line per strategy, log axes
#   bench.md     every table of the run as Markdown
#   bench.txt    the printed tables
#   env.txt      nvidia-smi, torch/CUDA/Triton/cuda-bindings versions
#   doctor.json  `stagebuf doctor --json`: the tiers this machine offers, and why
# Where the working tree has no .git, pass the commit: STAGEBUF_BENCH_COMMIT=<sha> bash scripts/gpu_bench.sh
# Runs from a checkout without installing it (PYTHONPATH=src:.). Needs torch with CUDA, numpy, click, rich,
# matplotlib; cuda-bindings for tier UVA; triton for the staged-write kernel. About 2 minutes on an H200.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=src:.${PYTHONPATH:+:$PYTHONPATH}
export COLUMNS=${COLUMNS:-200}

if ! "$PY" -c "import torch, numpy, click, rich, matplotlib" 2>"$OUT/import-error.txt"; then
  echo "gpu_bench: a dependency is missing:" >&2
  cat "$OUT/import-error.txt" >&2
  exit 1
fi
rm -f "$OUT/import-error.txt"

{
  echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "# commit: ${STAGEBUF_BENCH_COMMIT:-$(git rev-parse --verify -q HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi || echo "nvidia-smi: not available"
  "$PY" - <<'EOF'
import platform
from importlib import metadata
import torch
print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
for dist in ("triton", "cuda-bindings", "numpy", "matplotlib", "rich", "click"):
    try:
        print(dist, metadata.version(dist))
    except metadata.PackageNotFoundError:
        print(dist, "not installed")
EOF
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

"$PY" -m stagebuf doctor --json >"$OUT/doctor.json" || echo "gpu_bench: stagebuf doctor failed (see above)" >&2

echo "+ $PY -m benchmarks --no-progress --json $OUT/bench.json --plot $OUT/bench.png --markdown $OUT/bench.md $*"
"$PY" -m benchmarks --no-progress --json "$OUT/bench.json" --plot "$OUT/bench.png" \
  --markdown "$OUT/bench.md" "$@" 2>&1 | tee "$OUT/bench.txt"
