"""KVBM-compatible sequence hashes, namespace fingerprints."""
import struct
from array import array

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


def test_sequence_hashes_equal_the_per_block_definition_for_every_input_form():
    """sequence_hashes hashes the blocks straight from one u32 buffer (``array('I')`` for a list of ints,
    numpy for arrays and odd values): the same hashes as block_hash + chain one block at a time (the
    definition, KVBM tokens.rs), for lists, tuples, uint32/int64 arrays and numpy ints, salts, parents,
    page sizes, trailing partial blocks and empty input; out-of-range ids raise as numpy does."""
    import random

    import numpy as np

    def definition(tokens, ps, salt=0, parent=None):
        toks = [int(t) for t in tokens]
        out = []
        for i in range(len(toks) // ps):
            b = xxhash.xxh3_64_intdigest(struct.pack(f"<{ps}I", *toks[i * ps:(i + 1) * ps]), seed=salt)
            parent = b if parent is None else xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, b), seed=salt)
            out.append(parent)
        return out

    rng = random.Random(7)
    for _ in range(200):
        ps = rng.choice([1, 3, 16, 32])
        toks = [rng.randrange(0, 2 ** 32) for _ in range(rng.randrange(0, 300))]
        salt = rng.choice([0, salt_hash(salt_bytes("t")), 2 ** 64 - 1])
        parent = rng.choice([None, 0, rng.randrange(2 ** 64)])
        want = definition(toks, ps, salt, parent)
        for form in (toks, tuple(toks), np.array(toks, np.uint32), np.array(toks, np.int64),
                     [np.int64(t) for t in toks]):
            assert sequence_hashes(form, ps, salt=salt, parent=parent) == want
        got = sequence_hashes(toks, ps, salt=salt, parent=parent, into=array("Q", [5]))  # the scheduler's form
        assert isinstance(got, array) and got.tolist() == [5] + want
    for bad in ([-1] * 16, [2 ** 32] * 16):
        with pytest.raises(OverflowError):
            sequence_hashes(bad, 16)
    with pytest.raises(TypeError, match=r"into: an array\('Q'\) or a list is needed, got array\('I'\)"):
        sequence_hashes([1] * 16, 16, into=array("I"))
    with pytest.raises(ValueError, match="page_size"):
        sequence_hashes([1, 2], 0)
