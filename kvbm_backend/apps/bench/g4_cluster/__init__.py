"""Multi-node G4 test bed (a SeaweedFS cluster and G4 worker processes): see ``cluster.py``."""
from __future__ import annotations

from .cluster import G4Cluster, weed_binary

__all__ = ["G4Cluster", "weed_binary"]
