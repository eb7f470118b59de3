#!/usr/bin/env bash
# make test-gpu, then the blog post's job (checks/gpu_benchmark.py), on one GPU, within SECONDS:
#
#     bash checks/gpu_proof.sh OUT [SECONDS] [PYTHON]      # SECONDS: 570 by default
#     bash checks/gpu_proof.sh --dry-run OUT               # on a CPU: all of it but the GPU's work
#
# The self-test gets until SELFTEST seconds (420: make test-gpu's 7 minutes), the benchmark what is
# left less a margin; each stops what would run past its deadline and says so in its report. The
# work (data, runs, checkpoints: several GB) stays in WORK (/tmp/gpu-proof); OUT gets the reports
# (Markdown and JSON), the launches' logs and records, the runs' histories and nvidia-smi's view,
# small files only. --dry-run: the self-test with --device cpu and the benchmark with --dry-run,
# tiny, without deadlines, and no nvidia-smi: what a GPU would run is skipped, the rest is done.
set -u
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
OUT=${1:?usage: bash checks/gpu_proof.sh [--dry-run] OUT [SECONDS] [PYTHON]}
SECONDS_ALL=${2:-570}
PY=${3:-}
SELFTEST=${SELFTEST:-420}
WORK=${WORK:-/tmp/gpu-proof}
MARGIN=20
cd "$(dirname "$0")/.."
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
start=$(date +%s)
mkdir -p "$OUT" "$WORK"
if [ "$DRY_RUN" = 1 ]; then
    SELFTEST_FLAGS=(--device cpu)
    BENCHMARK_FLAGS=(--dry-run)
    { echo "nvidia-smi: not run (--dry-run)"; df -h "$WORK"; nproc; } > "$OUT/machine.txt" 2>&1
else
    SELFTEST_FLAGS=(--deadline "$SELFTEST")
    BENCHMARK_FLAGS=()
    { nvidia-smi; nvidia-smi -q -d CLOCK,POWER,MEMORY; df -h /dev/shm "$WORK"; nproc; } > "$OUT/machine.txt" 2>&1
fi
"$PY" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())" >> "$OUT/machine.txt" 2>&1

"$PY" checks/gpu_selftest.py --out "$WORK/selftest" "${SELFTEST_FLAGS[@]}" > "$OUT/selftest.log" 2>&1
echo "make test-gpu: exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
left=$(( SECONDS_ALL - ($(date +%s) - start) - MARGIN ))
had="it had $left s"
if [ "$DRY_RUN" = 0 ]; then BENCHMARK_FLAGS=(--deadline "$left"); else had="no deadline: --dry-run"; fi
"$PY" checks/gpu_benchmark.py --out "$WORK/benchmark" "${BENCHMARK_FLAGS[@]}" > "$OUT/benchmark.log" 2>&1
echo "benchmark: exit $? after $(( $(date +%s) - start )) s ($had)" | tee -a "$OUT/summary.txt"

# The small files: reports, the self-test's launch logs and hook records, the runs' histories.
(cd "$WORK" && find selftest benchmark -maxdepth 4 -type f \( -name 'report.*' -o -name 'benchmark.*' \
    -o -name 'log-*.txt' -o -name 'syncs.json.*' -o -name 'compiled.json.*' -o -name 'compiled.txt' \
    -o -name 'dtypes.txt' -o -name 'targets.txt' -o -name 'memory.json.*' -o -name 'tf32.txt' \
    -o -name 'history.json' -o -name 'log.txt' \) -size -2M -print0 2>/dev/null | xargs -0 -r cp --parents -t "$OUT")
cat "$OUT/summary.txt"
