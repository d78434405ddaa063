"""A local Ray cluster for the Ray suite (`make test-ray`): a head node that runs no work and a
worker node with the CPUs, two sets of processes on this machine as `ray start` makes them on two.
(Ray binds the machine's own address, not loopback: it rewrites 127.0.0.1 to it when connecting.)"""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from server.connections.ray_cluster import LOCAL_SYSTEM_CONFIG  # noqa: E402

# Logical CPUs: Ray schedules by them, the two real cores are shared. A replica or trainer process
# asks for one, so replicas, a data-parallel trainer and rollout workers fit at once.
WORKER_CPUS = 6


@pytest.fixture(scope="session")
def ray_cluster() -> str:
    """The cluster's address, for `art-server --ray-address` and `client.train --ray-address`."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a test cluster: no token file to share
    # Its workers at the test's niceness, as the server's own local Ray runs them (Ray's default
    # puts them at nice 15, where the suites beside this one in CI take the CPU from them).
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                            "_system_config": LOCAL_SYSTEM_CONFIG})
    cluster.add_node(num_cpus=WORKER_CPUS)
    cluster.wait_for_nodes()
    try:
        yield cluster.address
    finally:
        cluster.shutdown()
