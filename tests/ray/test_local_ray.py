"""The Ray an art-server starts for itself when it is given no --ray-address."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT

# The server's connection, in a process of its own (it starts a Ray of its own), run at nice 2: a
# worker at 2 follows the server, where one fixed at 0 would look right beside a server at 0.
WORKER_NICENESS = """
import os
from server.connections.ray_cluster import connect
ray = connect(None)
print("worker niceness", ray.get(ray.remote(lambda: os.getpriority(os.PRIO_PROCESS, 0)).remote()))
ray.shutdown()
"""


def test_a_local_ray_runs_its_workers_at_the_servers_niceness():
    """Ray's default puts them 15 above it, where any other process takes the CPU from them first."""
    proc = subprocess.run([sys.executable, "-c", WORKER_NICENESS], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "RAY_AUTH_MODE": "disabled"}, preexec_fn=lambda: os.nice(2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"worker niceness {os.getpriority(os.PRIO_PROCESS, 0) + 2}\n" in proc.stdout, proc.stdout
