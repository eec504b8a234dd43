"""KVBM-compatible sequence hashes, namespace fingerprints."""
import struct

import pytest
import xxhash

from kvbm_backend.model.hashing import (ROUTER_SEED, block_hash, salt_bytes, salt_hash, sequence_hashes)
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import Namespace


def test_matches_dynamo_runtime_block_hash():
    """Dynamo's own router hash (compute_block_hash_for_seq) equals ours with its seed."""
    core = pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime not installed (extra 'dynamo')")
    tokens = [(i * 7919) % 50_000 for i in range(16 * 9 + 5)]
    theirs = core.compute_block_hash_for_seq(tokens, 16)
    ours = [block_hash(tokens[i:i + 16], ROUTER_SEED) for i in range(0, 16 * 9, 16)]
    assert theirs == ours
    assert len(theirs) == 9  # partial trailing block has no hash


def test_chain_definition_from_kvbm_tokens_rs():
    tokens = list(range(48))
    s = salt_hash(salt_bytes("tenant-a"))
    b = [xxhash.xxh3_64_intdigest(struct.pack("<16I", *tokens[i:i + 16]), seed=s) for i in (0, 16, 32)]
    s1 = b[0]
    s2 = xxhash.xxh3_64_intdigest(struct.pack("<QQ", s1, b[1]), seed=s)
    s3 = xxhash.xxh3_64_intdigest(struct.pack("<QQ", s2, b[2]), seed=s)
    assert sequence_hashes(tokens, 16, salt=s) == [s1, s2, s3]


def test_prefix_property_and_salting():
    a = list(range(100))
    b = a[:64] + [9] * 36
    ha, hb = sequence_hashes(a, 16), sequence_hashes(b, 16)
    assert ha[:4] == hb[:4] and ha[4] != hb[4]
    # same tokens, other tenant: nothing shared
    hs = sequence_hashes(a, 16, salt=salt_hash(salt_bytes("other")))
    assert not set(hs) & set(ha)
    assert salt_hash(None) == 0 and salt_bytes(None, None) is None
    # continuing from a parent equals hashing the whole
    assert sequence_hashes(a[64:], 16, parent=ha[3]) == ha[4:]


def test_namespace_fingerprint_stable_and_sensitive():
    lay = KvLayout(4, 2, 16, 128)
    ns = Namespace("m", lay)
    assert ns.fingerprint == Namespace("m", KvLayout(4, 2, 16, 128)).fingerprint
    assert len(ns.fingerprint) == 16
    others = [Namespace("m2", lay), Namespace("m", lay, revision="r2"), Namespace("m", KvLayout(4, 2, 32, 128)),
              Namespace("m", lay, tp_world_size=2), Namespace("m", KvLayout(4, 2, 16, 128, "float16")),
              Namespace("m", lay, hash_scheme="vllm-block-hash")]
    assert len({o.fingerprint for o in others} | {ns.fingerprint}) == len(others) + 1
    assert Namespace.from_dict(ns.to_dict()) == ns
    with pytest.raises(ValueError, match="rank"):
        ns.key(1, "t", rank=1)
