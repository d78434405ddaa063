"""Engine replicas on Ray (`art-server --replicas N`): N TorchEngines, each a Ray actor with the
base model and every loaded adapter (server/engine/replica_actor.py), behind this server's one API.

The server keeps its own ModelHost for rendering, tokenizing and training, as with vLLM; only
prompt token ids and sampled ids and logprobs cross to the replicas. Each request goes where
server/engine/router.py says (a conversation stays on the replica that holds its prefix; the rest
go to the least loaded), and its events stream back through a Ray streaming generator. A seeded
request is token-exact on any replica: each one runs the same engine on the same weights.

Adapters: `load_adapter` returns once every replica that is up has the adapter, so a step is served
under the run's name only when every replica can decode it (runs/served_steps.py loads, then publishes). The
server keeps every loaded adapter (config and weights in Ray's object store); a replica that comes
back from a restart is given all of them before it is routed to again.

Failures: Ray restarts a dead replica (max_restarts=-1). Its requests in flight fail as lost
(retryable: a retry is routed to a replica that is up); a monitor thread pings every replica,
notices a restart (a new incarnation id), reloads the adapters and routes to it again. A request
also fails as lost once the monitor has seen its replica down or restarted, should Ray's stream of
the dead actor not end on its own.

Plain Ray actors rather than Ray Serve, by measurement (bench/ray_dispatch.py: two replicas of an
echo actor on a local cluster, Ray 2.60, the shared 2-core machine at load 10): plain actors started
in 1.5 s and answered one streamed request in 2.0 ms median (5.0 ms p90), 1169 requests/s with 32
in flight; Serve took 5.9 s to start and 4.9 ms median (9.5 ms p90), 317 requests/s. Serve is also
an extra install (`ray[serve]`: grpc and more) with a controller and proxy actors of its own, and
its router sees requests, not prompt token ids, so the cache-aware routing and the adapter barrier
would still be written here.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.engine.base import DecodeSequence, EngineError, EngineFull, GenRequest, ReplicaLost
from server.engine.replica_actor import ReplicaActor, SeqEvent
from server.engine.router import Candidate, PrefixMemory, route
from server.model.host import ModelHost
from server.connections.ray_cluster import connect
from server.settings import Settings

log = logging.getLogger("artisan.replicas")
PING_INTERVAL = 0.5
ADAPTER_TIMEOUT = 600.0


@dataclass
class Replica:
    index: int
    name: str
    handle: Any
    state: str = "starting"  # starting, up, down (restarting or resyncing)
    incarnation: str | None = None
    pid: int | None = None
    node: str | None = None  # the address of the Ray node it runs on
    restarts: int = 0
    in_flight: int = 0  # sequences this server has on it
    served: int = 0  # requests it finished
    running: int = 0
    waiting: int = 0
    memory: PrefixMemory = field(default_factory=PrefixMemory)
    ping: Any = None  # the ObjectRef of the ping in progress


class ReplicatedEngine:
    max_lora_rank = None

    def __init__(self, host: ModelHost, settings: Settings):
        self.ray = connect(settings.ray_address)
        self.host = host
        self.capacity = settings.max_batch + settings.max_waiting  # sequences per replica
        actor = self.ray.remote(num_cpus=1, max_restarts=-1, max_task_retries=0, max_concurrency=10_000)(ReplicaActor)
        # The replicas import this server's own code, wherever Ray starts them on this machine's paths.
        root = str(Path(__file__).resolve().parents[2])
        runtime_env = {"env_vars": {"PYTHONPATH": root, "OMP_NUM_THREADS": "1"}}
        prefix = f"replica-{uuid.uuid4().hex[:8]}"  # names unique per server on a shared cluster
        one = settings.model_copy(update={"replicas": 1, "gradient_checkpointing": False})
        # SPREAD: on a cluster of several nodes the replicas go to different ones, so one node's loss
        # leaves the others serving (and each replica gets a node's memory and cores to itself).
        self.replicas = [Replica(i, f"{prefix}-{i}", actor.options(name=f"{prefix}-{i}", runtime_env=runtime_env,
                                                                   scheduling_strategy="SPREAD")
                                 .remote(one)) for i in range(settings.replicas)]
        self._adapters: dict[str, tuple[Any, Any]] = {}  # name -> (lora config, ObjectRef of the weights)
        self._adapters_lock = threading.Lock()  # held while any replica's adapter set changes
        self._lock = threading.Lock()  # loads and routing
        self._stopped = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="artisan-replicas", daemon=True)
        self._monitor = threading.Thread(target=self._watch, name="artisan-replica-monitor", daemon=True)
        self.start_timeout = 600.0

    # ---- Engine ---------------------------------------------------------------------------------
    def start(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        for r in self.replicas:  # the model loads in every replica at once
            try:
                info = self.ray.get(r.handle.info.remote(), timeout=max(1.0, deadline - time.monotonic()))
            except Exception as exc:  # GetTimeoutError: no CPU free for it on the cluster; or its start failed
                raise SystemExit(f"engine replica {r.name} did not start within {self.start_timeout:.0f}s (each "
                                 f"replica needs 1 free CPU on the Ray cluster): {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
            r.incarnation, r.pid, r.node, r.state = info["incarnation"], info["pid"], info["node"], "up"
        self._loop_thread.start()
        self._monitor.start()
        log.info("%d engine replicas up: %s", len(self.replicas), ", ".join(r.name for r in self.replicas))

    def stop(self) -> None:
        self._stopped.set()
        for r in self.replicas:
            self.ray.kill(r.handle, no_restart=True)
        self._loop.call_soon_threadsafe(self._loop.stop)

    def check(self, params: Any) -> None:
        pass  # every replica is a torch engine: every setting is exact

    def submit(self, req: GenRequest) -> None:
        req.sequences = [DecodeSequence(req, i) for i in range(req.n)]
        with self._lock:
            up = [r for r in self.replicas if r.state == "up"]
            if not up:  # a 503 with Retry-After: Ray is bringing them back
                raise EngineFull("no engine replica is up; they are restarting")
            if sum(r.in_flight for r in up) + req.n > self.capacity * len(up):
                raise EngineFull(f"{sum(r.in_flight for r in up)} sequences are in flight on {len(up)} replicas")
            matches = [Candidate(r.in_flight, r.memory.match(req.prompt_ids)) for r in up]
            replica = up[route(len(req.prompt_ids), matches)]
            replica.in_flight += req.n
        asyncio.run_coroutine_threadsafe(self._request(replica, req), self._loop)

    def load_adapter(self, name: str, lora_config: Any, state: dict[str, Any]) -> None:
        ref = self.ray.put({k: v.detach().cpu().contiguous() for k, v in state.items()})
        with self._adapters_lock:
            self._adapters[name] = (lora_config, ref)
            up = [r for r in self.replicas if r.state == "up"]
            self._on_each(up, lambda r: r.handle.load_adapter.remote(name, lora_config, ref), f"load {name}")

    def unload_adapter(self, name: str) -> None:
        with self._adapters_lock:
            self._adapters.pop(name, None)
            up = [r for r in self.replicas if r.state == "up"]
            self._on_each(up, lambda r: r.handle.unload_adapter.remote(name), f"unload {name}")

    @property
    def load(self) -> dict[str, Any]:
        return {"running": sum(r.running for r in self.replicas), "waiting": sum(r.waiting for r in self.replicas),
                "replicas": [{"index": r.index, "name": r.name, "state": r.state, "pid": r.pid, "node": r.node,
                              "restarts": r.restarts,
                              "in_flight": r.in_flight, "served": r.served, "running": r.running, "waiting": r.waiting}
                             for r in self.replicas]}

    @property
    def alive(self) -> bool:
        return any(r.state == "up" for r in self.replicas)

    # ---- adapters across replicas ---------------------------------------------------------------
    def _on_each(self, replicas: list[Replica], call: Any, what: str) -> None:
        """Run `call` on every replica and wait for all; a replica that fails is down (the monitor
        gives it every adapter when it is back)."""
        refs = [(r, call(r)) for r in replicas]
        for r, ref in refs:
            try:
                self.ray.get(ref, timeout=ADAPTER_TIMEOUT)
            except Exception as exc:
                log.warning("replica %s failed to %s (%s); it is down until it is back with every adapter",
                            r.name, what, exc)
                self._down(r)

    def _down(self, r: Replica) -> None:
        with self._lock:
            if r.state == "up":
                r.state = "down"
                r.memory.clear()

    def _resync(self, r: Replica, info: dict[str, Any]) -> None:
        """Give a replica back from a restart every loaded adapter, then route to it again."""
        with self._adapters_lock:
            adapters = dict(self._adapters)
            try:
                refs = [r.handle.load_adapter.remote(n, cfg, ref) for n, (cfg, ref) in adapters.items()]
                self.ray.get(refs, timeout=ADAPTER_TIMEOUT)
            except Exception as exc:
                log.warning("replica %s: reloading adapters failed (%s); retrying", r.name, exc)
                return
            with self._lock:
                if r.incarnation is not None and r.incarnation != info["incarnation"]:
                    r.restarts += 1
                r.incarnation, r.pid, r.node, r.state = info["incarnation"], info["pid"], info["node"], "up"
        log.info("replica %s is up (pid %s) with %d adapters", r.name, r.pid, len(adapters))

    # ---- the monitor ----------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stopped.wait(PING_INTERVAL):
            for r in self.replicas:
                if r.ping is None:
                    r.ping = r.handle.info.remote()
            ready, _ = self.ray.wait([r.ping for r in self.replicas], num_returns=len(self.replicas),
                                     timeout=PING_INTERVAL)
            for r in self.replicas:
                if r.ping is None or r.ping not in ready:
                    continue
                ref, r.ping = r.ping, None
                try:
                    info = self.ray.get(ref)
                except Exception:  # dead or restarting: Ray brings it back, the next ping sees it
                    self._down(r)
                    continue
                r.running, r.waiting = info["running"], info["waiting"]
                if r.state != "up" or info["incarnation"] != r.incarnation:
                    self._down(r)
                    self._resync(r, info)

    # ---- one request ----------------------------------------------------------------------------
    async def _request(self, r: Replica, req: GenRequest) -> None:
        request_id = uuid.uuid4().hex
        incarnation = r.incarnation
        gen = r.handle.generate.remote(request_id, req.prompt_ids, req.params, req.policy.adapter, req.n, req.stream)
        cancel_sent = False
        finished = 0
        try:
            while finished < req.n:
                nxt = asyncio.ensure_future(gen.__anext__())
                while not nxt.done():
                    await asyncio.wait({nxt}, timeout=0.5)
                    if req.cancelled and not cancel_sent:  # the client went away: its rows stop at the next step
                        r.handle.cancel.remote(request_id)
                        cancel_sent = True
                    if not nxt.done() and (r.state == "down" or r.incarnation != incarnation):
                        # The monitor saw the replica die. Ray's stream of a killed actor normally fails at
                        # once (below), but a stream that never ends would hold the client until its timeout.
                        nxt.cancel()
                        raise ReplicaLost(f"engine replica {r.name} was lost while sampling; retry the request")
                events: list[SeqEvent] = await nxt.result()
                for ev in events:
                    finished += self._apply(r, req, ev, last=finished == req.n - 1)
        except StopAsyncIteration:
            req.emit("error", ReplicaLost(f"engine replica {r.name} ended the request before it finished; "
                                          f"retry the request"))
        except ReplicaLost as exc:
            log.warning("replica %s failed a request: %s", r.name, exc)
            req.emit("error", exc)
        except EngineError as exc:
            req.emit("error", exc)
        except Exception as exc:  # the replica died or became unreachable: this request fails, a retry goes elsewhere
            log.warning("replica %s failed a request: %s", r.name, exc)
            self._down(r)
            req.emit("error", ReplicaLost(f"engine replica {r.name} failed while sampling ({type(exc).__name__}); "
                                          f"retry the request"))
        finally:
            with self._lock:
                r.in_flight -= req.n

    def _apply(self, r: Replica, req: GenRequest, ev: SeqEvent, last: bool) -> int:
        """Mirror one event on the request's own sequences; 1 when a sequence finished. A finished
        sequence is remembered before the caller hears of it: its conversation's next turn may
        follow at once, and must find its replica."""
        if ev.kind == "full":
            raise EngineError(f"engine replica is at capacity ({ev.message}); retry shortly")
        if ev.kind == "error":
            raise EngineError(ev.message)
        seq = req.sequences[ev.index]
        seq.token_ids.extend(ev.token_ids)
        seq.logprobs.extend(ev.logprobs)
        seq.top_logprobs.extend(ev.top_logprobs)
        if ev.kind == "finished":
            seq.finish_reason, seq.stop_text_end = ev.finish_reason, ev.stop_text_end
            with self._lock:  # routing reads the memory from request threads
                r.memory.add([*req.prompt_ids, *seq.token_ids])
                r.served += last
            req.emit("finished", seq)
            return 1
        if ev.token_ids and req.stream:
            req.emit("token", seq)
        return 0
