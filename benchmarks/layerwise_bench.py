"""Layer-wise G3 loads overlapped with a prefill (issue 24 item 5): the same forward of a transformers Llama
over a prompt whose first ``hit_fraction`` is a G3 prefix hit, timed

* ``serial_s``: load then compute -- every layer of the hit loaded and verified (``G3Pool.layerwise_load``,
  the public entry point: the pool's reader threads, fds and staging), then the forward over the rest of the
  prompt;
* ``overlap_s``: layer-wise -- the load started, then the forward, whose decoder layer ``l`` first waits for
  layer ``l`` of the hit (a forward pre-hook calling ``wait_layer(l)``); payloads verified after the forward;
* ``load_s`` (the load alone) and ``compute_s`` (the forward with the prefix KV already resident),
* ``default_serial_s``: what runs with ``g3.layerwise_load`` off -- the whole hit through ``G3Pool.get`` into
  device staging (the whole-request device loader: kvikio on a GPU), scattered, then the forward
  (``default_load_s`` without the forward; ``overlap_vs_default = overlap_s / default_serial_s``: below 1
  only where turning layer-wise loads on pays),

(the overlapped run also gives ``first_layer_s``, start until ``wait_layer(0)`` returned, and ``finish_s``,
the ``finish()`` after the forward is done on the device: verification and release, the load's unoverlapped
tail), so ``overlap_s``
can be compared with ``max(load_s, compute_s)`` (``ideal_s``) and with ``serial_s``
(``ratio = overlap_s / serial_s``; ``ideal_ratio = ideal_s / serial_s``). Every timing is the best of
``repeats`` after a warm-up; the overlapped forward's last hidden state is compared with the resident
one (``max_abs_diff``, 0 when the loaded KV is the computed KV bit for bit).

The prefix KV is the model's own (a full forward's cache), packed into KVBM blocks
(FullyContiguous ``[layer, K/V, page, kv_heads * head_dim]``) and stored in a real G3 pool (on a CUDA
device with the device checksum, verified in HBM; on the CPU with xxh3). Shapes: on a GPU the
Llama-3.1-8B shape (random weights, bf16), on the CPU a tiny one (float32).

Needs torch, transformers and kvbm_backend only (no vLLM)::

    python benchmarks/layerwise_bench.py --smoke-cpu --out DIR      # CPU smoke: DIR/layerwise_bench.json
    python benchmarks/layerwise_bench.py --device cuda --out DIR

From another bench: ``bench_layerwise(res, "cuda")`` fills ``res["layerwise"]``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from kvbm_backend.config import G3Config
from kvbm_backend.integrations import load_priority
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.pool.g3.pool import G3Pool

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
                max_position_embeddings=131072)
TINY = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
            num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=8192)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _cache_kv(cache, layer: int):
    """The (keys, values) tensors a transformers cache holds for ``layer`` (v5 ``layers``, v4 lists)."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


class _Rig:
    """The model, the prompt, its prefix KV and a G3 pool holding it (for one hit size at a time)."""

    def __init__(self, device: str, shape: dict, tokens: int, page: int, workdir: Path, threads: int):
        from transformers import DynamicCache, LlamaConfig, LlamaModel
        self.DynamicCache = DynamicCache
        self.device = torch.device(device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        cfg = LlamaConfig(**shape, attn_implementation="sdpa")
        torch.manual_seed(0)
        old = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)  # built in the KV dtype (the 8B shape in fp32 would need 32 GB)
        try:
            with torch.device(self.device):
                self.model = LlamaModel(cfg).eval()
        finally:
            torch.set_default_dtype(old)
        self.L, self.kvh, self.hd = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        self.page, self.T = page, tokens
        self.ids = torch.randint(3, cfg.vocab_size, (1, tokens), device=self.device)
        with torch.no_grad():
            full = self.model(input_ids=self.ids, use_cache=True).past_key_values
        self.kv = [tuple(t.detach().clone() for t in _cache_kv(full, li)) for li in range(self.L)]  # [1, kvh, T, hd]
        self.layout = KvLayout(self.L, 2, page, self.kvh * self.hd, "bfloat16" if self.dtype == torch.bfloat16 else "float32")
        self.ns = Namespace("bench/layerwise", self.layout)
        self.workdir = workdir
        self.pool = G3Pool(G3Config(paths=[str(workdir / "g3")], capacity_gb=max(1.0, 2.2 * tokens * self.layout.bytes_per_token / 1e9),
                                    files_per_path=4, admission={"policy": "all"}, fsync=False, load_timeout_s=120,
                                    io_threads=threads), self.ns)
        self.stored = 0

    def store(self, nblocks: int) -> list:
        """Blocks ``[0, nblocks)`` of the prompt in G3 (stored once); their keys."""
        keys = self.ns.keys(list(range(1, nblocks + 1)), "bench", 0)
        if nblocks > self.stored:
            a, P = self.stored, nblocks * self.page
            per = []
            for k, v in self.kv:  # [1, kvh, T, hd] -> [nblk, 2, page, kvh, hd]
                kk = k[0, :, a * self.page:P].permute(1, 0, 2).reshape(nblocks - a, 1, self.page, self.kvh, self.hd)
                vv = v[0, :, a * self.page:P].permute(1, 0, 2).reshape(nblocks - a, 1, self.page, self.kvh, self.hd)
                per.append(torch.cat([kk, vv], 1))
            blocks = torch.stack(per, 1).contiguous().view(nblocks - a, -1).view(torch.uint8)  # [n, bpb]
            checks = None
            if self.device.type == "cuda":
                from kvbm_backend.gpu.checksum import device_checksums_torch
                checks = device_checksums_torch(blocks, 0, self.layout.bytes_per_block)
            host = [b.numpy() for b in blocks.cpu().unbind(0)]
            r = self.pool.put(keys[a:], host, dev_checks=checks).result(timeout=600)
            assert r.written == nblocks - a, r
            assert self.pool.flush(600)
            self.stored = nblocks
        return keys

    def cache(self, P: int, fill: bool):
        """A cache holding ``P`` prefix tokens per layer: the computed KV (``fill``) or placeholders."""
        c = self.DynamicCache()
        for li, (k, v) in enumerate(self.kv):
            if fill:
                c.update(k[:, :, :P].clone(), v[:, :, :P].clone(), li)
            else:
                c.update(torch.empty_like(k[:, :, :P]), torch.empty_like(v[:, :, :P]), li)
        return c

    def put_layer(self, cache, li: int, t: torch.Tensor, P: int) -> None:
        """Layer ``li`` as a load delivers it (``[n, layer_bytes]`` uint8) into the cache's prefix."""
        x = t.view(self.dtype).view(-1, 2, self.page, self.kvh, self.hd)  # [n, K/V, page, kvh, hd]
        ck, cv = _cache_kv(cache, li)
        ck[0].copy_(x[:, 0].reshape(P, self.kvh, self.hd).permute(1, 0, 2))
        cv[0].copy_(x[:, 1].reshape(P, self.kvh, self.hd).permute(1, 0, 2))

    def forward(self, cache, P: int, hooks=None):
        pos = torch.arange(P, self.T, device=self.device)
        handles = [self.model.layers[li].register_forward_pre_hook(h) for li, h in enumerate(hooks or [])]
        try:
            with torch.no_grad():
                out = self.model(input_ids=self.ids[:, P:], past_key_values=cache, cache_position=pos,
                                 position_ids=pos[None], use_cache=True)
        finally:
            for h in handles:
                h.remove()
        return out.last_hidden_state[:, -1]

    def load(self, keys):
        return self.pool.layerwise_load(keys, self.device, timeout_s=120)

    def close(self):
        self.pool.close()


def _best(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t, o = fn()
        if t < best:  # the best run's own outputs
            best, out = t, o
    return best, out


def _case(rig: _Rig, frac: float, repeats: int) -> dict:
    nblk = max(1, min(int(round(frac * rig.T / rig.page)), rig.T // rig.page - 1))
    P = nblk * rig.page
    keys = rig.store(nblk)
    dev = rig.device

    def compute():
        c = rig.cache(P, fill=True)
        _sync(dev)
        t0 = time.perf_counter()
        h = rig.forward(c, P)
        _sync(dev)
        return time.perf_counter() - t0, h

    def load_all(c=None):
        with load_priority.loading():  # as the connector's loads run (load_gil_switch_ms)
            ld = rig.load(keys)
            for li in range(rig.L):
                _, t = ld.wait_layer(li)
                if c is not None:
                    rig.put_layer(c, li, t, P)
            why = ld.finish()
        assert why == [None] * nblk, why
        return ld

    def default_serial(with_compute=True):
        """The default path (``g3.layerwise_load`` off): the whole hit through ``G3Pool.get`` into device
        staging (the whole-request device loader, what the connector runs), scattered, then the forward."""
        c = rig.cache(P, fill=False)
        stage = torch.empty((nblk, rig.layout.bytes_per_block), dtype=torch.uint8, device=dev)
        _sync(dev)
        t0 = time.perf_counter()
        with load_priority.loading():
            ok = rig.pool.get(keys, list(stage.unbind(0))).result(timeout=120).ok
        assert all(ok), ok
        for li in range(rig.L):
            rig.put_layer(c, li, stage.view(nblk, rig.L, -1)[:, li], P)
        h = rig.forward(c, P) if with_compute else None
        _sync(dev)
        return time.perf_counter() - t0, h

    def load_only():
        _sync(dev)
        t0 = time.perf_counter()
        load_all()
        _sync(dev)
        return time.perf_counter() - t0, None

    def serial():
        c = rig.cache(P, fill=False)
        _sync(dev)
        t0 = time.perf_counter()
        load_all(c)
        h = rig.forward(c, P)
        _sync(dev)
        return time.perf_counter() - t0, h

    def overlap():
        c = rig.cache(P, fill=False)
        _sync(dev)
        t0 = time.perf_counter()
        load_priority.hold()  # start_load_kv .. wait_for_save, as LayerwiseLoads holds it
        ld = rig.load(keys)
        first = []

        def hook_for(li):
            def hook(_mod, _args):
                _, t = ld.wait_layer(li)
                if li == 0:
                    first.append(time.perf_counter() - t0)
                rig.put_layer(c, li, t, P)
            return hook
        h = rig.forward(c, P, hooks=[hook_for(li) for li in range(rig.L)])
        _sync(dev)  # the forward is done: finish_s is finish's own tail, not the GPU still computing
        t1 = time.perf_counter()
        try:
            why = ld.finish()
        finally:
            load_priority.release()
        _sync(dev)
        t2 = time.perf_counter()
        assert why == [None] * nblk, why
        return t2 - t0, (h, first[0], t2 - t1)

    compute()  # warm-up (kernels, allocator)
    overlap()
    compute_s, h_ref = _best(compute, repeats)
    load_s, _ = _best(load_only, repeats)
    serial_s, h_ser = _best(serial, repeats)
    overlap_s, (h_ov, first_layer_s, finish_s) = _best(overlap, repeats)  # the best run's own parts
    default_serial(False)  # warm-up of the whole-request loader (its staging ring, the checksum kernel)
    default_load_s, _ = _best(lambda: default_serial(False), repeats)
    default_serial_s, h_def = _best(default_serial, repeats)
    ideal = max(load_s, compute_s)
    return {"hit_fraction": frac, "hit_tokens": P, "suffix_tokens": rig.T - P, "hit_blocks": nblk,
            "hit_bytes": nblk * rig.layout.bytes_per_block, "load_s": round(load_s, 6),
            "compute_s": round(compute_s, 6), "serial_s": round(serial_s, 6), "overlap_s": round(overlap_s, 6),
            "first_layer_s": round(first_layer_s, 6), "finish_s": round(finish_s, 6),
            "ideal_s": round(ideal, 6), "ratio": round(overlap_s / serial_s, 4),
            "ideal_ratio": round(ideal / serial_s, 4), "overlap_vs_ideal": round(overlap_s / ideal, 4),
            "load_gbps": round(nblk * rig.layout.bytes_per_block / load_s / 1e9, 3),
            "default_load_s": round(default_load_s, 6), "default_serial_s": round(default_serial_s, 6),
            "overlap_vs_default": round(overlap_s / default_serial_s, 4),
            "default_max_abs_diff": float((h_def.float() - h_ref.float()).abs().max()),
            "max_abs_diff": float((h_ov.float() - h_ref.float()).abs().max()),
            "serial_max_abs_diff": float((h_ser.float() - h_ref.float()).abs().max())}


def _free(path: str) -> int:
    """Bytes free under ``path`` (0 when it is not there)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def bench_layerwise(res: dict, device: str, hit_fractions=(0.25, 0.5, 0.75), *, tokens: int | None = None,
                    page: int = 16, repeats: int = 3, workdir: str | None = None, threads: int = 8,
                    shape: dict | None = None, switch_ms=None) -> dict:
    """Time load-then-compute vs layer-wise overlap for each hit fraction; fills and returns ``res["layerwise"]``.

    Args:
        res: the caller's result dict.
        device: ``cuda`` / ``cuda:N`` (Llama-3.1-8B shape, bf16) or ``cpu`` (tiny shape, float32).
        hit_fractions: fractions of the prompt served by G3 (rounded to whole blocks of ``page`` tokens).
        tokens: prompt length (default 8192 on a GPU, 512 on the CPU).
        page: tokens per KV block.
        repeats: timed runs per measurement (best kept), after one warm-up.
        workdir: where the G3 pool lives (default: a new directory under /dev/shm where it exists, else
            the system temp dir; removed afterwards).
        threads: reader threads.
        shape: LlamaConfig fields overriding the default shape.
        switch_ms: switch intervals (ms) the loads run under, as ``load_gil_switch_ms`` sets them (5: CPython's
            own; default: the setting's default only); each value's cases under ``by_switch_ms``.
    Returns ``{"device", "shape", "tokens", "page", "storage", "load_gil_switch_ms", "cases": [per hit
    fraction: seconds, ratios, at the setting's default], "by_switch_ms"}``.
    """
    from kvbm_backend.config import KvbmBackendConfig
    default_ms = KvbmBackendConfig().load_gil_switch_ms
    dev = torch.device(device)
    shp = dict(shape or (LLAMA_8B if dev.type == "cuda" else TINY))
    tokens = tokens or (8192 if dev.type == "cuda" else 512)
    need = 3 * tokens * 2 * shp["num_hidden_layers"] * shp["num_key_value_heads"] * shp["head_dim"] * 2 * 2
    base = workdir or (_shm if _free(_shm := "/dev/shm") > need else None)  # tmpfs where it is big enough
    root = Path(tempfile.mkdtemp(prefix="kvbm-layerwise-", dir=base))
    out = {"device": str(dev) if dev.type != "cuda" else torch.cuda.get_device_name(dev), "shape": shp,
           "tokens": tokens, "page": page, "storage": str(root), "repeats": repeats, "threads": threads,
           "load_gil_switch_ms": default_ms, "cases": [], "by_switch_ms": {}}
    t0 = time.perf_counter()
    rig = _Rig(device, shp, tokens, page, root, threads)
    old = sys.getswitchinterval()
    try:
        for ms in (switch_ms or (default_ms,)):
            sys.setswitchinterval(0.005)  # CPython's own; the loads shorten it to ms (never lengthen it)
            load_priority.configure(ms)
            cases = [_case(rig, f, repeats) for f in hit_fractions]
            out["by_switch_ms"][f"{ms:g}"] = cases
            if ms == default_ms or not out["cases"]:
                out["cases"] = cases
    finally:
        sys.setswitchinterval(old)
        load_priority.configure(default_ms)
        rig.close()
        shutil.rmtree(root, ignore_errors=True)
    out["wall_s"] = round(time.perf_counter() - t0, 3)
    res["layerwise"] = out
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke-cpu", action="store_true", help="tiny model on the CPU, 2 repeats")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--switch-ms", default=None,
                    help="comma-separated switch intervals (ms) to run the loads under, e.g. 5,0.5 (default: "
                         "load_gil_switch_ms's default)")
    ap.add_argument("--out", required=True, help="directory for layerwise_bench.json")
    a = ap.parse_args(argv)
    device = "cpu" if a.smoke_cpu else (a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    res: dict = {}
    bench_layerwise(res, device, tokens=a.tokens, repeats=a.repeats or (2 if a.smoke_cpu else 3),
                    workdir=a.workdir, threads=a.threads,
                    switch_ms=tuple(float(x) for x in a.switch_ms.split(",")) if a.switch_ms else None)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "layerwise_bench.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    for ms, cases in res["layerwise"]["by_switch_ms"].items():
        for c in cases:
            print(f"switch {ms} ms: hit {c['hit_fraction']:.2f} ({c['hit_tokens']} tok): load {c['load_s']*1e3:.1f} "
                  f"ms, compute {c['compute_s']*1e3:.1f} ms, serial {c['serial_s']*1e3:.1f} ms, overlap "
                  f"{c['overlap_s']*1e3:.1f} ms (ratio {c['ratio']:.2f}, ideal {c['ideal_ratio']:.2f}), default path "
                  f"{c['default_serial_s']*1e3:.1f} ms (load {c['default_load_s']*1e3:.1f} ms), max_abs_diff "
                  f"{c['max_abs_diff']}")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
