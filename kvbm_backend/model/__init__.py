"""Model layer: KV geometry (KvLayout), identity (sequence hashes, Namespace, BlockKey), stored frame."""
