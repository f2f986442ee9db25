#!/usr/bin/env bash
# The GPU check, in one command and one results file: the machine and its software, the GPU half of
# the tests (pytest -m cuda: every test that runs on each device present, its cuda half) and the
# benchmark beside nanoGPT (tests/gpu_bench.sh). Exits 1 if a check failed.
#
#     bash tests/gpu_check.sh RESULTS_DIR      # RESULTS_DIR/gpu_check.md, and each step's log
#
# Under 8 minutes on one H100 (the tests 3, the benchmark 3, limits below). It needs only the
# machine's own python (PYTHON=..., default python3) with torch 2.11 or newer, numpy, tiktoken,
# pytest, pytest-xdist, safetensors, transformers and matplotlib; no network, no rustbpe. Without
# CUDA it still runs: the GPU tests are skipped and the benchmark runs its small CPU mode, so that
# CI keeps this script working.
set -uo pipefail
RESULTS=$(mkdir -p "${1:?usage: bash tests/gpu_check.sh RESULTS_DIR}" && cd "$1" && pwd)
export PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/.."
REPORT=$RESULTS/gpu_check.md
failed=0

# step NAME SECONDS COMMAND...: runs it with a time limit, its output in RESULTS/NAME.log, its
# verdict and last lines in the report
step() {
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    timeout "$limit" "$@" >"$RESULTS/$name.log" 2>&1
    rc=$?
    [ $rc = 0 ] || failed=1
    { echo "## $name: $([ $rc = 0 ] && echo passed || echo "FAILED (exit code $rc)")," \
        "$((SECONDS - start)) s"
      echo; echo '```'; echo "\$ $*"; tail -n "${TAIL:-15}" "$RESULTS/$name.log"; echo '```'; echo
    } >>"$REPORT"
}

{ echo "# GPU check: $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null)"
  echo; echo '```'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "no nvidia-smi"
  "$PYTHON" - <<'EOF'
import platform, torch, perf
device = 'cuda:0' if torch.cuda.is_available() else 'cpu'
print(f"python {platform.python_version()}, torch {torch.__version__}, CPU {perf.cpu_name()}")
print(f"GPU: {perf.gpu_info(device)}")
if device != 'cpu':  # the peak MFU is measured against, from the datasheet table or measured
    print("peak (bfloat16): {:.0f} TFLOP/s, {}".format(*perf.peak_flops(device, torch.bfloat16)))
EOF
  echo '```'; echo
} >"$REPORT" 2>&1

# -n 8: the tests' runs are small; more processes at once would only queue on the one GPU
TAIL=25 step tests 330 "$PYTHON" -m pytest -m cuda -n 8 -rfEs -p no:cacheprovider
if "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    step benchmark 300 bash tests/gpu_bench.sh "$RESULTS"
else
    step benchmark 300 bash tests/gpu_bench.sh "$RESULTS" small
fi
echo "$([ $failed = 0 ] && echo 'every check passed' || echo 'a check FAILED'), $SECONDS s in all" \
    | tee -a "$REPORT"
exit $failed
