"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause becomes one of these with the right status; nothing a request
sends can take the server down.
"""

from __future__ import annotations

import json
import logging
from typing import Sequence

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from protocol.jobs import JOB_KINDS
from server.request_errors import APIError, ParamError

log = logging.getLogger("artisan.api")

# The name of a route that takes any path to say what is there instead: its methods are none of a path's.
CATCH_ALL = "catch_all"

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          409: "conflict_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 503: "server_overloaded"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every error the server answers (on the Messages paths with `"type": "error"` beside it)."""

    error: ErrorDetail


# What each code means here, as the OpenAPI document says it.
_MEANINGS = {400: "a malformed request or a value out of range (the message names the field)",
             401: "a missing or invalid API key (when the server has keys)",
             403: "not this key's to use (a session of another key), or the key's bound is reached",
             404: "no such thing, or not this key's to see (another tenant's run answers as if absent)",
             409: "a conflict with the server's state (a reused key, a damaged checkpoint, a name taken)",
             413: "the request body is larger than --max-request-bytes",
             429: "too many live sessions",
             503: "the server is at capacity, or its data directory refused a write: retry later"}


def documented(*codes: int) -> dict[int | str, dict]:
    """`responses=` for a route or router: these error codes, with the error body."""
    return {code: {"model": ErrorBody, "description": _MEANINGS[code]} for code in codes}


def publish_error_codes(app: FastAPI) -> None:
    """The OpenAPI document as the server answers: a request that fails validation gets a 400 (the
    handler below), never FastAPI's 422, and any route with a body may answer 413 (server/api/limits.py)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in schema["paths"].values():
                for op in operations.values():
                    responses = op.setdefault("responses", {})
                    invalid = responses.pop("422", None)
                    if invalid is not None or "requestBody" in op:
                        responses.setdefault("400", _reference(400))
                    if "requestBody" in op:
                        responses.setdefault("413", _reference(413))
            schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
            schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _reference(code: int) -> dict:
    return {"description": _MEANINGS[code],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")  # 405: the client's
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _for(request: Request, response: JSONResponse) -> JSONResponse:
    """Anthropic's clients read `{"type": "error", "error": {...}}`: on the Messages paths the
    body says so too (the rest of it is the same)."""
    if request.url.path.endswith(("/messages", "/messages/count_tokens")):
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


def allow_header(request: Request) -> dict[str, str]:
    """A 405's Allow header: every method a route at the request's path takes (RFC 9110), {} where
    none does. Starlette names only the first route that matched the path, and an included router's
    routes are not among `app.routes` (FastAPI wraps each router in one route), so they are read
    from the routers `install` was given."""
    app = request.app
    routes = [*app.routes, *(route for router in app.state.routers for route in router.routes)]
    methods = {m for route in routes if getattr(route, "name", None) != CATCH_ALL
               and route.matches(request.scope)[0] is not Match.NONE for m in getattr(route, "methods", None) or ()}
    return {"Allow": ", ".join(sorted(methods))} if methods else {}


def install(app: FastAPI, routers: Sequence[APIRouter] = ()) -> None:
    """The error handlers of `app`, whose routes are its own and those of `routers` (included in it)."""
    publish_error_codes(app)
    app.state.routers = tuple(routers)

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
        raised = first.get("ctx", {}).get("error")  # a validator's own exception, worded for the client
        blamed = (raised.param,) if isinstance(raised, ParamError) else ()
        param = _loc((*first.get("loc", ()), *blamed))
        msg = str(raised) if isinstance(raised, ValueError) and str(raised) else first.get("msg", "invalid value")
        more = f" (and {len(errors) - 1} more problem{'s' * (len(errors) > 2)})" if len(errors) > 1 else ""
        named = param is None or msg.startswith(param + " ")  # "top_logprobs requires ...": said once
        return _for(request, error_response(400, f"{msg}{more}" if named else f"{param}: {msg}{more}", param,
                                            "invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 405:
            return error_response(405, f"{request.url.path} does not take {request.method}",
                                  code="method_not_allowed", headers=allow_header(request) or exc.headers)
        if exc.status_code == 404 and exc.detail == "Not Found":  # the router's: no path matched
            return error_response(404, f"no route {request.method} {request.url.path}", code="unknown_route")
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, "internal error; the server logged it", code="internal_error")
