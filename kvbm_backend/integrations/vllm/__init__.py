"""vLLM integration: ``KvbmBackendConnector`` (``kvbm_backend.integrations.vllm.connector``).

Importing this package does not import vLLM; the connector module does.
"""
