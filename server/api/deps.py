"""What a route depends on: the server's state, the run a path names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Path, Request

from protocol.config import RUN_NAME
from server.api.errors import APIError
from server.engine.base import Engine
from server.export_queue import ExportQueue
from server.model_host import ModelHost
from server.serving import ServedModels
from server.settings import Settings
from server.store import Store
from server.training.jobs import JobManager
from server.training.runs import Run, RunManager


@dataclass
class ServerState:
    settings: Settings
    host: ModelHost
    engine: Engine
    served: ServedModels
    runs: RunManager
    store: Store
    jobs: JobManager
    export_queue: ExportQueue | None = None  # when --export asks for exporters


def get_state(request: Request) -> ServerState:
    return request.app.state.artisan


State = Annotated[ServerState, Depends(get_state)]
RunName = Annotated[str, Path(pattern=RUN_NAME, description="a run's name")]


def get_run(name: RunName, state: State) -> Run:
    run = state.runs.get(name)
    if run is None:
        raise APIError(404, f"run {name!r} does not exist", param="name", code="run_not_found")
    return run


RunDep = Annotated[Run, Depends(get_run)]
