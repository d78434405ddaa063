"""What every request passes before a route sees it: the API key, checked before the body is
read; a size limit that holds for chunked bodies too; and JSON that can be stored and sent back
(no lone UTF-16 surrogates, which Python's JSON parser accepts and UTF-8 cannot encode).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from server.api.auth import key_problem
from server.api.errors import APIError, error_response
from server.runs.checkpoints import CheckpointDamaged
from server.settings import Settings
from server.store import storage_failure

log = logging.getLogger("artisan.api")
# A \\uXXXX escape for a surrogate, not itself escaped (an even run of backslashes before it).
_SURROGATE = re.compile(rb"(?<!\\)((?:\\\\)*)\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_PAIR = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")


class BodyTooLarge(Exception):
    pass


def lone_surrogate(body: bytes) -> bool:
    """Whether a JSON body escapes a UTF-16 surrogate that is not half of a pair."""
    if b"\\u" not in body:
        return False
    for m in _SURROGATE.finditer(body):
        start = m.start() + len(m.group(1))
        if _PAIR.match(body, start):
            continue
        if start >= 6 and _PAIR.match(body, start - 6):
            continue  # the low half of a pair just matched
        return True
    return False


class GuardedRoute(APIRoute):
    """Refuses a JSON body holding a lone surrogate (a 400) before the route parses it, answers a
    damaged checkpoint with a 409 that names its step and a full or failing disk with a 503, and
    turns an unexpected error into a plain 500 answered on a connection that stays usable."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Any:
            if request.method in ("POST", "PUT", "PATCH") and lone_surrogate(await request.body()):
                raise APIError(400, "the body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff not in a "
                                    "pair): it is not text", code="invalid_text")
            try:
                return await handler(request)
            except (APIError, HTTPException, RequestValidationError, BodyTooLarge):
                raise
            except CheckpointDamaged as exc:  # the request is fine, the run's files are not: name the step
                raise APIError(409, str(exc), code="checkpoint_damaged") from None
            except Exception as exc:
                if storage_failure(exc):  # nothing was accepted; the same request can be sent again later
                    log.warning("%s: the data directory refused a write: %s", request.url.path, exc)
                    raise APIError(503, f"the server could not write to its data directory ({exc}); nothing "
                                        f"was accepted: retry once space is freed", code="storage_unavailable",
                                   headers={"Retry-After": "10"}) from None
                log.exception("unhandled error on %s", request.url.path)
                return error_response(500, "internal error; the server logged it", code="internal_error")

        return guarded


def install(app: FastAPI, settings: Settings) -> None:
    limit = settings.max_request_bytes
    inner = app.build_middleware_stack

    def build() -> Any:
        stack = inner()

        async def guard(scope: dict, receive: Callable, send: Callable) -> None:
            if scope["type"] != "http":
                return await stack(scope, receive, send)
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            problem = key_problem(settings, scope["path"], headers)
            if problem is not None:
                return await problem(scope, receive, send)
            size = headers.get("content-length", "")
            if size.isdigit() and int(size) > limit:
                return await _too_large(size, limit)(scope, receive, send)
            await stack(scope, _counting(receive, limit), send)

        return guard

    app.build_middleware_stack = build  # outermost: nothing is read before these checks

    @app.exception_handler(BodyTooLarge)
    async def _chunked_too_large(request: Request, exc: BodyTooLarge):
        return _too_large("more than that many", limit)


def _counting(receive: Callable, limit: int) -> Callable:
    seen = 0

    async def counted() -> dict:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge()
        return message

    return counted


def _too_large(size: str, limit: int) -> Any:
    return error_response(413, f"request body of {size} bytes exceeds the limit of {limit} bytes",
                          code="payload_too_large")
