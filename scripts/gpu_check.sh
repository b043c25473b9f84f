#!/usr/bin/env bash
# The one GPU check: sets up (scripts/setup.sh: the CUDA build of torch and cuda-python where
# nvidia-smi works; nothing else from the network), runs every `gpu`-marked test, then the GPU
# benchmark (scripts/gpu_bench.py: attach, cold vs warm restarts on a generated checkpoint, each
# scheme's linear against bf16, TP=1 vs TP=2 where two GPUs are visible), all within 8 minutes, and
# writes DIR/summary.txt (and the parts beside it). Exit status 0 only if everything passed.
#
#   scripts/gpu_check.sh [DIR]     # default DIR: gpu-check
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
mkdir -p "$out"
started=$(date +%s)
if ! nvidia-smi -L > "$out/gpus.txt" 2>&1; then
  echo "gpu_check: nvidia-smi finds no GPU here; nothing to check (see $out/gpus.txt)" | tee "$out/summary.txt"
  exit 1
fi
scripts/setup.sh > "$out/setup.txt" 2>&1 || { echo "gpu_check: setup failed (see $out/setup.txt)" | tee "$out/summary.txt"; exit 1; }
timeout 240 .venv/bin/python -m pytest -q -m gpu -rs -p no:cacheprovider > "$out/tests.txt" 2>&1
tests=$?
timeout 300 .venv/bin/python scripts/gpu_bench.py --out "$out/bench.json" --gb "${GPU_CHECK_GB:-4}" > "$out/bench.txt" 2>&1
bench=$?
{
  echo "gpu_check $(date -u +%FT%TZ), $(( $(date +%s) - started )) s"
  cat "$out/gpus.txt"
  echo "tests ($( [ $tests -eq 0 ] && echo passed || echo "FAILED, exit $tests")): $(tail -n 1 "$out/tests.txt")"
  echo "bench ($( [ $bench -eq 0 ] && echo passed || echo "FAILED, exit $bench")):"
  cat "$out/bench.txt"
} > "$out/summary.txt"
cat "$out/summary.txt"
[ $tests -eq 0 ] && [ $bench -eq 0 ]
