"""Block pools: one :class:`~kvbm_backend.pool.base.BlockPool` protocol for G3 and G4."""
