#!/usr/bin/env bash
# The README's main-job command: installs into .venv if needed, then runs `kvbm-backend demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/kvbm-backend ] && [ -z "${KVBM_REINSTALL:-}" ] || bash ci/install.sh
mkdir -p out
exec .venv/bin/kvbm-backend demo --json out/demo.json --plot out/demo.png "$@"
