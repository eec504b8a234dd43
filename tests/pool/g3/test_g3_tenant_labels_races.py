"""Tenant labels (862f503) under a concurrent first sighting and a pool's close: a tenant's label is in its file
before any of its blocks is handed to G3, and a closed pool leaves no label WARNING budget behind (review, 2026-12-03)."""
from __future__ import annotations

import os
import threading

from kvbm_backend.integrations.revoked_tenants import RevokedTenants
from kvbm_backend.pool.g3 import tenant_labels as tl
from kvbm_backend.pool.g3.index import tag_of
from tests.helpers.crash_writer import NS, open_pool, payload
from tests.helpers.g3_restart import CFG, HANG_S
from tests.pool.g3.test_g3_tenant_labels import A, NEVER_S, _keyring, _on_disk


def test_a_concurrent_first_save_is_handed_to_g3_before_the_tenants_label_is_written(tmp_path):
    """862f503 promises 'a label is in its file before the blocks it names are journaled' (put_g3 writes it first)
    and moved ``_sight``'s ``self._ps[tenant] = ps`` before the labels are noted. A second thread's put_g3 of the same
    new tenant (a hybrid model: each KV group's Offloads thread hands its first save; or the worker's load path
    sighting it) that runs while the first is between the two sees the tenant in ``_ps``, skips ``_sight``, and
    ``_label_before_put`` finds nothing unsynced (the label is not noted yet): its blocks go to G3 with no label on
    disk. Here thread 1's ``note`` is held at its start; thread 2's put finds the file empty at hand-off."""
    kr = _keyring(tmp_path)
    try:
        kr.create(A)
        keys = NS.keys(range(1, 5), A)
        with open_pool(tmp_path / "g3", **CFG) as pool:
            gate = RevokedTenants(kr, [pool], interval_s=NEVER_S, start=False)
            try:
                lb = tl.labels_of(pool)
                real_note, inside, go = lb.note, threading.Event(), threading.Event()
                first = []

                def held_note(tag, label):
                    if not first:
                        first.append(threading.current_thread())
                        inside.set()
                        go.wait(HANG_S)
                    return real_note(tag, label)
                lb.note = held_note  # type: ignore[method-assign]
                t1 = threading.Thread(target=gate.refused, args=(A,))  # first sighting (another thread)
                t1.start()
                assert inside.wait(HANG_S)
                on_disk: list[dict] = []

                def put():
                    on_disk.append(_on_disk(lb.path))
                    return pool.put(keys, [payload(k.seq_hash) for k in keys])
                try:
                    f = gate.put_g3(A, put, len(keys))
                finally:
                    go.set()
                    t1.join(HANG_S)
                assert f is not None and f.result(timeout=HANG_S).written == 4
                assert on_disk == [{tag_of(A): kr.pseudonym(A)}], f"blocks handed to G3 with the file holding {on_disk}"
            finally:
                gate.close()
    finally:
        kr.close()


def test_a_closed_pool_leaves_no_tenant_label_warning_budget_behind(tmp_path):
    """0686707's rule (log_limits.forget, G3Pool.close): a closed pool keeps no WARNING budget in any limiter. 862f503
    gave the tenant labels a LimitedLog whose kinds name the labels file (``tenant-labels-write <path>``, ``-read``,
    ``-full``) and forgets them only when a TenantLabels opens at that path, never at close: each closed pool whose
    labels logged leaves its kinds for the process's life."""
    with open_pool(tmp_path / "g3", **CFG) as pool:
        lb = tl.labels_of(pool)
        path = lb.path
        os.mkdir(path)  # the write fails: one WARNING, its kind held
        assert lb.note(tag_of("a"), b"1" * 16) and not lb.persist()
        assert any(k.endswith(" " + path) for k in tl._limited.kinds())
        os.rmdir(path)
    held = [k for k in tl._limited.kinds() if k.endswith(" " + path)]
    assert not held, f"kinds of a closed pool kept: {held}"
