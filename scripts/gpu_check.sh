#!/usr/bin/env bash
# One run on a machine with CUDA GPUs: the `gpu` tests, then the overhead and recovery benchmarks
# on the GPU(s), short, so that the figures fit in a single device session (~10 min).
# Usage: scripts/gpu_check.sh [PYTHON]   (default: .venv/bin/python, else python3)
# Writes bench/results/gpu/{gpu-tests.txt,overhead.json,overhead.png,recovery.json,recovery.png}.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${1:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
out=bench/results/gpu
"$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'no CUDA on this host: nothing to check')" || exit 2
mkdir -p "$out"
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
nvidia-smi -L 2>/dev/null | tee "$out/devices.txt"
status=0

echo "+ pytest -m gpu tests/gpu ($gpus GPU(s))"
timeout 300 "$py" -m pytest -m gpu tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "+ unbroken bench overhead --device cuda (worlds: $gpus)"
timeout 300 "$py" -m unbroken.cli bench overhead --device cuda --worlds "$gpus" --steps 12 --rounds 1 \
    --out-dir "$out" || status=1

if [ "$gpus" -ge 4 ]; then  # the recovery benchmark runs 4 ranks, one per GPU
    echo "+ unbroken bench recovery --device cuda --quick"
    timeout 240 "$py" -m unbroken.cli bench recovery --device cuda --quick --out "$out" || status=1
else
    echo "skipped: bench recovery --device cuda needs 4 GPUs (one rank each), $gpus visible" | tee "$out/recovery-skipped.txt"
fi
exit $status
