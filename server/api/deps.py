"""What a route depends on: the server's state, the run a path names (when the caller's key may
see it: keys per tenant are enforced here, for every run-scoped route)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Path, Request

from protocol.config import RUN_NAME
from protocol.jobs import SESSION_ID
from server.api.auth import Caller, CallerDep, caller
from server.api.errors import APIError
from server.engine.base import Engine
from server.export_queue import ExportQueue
from server.model.host import ModelHost
from server.runs.ownership import Owners
from server.harness.responses import ResponseStore
from server.runs.facade import Runs
from server.runs.run import Run
from server.sampling.served_names import ServedModels
from server.harness.sessions import Recording, SessionError, Sessions
from server.settings import Settings
from server.store import Store
from server.training.jobs import JobManager


@dataclass
class ServerState:
    settings: Settings
    host: ModelHost
    engine: Engine
    served: ServedModels
    runs: Runs
    store: Store
    jobs: JobManager
    sessions: Sessions
    responses: ResponseStore  # for previous_response_id
    export_queue: ExportQueue | None = None  # when --export asks for exporters
    owners: Owners | None = None  # who created each run; build_state always sets it


def get_state(request: Request) -> ServerState:
    return request.app.state.artisan


State = Annotated[ServerState, Depends(get_state)]
RunName = Annotated[str, Path(pattern=RUN_NAME, description="a run's name")]
SessionId = Annotated[str, Path(pattern=SESSION_ID, description="a session's id, chosen by the client")]


def session_error(e: SessionError) -> APIError:
    return APIError(e.status, e.message, param="session_id", code="session_unavailable")


def open_session(state: ServerState, session_id: str, request: Request) -> Recording:
    """How the request records into the session its URL names (the caller's: ids are per key).
    Nothing is created or checked yet: server/api/completions.py begins it once the request is
    known to be sampled, so a request that fails leaves no session."""
    return state.sessions.recording(session_id, caller(request))


def run_not_found(name: str) -> APIError:
    return APIError(404, f"run {name!r} does not exist", param="name", code="run_not_found")


def may_see_run(state: ServerState, who: Caller, name: str) -> bool:
    """Whether the caller may see run `name`: another tenant's run is, to it, a run that does not exist."""
    return who.may_see(state.owners.owner(name))


def other_model(message: str) -> APIError:
    """A run of another base model than this server's, named in a request or a registration."""
    return APIError(409, message, param="name", code="run_of_another_model")


def get_run(name: RunName, state: State, who: CallerDep) -> Run:
    run = state.runs.get(name)
    if run is None or not may_see_run(state, who, name):
        if may_see_run(state, who, name) and (why := state.runs.other_model(name)) is not None:
            raise other_model(why)
        raise run_not_found(name)
    return run


RunDep = Annotated[Run, Depends(get_run)]  # a run-scoped route takes `run: RunDep`, and is owner-checked
