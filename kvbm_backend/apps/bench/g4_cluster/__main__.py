"""``python -m kvbm_backend.apps.bench.g4_cluster up|clean|bench|worker|relay``."""
import sys

from .cluster import main

if __name__ == "__main__":
    sys.exit(main())
