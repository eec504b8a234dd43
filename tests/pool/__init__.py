"""G3/G4 pools: crash, corruption, ENOSPC, conformance, keyrings, S3 clients, cluster plumbing."""
