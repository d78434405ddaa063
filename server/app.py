"""The FastAPI application: settings, shared state, routes."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request

from server import export
from server.api import errors, export_routes, openai_routes, training_routes, ui_routes
from server.engine.scheduler import Engine
from server.model_host import ModelHost, Policy
from server.settings import Settings
from server.store import Store
from server.training.jobs import JobManager
from server.training.runs import RunManager

log = logging.getLogger("artisan")


@dataclass
class ServerState:
    settings: Settings
    host: ModelHost
    engine: Engine
    runs: RunManager
    store: Store
    jobs: JobManager
    exports: Any = None  # the exporters' dispatcher (server/export) when --export asks for one

    def resolve(self, model: str) -> Policy | None:
        return self.runs.resolve(model)


def create_app(settings: Settings) -> FastAPI:
    exports = export.build(settings)  # None unless --export asks; first, so a bad one stops start-up at once
    host = ModelHost(settings.model, device=settings.device, dtype=settings.dtype)
    engine = Engine(host, max_batch=settings.max_batch, max_waiting=settings.max_waiting)
    data_dir = Path(settings.data_dir)
    store = Store(data_dir / "artisan.sqlite")
    runs = RunManager(host, data_dir)
    jobs = JobManager(host, runs, store, exports, settings.keep_trajectory_steps)
    state = ServerState(settings, host, engine, runs, store, jobs, exports)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runs.resume_all()
        jobs.start()
        engine.start()
        log.info("serving %s (%.1fM parameters) on %s", host.name, host.n_params / 1e6, host.device)
        yield
        engine.stop()
        jobs.stop()
        if exports is not None:
            exports.close()

    app = FastAPI(title="art-server", lifespan=lifespan)
    app.state.settings = settings
    app.state.artisan = state
    errors.install(app)

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > settings.max_request_bytes:
            return errors.error_response(413, f"request body of {size} bytes exceeds the limit of "
                                              f"{settings.max_request_bytes} bytes", code="payload_too_large")
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": host.name, **engine.load}

    app.include_router(openai_routes.router)
    app.include_router(training_routes.router)
    app.include_router(ui_routes.router)
    app.include_router(export_routes.router)
    return app
