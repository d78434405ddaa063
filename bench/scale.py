"""Scaling past one process: serving tokens/s with 1 and with 2 engine replicas (`--replicas 2` on Ray),
and training tokens/s with 1 and with 2 data-parallel processes (`--train-processes 2`,
bench/scale_training.py).

Serving: art-server on the embedded model, 32 concurrent clients sending the same seeded requests
to each set-up, every engine on one torch thread. One replica (`--replicas 1`, the engine in the
server's process) is measured twice: the server process free to run on any core (its engine thread
uses one at a time; rendering and HTTP may use another), the baseline of the ratio; and the whole
process pinned to one core (`replicas_1_pinned`: everything one core does). With two, each replica
actor is pinned to a core of its own (every thread of its process, where the OS allows) and the
server process, which renders and routes, runs where the OS puts it. The three are up at once and
measured in turn, three rounds, the best of each kept. Beside them, one engine alone in this
process on one thread, with 16 and with 32 requests at once: twice the first over the second is
what two replicas could give at most on this model (`engine_bound_replicas_2_vs_1`), since each
batches half the clients. The Ray cluster is this bench's own (a head
node and a worker node on this machine), never one found running.

    python bench/scale.py                    # every section
    python bench/scale.py --section serving

Sections are functions returning a dict. Prints one JSON line last.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.scale_training import measure_training  # noqa: E402
from client.local_server import LocalServer  # noqa: E402

CLIENTS = 32
REQUESTS_PER_CLIENT = 4
MAX_TOKENS = 64
ROUNDS = 3
TOPICS = ("apple", "banana", "cherry", "plum", "pear", "grape", "melon", "lemon")


async def _load(url: str, clients: int, per_client: int) -> float:
    """Generated tokens per second; client c's request k is the same in every set-up (its prompt and seed)."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=1800) as client:
        async def one(c: int, k: int) -> int:
            r = await client.chat.completions.create(
                model="bench", max_tokens=MAX_TOKENS, temperature=1.0, seed=c * 100 + k,
                messages=[{"role": "user", "content": f"Client {c} asks about the {TOPICS[(c + k) % len(TOPICS)]}."}],
                extra_body={"ignore_eos": True})
            return r.usage.completion_tokens

        async def one_client(c: int) -> int:
            return sum([await one(c, k) for k in range(per_client)])

        await asyncio.gather(*(one(c, 99) for c in range(4)))  # warm-up
        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one_client(c) for c in range(clients))))
        return tokens / (time.perf_counter() - started)


def _pin(pid: int, cores: set[int]) -> bool:
    """Every thread of `pid` on `cores`; False where the OS does not allow it."""
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), cores)
        return True
    except (OSError, AttributeError):
        return False


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _measure(url: str, pids: dict[str, int]) -> tuple[float, dict[str, float]]:
    """Tokens/s, and the CPU seconds each process (and this bench, the clients) spent per 1000 tokens."""
    before = {name: _cpu_seconds(pid) for name, pid in pids.items()}
    own = sum(os.times()[:2])
    started = time.perf_counter()
    per_s = asyncio.run(_load(url, CLIENTS, REQUESTS_PER_CLIENT))
    tokens = per_s * (time.perf_counter() - started) / 1000  # includes the warm-up: a small overcount of time
    cpu = {name: (_cpu_seconds(pid) - before[name]) / tokens for name, pid in pids.items()}
    cpu["clients"] = (sum(os.times()[:2]) - own) / tokens
    return round(per_s, 1), {k: round(v, 3) for k, v in cpu.items()}


def _engine_alone(batches: tuple[int, ...], rounds: int) -> dict[int, float]:
    """Tokens/s of one torch engine on one thread in this process with each of `batches` requests
    at once, measured in turn, best round of each: what one replica could do with a core to itself
    and nothing in front of it."""
    import threading

    import torch

    from server.model.host import load_model
    from server.engine.base import GenRequest
    from server.engine.sampling import SamplingParams
    from server.engine.torch_engine import TorchEngine
    from server.sampling.served_names import Policy
    from server.settings import Settings

    torch.set_num_threads(1)
    settings = Settings(device="cpu")
    host = load_model(settings)
    engine = TorchEngine.from_settings(host, settings)
    engine.start()
    base = Policy(host.name, None, None, 0)
    prompt = host.chat.renderer.render([{"role": "user", "content": f"Client 0 asks about the {TOPICS[0]}."}]).ids

    def once(rows: int) -> float:
        done = threading.Semaphore(0)
        reqs = [GenRequest(prompt_ids=prompt, params=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=i),
                           policy=base, emit=lambda kind, _: done.release() if kind in ("finished", "error") else None)
                for i in range(rows)]
        started = time.perf_counter()
        for r in reqs:
            engine.submit(r)
        for _ in reqs:
            done.acquire()
        return rows * MAX_TOKENS / (time.perf_counter() - started)

    try:
        once(4)
        runs: dict[int, list[float]] = {rows: [] for rows in batches}
        for _ in range(rounds):
            for rows in batches:
                runs[rows].append(once(rows))
        return {rows: round(max(r), 1) for rows, r in runs.items()}
    finally:
        engine.stop()


def _start(work: Path, name: str, extra: list[str]) -> LocalServer:
    return LocalServer(work / name, extra=["--device", "cpu", "--served-model-name", "bench", *extra],
                       env={"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}).start(timeout=600)


def measure_serving(rounds: int = ROUNDS, pin: bool = True) -> dict[str, Any]:
    """The three set-ups are up at once and measured in turn, `rounds` times; the best round of
    each counts, so a burst of another user's load on this shared machine skews no set-up alone."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import httpx
    from ray.cluster_utils import Cluster

    work = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    cores = sorted(os.sched_getaffinity(0))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    servers: dict[str, LocalServer] = {}
    try:
        servers["replicas_1"] = _start(work, "one", ["--replicas", "1"])
        servers["replicas_1_pinned"] = _start(work, "one-pinned", ["--replicas", "1"])
        servers["replicas_2"] = _start(work, "two", ["--replicas", "2", "--ray-address", cluster.address])
        pinned = _pin(servers["replicas_1_pinned"].proc.pid, {cores[0]})
        pids = {name: {"server": server.proc.pid} for name, server in servers.items()}
        for i, r in enumerate(httpx.get(servers["replicas_2"].url + "/health", timeout=30).json()["replicas"]):
            pinned = pin and _pin(r["pid"], {cores[i % len(cores)]}) and pinned
            pids["replicas_2"][f"replica_{i}"] = r["pid"]
        runs: dict[str, list[float]] = {name: [] for name in servers}
        cpu: dict[str, dict[str, float]] = {}
        for _ in range(rounds):
            for name, server in servers.items():
                per_s, used = _measure(server.url, pids[name])
                runs[name].append(per_s)
                if per_s == max(runs[name]):
                    cpu[name] = used
    finally:
        for server in servers.values():
            server.stop()
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    best = {name: max(r) for name, r in runs.items()}
    # Two replicas split the clients, so each batches half of them: the engine's own gain from that
    # is the most two replicas can give, whatever the cores.
    alone = _engine_alone((CLIENTS // 2, CLIENTS), rounds)
    half, full = alone[CLIENTS // 2], alone[CLIENTS]
    return {"clients": CLIENTS, "requests": CLIENTS * REQUESTS_PER_CLIENT, "max_tokens": MAX_TOKENS,
            "cores": len(cores), "pinned": pinned, "rounds_tokens_per_s": runs,
            "cpu_s_per_1000_tokens_best_round": cpu,
            **{f"{name}_tokens_per_s": v for name, v in best.items()},
            "replicas_2_vs_1": round(best["replicas_2"] / best["replicas_1"], 3),
            "replicas_2_vs_1_pinned": round(best["replicas_2"] / best["replicas_1_pinned"], 3),
            f"engine_alone_rows_{CLIENTS // 2}_tokens_per_s": half, f"engine_alone_rows_{CLIENTS}_tokens_per_s": full,
            "engine_bound_replicas_2_vs_1": round(2 * half / full, 3)}


SECTIONS: dict[str, Callable[..., dict[str, Any]]] = {"serving": measure_serving, "training": measure_training}


def main(section: list[str] = typer.Option(None, help="Sections to run (default: all): " + ", ".join(SECTIONS)),
         pin: bool = typer.Option(True, help="Pin each replica to a core of its own (--no-pin: where the OS puts "
                                             "them, to see what pinning costs).")) -> None:
    out: dict[str, Any] = {"load_average_at_start": [round(x, 2) for x in os.getloadavg()]}
    for name in section or list(SECTIONS):
        out[name] = measure_serving(pin=pin) if name == "serving" else SECTIONS[name]()
    print(json.dumps(out))


if __name__ == "__main__":
    typer.run(main)
