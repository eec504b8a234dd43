"""device_checksum_torch (torch int64 ops, runs on CPU tensors here and on CUDA on a GPU) must equal
frame.device_checksum (numpy reference) for the same bytes."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbm_backend.gpu.checksum import CHUNK_WORDS, checksums_match, device_checksum_torch, device_checksums_torch
from kvbm_backend.model.frame import device_checksum


def _cuda_ok():
    return torch.cuda.is_available()


DEVICES = ["cpu"] + (["cuda"] if _cuda_ok() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 4096, 4097, CHUNK_WORDS * 4, CHUNK_WORDS * 4 + 4, 1_000_003])
def test_equals_reference_random(device, n):
    b = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert device_checksum_torch(torch.from_numpy(b).to(device)) == device_checksum(b.tobytes())


@pytest.mark.parametrize("device", DEVICES)
def test_equals_reference_worst_case_overflow(device):
    # all-ones words times large indices: every intermediate a naive int64 version would overflow
    b = np.full(8 << 20, 0xFF, dtype=np.uint8)
    ref = device_checksum(b.tobytes())
    assert ref != 0
    assert device_checksum_torch(torch.from_numpy(b).to(device)) == ref


def test_other_dtypes_use_raw_bytes():
    x = torch.randn(3, 17, 64, dtype=torch.bfloat16)
    raw = x.view(torch.uint8).numpy().tobytes()
    assert device_checksum_torch(x) == device_checksum(raw)


def test_detects_flip_and_reorder():
    b = np.random.default_rng(1).integers(0, 256, 1 << 16, dtype=np.uint8)
    t = torch.from_numpy(b.copy())
    c0 = device_checksum_torch(t)
    t[12345] ^= 1
    assert device_checksum_torch(t) != c0
    w = torch.from_numpy(b.copy()).view(torch.int32)
    w[[10, 11]] = w[[11, 10]]
    if w[10] != w[11]:
        assert device_checksum_torch(w) != c0


def test_batched_rows_match_and_mismatch():
    rng = np.random.default_rng(7)
    rows = rng.integers(0, 256, (6, 4096 + 3 * 4096), dtype=np.uint8)
    t = torch.from_numpy(rows)
    want = [device_checksum(rows[i, 4096:].tobytes()) for i in range(6)]
    assert device_checksums_torch(t, 4096, 3 * 4096) == want
    # a small pass size exercises the multi-pass loop
    assert device_checksums_torch(t, 4096, 3 * 4096, max_words_per_pass=3072) == want
    bad = list(want)
    bad[2] ^= 1
    assert checksums_match(t, 4096, 3 * 4096, bad) == [True, True, False, True, True, True]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="contiguous"):
        device_checksum_torch(torch.zeros(4, 4, dtype=torch.uint8).t())
    with pytest.raises(ValueError, match="multiples of 4"):
        device_checksums_torch(torch.zeros(2, 64, dtype=torch.uint8), 2, 8)
    with pytest.raises(ValueError, match="exceeds row"):
        device_checksums_torch(torch.zeros(2, 64, dtype=torch.uint8), 32, 64)
    with pytest.raises(ValueError, match="2-D uint8"):
        device_checksums_torch(torch.zeros(64, dtype=torch.uint8), 0, 64)
