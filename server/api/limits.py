"""What every request passes before a route sees it: the API key, checked before the body is
read; a size limit that holds for chunked bodies too; JSON that can be stored and sent back
(no lone UTF-16 surrogates, which Python's JSON parser accepts and UTF-8 cannot encode) and
that nests no deeper than protocol/nesting.py allows; and a body parsed and validated in a
worker thread (a large one item by item: server/api/piecewise.py), so that it does not hold up
every other request on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.message
import gc
import json
import logging
import re
import threading
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from protocol.nesting import MAX_BODY_DEPTH, TooDeep, check_depth
from server.api.auth import key_problem
from server.api.errors import error_response
from server.api.piecewise import body_model, prevalidated
from server.request_errors import APIError
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


def json_content(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this type as JSON (application/json or */*+json; a body
    without a type it does not read as JSON at all)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _yield_gil(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Called for every object parsed: running Python code here lets the interpreter hand the GIL
    # to the event loop's thread, which json.loads alone (one C call) would hold to the end.
    return dict(pairs)


# A body above this is read in a worker thread; a smaller one takes a few milliseconds at most, less
# than waiting for a thread of the pool that store writes and event streams share.
OFF_LOOP_BYTES = 64 << 10
# Above this, a body is parsed with _yield_gil (about 4x slower); below, the parser's one C call is
# over within milliseconds.
_LARGE_BODY = 1 << 20


_collector_lock = threading.Lock()
_collector_pauses = 0
_collector_was_enabled = True


@contextlib.contextmanager
def collector_paused():
    """The cyclic garbage collector off while a large body becomes objects. Building millions of
    them sets off full collections that scan the whole heap, 0.6-1.3 s each with the whole process
    stopped, four to six per 20 MiB body: every other request waited on them. Nothing is lost: the
    next full collection finds any cycle made meanwhile. Nested and concurrent uses count."""
    global _collector_pauses, _collector_was_enabled
    with _collector_lock:
        if _collector_pauses == 0:
            _collector_was_enabled = gc.isenabled()
            gc.disable()
        _collector_pauses += 1
    try:
        yield
    finally:
        with _collector_lock:
            _collector_pauses -= 1
            if _collector_pauses == 0 and _collector_was_enabled:
                # What the body left alive (the job's millions of objects) goes straight to the
                # oldest generation: enabled with them young, the collector's next run scanned them
                # all at once on whichever thread allocated next (0.7 s on the event loop, measured).
                gc.freeze()
                gc.unfreeze()
                gc.enable()


def refuse_lone_surrogate(body: bytes) -> None:
    if lone_surrogate(body):
        raise APIError(400, "the body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff not in a "
                            "pair): it is not text", code="invalid_text")


def parse_body(body: bytes) -> Any:
    """A JSON body, parsed, or the 400 that says why not (FastAPI's own for malformed JSON)."""
    try:
        value = json.loads(body, object_pairs_hook=_yield_gil if len(body) > _LARGE_BODY else None)
    except RecursionError:  # the parser recurses once per level
        raise APIError(400, f"the body nests deeper than {MAX_BODY_DEPTH} levels", param="body",
                       code="nested_too_deeply") from None
    except json.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}]) from None
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: not UTF-8 text ({e.reason})",
                       code="invalid_json") from None
    try:
        check_depth(value, MAX_BODY_DEPTH, "the body")
    except TooDeep as e:
        raise APIError(400, str(e), param="body", code="nested_too_deeply") from None
    return value


def _body_params(dependant: Dependant) -> list[Any]:
    """The body parameters of a route and of every dependency it has."""
    found, todo = [], [dependant]
    while todo:
        d = todo.pop()
        found.extend(d.body_params)
        todo.extend(d.dependencies)
    return found


class GuardedRoute(APIRoute):
    """Parses and validates a JSON body in a worker thread (refusing a lone surrogate or nesting
    past the bound with a 400) before the route runs, answers a damaged checkpoint with a 409
    that names its step and a full or failing disk with a 503, and turns an unexpected error
    into a plain 500 answered on a connection that stays usable."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()
        body_fields = _body_params(self.dependant)
        # The one field a whole body validates as (FastAPI's own, so its errors are FastAPI's);
        # None where the body is split among several parameters.
        whole = body_fields[0] if len(body_fields) == 1 and not getattr(body_fields[0].field_info, "embed", False) \
            else None

        def read(body: bytes, as_json: bool) -> Any:
            refuse_lone_surrogate(body)
            if not as_json or not body_fields:  # FastAPI hands it over as bytes, refuses it, or never reads it
                return None
            value = parse_body(body)
            if whole is None:
                return value
            if len(body) > _LARGE_BODY:
                model = body_model(whole.field_info.annotation, whole.field_info.discriminator, value)
                if model is not None:
                    value = prevalidated(model, value)
            validated, errors = whole.validate(value, {}, loc=("body",))
            if errors:
                raise RequestValidationError(errors, body=value)
            return validated

        async def guarded(request: Request) -> Any:
            body = await request.body() if request.method in ("POST", "PUT", "PATCH") else b""
            # A large body's request, from parsing to the job stored, with the collector paused.
            with collector_paused() if len(body) > _LARGE_BODY else contextlib.nullcontext():
                if body:
                    as_json = json_content(request.headers.get("content-type"))
                    parsed = await asyncio.to_thread(read, body, as_json) if len(body) > OFF_LOOP_BYTES \
                        else read(body, as_json)
                    if as_json and body_fields:
                        # Starlette's Request.json() returns this instead of parsing again, and FastAPI's
                        # validation of a model instance it made itself is a no-op.
                        request._json = parsed
                return await self._answer(handler, request)

        return guarded

    @staticmethod
    async def _answer(handler: Callable, request: Request) -> Any:
        """The route's answer, or the one its error calls for."""
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
