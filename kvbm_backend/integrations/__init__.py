"""Integrations with serving engines: the vLLM KV connector (:mod:`.vllm`), tier opening (:mod:`.tiers`)."""
