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
@pytest.mark.parametrize("nbytes", [8 << 20, (2 * CHUNK_WORDS + 777) * 4, 777 * 4], ids=["chunks", "tail", "short"])
def test_equals_reference_worst_case_overflow(device, nbytes):
    # all-ones words times large indices: every intermediate a naive int64 version would overflow; with a tail
    # shorter than a chunk (its own chunk) and a payload shorter than one chunk
    b = np.full(nbytes, 0xFF, dtype=np.uint8)
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


_INTERPRET_CHECK = r"""
import numpy as np, torch
from kvbm_backend.gpu import checksum_triton as ct
from kvbm_backend.gpu.checksum import _combine
from kvbm_backend.model.frame import device_checksum
assert ct.IMPORT_ERROR is None, ct.IMPORT_ERROR
rng = np.random.default_rng(3)
cases = [(3, 3 * ct.BLOCK_WORDS * 4 + 8, 4), (2, ct.BLOCK_WORDS * 4, 0), (1, 12, 8), (2, 2 * 1024 * 1024, 4096)]
for n, plen, off in cases:
    b = rng.integers(0, 256, (n, off + plen + 4), dtype=np.uint8)
    b[0, off:off + 64] = 255  # the largest words: the int64 sums must not overflow
    w = torch.from_numpy(b)[:, off:off + plen].view(torch.int32)
    got = [_combine(*s) for s in ct.limb_sums(w).tolist()]
    assert got == [device_checksum(b[i, off:off + plen].tobytes()) for i in range(n)], (n, plen, off)
print("ok")
"""


def test_fused_triton_kernel_matches_the_reference_in_the_interpreter():
    """The Triton kernel's arithmetic, run by Triton's CPU interpreter (the same kernel source the GPU
    compiles), equals ``frame.device_checksum`` - incl. payloads that are not whole programs and the
    largest word values."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _INTERPRET_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


@pytest.mark.skipif(not _cuda_ok(), reason="no CUDA device: the compiled Triton kernel cannot run here")
def test_fused_kernel_is_verified_and_used_on_cuda():
    """On a CUDA device the fused kernel passes its self-check (against the torch ops) and gives the
    reference checksums for frames in a loader-like staging layout (4 KiB header + 2 MiB payload)."""
    pytest.importorskip("triton")
    from kvbm_backend.gpu import checksum_triton
    rng = np.random.default_rng(11)
    rows = rng.integers(0, 256, (5, 4096 + (2 << 20)), dtype=np.uint8)
    t = torch.from_numpy(rows).cuda()
    want = [device_checksum(rows[i, 4096:].tobytes()) for i in range(5)]
    assert device_checksums_torch(t, 4096, 2 << 20) == want
    assert checksum_triton.usable(t.device, None) == (True, "triton kernel verified")
    assert device_checksums_torch(t, 4096, 2 << 20, fused=False) == want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layers,layer_bytes,rows", [(6, 8192, 3), (5, 4 * 7, 2), (3, CHUNK_WORDS * 4 + 12, 2),
                                                     (32, 4096, 4), (1, 4, 1)])
def test_partial_range_sums_combine_into_the_whole_payload_checksum(device, layers, layer_bytes, rows):
    """checksum_partial: the device checksum of a payload from per-range sums (a layer-wise load's groups,
    verified as they land): ``sum(S1 + base * S0)`` over the ranges equals frame.device_checksum of the
    whole payload, worst-case words included, and a flipped byte in any range changes it."""
    from kvbm_backend.gpu.checksum_partial import combine, range_sums
    rng = np.random.default_rng(layers * layer_bytes)
    pay = rng.integers(0, 256, (rows, layers * layer_bytes), dtype=np.uint8)
    pay[0] = 0xFF  # every intermediate at its largest
    lay = np.ascontiguousarray(pay.reshape(rows, layers, layer_bytes).transpose(1, 0, 2))  # layer-major
    t = torch.from_numpy(lay).to(device).reshape(layers * rows, layer_bytes)
    sums = range_sums(t).view(layers, rows, 5).cpu().numpy()
    got = combine(sums, np.arange(layers) * (layer_bytes // 4))
    assert [int(x) for x in got] == [device_checksum(p.tobytes()) for p in pay]
    lay[layers - 1, rows - 1, layer_bytes // 2] ^= 1
    t2 = torch.from_numpy(lay).to(device).reshape(layers * rows, layer_bytes)
    got2 = combine(range_sums(t2).view(layers, rows, 5).cpu().numpy(), np.arange(layers) * (layer_bytes // 4))
    assert int(got2[rows - 1]) != int(got[rows - 1]) and [int(x) for x in got2[:-1]] == [int(x) for x in got[:-1]]


def test_partial_range_sums_name_bad_input():
    from kvbm_backend.gpu.checksum_partial import range_sums
    with pytest.raises(ValueError, match="2-D uint8"):
        range_sums(torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="whole aligned u32 words"):
        range_sums(torch.zeros((2, 6), dtype=torch.uint8))
