"""What a replica costs to reach on Ray, plain actors against Ray Serve: start-up of two replicas
and the round trip of one streamed request (one chunk back, no model), sequential and 32 at once.

Why: server/engine/replicas.py uses plain actors; this is the measurement behind that choice.
Serve is measured where `ray[serve]` is installed (an extra install: run this with a Python that
has it), else reported missing. Needs only Ray; starts a local cluster of its own.

    python bench/ray_dispatch.py

Prints one JSON line last.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from typing import Any, Callable

import ray

ROUNDS = 200
CONCURRENT = 32


class Echo:
    async def generate(self, prompt: list[int]):
        yield list(prompt)


async def _rtt(call: Callable[[], Any]) -> dict[str, float]:
    """Median and p90 of a sequential round trip, then requests per second with 32 in flight."""
    for _ in range(20):
        await call()
    times = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        await call()
        times.append(time.perf_counter() - t)
    limit = asyncio.Semaphore(CONCURRENT)

    async def limited() -> None:
        async with limit:
            await call()

    t = time.perf_counter()
    await asyncio.gather(*(limited() for _ in range(ROUNDS)))
    per_s = ROUNDS / (time.perf_counter() - t)
    q = statistics.quantiles(times, n=10)
    return {"median_ms": round(statistics.median(times) * 1e3, 2), "p90_ms": round(q[8] * 1e3, 2),
            "concurrent_per_s": round(per_s, 1)}


def plain_actors() -> dict[str, Any]:
    started = time.perf_counter()
    actor = ray.remote(num_cpus=1, max_restarts=-1)(Echo)
    replicas = [actor.remote() for _ in range(2)]
    ray.get([r.__ray_ready__.remote() for r in replicas])
    start_s = time.perf_counter() - started

    async def call() -> None:
        async for ref in replicas[0].generate.remote([1, 2, 3]):
            await ref

    out = {"start_two_s": round(start_s, 2), **asyncio.run(_rtt(call))}
    for r in replicas:
        ray.kill(r)
    return out


def serve() -> dict[str, Any]:
    try:
        from ray import serve as rs
    except ImportError as exc:
        return {"missing": str(exc).splitlines()[0]}
    started = time.perf_counter()
    app = rs.deployment(num_replicas=2, ray_actor_options={"num_cpus": 1})(Echo).bind()
    handle = rs.run(app, name="echo", route_prefix=None).options(stream=True)
    start_s = time.perf_counter() - started

    async def call() -> None:
        async for _ in handle.generate.remote([1, 2, 3]):
            pass

    out = {"start_two_s": round(start_s, 2), **asyncio.run(_rtt(call))}
    rs.shutdown()
    return out


def main() -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    cluster.add_node(num_cpus=4)
    cluster.wait_for_nodes()
    try:
        ray.init(address=cluster.address, namespace="bench-dispatch", log_to_driver=False)
        out = {"ray": ray.__version__, "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
               "plain_actors": plain_actors(), "serve": serve()}
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
