#!/usr/bin/env bash
# One run on a machine with CUDA GPUs: the `gpu` tests, then the overhead and recovery benchmarks
# on the GPU(s), short: about 10 minutes on one H200 (tests ~4.5, overhead ~2, recovery ~3).
# With fewer GPUs than a benchmark's ranks (one GPU, say), the ranks share the GPU(s) under gloo,
# their collectives staged through host memory (NCCL refuses two ranks on one GPU).
# Usage: scripts/gpu_check.sh [PYTHON]   (default: .venv/bin/python, else python3)
# Writes bench/results/gpu/{devices.txt,gpu-tests.txt,overhead.json,overhead.png,recovery.json,recovery.png}.
# Limits (seconds) can be set: GPU_TESTS_S (default 330), GPU_OVERHEAD_S (150), GPU_RECOVERY_S (220).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${1:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
out=bench/results/gpu
"$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'no CUDA on this host: nothing to check')" || exit 2
mkdir -p "$out"
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
{ nvidia-smi -L 2>/dev/null; "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'nccl', '.'.join(map(str, torch.cuda.nccl.version())))"; } | tee "$out/devices.txt"
status=0

echo "+ pytest -m gpu tests/gpu ($gpus GPU(s))"
timeout "${GPU_TESTS_S:-330}" "$py" -m pytest -m gpu tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

worlds=$(( gpus >= 2 ? gpus : 2 ))  # one GPU: two ranks share it
echo "+ unbroken bench overhead --device cuda (worlds: $worlds)"
timeout "${GPU_OVERHEAD_S:-150}" "$py" -m unbroken.cli bench overhead --device cuda --worlds "$worlds" \
    --strategies ddp --steps 12 --rounds 2 --out-dir "$out" || status=1

echo "+ unbroken bench recovery --device cuda --quick (4 ranks: shared GPUs if fewer than 4)"
timeout "${GPU_RECOVERY_S:-220}" "$py" -m unbroken.cli bench recovery --device cuda --quick --out "$out" || status=1
exit $status
