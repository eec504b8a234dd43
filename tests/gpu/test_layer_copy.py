"""One kernel launch per block move between staging and the engine's per-layer KV (:mod:`kvbm_backend.gpu.layer_copy`,
:meth:`EngineKv.gather` / :meth:`EngineKv.scatter`).

The kernel source the GPU compiles runs here in Triton's CPU interpreter (``TRITON_INTERPRET=1``, a child
process), through ``EngineKv`` as the connector calls it, against the per-layer torch ops; on a CUDA device
the compiled kernel is checked the same way (skips here).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from kvbm_backend.integrations.vllm.kv_io import EngineKv

_INTERPRETED = r'''
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from kvbm_backend.gpu import layer_copy
from kvbm_backend.integrations.vllm.kv_io import EngineKv

NB, BS, H, D, MD, L = __GEOMETRY__  # MD: the MLA latent dim
DEV = __DEVICE__
# pieces (a layer's K or V, or its whole MLA / block_first layer) longer than one program's BLOCK_WORDS, ending
# in a partial program: the kernel's programs c > 0 and its tail mask run
LONG = __LONG__


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)  # any bytes: NaN payloads included
    if dtype != torch.uint8:
        t = t.view(dtype)
    return t.to(DEV)


def engine(lay, seed, dtype=torch.bfloat16):
    e = 2 if dtype == torch.bfloat16 else 1
    if lay == "mla":
        return EngineKv.from_tensors([rand((NB, 1, BS, MD * e), dtype, seed + i) for i in range(L)], NB, BS, 1, MD,
                                     mla=True)
    if lay == "mla3":
        return EngineKv.from_tensors([rand((NB, BS, MD * e), dtype, seed + i) for i in range(L)], NB, BS, 1, MD,
                                     mla=True)
    if lay == "LBNHC":  # vLLM 0.32's GPU default (NHD): physically [nb, N, H, 2D], logically [nb, H, N, 2D]
        return EngineKv.from_tensors([rand((NB, BS, H, 2 * D * e), dtype, seed + i).permute(0, 2, 1, 3)
                                      for i in range(L)], NB, BS, H, D, packed=True)
    if lay == "LBHNC":  # HND: physically as logically
        return EngineKv.from_tensors([rand((NB, H, BS, 2 * D * e), dtype, seed + i) for i in range(L)], NB, BS, H, D,
                                     packed=True)
    if lay == "BLNHC":  # block-major: one [nb, L, N, H, 2D] buffer, a layer is a strided slice
        buf = rand((NB, L, BS, H, 2 * D * e), dtype, seed)
        return EngineKv.from_tensors([buf[:, i].permute(0, 2, 1, 3) for i in range(L)], NB, BS, H, D, packed=True)
    if lay == "cpu":  # vLLM's CPU backend: [nb, H, N, 2D] read as [nb, H, 2, N, D]
        return EngineKv.from_tensors([rand((NB, H, BS, 2 * D * e), dtype, seed + i) for i in range(L)], NB, BS, H, D,
                                     packed=False)
    if lay == "kv_first_nc":  # kv_first with tokens and heads transposed in memory: not contiguous
        return EngineKv.from_tensors([rand((2, NB, H, BS, D * e), dtype, seed + i).transpose(2, 3) for i in range(L)],
                                     NB, BS, H, D)
    shape = (2, NB, BS, H, D * e) if lay == "kv_first" else (NB, 2, BS, H, D * e)
    return EngineKv.from_tensors([rand(shape, dtype, seed + i) for i in range(L)], NB, BS, H, D)


def same(a, b):
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a.tensors, b.tensors))


for lay, dtype in [("kv_first", torch.bfloat16), ("block_first", torch.bfloat16), ("mla", torch.bfloat16),
                   ("mla3", torch.bfloat16), ("kv_first", torch.float8_e4m3fn), ("LBNHC", torch.bfloat16),
                   ("LBHNC", torch.bfloat16), ("BLNHC", torch.bfloat16), ("LBNHC", torch.float8_e4m3fn),
                   ("cpu", torch.bfloat16), ("kv_first_nc", torch.bfloat16)]:
    kv, ref = engine(lay, 1, dtype), engine(lay, 1, dtype)
    assert kv.move_mode == "triton kernel verified", (lay, kv.move_mode)
    bpb = kv.layout.bytes_per_block
    words = layer_copy.plan([tv for tv, _ in kv._targets()], kv._dims, bpb)[0].piece // 4
    assert (words > layer_copy.BLOCK_WORDS and words % layer_copy.BLOCK_WORDS > 0) == LONG, (lay, words)
    ids = [7, 2, 9, 0]
    got, want = torch.zeros(4 * bpb, dtype=torch.uint8, device=DEV), torch.zeros(4 * bpb, dtype=torch.uint8, device=DEV)
    with Ops() as ops:
        kv.gather(ids, got)
        src = rand((4 * bpb,), torch.uint8, 99)
        kv.scatter(src, [1, 5, 3, 8])
    assert not any("index_select" in n or "index_copy" in n for n in ops.names), (lay, ops.names)
    ref._torch_gather(ids, want)
    assert torch.equal(got, want), lay
    ref._torch_scatter(src, [1, 5, 3, 8])
    assert same(kv, ref), lay
    # a 2-D [n, bytes] staging (the worker's) and a slice of a longer one
    big = rand((6 * bpb,), torch.uint8, 7)
    kv.scatter(big[bpb:3 * bpb].view(2, bpb), [4, 6])
    ref._torch_scatter(big[bpb:3 * bpb].view(2, bpb), [4, 6])
    assert same(kv, ref), lay
    # an id outside the engine's blocks: IndexError, as index_copy_ raises, and nothing written
    try:
        kv.scatter(src, [1, 5, 3, NB])
        raise AssertionError("no IndexError")
    except IndexError as e:
        assert str(NB) in str(e)
    assert same(kv, ref), lay
    # layer-wise: one layer of each block, rows strided as in a group's staging (3 layers per row here),
    # ids as a list or as an index made once
    lb = bpb // L
    grp = rand((3, 3 * lb), torch.uint8, 13)
    ref.__dict__["_mover_state"] = (None, "forced: the torch ops")
    for li in range(L):
        with Ops() as ops:
            kv.scatter_layer(li, grp[:, li * lb:(li + 1) * lb], [6, 1, 4] if li % 2 else kv.block_index([6, 1, 4]))
        assert not any("index_copy" in n for n in ops.names), (lay, ops.names)
        ref.scatter_layer(li, grp[:, li * lb:(li + 1) * lb], [6, 1, 4])
    assert same(kv, ref), lay
    try:
        kv.scatter_layer(0, grp[:, :lb], [6, 1, NB])
        raise AssertionError("no IndexError")
    except IndexError:
        pass
    # an index tensor is not checked on the host: the kernel writes nothing for an id out of range
    kv.scatter_layer(0, grp[:2, 2 * lb:3 * lb], kv.block_index([2, NB + 5]))
    ref.scatter_layer(0, grp[:1, 2 * lb:3 * lb], [2])
    assert same(kv, ref), lay

# where the kernel is not used, the reason
strided = [rand((2, NB, BS, H, 4 * D), torch.bfloat16, i)[..., ::2] for i in range(L)]  # head_dim every other element
assert "head_dim is not contiguous" in EngineKv.from_tensors(strided, NB, BS, H, D).move_mode
mixed = engine("LBNHC", 3).tensors[:-1] + engine("LBHNC", 3).tensors[-1:]  # one layer in another stride order
assert "differ in strides" in EngineKv.from_tensors(mixed, NB, BS, H, D, packed=True).move_mode

# the check catches a kernel that writes the wrong place: the torch ops run, and their result is right
import dataclasses
real = layer_copy.plan
def wrong(tensors, lay, bpb):  # V pieces one word off
    p, why = real(tensors, lay, bpb)
    return (dataclasses.replace(p, piece_stride=p.piece_stride + 4) if p else None), why
layer_copy.plan = wrong
kv, ref = engine("kv_first", 5), engine("kv_first", 5)
assert kv.move_mode == "triton kernel wrote engine blocks that differ from the torch ops", kv.move_mode
src = rand((2 * kv.layout.bytes_per_block,), torch.uint8, 11)
kv.scatter(src, [2, 6])
ref._torch_scatter(src, [2, 6])
assert same(kv, ref)
layer_copy.plan = real
print("ok")
'''


#: (engine blocks, block size, heads, head dim, MLA latent dim, layers): pieces of 32-192 bytes, all in one
#: program of the kernel
SHORT = (10, 4, 2, 8, 24, 3)
#: pieces of 2304-4608 words (BLOCK_WORDS = 1024 per program): several programs per piece, the last one partial
#: (kv_first bf16 2304 words, FP8 1152, block_first 4608, MLA 576-dim 4608; Llama-like head dim 72, block size 16)
LONG = (10, 16, 4, 72, 576, 2)


def _run_checks(device: str, geometry: tuple[int, ...] = SHORT) -> None:
    """The checks in a child: on ``"cpu"`` under Triton's interpreter, on ``"cuda"`` compiled."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1" if device == "cpu" else "0",
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    code = (_INTERPRETED.replace("__DEVICE__", repr(device)).replace("__GEOMETRY__", repr(geometry))
            .replace("__LONG__", repr(geometry == LONG)))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_one_launch_moves_equal_the_torch_ops_in_the_triton_interpreter():
    """kv_first, block_first, both MLA shapes, FP8, vLLM 0.32's packed GPU caches in the stride orders vLLM
    allocates (NHD/LBNHC, HND/LBHNC, block-major BLNHC slices; bf16 and FP8), vLLM's CPU layout and a
    non-contiguous kv_first: gather and scatter through ``EngineKv`` run the kernel (no ``index_select`` /
    ``index_copy_`` dispatched) and give the torch ops' bytes; an id out of range raises IndexError and writes
    nothing; a head_dim that is not contiguous and layers in different stride orders say why the torch ops run;
    a kernel that writes the wrong place fails the check and the torch ops run instead."""
    _run_checks("cpu")


@pytest.mark.slow  # ~30 s on the 2-core VM (the interpreter runs every program in Python)
@pytest.mark.side  # no wall-clock assertion: beside the engine lane, not on its critical path
def test_pieces_longer_than_one_program_move_exactly_in_the_triton_interpreter():
    """The same checks with pieces of several programs each, the last one partial (head dim 72, block size
    16, and a 576-dim MLA latent): the kernel's programs ``c > 0`` and its tail mask run here, not only on
    a GPU; a program that skipped its offset or dropped the tail would fail ``check`` (the torch ops would
    run, ``move_mode`` says so) and this test."""
    _run_checks("cpu", LONG)


def test_a_cpu_engine_moves_with_the_torch_ops_and_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter would run the kernel on the CPU
    t = [torch.zeros(2, 4, 2, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    kv = EngineKv.from_tensors(t, 4, 2, 2, 8)
    assert "runs on CUDA" in kv.move_mode or "triton unavailable" in kv.move_mode, kv.move_mode


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")
def test_gpu_one_launch_moves_equal_the_torch_ops():
    """The compiled kernel on the device: the same checks as in the interpreter, short and long pieces."""
    _run_checks("cuda")
    _run_checks("cuda", LONG)
