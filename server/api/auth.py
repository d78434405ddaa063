"""Bearer API key on the API (`/v1/...`) and the web page's data (`/ui/api/...`); the health check,
the page's static files and the API documentation stay open. Checked before a request's body is
read (server/api/limits.py); the dependency below puts the same rule in the OpenAPI document."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import Request

from server.api.errors import APIError, error_response

PROTECTED = ("/v1/", "/inference/", "/ui/api/")  # /inference/: vLLM's token-in route
MESSAGE = "missing or invalid API key: send 'Authorization: Bearer <key>'"


def _valid(key: str, header: str) -> bool:
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def key_problem(key: str | None, path: str, header: str) -> Any:
    """The 401 response for a request without the key, or None when it may go on."""
    if not key or not path.startswith(PROTECTED) or _valid(key, header):
        return None
    return error_response(401, MESSAGE, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def require_api_key(request: Request) -> None:
    key: str | None = request.app.state.settings.api_key
    if key and not _valid(key, request.headers.get("authorization", "")):
        raise APIError(401, MESSAGE, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
