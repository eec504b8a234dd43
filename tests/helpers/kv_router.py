"""What Dynamo's KV router keeps of one worker's ``DISK`` blocks, fed the KV events our connector publishes
(tests/integrations/vllm/test_g4_announce_reset.py, test_connector_reset_queued_events.py). Imports vLLM lazily."""
from __future__ import annotations


class DiskRouter:
    """What Dynamo's router keeps of one worker's ``DISK`` blocks: one credit per vLLM hash (``disk``)."""

    def __init__(self) -> None:
        self.disk: set = set()

    def apply(self, events: list) -> None:
        """Apply vLLM KV events in order: ``AllBlocksCleared`` empties ``disk``, ``BlockStored`` adds its hashes,
        ``BlockRemoved`` takes its hashes out; other events are ignored."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
        for e in events:
            if isinstance(e, AllBlocksCleared):
                self.disk.clear()
            elif isinstance(e, BlockStored):
                self.disk.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                self.disk.difference_update(e.block_hashes)
