"""The scheduler's failed-load cool-down per ``(tenant, sequence hash)`` cools only requests whose own token digest
of the block is a failed request's (:class:`~kvbm_backend.integrations.vllm.failed_blocks.FailedBlocks`): the
sequence hash is forgeable (docs/format.md "Token digest"), and before 2026-12-01 a tenant-mate's forged prompt,
failing on the victim's stored block, cooled it for every request of the tenant for 30 s. Pure units (the
connector-level proof: tests/integrations/vllm/test_forged_hashes.py)."""
from __future__ import annotations

from types import SimpleNamespace

from kvbm_backend.integrations.vllm.failed_blocks import FAILED_DIGESTS_MAX, FailedBlocks
from kvbm_backend.model.hashing import sequence_hashes, token_digests
from tests.model.test_token_digest import colliding_prompts

D1, D2, D3 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16
HS = [10, 11, 12, 13]


def _asker(digest: bytes | None):
    """``digest_of`` of a request whose every block has ``digest``, and the block indexes it was asked for."""
    asked: list[int] = []

    def of(i: int) -> bytes | None:
        asked.append(i)
        return digest
    return of, asked


def test_a_digest_entry_cools_only_requests_with_that_digest_and_asks_lazily():
    fb = FailedBlocks(cooldown_s=60)
    fb.add("t", 12, D1)
    of1, asked = _asker(D1)
    assert fb.first_in("t", HS, 0, 4, of1) == 2 and asked == [2]  # only the cooling block's digest is computed
    of2, asked = _asker(D2)
    assert fb.first_in("t", HS, 0, 4, of2) == 4 and asked == [2]  # another digest: not cooled (before: 2)
    assert fb.first_in("t", HS, 0, 4) == 2  # an asker that cannot tell its digest: cooled
    assert fb.first_in("t", HS, 0, 4, _asker(None)[0]) == 2
    assert fb.first_in("u", HS, 0, 4) == 4  # another tenant
    fb.add("t", 12, D2)  # a second failed digest: both cool, a third does not
    assert fb.first_in("t", HS, 0, 4, _asker(D1)[0]) == 2 and fb.first_in("t", HS, 0, 4, _asker(D2)[0]) == 2
    assert fb.first_in("t", HS, 0, 4, _asker(D3)[0]) == 4


def test_an_entry_without_a_digest_cools_every_request_and_stays_so():
    fb = FailedBlocks(cooldown_s=60)
    fb.add("t", 11)
    assert fb.first_in("t", HS, 0, 4, _asker(D2)[0]) == 1
    fb.add("t", 11, D1)  # a digest named later does not narrow it
    assert fb.first_in("t", HS, 0, 4, _asker(D2)[0]) == 1
    fb.add("t", 13, D1)
    fb.add("t", 13)  # nor does an earlier one narrow a digest-less failure
    assert fb.first_in("t", HS, 3, 4, _asker(D2)[0]) == 3


def test_cycling_digests_never_widens_an_entry_to_every_request():
    fb = FailedBlocks(cooldown_s=60)
    for i in range(FAILED_DIGESTS_MAX + 10):
        fb.add("t", 10, i.to_bytes(16, "little"))
    victim = b"\xff" * 16
    assert fb.first_in("t", HS, 0, 4, _asker(victim)[0]) == 4
    newest = (FAILED_DIGESTS_MAX + 9).to_bytes(16, "little")
    assert fb.first_in("t", HS, 0, 4, _asker(newest)[0]) == 0
    assert fb.first_in("t", HS, 0, 4, _asker((0).to_bytes(16, "little"))[0]) == 4  # the oldest forgotten


def test_expiry_forgets_the_digests_too():
    fb = FailedBlocks(cooldown_s=0.0)
    fb.add("t", 10, D1)
    assert fb.first_in("t", HS, 0, 4, _asker(D1)[0]) == 4 and len(fb) == 0 and not fb._digests


def test_add_failed_load_takes_the_failed_requests_own_digest():
    """Real colliding prompts (equal sequence hashes, other tokens): the forger's failure at block 0 cools the
    forger's prompt, not the victim's; a request gone (no state) or of another tenant cools every request."""
    bs, n = 16, 3
    a, b = colliding_prompts(bs, n)
    hs = sequence_hashes(a, bs)
    assert hs == sequence_hashes(b, bs)

    def st(toks):
        return SimpleNamespace(tenant="", hashes=hs, n_local=0, digests=bytearray(),
                               request=SimpleNamespace(all_token_ids=toks, cache_salt=None, lora_request=None))

    fb = FailedBlocks(cooldown_s=60)
    forger = st(b)
    fb.add_failed_load("", forger, hs[0], bs)
    assert forger.digests[:16] == token_digests(b, bs)[:16]
    assert fb.first_for(st(a), n, bs) == n  # the victim's prompt: offered (before: 0)
    assert fb.first_for(st(b), n, bs) == 0  # the forger's prompt: cooled
    fb.add_failed_load("", None, hs[1], bs)  # the failed request is gone: every request cools at block 1
    assert fb.first_for(st(a), n, bs) == 1
    fb.add_failed_load("other", st(b), hs[2], bs)  # a report of another tenant than the state's: no digest
    assert fb.first_in("other", hs, 0, n, lambda i: b"\x00" * 16) == 2
