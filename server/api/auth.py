"""API keys on the API (`/v1/...`) and the web page's data (`/ui/api/...`); the health check,
the page's static files and the API documentation stay open. Checked before a request's body is
read (server/api/limits.py); the dependency below puts the same rule in the OpenAPI document.

A key comes as `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>` (Anthropic's).
`--api-key` may hold several keys separated by commas: each is a caller of its own, and what a
caller records (a session, a stored response) is refused to the others.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Mapping

from fastapi import Request

from server.api.errors import APIError, error_response

PROTECTED = ("/v1/", "/inference/", "/ui/api/")  # /inference/: vLLM's token-in route
MESSAGE = "missing or invalid API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"


def server_keys(setting: str | None) -> list[str]:
    return [k.strip() for k in (setting or "").split(",") if k.strip()]


def presented_key(headers: Mapping[str, str]) -> str:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key", "").strip()


def _valid(keys: list[str], presented: str) -> bool:
    # Every key is compared, so the time taken does not tell which one nearly matched.
    return bool(presented) and sum(hmac.compare_digest(presented.encode(), k.encode()) for k in keys) > 0


def key_problem(setting: str | None, path: str, headers: Mapping[str, str]) -> Any:
    """The 401 response for a request without a key, or None when it may go on."""
    keys = server_keys(setting)
    if not keys or not path.startswith(PROTECTED) or _valid(keys, presented_key(headers)):
        return None
    return error_response(401, MESSAGE, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def require_api_key(request: Request) -> None:
    keys = server_keys(request.app.state.settings.api_key)
    if keys and not _valid(keys, presented_key(request.headers)):
        raise APIError(401, MESSAGE, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def caller(request: Request) -> str:
    """Who is asking, as far as ownership goes: a digest of their key; everyone is one caller on a
    server without keys."""
    if not server_keys(request.app.state.settings.api_key):
        return ""
    return hashlib.sha256(presented_key(request.headers).encode()).hexdigest()[:16]
