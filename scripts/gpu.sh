#!/usr/bin/env bash
# Everything the docs quote from a GPU machine, in named stages, run from the checkout (no install).
#
#   OUT=dir STAGEBUF_BENCH_COMMIT=<sha> bash scripts/gpu.sh STAGE [STAGE ...]
#
# vLLM's files: the GPU tests, bench and profile run vLLM's own MRV2 code of every release in
# benchmarks/vllm_mrv2.py's RELEASES, fetched with pip. A GPU machine without network gets them carried
# inside the checkout: here, once, with network,
#   STAGEBUF_CACHE_DIR=$PWD/.cache python -m benchmarks.vllm_mrv2 --fetch   # .cache/vllm-<release>/
# then carry .cache (ignored by git) with the tree. This script sets STAGEBUF_CACHE_DIR=$PWD/.cache
# (unless set), so they are found there; a release missing there is fetched if the network allows, or
# its tests skip saying so.
#
# Stages:
#   tests     pytest -m gpu (every GPU test, fuzz machines at their default sizes, CUDA graphs; the engine
#             tests once per vLLM release, so TESTS_TIMEOUT defaults to 480 s)
#   fuzz      the CUDA-tier state machines with FUZZ_EXAMPLES examples (scripts/gpu_reliability.sh fuzz)
#   sanitize  compute-sanitizer memcheck and racecheck over the GPU tests (scripts/gpu_reliability.sh)
#   multigpu  torchrun decode across GPUs (scripts/gpu_reliability.sh mp)
#   bench     the full bench, python -m benchmarks (scripts/gpu_bench.sh): bench.json, bench.md, bench-*.png;
#             its engine workload needs the newest release's files (.cache/vllm-<release>, see above)
#   ab        python -m benchmarks.ab --before $AB_BEFORE (a git revision, or a directory holding the old
#             stagebuf package) $AB_ARGS (--prompts RELEASE adds the prompt cells), then the same against the
#             checkout itself (the method's own rate): ab*.json
#   compare   python -m benchmarks.vs_vllm $COMPARE_ARGS, RUNS (default 2) runs a side in turns, the old
#             side with the stagebuf package of $COMPARE_BEFORE (a directory holding it, or a git
#             revision), then python -m benchmarks.compare over them: vs_*.json, compare.log
#   e2e       python -m benchmarks.e2e $E2E_ARGS: nano-vllm's real engine generating tokens, own vs attached
#             (a random Qwen3 of 0.6B's shape, written under $STAGEBUF_CACHE_DIR): e2e.json, e2e.md, e2e.png
#   profile   python -m benchmarks.engine_profile $PROFILE_ARGS: the engine workload's parts, timed (with
#             the floor) and profiled with call counts: profile.json, profile.md (needs vLLM's files, above)
# Each stage writes its log under $OUT and a line to $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=src:.${PYTHONPATH:+:$PYTHONPATH}
export STAGEBUF_CACHE_DIR=${STAGEBUF_CACHE_DIR:-$PWD/.cache}  # vLLM's files, carried (see above)
OUT=${OUT:-out}
mkdir -p "$OUT"
unset STAGEBUF_TIER
echo "commit: ${STAGEBUF_BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" >> "$OUT/summary.txt"
for stage in "$@"; do
  t0=$SECONDS
  case "$stage" in
    tests)
      timeout "${TESTS_TIMEOUT:-480}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
      rc=$?; line=$(tail -n 1 "$OUT/gpu_tests.log") ;;
    fuzz|sanitize|multigpu)
      sub=$stage; [ "$stage" = sanitize ] && sub="memcheck racecheck"; [ "$stage" = multigpu ] && sub=mp
      # shellcheck disable=SC2086
      OUT="$OUT/$stage" bash scripts/gpu_reliability.sh $sub > "$OUT/$stage.log" 2>&1
      rc=$?; line=$(tail -n 3 "$OUT/$stage.log" | tr '\n' ' ') ;;
    bench)
      OUT="$OUT/bench" timeout "${BENCH_TIMEOUT:-540}" bash scripts/gpu_bench.sh > "$OUT/bench_run.log" 2>&1
      rc=$?; line=$(grep -E "total .* s" "$OUT/bench_run.log" | tail -n 1) ;;
    ab)
      # shellcheck disable=SC2086
      timeout "${AB_TIMEOUT:-200}" python3 -m benchmarks.ab --before "${AB_BEFORE:?set AB_BEFORE}" ${AB_ARGS:-} \
        --json "$OUT/ab.json" > "$OUT/ab.log" 2>&1 &&
        timeout "${AB_TIMEOUT:-200}" python3 -m benchmarks.ab --before src ${AB_ARGS:-} --json "$OUT/ab_same.json" \
          > "$OUT/ab_same.log" 2>&1
      rc=$?; line="$(tail -n 1 "$OUT/ab.log"); the same code: $(tail -n 1 "$OUT/ab_same.log")" ;;
    compare)
      old=${COMPARE_BEFORE:?set COMPARE_BEFORE}
      if [ ! -f "$old/stagebuf/__init__.py" ]; then  # a revision: its src, unpacked
        tree=$(mktemp -d) && git archive "$old" src | tar -x -C "$tree" && old=$tree/src
      fi
      args=()
      for i in $(seq "${RUNS:-2}"); do
        for side in before after; do
          pp=src; label=${STAGEBUF_BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
          [ "$side" = before ] && pp=$old && label=$COMPARE_BEFORE
          # shellcheck disable=SC2086
          PYTHONPATH=$pp:. STAGEBUF_BENCH_COMMIT=$label timeout "${COMPARE_TIMEOUT:-120}" \
            python3 -m benchmarks.vs_vllm --json "$OUT/vs_$side$i.json" ${COMPARE_ARGS:-} \
            >> "$OUT/compare_runs.log" 2>&1
          args+=("--$side" "$OUT/vs_$side$i.json")
        done
      done
      python3 -m benchmarks.compare "${args[@]}" > "$OUT/compare.log" 2>&1
      rc=$?; line=$(tail -n 2 "$OUT/compare.log" | tr '\n' ' ') ;;
    profile)
      # shellcheck disable=SC2086
      timeout "${PROFILE_TIMEOUT:-240}" python3 -m benchmarks.engine_profile --json "$OUT/profile.json" \
        --markdown "$OUT/profile.md" ${PROFILE_ARGS:-} > "$OUT/profile.log" 2>&1
      rc=$?; line="$(grep -c "^#### " "$OUT/profile.md" 2>/dev/null) runs profiled" ;;
    e2e)
      # shellcheck disable=SC2086
      timeout "${E2E_TIMEOUT:-420}" python3 -m benchmarks.e2e --json "$OUT/e2e.json" --markdown "$OUT/e2e.md" \
        --plot "$OUT/e2e.png" ${E2E_ARGS:-} > "$OUT/e2e.log" 2>&1
      rc=$?; line=$(tail -n 1 "$OUT/e2e.log") ;;
    *) echo "unknown stage $stage; allowed: tests fuzz sanitize multigpu bench ab compare e2e profile" >&2
       exit 2 ;;
  esac
  echo "$stage: exit $rc in $((SECONDS - t0)) s: $line" | tee -a "$OUT/summary.txt"
done
