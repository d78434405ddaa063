"""How long other requests wait while art-server reads a large training job.

A 20 MiB RL job (one real sampled trajectory, repeated into groups) is posted to a real server
on the embedded model while another client asks /health every 5 ms. Reading, parsing and
validating the body happen off the event loop, so /health should be answered as fast as when
the server is idle: the issue's target is no request waiting more than 100 ms behind another's
body. Measured twice: on an idle server, and while the first job trains.

    python bench/body_wait.py                    # 20 MiB, the embedded model
    python bench/body_wait.py --mib 40

Prints one JSON line: /health's latency idle (the baseline, in the same run) and during each
post (median, 99th percentile, max, in ms), the body's size and how long the post took to be
accepted. Not run in CI.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.local_server import LocalServer  # noqa: E402

RUN = "body-wait"
POLL_EVERY = 0.005


def job_body(choice: dict, mib: float, key: str) -> bytes:
    """An RL job of groups of 8 copies of one sampled trajectory, rewarded 0 and 1, about `mib` MiB."""
    messages = [{"role": "system", "content": "You are a shop assistant."},
                {"role": "user", "content": "What is the price of tea?"}]

    def group(g: int) -> dict:
        return {"trajectories": [{"messages_and_choices": [*messages, choice], "reward": float((g + i) % 2)}
                                 for i in range(8)]}

    one = len(json.dumps(group(0)))
    groups = max(1, int(mib * 2**20 / one))
    return json.dumps({"kind": "rl", "groups": [group(g) for g in range(groups)], "idempotency_key": key}).encode()


def figures(latencies: list[float]) -> dict[str, float]:
    ms = sorted(x * 1000 for x in latencies)
    return {"n": len(ms), "median_ms": round(statistics.median(ms), 1),
            "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 1), "max_ms": round(ms[-1], 1)}


async def health_latencies(http: httpx.AsyncClient, stop: asyncio.Event) -> list[float]:
    out = []
    while not stop.is_set():
        t0 = time.perf_counter()
        r = await http.get("/health")
        out.append(time.perf_counter() - t0)
        r.raise_for_status()
        await asyncio.sleep(POLL_EVERY)
    return out


async def during(url: str, body: bytes | None, idle_seconds: float = 2.0) -> dict:
    """/health's latencies while `body` is posted as a job (or, with None, for `idle_seconds`)."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as health, \
            httpx.AsyncClient(base_url=url, timeout=600) as poster:
        stop = asyncio.Event()
        polling = asyncio.create_task(health_latencies(health, stop))
        await asyncio.sleep(0.2)
        t0 = time.perf_counter()
        if body is None:
            await asyncio.sleep(idle_seconds)
        else:
            r = await poster.post(f"/v1/runs/{RUN}/jobs", content=body, headers={"Content-Type": "application/json"})
            if r.status_code != 202:
                raise SystemExit(f"the job was not accepted: {r.status_code} {r.text[:300]}")
        took = time.perf_counter() - t0
        await asyncio.sleep(0.2)
        stop.set()
        result = figures(await polling)
    return {**result, "post_seconds": round(took, 2)} if body is not None else result


async def measure(url: str, mib: float) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        (await http.post("/v1/runs", json={"name": RUN})).raise_for_status()
        r = await http.post("/v1/chat/completions", json={
            "model": RUN, "max_tokens": 48, "logprobs": True, "seed": 0,
            "messages": [{"role": "user", "content": "What is the price of tea?"}]})
        r.raise_for_status()
        choice = r.json()["choices"][0]
    first, second = job_body(choice, mib, "first"), job_body(choice, mib, "second")
    idle = await during(url, None)
    accepted_idle = await during(url, first)
    accepted_training = await during(url, second)  # the first job is training meanwhile
    return {"body_mib": round(len(first) / 2**20, 1), "health_idle": idle, "health_during_post": accepted_idle,
            "health_during_post_while_training": accepted_training}


def main(mib: float = typer.Option(20.0, help="Size of each job body.")) -> None:
    with tempfile.TemporaryDirectory(prefix="body-wait-") as work:
        with LocalServer(Path(work) / "data") as server:
            result = asyncio.run(measure(server.url, mib))
    result["target_max_ms"] = 100
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    typer.run(main)
