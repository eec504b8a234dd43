#!/usr/bin/env bash
# The README's test command: installs into .venv if needed, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/kvbm-backend ] && [ -z "${KVBM_REINSTALL:-}" ] || bash ci/install.sh
export PYTHONUNBUFFERED=1
# --fast: the unit lane (no SeaweedFS, no vLLM engine, no GPU, nothing slow; markers in tests/conftest.py)
args=()
for a in "$@"; do
  if [ "$a" = "--fast" ]; then args+=(-m "not slow and not vllm and not s3 and not gpu"); else args+=("$a"); fi
done
set +e
.venv/bin/python -m pytest -ra --durations=15 "${args[@]}"
rc=$?
set -e
# pytest exit 5 = no tests collected: that is a failure for CI, never a pass.
exit $rc
