"""What a route depends on: the server's state, the run a path names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Callable

from fastapi import Depends, Path, Request

from protocol.config import RUN_NAME
from protocol.jobs import SESSION_ID
from server.api.auth import caller
from server.api.errors import APIError
from server.engine.base import Engine
from server.export_queue import ExportQueue
from server.model_host import ModelHost
from server.response_store import ResponseStore
from server.serving import ServedModels
from server.sessions import SessionError, Sessions
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
    sessions: Sessions = field(default_factory=Sessions)
    responses: ResponseStore = field(default_factory=ResponseStore)  # for previous_response_id


def get_state(request: Request) -> ServerState:
    return request.app.state.artisan


State = Annotated[ServerState, Depends(get_state)]
RunName = Annotated[str, Path(pattern=RUN_NAME, description="a run's name")]
SessionId = Annotated[str, Path(pattern=SESSION_ID, description="a session's id, chosen by the client")]


def session_error(e: SessionError) -> APIError:
    return APIError(e.status, e.message, param="session_id", code="session_unavailable")


def open_session(state: ServerState, session_id: str, request: Request
                 ) -> Callable[[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]], None]:
    """The recorder of the session a URL names, opened (or created) for one more exchange."""
    try:
        return state.sessions.recorder(state.sessions.open(session_id, caller(request)))
    except SessionError as e:
        raise session_error(e)


def get_run(name: RunName, state: State) -> Run:
    run = state.runs.get(name)
    if run is None:
        raise APIError(404, f"run {name!r} does not exist", param="name", code="run_not_found")
    return run


RunDep = Annotated[Run, Depends(get_run)]


def deletable_run(run: RunDep) -> Run:
    """The run a path names, for deleting it: the one place that decides who may delete a run
    (today, any caller with a key)."""
    return run


DeletableRun = Annotated[Run, Depends(deletable_run)]
