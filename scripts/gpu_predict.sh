#!/usr/bin/env bash
# Issue 21 on a CUDA GPU: measure ITL and power of random-weight replicas of models in the tables
# (`unbroken predict profile --like`), then compare with the predictor (run the check anywhere:
# `unbroken predict --check OUT/measurements.jsonl --gpu-specs ...` needs no GPU).
# Batch 1 follows ML.ENERGY 2023's protocol (transformers' generate, fp16, one request); two
# batched runs of a newer model follow. About 3 minutes on one H200.
# Usage: scripts/gpu_predict.sh [OUT] [GPU NAME]   (defaults: bench/results/gpu/predict, "H200 SXM")
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/gpu/predict}
gpu=${2:-H200 SXM}
py=$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )
mkdir -p "$out"
{ nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv; "$py" -c "import torch, transformers; \
print('torch', torch.__version__, 'transformers', transformers.__version__)"; } | tee "$out/devices.txt"
status=0
profile() { timeout 150 "$py" -m unbroken.cli predict profile --gpu "$gpu" --out "$out" --device cuda "$@" 2>&1 \
    | grep -v -i warn | tee -a "$out/profile.log"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1; }
for m in metaai/llama-7B metaai/Llama-2-7b-chat-hf metaai/Llama-2-13b-chat-hf lmsys/vicuna-13B; do
    profile --like "$m" --batch 1 --tokens 256 --prompt-tokens 64 --dtype float16
done
for b in 8 32; do
    profile --like meta-llama/Meta-Llama-3.1-8B-Instruct --batch "$b" --tokens 128 --prompt-tokens 64 --dtype bfloat16
done
exit $status
