#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one go: the CUDA-only tests (real CUDA-graph captures of
# scale + backward and of scale + fused step + update replayed with skips and growth, the
# sync-free fused path under torch.cuda.set_sync_debug_mode("error"), a second device), then
# the overhead and compiled benchmarks with --device cuda. Writes everything to one results file.
#
#   bash benchmarks/gpu_check.sh [RESULTS_FILE]      (default: gpu_check_results.txt)
#
# Run it from an environment set up as the README's test command sets it up (torch, then
# pip install -e ".[dev]"), with a CUDA build of torch. Without a CUDA device it says so and
# exits 0, having run nothing.
set -u -o pipefail
cd "$(dirname "$0")/.."
results=${1:-gpu_check_results.txt}

if ! python -c "import torch" 2>/dev/null; then
  echo "gpu_check: torch is not importable from $(command -v python); set up the environment as the"
  echo "README's test command does (pip install torch, then pip install -e \".[dev]\"), then run again."
  exit 2
fi
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing was run."
  exit 0
fi

status=0
run() {
  echo
  echo "\$ $*"
  "$@" || status=1
}

{
  echo "# ampscaler gpu_check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())"
  run python -m pytest -q -p no:cacheprovider -rs -m cuda tests
  run env PYTHONPATH=src python benchmarks/overhead.py --device cuda
  run env PYTHONPATH=src python benchmarks/compiled.py --device cuda
  echo
  if [ "$status" -eq 0 ]; then echo "gpu_check: all passed"; else echo "gpu_check: FAILURES above"; fi
  [ "$status" -eq 0 ]
} 2>&1 | tee "$results"
status=$?

echo "gpu_check: results in $results"
exit "$status"
