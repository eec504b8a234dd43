"""Applications built on the library: the ``kvbm-backend`` command line (``cli.py``), benchmarks (``bench/``),
trace replay and capacity planning (``replay.py``, ``plan*.py``), the demo, ``doctor``, reports and the
test-model writer (``engine_model.py``).

The library (everything outside ``apps/``) never imports this package.
"""
