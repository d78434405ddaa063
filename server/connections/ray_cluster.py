"""The server's one connection to Ray, shared by engine replicas and data-parallel trainers.

Ray is optional (the `ray` extra): it is imported only when a setting asks for more than one
replica or training process, and its absence is one clear line, not a traceback.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()

# Ray starts its workers at nice 15, below its own daemons. Here the workers are the engine replicas
# and training processes, the server's main work: at 15 every other process on the machine, the
# server's own front included, takes the CPU from them first (the Ray suite: 285 s on the idle
# machine, 1,455 s beside CI's other suites). A local Ray runs them at the server's niceness; a
# cluster the server joins keeps the setting its `ray start` gave it (`RAY_worker_niceness=0`).
LOCAL_SYSTEM_CONFIG = {"worker_niceness": 0}


class RayUnavailable(SystemExit):
    """Ray is needed by the settings and is not installed, or its cluster cannot be reached."""


def connect(address: str | None) -> Any:
    """The `ray` module, connected once per process: to the cluster at `address`, or to a local
    Ray started for this server when there is none."""
    try:
        import ray
    except ImportError:
        raise RayUnavailable("--replicas and --train-processes above 1 need Ray: pip install 'artisan-rl[ray]'") \
            from None
    with _lock:
        if not ray.is_initialized():
            try:
                # A namespace of its own: the actors' names never meet another application's. Without
                # an address, "local" starts a Ray of our own: Ray would otherwise join the newest
                # cluster `ray start` recorded on this machine, whoever started it.
                local = {} if address else {"_system_config": LOCAL_SYSTEM_CONFIG}  # Ray refuses it for a join
                ray.init(address=address or "local", namespace="artisan", log_to_driver=False, **local)
            except ConnectionError as exc:
                raise RayUnavailable(f"--ray-address {address}: cannot reach the Ray cluster ({exc})") from None
    return ray
