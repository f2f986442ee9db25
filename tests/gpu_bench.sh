#!/usr/bin/env bash
# honestgpt's train.py against nanoGPT's on the same GPU, shape and tokens, in one run of
# bench.py (--reference: ours, then nanoGPT's), which ends with "tokens/s A/reference: RATIO"
# (above 1: ours is faster).
#
#     bash tests/gpu_bench.sh RESULTS_DIR        # GPT-2 124M, compiled, bfloat16 (H100: ~3 min)
#     bash tests/gpu_bench.sh RESULTS_DIR small  # a tiny shape on the CPU, eager, float32: ~40 s
#     bash tests/gpu_bench.sh RESULTS_DIR recipe # each's tiny Shakespeare GPU recipe: ~1.5 min
#
# RESULTS_DIR gets bench.txt (bench.py's output), bench.json (every figure) and both runs' logs.
# The small mode keeps the script working where there is no GPU. PYTHON=... picks the
# interpreter (python3 by default, as on GPU images).
#
# nanoGPT's source is read from .nanogpt/ (ignored by git). Get it once, with network:
#     git clone https://github.com/karpathy/nanoGPT /tmp/nanoGPT && mkdir .nanogpt
#     git -C /tmp/nanoGPT archive HEAD | tar -x -C .nanogpt
#     git -C /tmp/nanoGPT rev-parse HEAD > .nanogpt/COMMIT
#     (cd .nanogpt && python data/shakespeare_char/prepare.py)  # the recipe mode's text
# Written against 3adf61e154c3fe3fca428ad6bc3818b27a3b8291 (Nov 2025, the newest one then). On a
# machine without network (the device tool's), the folder travels with the tree: carry .nanogpt.
# Without .nanogpt/ the GPU mode fails (exit 1: there is nothing to compare with) and the small
# mode prints a SKIP line and exits 0; without CUDA (or, recipe, the text) a SKIP line. nanoGPT runs
# as it is on torch 2.11: torch.cuda.amp.GradScaler only warns (deprecated), allow_tf32 sets the
# new TF32 flag too (no mixed-API error in torch.compile), AdamW still takes fused.
#
# Every setting that still differs between the two runs: docs/benchmarks.md, GPU.
set -euo pipefail
USAGE="usage: bash tests/gpu_bench.sh RESULTS_DIR [small|recipe]"
RESULTS=$(mkdir -p "${1:?$USAGE}" && cd "$1" && pwd)
MODE=${2:-gpu}
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/.."
skip() { echo "SKIP gpu_bench: $1" | tee "$RESULTS/bench.txt"; exit 0; }
if [ ! -f .nanogpt/train.py ]; then  # the small mode only keeps the script working
    [ "$MODE" = small ] && skip "no nanoGPT source in .nanogpt/ (see tests/gpu_bench.sh's top)"
    echo "FAILED gpu_bench: no nanoGPT source in .nanogpt/ to compare with (see" \
        "tests/gpu_bench.sh's top)" | tee "$RESULTS/bench.txt"
    exit 1
fi

if [ "$MODE" = recipe ]; then
    # config/shakespeare_char_fast_gpu.py against nanoGPT's own recipe, each with its own settings
    # at their one shape (6 x 384, block 256, batch 64), compiled, on the text nanoGPT's prepare.py
    # fetched: a small model, whose iteration is the host's (docs/benchmarks.md, GPU)
    "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' \
        || skip "no CUDA device"
    CHARS=.nanogpt/data/shakespeare_char
    [ -f $CHARS/train.bin ] || skip "no tiny Shakespeare in $CHARS: run its prepare.py once"
    TMP=$(mktemp -d)
    trap 'cp "$TMP"/bench-*/*.log "$RESULTS"/ 2>/dev/null || true; rm -rf "$TMP"' EXIT
    "$PYTHON" prepare.py shakespeare_char --input $CHARS/input.txt --data_dir "$TMP" >/dev/null
    REFERENCE="cd $(printf %q "$PWD/.nanogpt") && $(printf %q "$PYTHON") train.py \
        config/train_shakespeare_char.py --compile=True --max_iters=119 --log_interval=1 \
        --eval_interval=1000000 --eval_iters=0 --out_dir=$TMP/nanogpt-out"
    TMPDIR=$TMP "$PYTHON" bench.py config/shakespeare_char_fast_gpu.py --compile=True \
        --data_dir="$TMP" --rounds=1 --bench_warmup=20 --bench_iters=100 \
        --reference="$REFERENCE" --json="$RESULTS/bench.json" 2>&1 | tee "$RESULTS/bench.txt"
    exit
fi

if [ "$MODE" = small ]; then  # seconds on a CPU: the same flow at a tiny shape
    L=2 H=2 C=64 T=64 B=8 WARMUP=2 ITERS=10 TOKENS=$((1 << 20))
    SYSTEM="--device=cpu --compile=False --dtype=float32"  # nanoGPT's CPU settings
elif [ "$MODE" = gpu ]; then
    "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' \
        || skip "no CUDA device"
    # GPT-2 124M. Micro-batch 32 for both: nanoGPT's default 12 was sized for a 40 GB A100; 32 x
    # 1024 tokens (an estimated ~30 GB for nanoGPT's run, which keeps its logits) fill an H100
    # better, so a step is ~0.1 s of GPU work and the per-step host costs that differ (a sync, a
    # metrics record, a loader worker: docs/benchmarks.md, GPU) weigh little.
    L=12 H=12 C=768 T=1024 B=32 WARMUP=10 ITERS=50 TOKENS=$((1 << 25))
    SYSTEM="--device=cuda --compile=True --dtype=bfloat16"
else
    echo "$USAGE" >&2
    exit 2
fi
# keys both train.py files take, with the same meaning; the optimizer's at the defaults they share
COMMON="--n_layer=$L --n_head=$H --n_embd=$C --block_size=$T --batch_size=$B $SYSTEM \
    --gradient_accumulation_steps=1 --dropout=0.0 --bias=False --learning_rate=6e-4 --min_lr=6e-5 \
    --warmup_iters=2000 --lr_decay_iters=600000 --decay_lr=True --weight_decay=0.1 --beta1=0.9 \
    --beta2=0.95 --grad_clip=1.0"
# ours only: nanoGPT's architecture and optimizer, in case our defaults change
OURS="--activation=gelu --pos_emb=learned --tie_head=True --qk_norm=False --logit_softcap=0.0 \
    --zero_init=False --optimizer=adamw --lr_schedule=cosine"

TMP=$(mktemp -d)  # the data, nanoGPT's out_dir and bench.py's runs; their logs are kept
trap 'cp "$TMP"/bench-*/*.log "$RESULTS"/ 2>/dev/null || true; rm -rf "$TMP"' EXIT
"$PYTHON" - "$TMP" "$TOKENS" <<'EOF'
# the same tokens twice: llm.c shards + meta.json for ours, flat uint16 {train,val}.bin for nanoGPT
import json, os, sys
import numpy as np
tmp, n = sys.argv[1], int(sys.argv[2])
# uniform GPT-2 ids, seeded: a step's speed does not depend on which tokens it sees
tokens = np.random.default_rng(1337).integers(0, 50257, n + n // 16, dtype=np.uint16)
os.makedirs(f'{tmp}/bench')
os.makedirs(f'{tmp}/nanogpt')
with open(f'{tmp}/bench/meta.json', 'w') as f:  # no meta.pkl for nanoGPT: it pads 50257 to 50304
    json.dump({'vocab_size': 50257, 'tokenizer': 'gpt2'}, f)
for split, ids in (('train', tokens[:n]), ('val', tokens[n:])):
    header = np.zeros(256, dtype=np.int32)
    header[:3] = 20240520, 1, len(ids)  # llm.c's magic, version 1 (uint16), token count
    with open(f'{tmp}/bench/bench_{split}_000000.bin', 'wb') as f:
        f.write(header.tobytes())
        f.write(ids.tobytes())
    ids.tofile(f'{tmp}/nanogpt/{split}.bin')
EOF

# nanoGPT prints bench_warmup + bench_iters "iter N" lines (0 to max_iters); its data_dir is
# os.path.join('data', dataset), which an absolute dataset replaces
REFERENCE="cd $(printf %q "$PWD/.nanogpt") && $(printf %q "$PYTHON") train.py \
    --dataset=$TMP/nanogpt --out_dir=$TMP/nanogpt-out $COMMON --max_iters=$((WARMUP + ITERS - 1)) \
    --log_interval=1 --eval_interval=1000000 --eval_iters=0 --always_save_checkpoint=False \
    --wandb_log=False --init_from=scratch"
# shellcheck disable=SC2086  # COMMON and OURS split into arguments
TMPDIR=$TMP "$PYTHON" bench.py $COMMON $OURS --data_dir="$TMP" --dataset=bench --rounds=1 \
    --bench_warmup=$WARMUP --bench_iters=$ITERS --reference="$REFERENCE" \
    --reference_tokens_per_iter=$((B * T)) --json="$RESULTS/bench.json" 2>&1 \
    | tee "$RESULTS/bench.txt"
echo "gpu_bench ($MODE, nanoGPT $(cat .nanogpt/COMMIT 2>/dev/null || echo '?')): $SECONDS s" \
    | tee -a "$RESULTS/bench.txt"
