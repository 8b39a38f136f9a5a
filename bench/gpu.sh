#!/usr/bin/env bash
# Local step time and peak CUDA memory of PRISM vs factor-space DP-AdamW vs non-DP LoRA on a GPU.
#
# Runs bench/step.py on the first CUDA device with MiniLM (the bundled weights) and a
# config-built BERT-large (24 layers, hidden 1024; random weights: time and memory only, nothing
# is downloaded). Base weights in bf16, LoRA factors in float32 (prism_runtime.model on CUDA).
# Without a CUDA device it says so and exits with status 3, running nothing.
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
        --out "$OUT/step-$model.json" | tee "$OUT/step-$model.md"
done
echo "bench/gpu.sh: results in $OUT" >&2
