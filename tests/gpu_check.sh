#!/usr/bin/env bash
# The GPU check, in one command and one results file: the machine and its software, the GPU half of
# the tests (pytest -m cuda: every test that runs on each device present, its cuda half), the
# benchmarks beside nanoGPT (tests/gpu_bench.sh: GPT-2 124M, and each's tiny Shakespeare recipe)
# and Muon's step (tests/muon_step.py). Exits 1 if a check failed.
#
#     bash tests/gpu_check.sh RESULTS_DIR      # RESULTS_DIR/gpu_check.md, and each step's log
#
# About 5.5 minutes on one H100 or H200 (the tests 65-90 s, the benchmarks 95-120 s and about 90 s,
# Muon's step about 20 s; limits below). It needs only the machine's own python
# (PYTHON=..., default python3) with torch 2.11 or newer, numpy, tiktoken, pytest, pytest-xdist,
# safetensors, transformers, matplotlib, a C compiler for torch.compile, and nanoGPT's source in
# .nanogpt/ with its tiny Shakespeare prepared (tests/gpu_bench.sh); no network, no rustbpe.
# Without CUDA it still runs: the GPU tests are skipped, so that CI keeps the script working (and
# with .nanogpt/ there, the benchmark runs a tiny shape on the CPU; the recipe's benchmark and
# Muon's step, minutes and seconds a step there, are left out).
set -uo pipefail
RESULTS=$(mkdir -p "${1:?usage: bash tests/gpu_check.sh RESULTS_DIR}" && cd "$1" && pwd) || exit 2
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

# the commit, '-dirty' when the tree that ran differs from it (a copy of a working tree, say)
{ echo "# GPU check: $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git describe --always --dirty)"
  echo; echo '```'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "no nvidia-smi"
  echo "C compiler: $(command -v cc gcc clang | head -n 1)"
  "$PYTHON" - <<'EOF'
import importlib.util, platform, torch, perf
device = 'cuda:0' if torch.cuda.is_available() else 'cpu'
print(f"python {platform.python_version()}, torch {torch.__version__}, CPU {perf.cpu_name()}")
print(f"GPU: {perf.gpu_info(device)}")
if device != 'cpu':  # the peak MFU is measured against, from the datasheet table or measured
    flops, how = perf.peak_flops(device, torch.bfloat16)
    print(f"peak (bfloat16): {flops / 1e12:.0f} TFLOP/s, {how}")
needed = ('numpy', 'tiktoken', 'pytest', 'xdist', 'safetensors', 'transformers', 'matplotlib')
print(f"missing packages: {[p for p in needed if not importlib.util.find_spec(p)] or 'none'}")
EOF
  echo '```'; echo
} >"$REPORT" 2>&1

if "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    # 8 workers: the tests' runs are small; more at once would only queue on the one GPU
    TAIL=40 step tests 240 "$PYTHON" -m pytest -m cuda -n 8 -rfEs --durations=15 -p no:cacheprovider
    step benchmark 270 bash tests/gpu_bench.sh "$RESULTS"
    step recipe 180 bash tests/gpu_bench.sh "$RESULTS/recipe" recipe
    step muon_step 90 "$PYTHON" tests/muon_step.py cuda  # torch's Muon against ours, at 124M
else
    step tests 240 "$PYTHON" -m pytest -m cuda -rfEs -p no:cacheprovider
    step benchmark 270 bash tests/gpu_bench.sh "$RESULTS" small
fi
echo "$([ $failed = 0 ] && echo 'every check passed' || echo 'a check FAILED'), $SECONDS s in all" \
    | tee -a "$REPORT"
exit $failed
