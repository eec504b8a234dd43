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
from tests.helpers.pools import g3_config  # noqa: E402
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
    them, the scheduler never offers them to B again, and A's frame, proven not B's, is dropped (counted under
    ``token_digest``) so that B's own KV can be stored at its next save. Before the fix B loaded A's KV."""
    kv = _engine("cpu", seed=61)
    bs = kv.layout.page_size
    a, b = colliding_prompts(bs, N)
    hs = sequence_hashes(a, bs)
    assert hs == sequence_hashes(b, bs) and len(hs) == N
    ns = Namespace(model="test/forged-hashes", revision="r1", layout=kv.layout, tp_world_size=1)
    g3 = G3Pool(g3_config(tmp_path / "g3", load_timeout_s=LOAD_S), ns) if tier == "G3" else None
    g4 = (G4Pool(G4Config(enabled=True, url=f"file://{tmp_path / 'g4'}", keyring={"path": str(tmp_path / "kr.json")}),
                 ns) if tier == "G4" else None)
    pool = g3 if g3 is not None else g4
    assert pool is not None
    w = WorkerSide(ns, 0, g3, g4, load_timeout_s=LOAD_S)
    try:
        w.register(kv)
        s = SchedulerSide(ns, bs, g3, g4)
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
        st = pool.stats()
        if tier == "G3":
            assert g3 is not None and st["corrupt_by_reason"].get("token_digest", 0) >= 1
            assert not g3.contains(ns.key(hs[0]))  # dropped: B's own block can be saved
        else:
            assert g4 is not None and st.get("corrupt_token_digest", 0) >= 1
            assert g4.store.get(g4.object_name(ns.key(hs[0]))) is None
    finally:
        w.shutdown()
        pool.close()
