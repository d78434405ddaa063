"""API keys on the API (`/v1/...`) and the web page's data (`/ui/api/...`); the health check,
the page's static files and the API documentation stay open. Checked before a request's body is
read (server/api/limits.py); the dependency below puts the same rule in the OpenAPI document.

A key comes as `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>` (Anthropic's).
`--api-key` keys are admin keys: they see every run. `--tenant-keys FILE` names tenant keys: a
tenant sees only the runs it created (server/runs/ownership.py's Owners.visible). Each key, admin or tenant, is
a caller of its own (server/runs/ownership.py's Caller) for what it records (a session, a stored
response).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path
from typing import Annotated, Any, Mapping

from fastapi import Depends, Request

from server.api.errors import error_response
from server.request_errors import APIError
from server.runs.ownership import Caller
from server.settings import Settings

PROTECTED = ("/v1/", "/inference/", "/ui/api/")  # /inference/: vLLM's token-in route
MESSAGE = "missing or invalid API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
TENANT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def server_keys(setting: str | None) -> list[str]:
    return [k.strip() for k in (setting or "").split(",") if k.strip()]


def read_tenant_keys(path: Path) -> dict[str, str]:
    """`NAME=KEY` per line (blank lines and `#` comments skipped); a mistake is one line naming it."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"--tenant-keys {path}: {e.strerror or e}")
    keys: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, key = (part.strip() for part in line.partition("="))
        if not sep or not TENANT_NAME.match(name) or not key:
            raise ValueError(f"--tenant-keys {path}:{n}: expected NAME=KEY (NAME of letters, digits, '.', '_', '-')")
        if name in keys:
            raise ValueError(f"--tenant-keys {path}:{n}: tenant {name!r} is named twice")
        if key in keys.values():
            raise ValueError(f"--tenant-keys {path}:{n}: this key is already another tenant's")
        keys[name] = key
    return keys


def presented_key(headers: Mapping[str, str]) -> str:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key", "").strip()


def _matches(keys: list[str], presented: str) -> list[bool]:
    # Every key is compared, so the time taken does not tell which one nearly matched.
    return [hmac.compare_digest(presented.encode(), k.encode()) for k in keys]


def identify(settings: Settings, headers: Mapping[str, str]) -> Caller | None:
    """The caller a request's key names; None for a missing or unknown key. A server without keys
    has one caller, the admin."""
    admin, tenants = server_keys(settings.api_key), settings.tenant_keys
    if not admin and not tenants:
        return Caller(None, "")
    presented = presented_key(headers)
    if not presented:
        return None
    is_admin, tenant_hits = any(_matches(admin, presented)), _matches(list(tenants.values()), presented)
    digest = hashlib.sha256(presented.encode()).hexdigest()[:16]
    if is_admin:
        return Caller(None, digest)
    for name, hit in zip(tenants, tenant_hits):
        if hit:
            return Caller(name, digest)
    return None


def key_problem(settings: Settings, path: str, headers: Mapping[str, str]) -> Any:
    """The 401 response for a request without a key, or None when it may go on."""
    if not path.startswith(PROTECTED) or identify(settings, headers) is not None:
        return None
    return error_response(401, MESSAGE, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def require_api_key(request: Request) -> Caller:
    who = identify(request.app.state.settings, request.headers)
    if who is None:
        raise APIError(401, MESSAGE, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return who


CallerDep = Annotated[Caller, Depends(require_api_key)]


def caller(request: Request) -> str:
    """Who is asking, as far as sessions and stored responses go: a digest of their key; everyone
    is one caller on a server without keys."""
    return require_api_key(request).digest
