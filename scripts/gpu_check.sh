#!/usr/bin/env bash
# The one GPU check: every `gpu`-marked test, then the GPU benchmark (scripts/gpu_bench.py: attach,
# cold vs warm restarts of a generated checkpoint, each scheme's linear against bf16, TP=1 vs TP=2
# where two GPUs are visible), within 8 minutes, writing DIR/summary.txt (the parts beside it).
# Exit status 0 only if everything passed.
#
# It uses .venv as scripts/setup.sh made it (running set-up first only where .venv cannot import
# preload yet: set-up needs the package registries), and says so when that torch has no CUDA.
#
#   scripts/gpu_check.sh [DIR]     # default DIR: gpu-check; GPU_CHECK_GB=4 sizes the checkpoint
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
mkdir -p "$out"
started=$(date +%s)
fail() { echo "gpu_check: $*" | tee "$out/summary.txt"; exit 1; }
nvidia-smi -L > "$out/gpus.txt" 2>&1 || fail "nvidia-smi finds no GPU here; nothing to check (see $out/gpus.txt)"
if ! .venv/bin/python -c 'import torch, preload_daemon' 2>/dev/null; then
  scripts/setup.sh > "$out/setup.txt" 2>&1 || fail "set-up failed (see $out/setup.txt)"
fi
.venv/bin/python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' ||
  fail "torch in .venv has no CUDA ($(.venv/bin/python -c 'import torch; print(torch.__version__)')): rebuild it with rm -rf .venv && TORCH_SPEC=torch scripts/setup.sh"
.venv/bin/python -c 'import cuda.bindings.runtime' 2>/dev/null ||
  fail "cuda-python is missing from .venv: .venv/bin/pip install 'preload[gpu]' (or rerun scripts/setup.sh)"
timeout 180 .venv/bin/python -m pytest -q -m gpu -rs -p no:cacheprovider > "$out/tests.txt" 2>&1
tests=$?
timeout 270 .venv/bin/python scripts/gpu_bench.py --out "$out/bench.json" --gb "${GPU_CHECK_GB:-4}" > "$out/bench.txt" 2>&1
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
