"""The FastAPI application: the model, the engine that serves it, the runs that train it, the
routes that reach them."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from server import export_queue
from server.api import (errors, exporter_routes, generate_routes, jsonl_routes, limits, logprobs_routes,
                        messages_routes, openai_routes, responses_routes, session_routes, text_completions_routes,
                        tokenize_routes, training_routes, ui_routes)
from server.api.auth import identify
from server.harness.responses import ResponseStore
from server.harness.sessions import Sessions
from server.model.host import ModelHost, load_model
from server.runs.facade import Runs
from server.runs.ownership import Owners
from server.sampling.served_names import ServedModels
from server.settings import REPLICAS_ARE_TORCH, Settings
from server.state import ServerState
from server.store import Store
from server.store.data_lock import lock_data_dir
from server.training.jobs import JobManager

log = logging.getLogger("artisan")


def make_engine(settings: Settings, host: ModelHost) -> Any:
    if settings.engine == "vllm" and settings.replicas > 1:
        raise SystemExit(REPLICAS_ARE_TORCH)
    if settings.engine == "vllm":
        from server.engine.vllm import VllmEngine

        return VllmEngine(host, settings)
    if settings.replicas > 1:
        from server.engine.replicas import ReplicatedEngine

        return ReplicatedEngine(host, settings)
    from server.engine.torch_engine import TorchEngine

    return TorchEngine.from_settings(host, settings)


def make_optimizer(settings: Settings, host: ModelHost) -> Any:
    """Where training steps optimise: in this process, or on --train-processes data-parallel
    processes (connecting to Ray here, so an unreachable cluster stops start-up at once)."""
    if settings.train_processes == 1:
        from server.training.optimize import optimize

        return optimize
    from server.training.data_parallel import DataParallelTrainer

    return DataParallelTrainer(settings.train_processes, settings.ray_address, host.model_dir, host.device, host.dtype,
                               settings.gradient_checkpointing).optimize


def build_state(settings: Settings) -> ServerState:
    lock_data_dir(Path(settings.data_dir))  # before anything is loaded: a second server stops at once
    queue = export_queue.build(settings)  # None unless --export asks; early, so a bad one stops start-up at once
    host = load_model(settings)
    engine = make_engine(settings, host)
    served = ServedModels(host.name, host.aliases)
    data_dir = Path(settings.data_dir)
    store = Store(data_dir / "artisan.sqlite")
    mib = 2**20
    runs = Runs(host, engine, served, data_dir, Owners(store),
                adapter_memory=settings.adapter_memory_mb * mib if settings.adapter_memory_mb else None,
                memory_reserve=settings.memory_reserve_mb * mib)
    jobs = JobManager(runs, store, queue, settings.keep_trajectory_steps, time_limit=settings.job_time_limit,
                      max_optimizer_steps=settings.max_job_optimizer_steps,
                      optimize_step=make_optimizer(settings, host))
    sessions = Sessions.from_settings(settings, host.chat.template, store.sessions)  # the unexpired ones, restored
    return ServerState(settings, host, engine, served, runs, store, jobs, sessions,
                       ResponseStore(ttl=settings.session_ttl, store=store.responses), export_queue=queue)


def bounded(problems: list[str], count: int = 20, length: int = 300) -> list[str]:
    """/health's problems: one line each, at most `count` lines of `length` characters, and how many
    more there are (a data directory of another model's runs must not make /health megabytes)."""
    lines = [" ".join(p.split()) for p in problems]
    lines = [p if len(p) <= length else p[: length - 3] + "..." for p in lines]
    more = len(lines) - count
    return lines if more <= 0 else [*lines[: count - 1], f"... and {more + 1} more problems (see the server's log)"]


def replica_problems(load: dict[str, Any]) -> list[str]:
    """A replica that is down: the others serve, with less room, until Ray brings it back."""
    replicas = load.get("replicas", [])
    up = sum(r["state"] == "up" for r in replicas)
    return [f"engine replica {r['index']} is {r['state']} ({up} of {len(replicas)} up); requests go to the others "
            f"until it is back" for r in replicas if r["state"] != "up"]


def counted(body: dict[str, Any], problems: int) -> dict[str, Any]:
    """/health for a caller without an admin key (health checks send none): how many problems and
    replicas, not the run names, file paths and processes they name."""
    out = {k: v for k, v in body.items() if k != "replicas"}
    if "replicas" in body:
        out["replicas_up"] = sum(r["state"] == "up" for r in body["replicas"])
        out["replicas_total"] = len(body["replicas"])
    out["problems"] = [f"{problems} problem{'s' if problems > 1 else ''}; /health with an admin key names them "
                       f"(so does the server's log)"] if problems else []
    return out


# In this order: the session catch-all (session_routes) sees only what the routers before it did not take.
ROUTERS = (openai_routes.router, generate_routes.router, text_completions_routes.router, logprobs_routes.router,
           tokenize_routes.router, responses_routes.router, messages_routes.router, session_routes.router,
           training_routes.router, ui_routes.router, jsonl_routes.router, exporter_routes.router)


def create_app(settings: Settings) -> FastAPI:
    state = build_state(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        state.runs.resume_all()
        state.jobs.start()
        log.info("serving %s (%.1fM parameters) on %s; served names: %s", state.host.name, state.host.n_params / 1e6,
                 state.host.device, ", ".join(state.served.names()))
        yield
        state.engine.stop()
        state.jobs.stop()
        if state.export_queue is not None:
            state.export_queue.close()
        state.store.close()

    app = FastAPI(title="art-server", lifespan=lifespan)
    app.state.settings = settings
    app.state.artisan = state
    errors.install(app, ROUTERS)
    limits.install(app, settings)

    @app.get("/health", responses={503: {"description": "the engine is down"}})
    async def health(request: Request) -> JSONResponse:
        alive, load = state.engine.alive, state.engine.load  # a 503 tells a load balancer or supervisor to act
        # Damaged data found at start: the server serves what it can (200), and says what it lost.
        found = [*state.store.problems, *([state.jobs.fault] if state.jobs.fault else []),
                 *state.runs.problem_lines(), *replica_problems(load)]
        status = "engine_down" if not alive else "degraded" if found else "ok"
        body = {"status": status, "model": state.host.name, **load, "problems": bounded(found)}
        who = identify(settings, request.headers)
        return JSONResponse(body if who is not None and who.admin else counted(body, len(found)),
                            status_code=200 if alive else 503)

    for router in ROUTERS:
        app.include_router(router)
    return app
