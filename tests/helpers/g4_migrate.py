"""Set-up shared by the ``kvbm-backend g4 migrate`` tests against a real S3 store (tests/pool/g4/
test_g4_migrate_throttle.py, test_g4_migrate_outage.py): a store holding ``n`` plaintext blocks under their format 1
names, the old names still in it, and which blocks a worker serves under their keyed names."""
from __future__ import annotations

from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.factory import open_store
from kvbm_backend.pool.g4.naming import parse_block_name
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace, put_blocks, read_checked
from tests.helpers.pools import G4_TIMEOUT_S


def legacy_store(tmp_path, url: str, endpoint: str, n: int, fanout: int) -> dict[str, bytes]:
    """Write ``n`` plaintext blocks (seqs ``0..n-1``, tenant alice) with a pool on ``tmp_path / "src"`` (directory
    fan-out ``fanout``) and copy each under its format 1 name into the S3 store ``url`` at ``endpoint`` (directly,
    not through a proxy): ``{old name: bytes}``."""
    ns, seqs = namespace(), list(range(n))
    cfg = G4Config(url=f"file://{tmp_path / 'src'}", encrypt=False, dir_fanout=fanout, timeout_s=G4_TIMEOUT_S)
    with G4Pool(cfg, ns) as p:
        assert put_blocks(p, seqs, "alice").written == n
        objs = {p.legacy_object_name(k): bytes(p.store.get(p.object_name(k))) for k in ns.keys(seqs, tenant="alice")}
    dst = open_store(url, endpoint_url=endpoint)
    for name, data in objs.items():
        dst.put(name, data)
    return objs


def legacy_left(url: str, endpoint: str, objs: dict[str, bytes]) -> list[str]:
    """The old (format 1) names still in the store, sorted, each checked to hold its bytes as written (``objs``:
    what :func:`legacy_store` returned)."""
    store = open_store(url, endpoint_url=endpoint)
    left = sorted(o.name for o in store.list("") if (parse_block_name(o.name, nested=True) or {}).get("legacy"))
    for name in left:
        assert bytes(store.get(name)) == objs[name], f"{name}: source changed"
    return left


def readable(url: str, endpoint: str, n: int, fanout: int) -> list[bool]:
    """Which of the ``n`` blocks a worker (unencrypted pool, fan-out ``fanout``) serves under their keyed names, each
    checked to hold its bytes (load bound :data:`~tests.helpers.pools.G4_TIMEOUT_S` x 2, not a bound under test)."""
    cfg = G4Config(url=url, endpoint_url=endpoint, encrypt=False, dir_fanout=fanout, timeout_s=G4_TIMEOUT_S)
    with G4Pool(cfg, namespace()) as p:
        return read_checked(p, list(range(n)), "alice")
