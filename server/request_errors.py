"""What a request is refused with: a status, a message and the field it names. The sampling core
and the routes raise it; the HTTP face answers it as an OpenAI error body (server/api/errors.py).
Nothing a request sends becomes anything else."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.harness.sessions import SessionError


class ParamError(ValueError):
    """A request model's check across fields, naming the field to blame: pydantic places a
    model-level error at the model, and the 400 then names `param` under it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def run_not_found(name: str) -> APIError:
    return APIError(404, f"run {name!r} does not exist", param="name", code="run_not_found")


def other_model(message: str) -> APIError:
    """A run of another base model than this server's, named in a request or a registration."""
    return APIError(409, message, param="name", code="run_of_another_model")


def session_error(e: SessionError) -> APIError:
    return APIError(e.status, e.message, param="session_id", code="session_unavailable")
