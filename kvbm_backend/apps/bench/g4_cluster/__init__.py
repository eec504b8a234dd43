"""Multi-node G4 test bed: a SeaweedFS cluster and G4 worker processes on separate "hosts".

One :class:`G4Cluster` starts, in this order:

* the network. ``netns`` mode: a private Linux bridge ``kvbr-<run id>`` with a random free
  ``10.2xx.y.0/24`` (bridge address ``.1``, so the starting process reaches every host) and one
  network namespace per host (``kv-<run id>-<host>``), joined to the bridge by a veth pair whose
  bridge-side end is the host's "switch port". ``loopback`` mode (no CAP_NET_ADMIN, no ``ip``, or
  ``KVBM_G4_CLUSTER_MODE=loopback``): every process on 127.0.0.1 with its own ports.
* SeaweedFS, each server in its own host: ``weed master`` (``-defaultReplication=001``: every volume
  has a second copy on another volume server of the same rack), ``>= 3`` ``weed volume`` servers
  (data center ``dc1``, rack ``r1``), ``weed filer`` and ``weed s3`` (the S3 gateway). A write that
  SeaweedFS acknowledges has been written on both replicas (SeaweedFS replicates synchronously and
  fails the write when a replica fails), so killing one volume server loses no acknowledged object.
* ``workers`` G4 worker processes (``python -m kvbm_backend.apps.bench.g4_cluster worker``), each in its
  own host, each with its own :class:`~kvbm_backend.pool.g4.pool.G4Pool` on one shared G4 namespace
  (``s3://kvbm-cluster/<prefix>``, one keyring file shared through the filesystem, as a fleet shares a
  KEK). They take JSON-line commands on stdin (:func:`.worker.worker_main`). In loopback mode each worker
  reaches the gateway through its own relay process (``... relay``), its "link".

Partitions: ``netns`` - the worker's bridge-side veth end goes down (the switch port: no carrier,
nothing arrives or leaves; in-flight requests and new connections time out). ``loopback`` - the
worker's relay is SIGSTOPped: connections still complete in the kernel's listen backlog but no byte
is forwarded either way, so every request waits for its timeout, as behind a dead link. Either way
the pool's ``timeout_s x (1 + retries)`` bound is what the worker pays.

Cleanup: every process is in its own session and killed by process group; namespaces and the bridge
are deleted in :meth:`G4Cluster.stop` (called from ``finally``/fixtures and at interpreter exit). Every
run has a unique id; its state file ``/tmp/kvbm-g4c-<uid>/<id>.json`` names the owner pid, and
:func:`clean_stale` removes what runs whose owner died left behind (``ci/g4_cluster.sh clean``).

The bench (:func:`.bench.bench`, ``python -m kvbm_backend.apps.bench.g4_cluster bench``): for each worker count
n in ``--workers`` the first n workers write ``--blocks`` blocks each at the same instant (aggregate
write GB/s = all payload bytes / time until the last worker's last block is acknowledged), then each
reads and verifies the blocks the next worker wrote (with one worker: its own; aggregate read GB/s
likewise). GB = 1e9 bytes, payload bytes only, encrypted (AES-256-GCM) unless ``--no-encrypt``. Each point
has a baseline taken in the same run, alternating with the pool's rounds: the same workers PUT then GET
plain objects of the stored size (header + payload) with the store the pool's config opens (same S3
client, as many requests in flight), and ``ratio`` is the pool's GB/s over it. Every option is checked
before any server starts (an argparse error naming it).

Modules, by job: ``hosts.py`` (network namespaces / loopback, ports, process groups, stale-run cleanup),
``cluster.py`` (:class:`G4Cluster`: SeaweedFS and the workers, partitions; :class:`Worker`: one worker's
command channel), ``worker.py`` (the worker and relay processes), ``bench.py`` (the scaling bench),
``__main__.py`` (``python -m kvbm_backend.apps.bench.g4_cluster up|clean|bench|worker|relay``).
"""
from __future__ import annotations

from .cluster import AWS_ENV, BUCKET, G4Cluster, Worker
from .hosts import MODE_ENV, STATE_DIR, Host, clean_stale, netns_unavailable_reason, weed_binary

__all__ = ["AWS_ENV", "BUCKET", "G4Cluster", "Host", "MODE_ENV", "STATE_DIR", "Worker", "clean_stale",
           "netns_unavailable_reason", "weed_binary"]
