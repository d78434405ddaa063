"""Rollouts on a Ray cluster (`client.train --ray-address ADDR`), for environments that need
machines of their own.

A pool of Ray actors, each holding the example (its environments run there) and its own OpenAI
client to the art-server's URL, runs the rollouts; the driver (the laptop) keeps everything else:
drawing tasks, the group judge, submitting batches. Each rollout is one actor call that returns the
Trajectory itself, pickled with its Choice objects, so the token ids and logprobs arrive as the
server sent them.

- Placement: `workers` actors of 1 CPU each, spread over the nodes by Ray. Each runs at most
  `concurrency` rollouts at once (the driver sends no more); a rollout goes to the least busy one.
- Code: the driver ships its own copy of artisan's client-side packages, and the example's
  top-level package, as the job's runtime_env `py_modules`, so workers run the driver's version
  of the code (an example in a one-file module is pickled by value). The nodes need artisan's
  dependencies installed (the same image as the server's).
- A lost worker (its process or node died): each rollout it was running fails with a WorkerLost
  that names it, so they count as their group's exceptions (infrastructure failures, never a zero
  reward), and a replacement actor takes its slot for the rollouts that follow.

Ray is imported only here, and only when a pool is started.
"""

from __future__ import annotations

import asyncio
import importlib.util
import ipaddress
import socket
import sys
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, Field

from client.errors import ConfigError
from protocol.trajectory import Trajectory
from rollouts.env import Example, Task

# What a worker imports of ours: the client side (never server/, which carries the model weights).
CLIENT_PACKAGES = ("protocol", "exporters", "rollouts", "rewards", "client", "environments", "examples")
WORKER_CPUS = 1  # rollouts wait on the server and on tools: one core each is room for the tools
START_SECONDS = 300.0  # a fresh node may install the runtime_env before its first actor starts
NOTICE_SECONDS = 10.0  # then a line says what the start is waiting for


class RayWorkers(BaseModel):
    """Where and how wide rollouts run on Ray."""

    address: str
    # Two by default: losing one leaves the other running while its replacement starts; with 32
    # each they run 64 rollouts at once, one default step (8 groups of 8), as the local path does.
    workers: int = Field(default=2, ge=1, le=1024)
    # Rollouts one worker runs at once: they spend their time waiting on HTTP, which one event loop
    # does for dozens; the bound keeps a worker's own tool work from starving them.
    concurrency: int = Field(default=32, ge=1, le=1024)


class WorkerLost(RuntimeError):
    """A rollout's worker died under it: an infrastructure failure of that rollout."""


def packages_to_ship(example_module: str) -> list[str]:
    """The top-level packages a worker needs: ours, and the example's when it lives elsewhere."""
    top = example_module.split(".")[0]
    return list(CLIENT_PACKAGES) + ([top] if top not in CLIENT_PACKAGES and top != "__main__" else [])


def package_dirs(names: list[str]) -> list[str]:
    """The directories the driver imports these packages from (the ones it has)."""
    out = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            out.extend(str(Path(p)) for p in spec.submodule_search_locations)
    return out


def least_busy(loads: list[int], limit: int) -> int | None:
    """The slot with the fewest rollouts running, the first among equals; None when all are full."""
    slot = min(range(len(loads)), key=lambda i: loads[i])
    return slot if loads[slot] < limit else None


def loopback_unreachable(server_url: str, driver_ip: str, worker_nodes: list[str]) -> str | None:
    """Why workers cannot reach the server, when `--server` is this machine's loopback address and
    some worker runs on another machine (`worker_nodes` as RolloutWorker.where gives them)."""
    host = urlsplit(server_url).hostname or ""
    loopback = host == "localhost" or (_is_ip(host) and ipaddress.ip_address(host).is_loopback)
    elsewhere = sorted({n.split("/")[0] for n in worker_nodes} - {driver_ip})
    if not loopback or not elsewhere:
        return None
    return (f"--server {server_url} is this machine's loopback address, and rollout workers run on "
            f"{', '.join(elsewhere)}: give the server's address on the cluster's network")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def address_host_port(address: str) -> tuple[str, int] | None:
    """The host and port a Ray address names (`host:port`, `ray://host:port`); None for the ones
    Ray resolves itself (`auto`, `local`)."""
    parts = urlsplit(address if "://" in address else f"ray://{address}")
    try:
        port = parts.port
    except ValueError:
        return None
    return (parts.hostname, port) if parts.hostname and port else None


def check_ray_address(address: str, timeout: float = 5.0) -> None:
    """A ConfigError when nothing answers at the address: ray.init would retry it for minutes."""
    where = address_host_port(address)
    if where is None:
        return
    try:
        socket.create_connection(where, timeout=timeout).close()
    except OSError as exc:
        raise ConfigError(f"--ray-address {address}: nothing answers there ({exc.strerror or exc}); start the "
                          f"cluster with `ray start --head` and give its address") from None


async def started_within(pending: Any, seconds: float, notice: Any, notice_after: float = NOTICE_SECONDS) -> Any:
    """`pending`'s result within `seconds` (else asyncio.TimeoutError), saying `notice()` on stderr
    once if it has not come after `notice_after`: a wait for the cluster is not silence."""
    task = asyncio.ensure_future(pending)
    done, _ = await asyncio.wait({task}, timeout=min(notice_after, seconds))
    if not done:
        print(notice(), file=sys.stderr, flush=True)
    return await asyncio.wait_for(task, max(0.0, seconds - notice_after))


def not_started_line(workers: int, available: dict[str, float], total: dict[str, float]) -> str:
    """Why the workers may not have started: the CPUs they need against the cluster's free ones."""
    need, free, have = workers * WORKER_CPUS, available.get("CPU", 0.0), total.get("CPU", 0.0)
    if free < need:
        return (f"ray: waiting for {need} CPUs for the {workers} rollout workers ({free:g} of the cluster's {have:g} "
                f"are free; art-server --replicas holds one each on its machine): give the cluster more CPUs "
                f"(ray start --num-cpus N) or use fewer --ray-workers; waiting up to {START_SECONDS:.0f} s")
    return (f"ray: the {workers} rollout workers have not started yet (their nodes may be installing this code's "
            f"runtime environment); waiting up to {START_SECONDS:.0f} s")


def lost_message(name: str, node: str, cause: BaseException) -> str:
    why = str(cause).strip().splitlines()[0][:300] if str(cause).strip() else type(cause).__name__
    return f"rollout worker {name} (node {node}) was lost mid-rollout: {why}"


class RolloutWorker:
    """One Ray actor: the example and an OpenAI client of the server, running rollouts it is sent."""

    def __init__(self, example: Example, server_url: str, api_key: str | None):
        self.example, self.server_url, self.api_key = example, server_url, api_key
        self.client: Any = None
        self.running = self.peak = 0

    def where(self) -> str:
        """The node this worker runs on: its address, and the start of its Ray node id (nodes of
        one machine share the address)."""
        import ray

        return f"{ray.util.get_node_ip_address()}/{ray.get_runtime_context().get_node_id()[:8]}"

    async def rollout(self, policy: str, task: Task) -> Trajectory | BaseException:
        if self.client is None:  # made in the actor's event loop, where it is used
            from openai import AsyncOpenAI

            from client.outage import MODEL_CALL_SECONDS

            self.client = AsyncOpenAI(base_url=self.server_url + "/v1", api_key=self.api_key or "EMPTY",
                                      max_retries=0, timeout=MODEL_CALL_SECONDS)
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            return await self.example.rollout(self.client, policy, task)
        finally:
            self.running -= 1

    async def load(self) -> dict[str, int]:
        """Rollouts running now, and the most that ever ran at once."""
        return {"running": self.running, "peak": self.peak}


class RayRolloutPool:
    """The driver's side of the workers: `rollout(policy, task)` runs one rollout on the least busy
    worker, and replaces a worker that died."""

    def __init__(self, settings: RayWorkers, example: Example, server_url: str, api_key: str | None, run: str):
        self.settings, self.example = settings, example
        self.server_url, self.api_key = server_url, api_key
        self.prefix = f"{run}.rollouts.{uuid.uuid4().hex[:6]}"
        self.ray: Any = None
        self.actors: list[Any] = []
        self.names: list[str] = []
        self.nodes: list[str] = []
        self.loads: list[int] = []
        self.made = 0
        self.figures = {"workers": settings.workers, "rollouts": 0, "lost_rollouts": 0, "workers_lost": 0}
        self._free: asyncio.Condition | None = None
        self._locating: set[asyncio.Task] = set()

    async def start(self) -> "RayRolloutPool":
        try:
            import ray
        except ImportError:
            raise ConfigError("--ray-address needs Ray: pip install 'artisan-rl[ray]'") from None
        self.ray = ray
        if not ray.is_initialized():  # else the caller's ray.init decided what workers import
            # Ray uploads local code only for a whole job, so it is shipped here, once.
            code = {"py_modules": package_dirs(packages_to_ship(type(self.example).__module__)),
                    "excludes": ["__pycache__", "*.pyc"]}
            try:
                ray.init(address=self.settings.address, namespace="artisan", log_to_driver=False, runtime_env=code)
            except ConnectionError as exc:
                raise ConfigError(f"--ray-address {self.settings.address}: cannot reach the Ray cluster ({exc})") \
                    from None
        module = type(self.example).__module__.split(".")[0]
        if module in sys.modules and not package_dirs([module]) and module != "__main__":
            # A one-file module (a script's neighbour, a test) is no package to ship: its classes
            # travel inside the pickled example instead.
            ray.cloudpickle.register_pickle_by_value(sys.modules[module])
        self.actor_class = ray.remote(num_cpus=WORKER_CPUS, max_restarts=0)(RolloutWorker)
        self._free = asyncio.Condition()
        self.loads = [0] * self.settings.workers
        made = [self._make() for _ in range(self.settings.workers)]
        self.actors, self.names = [a for a, _ in made], [n for _, n in made]
        try:
            self.nodes = await started_within(asyncio.gather(*(a.where.remote() for a in self.actors)), START_SECONDS,
                                              lambda: not_started_line(self.settings.workers, ray.available_resources(),
                                                                       ray.cluster_resources()))
        except Exception as exc:  # the example does not unpickle there, a package is missing, ...
            self.close()
            raise ConfigError(f"--ray-address: the rollout workers did not start: {_last_line(exc)}") from None
        unreachable = loopback_unreachable(self.server_url, ray.util.get_node_ip_address(), self.nodes)
        if unreachable:
            self.close()
            raise ConfigError(unreachable)
        return self

    def _make(self) -> tuple[Any, str]:
        name = f"{self.prefix}.{self.made}"
        self.made += 1
        # One call more than the rollouts the driver sends, so that load() and where() are answered.
        options = {"name": name, "max_concurrency": self.settings.concurrency + 1, "scheduling_strategy": "SPREAD"}
        return self.actor_class.options(**options).remote(self.example, self.server_url, self.api_key), name

    def describe(self) -> str:
        nodes = sorted(set(self.nodes))
        return (f"ray: {len(self.actors)} rollout workers ({', '.join(self.names)}) on {len(nodes)} node(s), "
                f"{self.settings.concurrency} rollouts each at most")

    async def rollout(self, policy: str, task: Task) -> Trajectory | BaseException:
        async with self._free:
            await self._free.wait_for(lambda: least_busy(self.loads, self.settings.concurrency) is not None)
            slot = least_busy(self.loads, self.settings.concurrency)
            self.loads[slot] += 1
        actor, name, node = self.actors[slot], self.names[slot], self.nodes[slot]
        try:
            result = await actor.rollout.remote(policy, task)
        except self.ray.exceptions.RayActorError as exc:
            self.figures["lost_rollouts"] += 1
            if self.actors[slot] is actor:  # the first of its rollouts to hear of it replaces it
                self._replace(slot)
            raise WorkerLost(lost_message(name, node, exc)) from None
        except self.ray.exceptions.RayTaskError as exc:  # the rollout itself raised: its error, as here
            raise (exc.cause if isinstance(exc.cause, Exception) else exc) from None
        finally:
            async with self._free:
                self.loads[slot] -= 1
                self._free.notify_all()
        self.figures["rollouts"] += 1
        return result

    def _replace(self, slot: int) -> None:
        self.figures["workers_lost"] += 1
        lost = self.names[slot]
        self.actors[slot], self.names[slot] = self._make()
        self.nodes[slot] = "(being placed)"
        task = asyncio.ensure_future(self._locate(slot, self.actors[slot]))
        self._locating.add(task)
        task.add_done_callback(self._locating.discard)
        print(f"ray: rollout worker {lost} was lost; {self.names[slot]} replaces it", file=sys.stderr, flush=True)

    async def _locate(self, slot: int, actor: Any) -> None:
        try:
            node = await actor.where.remote()
        except self.ray.exceptions.RayError:  # lost before it started: its rollouts say so
            return
        if self.actors[slot] is actor:
            self.nodes[slot] = node

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []


def _last_line(exc: BaseException) -> str:
    """Ray's error about an actor that could not start ends with the cause (the ImportError, ...)."""
    text = str(exc).strip()
    return text.splitlines()[-1][:500] if text else type(exc).__name__
