"""A prompt whose blocks have another prompt's KVBM sequence hashes never loads that prompt's KV (docs/format.md
"Token digest", docs/invariants.md 1 and 5).

KVBM's sequence hash (our blocks' name in G3, G4 and KV events) is xxh3_64 with a public seed: two prompts of the
default tenant (no ``cache_salt``) with every sequence hash equal are written down without a search
(:func:`tests.model.test_token_digest.colliding_prompts`). Before 2026-12-01 the second prompt's lookup found the
first's blocks and its load served them: a client could plant KV for another client's prompt. Now the scheduler
sends each block's token digest with the load and save jobs, the frames carry it, and the readers serve a frame
only when the digests match.

Real parts: the CPU engine's tensors, the connector's scheduler and worker roles (their own save and load plans),
real G3 files and a ``file://`` G4 store with its keyring.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from kvbm_backend.config import G4Config  # noqa: E402
from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide  # noqa: E402
from kvbm_backend.integrations.vllm.worker_side import WorkerSide  # noqa: E402
from kvbm_backend.model.hashing import sequence_hashes, token_digests  # noqa: E402
from kvbm_backend.model.namespace import Namespace  # noqa: E402
from kvbm_backend.pool.g3 import G3Pool  # noqa: E402
from kvbm_backend.pool.g4.pool import G4Pool  # noqa: E402
from tests.helpers.pools import G4_TIMEOUT_S, LOOKUP_S, g3_config  # noqa: E402
from tests.integrations.vllm.test_connector_units import _Blocks, _step  # noqa: E402
from tests.integrations.vllm.test_failed_load_paths import HANG_S, _ask, _finish  # noqa: E402
from tests.integrations.vllm.test_worker_device_path import LOAD_S, _block_bytes, _engine  # noqa: E402
from tests.model.test_token_digest import colliding_prompts  # noqa: E402

N = 4  # full blocks of each prompt (plus one token)


def _req(rid: str, toks: list[int]) -> SimpleNamespace:
    """A request of the default tenant (no ``cache_salt``: the salt hash is 0, as for every such request)."""
    return SimpleNamespace(request_id=rid, prompt_token_ids=toks, all_token_ids=list(toks), cache_salt=None,
                           lora_request=None)


def _load(s: SchedulerSide, w: WorkerSide, req, dst: list[int]):
    """Offer ``req`` its hit, plan the load into engine blocks ``dst`` and run it on the worker:
    ``(tokens offered, invalid block ids, worker report)``."""
    offered = _ask(s, req)
    if not offered:
        return 0, set(), None
    s.update_state_after_alloc(req, _Blocks(dst[:offered // w.kv.layout.page_size]), offered)
    w.start_loads(s.build_connector_meta(_step()).loads)  # the step that starts the load
    errs, meta = _finish(w, req.request_id)
    return offered, errs, meta


@pytest.mark.parametrize("tier", ["G3", "G4"])
def test_a_prompt_with_another_prompts_sequence_hashes_never_loads_its_kv(tmp_path, tier):
    """Prompt A is computed and saved through the scheduler's save plan; a second request of A loads it (the
    digests match). Prompt B, whose every block has A's sequence hash, is offered A's blocks by the lookup (names
    match), but its load fails at the first block: no byte of A's KV reaches B's engine blocks, vLLM recomputes
    them, and the scheduler never offers them to B (nor to another request of prompt B) within the cool-down.
    Before 2026-12-01 B loaded A's KV.

    A's frame, a verified block of another token sequence, is KEPT (a miss counted ``other_digest``): A's next
    request, on the same scheduler and on a fresh one, is offered it and loads it byte for byte, and B's
    recomputed blocks saved under the same names do not replace it. Before 2026-12-01 the frame was dropped as
    ``token_digest`` (from G3 and the shared G4) and the scheduler cooled the block for every request of the
    tenant: a forged prompt sent every 30 s kept A's prefix at 0 % hits (review 2026-12-01, /tmp/rev-b)."""
    kv = _engine("cpu", seed=61)
    bs = kv.layout.page_size
    a, b = colliding_prompts(bs, N)
    hs = sequence_hashes(a, bs)
    assert hs == sequence_hashes(b, bs) and len(hs) == N
    ns = Namespace(model="test/forged-hashes", revision="r1", layout=kv.layout, tp_world_size=1)
    g3 = G3Pool(g3_config(tmp_path / "g3", load_timeout_s=LOAD_S), ns) if tier == "G3" else None
    g4 = (G4Pool(G4Config(enabled=True, url=f"file://{tmp_path / 'g4'}", keyring={"path": str(tmp_path / "kr.json")},
                          timeout_s=G4_TIMEOUT_S), ns) if tier == "G4" else None)
    pool = g3 if g3 is not None else g4
    assert pool is not None
    w = WorkerSide(ns, 0, g3, g4, load_timeout_s=LOAD_S)
    try:
        w.register(kv)
        s = SchedulerSide(ns, bs, g3, g4, lookup_timeout_s=LOOKUP_S)
        src = list(range(1, N + 2))
        ra = _req("A", a)
        assert _ask(s, ra) == 0
        s.update_state_after_alloc(ra, _Blocks(src), 0)
        meta = s.build_connector_meta(_step(new=[("A", src, 0)], sched={"A": len(a)}))
        (job,) = meta.saves
        assert job.block_ids == src[:N] and job.seq_hashes == hs and job.digests == bytes(token_digests(a, bs))
        w.save(meta.saves)
        assert w.flush_saves(HANG_S)
        pool.flush(timeout=HANG_S)
        a_kv = [_block_bytes(kv, i) for i in src[:N]]

        # the same prompt again: loaded, byte for byte
        offered, errs, _ = _load(s, w, _req("A2", a), list(range(8, 8 + N)))
        assert offered == N * bs and errs == set()
        assert all(torch.equal(_block_bytes(kv, 8 + i), a_kv[i]) for i in range(N))

        # B: A's names, other tokens
        dst = list(range(14, 14 + N))
        before = [_block_bytes(kv, i) for i in dst]
        rb = _req("B", b)
        offered, errs, report = _load(s, w, rb, dst)
        assert offered == N * bs  # the lookup knows names only: it finds A's blocks
        assert errs == set(dst)  # before: set(), and B's blocks held A's KV
        assert all(torch.equal(_block_bytes(kv, i), x) for i, x in zip(dst, before))  # not a byte of A's KV
        assert report is not None and [(f.first_failed, f.reason) for f in report.failed] == [(hs[0], "miss")]
        s.update_connector_output(report)
        assert s.get_num_new_matched_tokens(rb, 0) == (0, False)  # recomputed, never offered again
        assert _ask(s, _req("B2", b)) == 0  # nor to another request of prompt B within the cool-down
        st = pool.stats()
        if tier == "G3":
            assert g3 is not None and st["misses_by_reason"].get("other_digest", 0) >= 1
            assert st["corrupt_by_reason"].get("token_digest", 0) == 0
            assert g3.contains(ns.key(hs[0]))  # A's good block kept (before: dropped)
        else:
            assert g4 is not None and st.get("miss_other_digest", 0) >= 1 and st.get("corrupt_token_digest", 0) == 0
            assert g4.store.get(g4.object_name(ns.key(hs[0]))) is not None

        # B recomputed: its blocks saved under A's names (a fresh request: B's own is done) do not replace A's
        rb3, bsrc = _req("B3", b), list(range(19, 20 + N))
        assert _ask(s, rb3) == 0
        s.update_state_after_alloc(rb3, _Blocks(bsrc), 0)
        w.save(s.build_connector_meta(_step(new=[("B3", bsrc, 0)], sched={"B3": len(b)})).saves)
        assert w.flush_saves(HANG_S)
        pool.flush(timeout=HANG_S)

        # A's next request is offered A's blocks and loads them byte for byte, on this scheduler (the cool-down
        # was B's) and on a fresh one (another worker's, or after the cool-down)
        fresh = SchedulerSide(ns, bs, g3, g4, lookup_timeout_s=LOOKUP_S)
        for sched, rid, dst in ((s, "A3", list(range(8, 8 + N))), (fresh, "A4", src[:N])):
            for i in dst:
                kv.scatter(torch.zeros(kv.layout.bytes_per_block, dtype=torch.uint8), [i])
            offered, errs, _ = _load(sched, w, _req(rid, a), dst)
            assert offered == N * bs and errs == set(), rid  # before: 0 (cooled, and the block deleted)
            assert all(torch.equal(_block_bytes(kv, d), a_kv[i]) for i, d in enumerate(dst)), rid
    finally:
        w.shutdown()
        pool.close()
