"""The FastAPI application: settings, shared state, routes."""

from __future__ import annotations

import ipaddress
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel

from server.api import errors, openai_routes, training_routes
from server.engine.scheduler import Engine
from server.model_host import ModelHost, Policy
from server.store import Store
from server.training.jobs import JobManager
from server.training.runs import RunManager

log = logging.getLogger("artisan")
DEFAULT_MODEL_DIR = Path(__file__).parent / "embedded" / "model"


class Settings(BaseModel):
    model: Path = DEFAULT_MODEL_DIR
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    data_dir: Path = Path("artisan-data")
    device: str = "auto"
    dtype: str = "auto"
    max_batch: int = 64
    max_waiting: int = 512
    max_request_bytes: int = 64 * 1024 * 1024


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(settings: Settings) -> None:
    """A server that trains on what it is sent must not listen to the world unauthenticated."""
    if not is_loopback(settings.host) and not settings.api_key:
        raise SystemExit(f"refusing to bind {settings.host} without an API key: pass --api-key or set ARTISAN_API_KEY")


@dataclass
class ServerState:
    settings: Settings
    host: ModelHost
    engine: Engine
    runs: RunManager
    store: Store
    jobs: JobManager
    extras: dict[str, Any] = field(default_factory=dict)

    def resolve(self, model: str) -> Policy | None:
        return self.runs.resolve(model)


def create_app(settings: Settings) -> FastAPI:
    host = ModelHost(settings.model, device=settings.device, dtype=settings.dtype)
    engine = Engine(host, max_batch=settings.max_batch, max_waiting=settings.max_waiting)
    data_dir = Path(settings.data_dir)
    store = Store(data_dir / "artisan.sqlite")
    runs = RunManager(host, data_dir)
    jobs = JobManager(host, runs, store)
    state = ServerState(settings, host, engine, runs, store, jobs)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runs.resume_all()
        jobs.start()
        engine.start()
        log.info("serving %s (%.1fM parameters) on %s", host.name, host.n_params / 1e6, host.device)
        yield
        engine.stop()
        jobs.stop()

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
    return app
