"""The TP ranks' agreement under vLLM's ``external_launcher`` with TP > 1 (torchrun-style SPMD: every TP rank its own
process hosting a scheduler and that rank's worker; vLLM's ``ExecutorWithExternalLauncher`` runs one worker and
aggregates nothing). vLLM assumes every rank's scheduler makes the same decisions; ranks that decide differently run
different batches, and the engine's collectives hang or compute wrong outputs. Each process's scheduler sees only its
own worker's output and asks its own pools with its own clock, so whatever of the connector feeds a scheduling decision
is agreed over vLLM's TP group (its CPU process group; binary records, never pickles) at a point every rank reaches in
the same step, in the same order:

* :class:`TpLoadAgree` (worker role, at ``get_transfer_results``, once per ``execute_model``): a request's load is
  finished (``finished_recving``) only once every rank finished it (the ids not finished everywhere yet are carried
  to later steps); ``failed_recving``, the failed blocks (``get_block_ids_with_load_errors``) and the failed loads
  (:class:`~.metadata.FailedLoad`, in the worker's step report) are every rank's, as vLLM's ``KVOutputAggregator``
  combines them for the other executors;
* :class:`TpMatchAgree` (scheduler role, at ``get_num_new_matched_tokens``, which every rank's scheduler calls for
  the same requests in the same order): the tokens to load are the fewest any rank found (G4 lookups answered in
  time, hand-off waits, the revoked tenants' reloads run on each process's clock), and "ask again" (None) when any
  rank has no answer yet. ``update_state_after_alloc`` then plans only that many on every rank (vLLM passes it).

The same load-result gather carries each rank's save staging room (:func:`.offloads.staging_rooms`): every rank
stages the next step's saves within the least room any rank had, so every rank keeps and drops the same blocks
(:func:`.offloads.set_staging_budgets`). The save plans, and the lookup counters of the agreed matches, are agreed
by the scheduler side itself (:mod:`.tp_sched`). The G3 reports of the ranks are exchanged by
:class:`~.report_channel.TpReportExchange`. A failed exchange (a rank
gone), or results this rank cannot encode, raises RuntimeError naming what was exchanged: going on would let the
ranks' decisions differ.
"""
from __future__ import annotations

import struct
from typing import Any

from .metadata import FailedLoad, KvbmWorkerMeta

_MAGIC = b"kvL1"
_HEAD = struct.Struct("<4sIIII")  # magic, finished ids, failed ids, failed block ids, failed loads
_U32, _I32, _Q, _LOAD = struct.Struct("<I"), struct.Struct("<i"), struct.Struct("<Q"), struct.Struct("<IQ")
_U64 = 2**64 - 1


def tp_group(why: str) -> Any:
    """vLLM's TP group (``GroupCoordinator``) of this process. Raises RuntimeError naming ``why`` when the process
    has none (vLLM's model-parallel state is not set up)."""
    from vllm.distributed.parallel_state import get_tp_group
    try:
        return get_tp_group()
    except Exception as e:  # noqa: BLE001 - vLLM's assertion when the model-parallel state is not set up
        raise RuntimeError("kvbm_backend: distributed_executor_backend 'external_launcher' with TP > 1 needs vLLM's "
                           f"TP group {why}: {e}") from e


def all_gather_bytes(group: Any, blob: bytes, what: str) -> list[bytes]:
    """Every TP rank's ``blob``, in rank order, gathered over ``group``'s CPU process group (two collectives: the
    sizes, then the bytes padded to the largest). Raises RuntimeError naming ``what`` when a collective fails."""
    import torch
    import torch.distributed as dist
    world, cpu = int(group.world_size), group.cpu_group
    try:
        heads = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(heads, torch.tensor([len(blob)], dtype=torch.int64), group=cpu)
        sizes = [int(h[0]) for h in heads]
        if not max(sizes):
            return [b""] * world
        mine = torch.zeros(max(sizes), dtype=torch.uint8)
        if blob:
            mine[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        bufs = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(bufs, mine, group=cpu)
    except Exception as e:  # noqa: BLE001 - torch.distributed's errors vary by backend
        raise RuntimeError(f"kvbm_backend: {what} of the TP ranks (vLLM external_launcher, TP={world}) could not be "
                           f"exchanged over the TP group: {e}") from e
    return [bytes(b[:n].numpy()) for b, n in zip(bufs, sizes)]


def _str(s: str | bytes | None) -> bytes:
    b = s if isinstance(s, bytes) else (s or "").encode("utf-8")
    return _I32.pack(-1 if s is None else len(b)) + b


def encode_loads(done: set[str], failed: set[str], errors: set[int], loads: list[tuple[int, FailedLoad]]) -> bytes:
    """One rank's load results of a step as bytes (:func:`decode_loads`): finished and failed request ids, failed
    engine block ids, and ``(KV cache group, FailedLoad)`` pairs. Sets are written sorted (every rank decodes the
    same bytes alike)."""
    out = [_HEAD.pack(_MAGIC, len(done), len(failed), len(errors), len(loads))]
    out += [_str(r) for r in sorted(done)] + [_str(r) for r in sorted(failed)]
    out += [_Q.pack(int(b)) for b in sorted(errors)]
    for g, f in loads:
        out += [_LOAD.pack(int(g), int(f.first_failed) & _U64), _str(f.req_id), _str(f.tenant), _str(f.reason),
                _str(f.digest)]
    return b"".join(out)


def decode_loads(data: bytes) -> tuple[list[str], list[str], list[int], list[tuple[int, FailedLoad]]]:
    """The fields :func:`encode_loads` wrote. Raises ValueError naming what is malformed (a truncated record, another
    magic)."""
    off = 0

    def take(st: struct.Struct) -> tuple:
        nonlocal off
        if off + st.size > len(data):
            raise ValueError(f"a TP rank's load results are truncated at byte {off} of {len(data)}")
        v = st.unpack_from(data, off)
        off += st.size
        return v

    def text(raw: bool = False) -> Any:
        nonlocal off
        (n,) = take(_I32)
        if n < 0:
            return None
        if off + n > len(data):
            raise ValueError(f"a TP rank's load results are truncated at byte {off} of {len(data)}")
        b, off = data[off:off + n], off + n
        return b if raw else b.decode("utf-8")

    magic, nd, nf, ne, nl = take(_HEAD)
    if magic != _MAGIC:
        raise ValueError(f"a TP rank's load results start with {magic!r}, not {_MAGIC!r}")
    done = [text() for _ in range(nd)]
    failed = [text() for _ in range(nf)]
    errors = [take(_Q)[0] for _ in range(ne)]
    loads = []
    for _ in range(nl):
        g, first = take(_LOAD)
        rid, tenant, reason, digest = text(), text(), text(), text(raw=True)
        loads.append((g, FailedLoad(rid, tenant, first, reason, digest)))
    if off != len(data):
        raise ValueError(f"a TP rank's load results have {len(data) - off} bytes after their last record")
    return done, failed, errors, loads


_ROOMS = struct.Struct("<4sI")  # magic, entries (then per entry: namespace fingerprint, room bytes)
_ROOMS_MAGIC = b"kvR1"


def encode_rooms(rooms: dict[str, int]) -> bytes:
    """One rank's save staging rooms (bytes per namespace fingerprint: :func:`.offloads.staging_rooms`) as bytes,
    sorted, each clamped to ``[0, 2**64 - 1]`` (a ``max_pending_save_bytes`` of 2**64 or more, "no bound", is sent as
    2**64 - 1 bytes: before 2026-12-03 it raised ``struct.error`` at every step); :func:`split_rooms` reads them back
    off the front of a blob."""
    return b"".join([_ROOMS.pack(_ROOMS_MAGIC, len(rooms))]
                    + [_str(fp) + _Q.pack(min(_U64, max(0, int(r)))) for fp, r in sorted(rooms.items())])


def split_rooms(data: bytes) -> tuple[dict[str, int], bytes]:
    """``(rooms, the rest of data)`` of a blob :func:`encode_rooms` starts. Raises ValueError naming what is
    malformed."""
    if len(data) < _ROOMS.size or data[:4] != _ROOMS_MAGIC:
        raise ValueError(f"a TP rank's staging rooms start with {data[:4]!r}, not {_ROOMS_MAGIC!r}")
    (_, n), off, out = _ROOMS.unpack_from(data), _ROOMS.size, {}
    for _ in range(n):
        if off + 4 > len(data) or off + 4 + max(0, _I32.unpack_from(data, off)[0]) + 8 > len(data):
            raise ValueError(f"a TP rank's staging rooms are truncated at byte {off} of {len(data)}")
        k = _I32.unpack_from(data, off)[0]
        out[data[off + 4:off + 4 + k].decode("utf-8")] = _Q.unpack_from(data, off + 4 + k)[0]
        off += 4 + k + 8
    return out, data[off:]


class TpLoadAgree:
    """The worker's load results agreed by every TP rank (see the module doc), as ``KVOutputAggregator`` combines
    the workers' outputs for vLLM's other executors: a request's load is finished once every rank reported it
    finished (counted per rank; every rank counts the same gathered bytes, so every rank's count is the same),
    ``failed_recving`` is any rank's, reported with the agreed finish; failed block ids and failed loads are every
    rank's, at the step the first rank reports them (vLLM rolls back a request still waiting for its load)."""

    def __init__(self, group: Any):
        self.group, self.world = group, int(group.world_size)
        self._counts: dict[str, int] = {}  # request id -> ranks that finished its load (not yet every rank)
        self._failed: set[str] = set()  # failed_recving of any rank, until the load is finished everywhere
        self._errors: set[int] = set()  # every rank's failed block ids, for the step's get_block_ids_with_load_errors
        self._loads: dict[int, list[FailedLoad]] = {}  # every rank's failed loads per group, for the step's report

    def agree(self, done: set[str], failed: set[str], errors: set[int],
              loads: list[tuple[int, FailedLoad]]) -> tuple[set[str], set[str]]:
        """This rank's step results (``done``: loads it finished since the last call; ``failed``: those of them
        failed as a whole; ``errors``: failed engine block ids; ``loads``: ``(group, FailedLoad)``) exchanged with
        every rank's; returns the agreed ``(finished_recving, failed_recving)``. Raises RuntimeError when the TP
        group's collective fails, this rank's results cannot be encoded (a block id or group out of range) or a
        rank's bytes are malformed. The same gather agrees the save staging room (:func:`.offloads.set_staging_budgets`:
        the least any rank has, per namespace every rank has)."""
        from . import offloads
        try:
            blob = encode_rooms(offloads.staging_rooms()) + encode_loads(done, failed, errors, loads)
        except (struct.error, ValueError, OverflowError, TypeError, UnicodeError) as exc:
            raise RuntimeError(f"kvbm_backend: this TP rank's load results (vLLM external_launcher, TP={self.world}) "
                               f"could not be encoded for the TP group: {exc}") from exc
        blobs = all_gather_bytes(self.group, blob, "the load results")
        out: set[str] = set()
        rooms: dict[str, int] | None = None
        for rank, blob in enumerate(blobs):
            try:
                r, rest = split_rooms(blob)
                d, f, e, ls = decode_loads(rest)
            except ValueError as ex:
                raise RuntimeError(f"kvbm_backend: TP rank {rank}'s load results: {ex}") from ex
            rooms = r if rooms is None else {fp: min(v, r[fp]) for fp, v in rooms.items() if fp in r}
            for rid in d:
                c = self._counts.pop(rid, 0) + 1
                if c >= self.world:
                    out.add(rid)
                else:
                    self._counts[rid] = c
            self._failed.update(f)
            self._errors.update(e)
            for g, fl in ls:
                self._loads.setdefault(g, []).append(fl)
        agreed_failed = self._failed & out
        self._failed -= agreed_failed
        offloads.set_staging_budgets(rooms or {})
        return out, agreed_failed

    def take_errors(self) -> set[int]:
        """Every rank's failed engine block ids agreed since the last call (``get_block_ids_with_load_errors``)."""
        out, self._errors = self._errors, set()
        return out

    def with_failed_loads(self, meta: KvbmWorkerMeta | None) -> KvbmWorkerMeta | None:
        """``meta`` (this worker's step report, None: nothing) carrying every rank's failed loads agreed since the
        last call instead of this rank's own (each group's in its own report)."""
        loads, self._loads = self._loads, {}
        if not loads:
            return meta
        meta = meta if meta is not None else KvbmWorkerMeta()
        for g, fls in sorted(loads.items()):
            m = meta.for_group(g)
            if m is None:
                m = meta.others[g] = KvbmWorkerMeta()
            m.failed = list(fls)
        return meta


_NO_FOUND = 1 << 62  # "no found blocks to agree" in the MIN all-reduce


class TpMatchAgree:
    """``get_num_new_matched_tokens`` agreed by every TP rank's scheduler (see the module doc): one all-reduce (MIN)
    of ``[tokens or -1, 0 if async else 1, found blocks]`` per call.

    One instance per scheduler side, shared by :class:`.tp_sched.SchedAgree` (which agrees inside the scheduler side
    and settles the answer, :meth:`settle`) and the wiring (whose :meth:`agree` right after returns it without a second
    collective). Before 2026-12-03 the settled answer lived in a module-level dict keyed by ``id(group)``: an answer
    settled and not taken (a scheduler side driven without the wiring's agreement) stayed there, and any later
    agreement over that group, or over a new group object given the same id, returned it without a collective: on a
    dead group, or while the other ranks entered the all-reduce (their answers then paired with this rank's next
    collective)."""

    def __init__(self, group: Any):
        self.group = group
        self._settled: tuple[int | None, bool] | None = None  # the answer agreed by the last agree_found, not taken

    def settle(self, answer: tuple[int | None, bool]) -> None:
        """``answer`` was just agreed over the group (:meth:`agree_found`, by :class:`.tp_sched.SchedAgree`): the next
        :meth:`agree` of this instance (the wiring's, right after) of the same answer returns it without a collective.
        Every rank settles the same answer at the same call, so every rank skips that collective alike. Only the next
        call can take it: any later agreement drops it."""
        self._settled = answer

    def agree(self, n: int | None, is_async: bool) -> tuple[int | None, bool]:
        """``(tokens, async)`` of this rank's scheduler -> the agreed answer: ``(None, False)`` when any rank has
        none yet, else the fewest tokens any rank found, async when any rank's load is (``(0, False)`` for none).
        The answer :meth:`settle` marked agreed right before is returned as it is. Raises RuntimeError when the TP
        group's collective fails."""
        settled, self._settled = self._settled, None
        if settled is not None and settled == (n, is_async):
            return n, is_async
        return self.agree_found(n, is_async, None)[:2]

    def agree_found(self, n: int | None, is_async: bool, found: int | None) -> tuple[int | None, bool, int | None]:
        """:meth:`agree` with ``found`` (this rank's blocks found, a count; None: none to agree) agreed too: the
        fewest any rank gave (None when no rank gave one)."""
        self._settled = None  # an answer settled before and never taken is not this one's
        import torch
        import torch.distributed as dist
        f = _NO_FOUND if found is None else int(found)
        t = torch.tensor([-1 if n is None else int(n), 0 if is_async else 1, f], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group.cpu_group)
        except Exception as e:  # noqa: BLE001 - torch.distributed's errors vary by backend
            raise RuntimeError("kvbm_backend: the matched tokens of the TP ranks (vLLM external_launcher) could not "
                               f"be agreed over the TP group: {e}") from e
        m, f = int(t[0]), int(t[2])
        agreed_found = None if f >= _NO_FOUND else f
        if m < 0:
            return None, False, agreed_found
        return m, bool(m) and int(t[1]) == 0, agreed_found
