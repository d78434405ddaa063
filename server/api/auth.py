"""Bearer API key on every route but the health check."""

from __future__ import annotations

import hmac

from fastapi import Request

from server.api.errors import APIError


def require_api_key(request: Request) -> None:
    key: str | None = request.app.state.settings.api_key
    if not key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
