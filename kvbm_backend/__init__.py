"""kvbm_backend: G3/G4 KV block pools for KVBM and vLLM."""
__version__ = "0.1.0"
