#!/usr/bin/env bash
# Local step time and peak CUDA memory of PRISM vs factor-space DP-AdamW vs non-DP LoRA on a GPU.
#
# Runs bench/step.py on the first CUDA device with MiniLM (the bundled weights), a
# config-built BERT-large (24 layers, hidden 1024) and a config-built decoder of Gemma-3-4B's
# shapes (34 layers, hidden 2560, MLP 10240, 8 query / 4 KV heads of 256, vocabulary 262,208)
# as a causal LM with LoRA r=16 on q, k, v, up, down, at micro-batch 4 and 64 (PRISM vs
# DP-AdamW vs non-DP: the paper's Table 5 comparison). Random weights: time and memory only,
# nothing is downloaded. Base weights in bf16, LoRA factors in float32 (prism_runtime.model on
# CUDA). Without a CUDA device it says so and exits with status 3, running nothing.
#
#   bench/gpu.sh [OUT_DIR]        (default bench-results/gpu; PYTHON=... to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${1:-bench-results/gpu}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "bench/gpu.sh: no CUDA device visible to torch ($("$PYTHON" -c 'import torch; print(torch.__version__)'))." >&2
    echo "  Install the CUDA build of the same torch version on a GPU machine and rerun; nothing was run." >&2
    exit 3
fi
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt" || true
for model in minilm bert-large; do
    echo "== $model ==" >&2
    "$PYTHON" bench/step.py --device cuda --model "$model" --steps 20 --warmup 3 --no-phases \
        --methods prism prism-hooks dp-adamw nondp --out "$OUT/step-$model.json" | tee "$OUT/step-$model.md"
done
for micro in 4 64; do
    echo "== gemma3-4b, micro-batch $micro ==" >&2
    "$PYTHON" bench/step.py --device cuda --model gemma3-4b --data sst2 --batch 64 \
        --micro-batch "$micro" --steps 10 --warmup 2 --no-phases \
        --methods prism prism-hooks dp-adamw nondp --out "$OUT/step-gemma3-4b-mb$micro.json" | tee "$OUT/step-gemma3-4b-mb$micro.md"
done
echo "bench/gpu.sh: results in $OUT" >&2
