"""G3: KV blocks in slab files on local/pooled SSD or a mounted filesystem (see :mod:`.pool`)."""
from .forked import G3ForkedError
from .pool import G3Pool
from .slabs import G3LockedError

__all__ = ["G3Pool", "G3LockedError", "G3ForkedError"]
