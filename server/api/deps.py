"""What a route depends on: the server's state, the run a path names (when the caller's key may
see it: keys per tenant are enforced here, for every run-scoped route)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request

from protocol.config import RUN_NAME
from protocol.jobs import SESSION_ID
from server.api.auth import CallerDep, caller
from server.harness.sessions import Recording
from server.request_errors import other_model, run_not_found
from server.runs.facade import NotServed, OtherBaseModel
from server.runs.run import Run
from server.state import ServerState


def get_state(request: Request) -> ServerState:
    return request.app.state.artisan


State = Annotated[ServerState, Depends(get_state)]
RunName = Annotated[str, Path(pattern=RUN_NAME, description="a run's name")]
SessionId = Annotated[str, Path(pattern=SESSION_ID, description="a session's id, chosen by the client")]


def open_session(state: ServerState, session_id: str, request: Request) -> Recording:
    """How the request records into the session its URL names (the caller's: ids are per key).
    Nothing is created or checked yet: server/sampling/completions.py begins it once the request is
    known to be sampled, so a request that fails leaves no session."""
    return state.sessions.recording(session_id, caller(request))


def get_run(name: RunName, state: State, who: CallerDep) -> Run:
    try:
        return state.runs.find(name, who)
    except OtherBaseModel as e:
        raise other_model(str(e)) from None
    except NotServed:
        raise run_not_found(name) from None


RunDep = Annotated[Run, Depends(get_run)]  # a run-scoped route takes `run: RunDep`, and is owner-checked
