"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause becomes one of these with the right status; nothing a request
sends can take the server down.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from protocol.jobs import JOB_KINDS

log = logging.getLogger("artisan.api")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          409: "conflict_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 503: "server_overloaded"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _for(request: Request, response: JSONResponse) -> JSONResponse:
    """Anthropic's clients read `{"type": "error", "error": {...}}`: on the Messages paths the
    body says so too (the rest of it is the same)."""
    if request.url.path.endswith("/messages"):
        body = json.loads(response.body)
        return JSONResponse({"type": "error", **body}, status_code=response.status_code, headers={
            k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")})
    return response


def _branch(part: object) -> bool:
    """A union's branch in an error's location (`str`, `list[...]`): a type, not a field."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "dict", "list", "none"))


def _first(errors: list[dict]) -> dict:
    """The error to name: with a union in play, the deepest one (a string-or-blocks field is best
    explained by the block that failed, not by its not being a string)."""
    if any(_branch(p) for e in errors for p in e.get("loc", ())):
        return max(errors, key=lambda e: len(e.get("loc", ())))
    return errors[0]


def _loc(loc: tuple) -> str | None:
    # "body", a union's branch and the job kind a discriminated union adds are not part of the field's path.
    parts = [str(p) for i, p in enumerate(loc)
             if p != "body" and not _branch(p) and not (i == 1 and p in JOB_KINDS)]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _for(request, error_response(exc.status, exc.message, exc.param, exc.code, exc.headers))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = _first(errors) if errors else {"msg": "invalid request", "loc": ()}
        if first.get("type") == "json_invalid":
            return _for(request, error_response(
                400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(), code="invalid_json"))
        param = _loc(tuple(first.get("loc", ())))
        msg = first.get("msg", "invalid value")
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        return _for(request, error_response(400, f"{param}: {msg}{more}" if param else f"{msg}{more}", param,
                                            "invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, "internal error; the server logged it", code="internal_error")
