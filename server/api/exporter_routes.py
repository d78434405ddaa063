"""The exporters' counters: what the server's export queue (server/export_queue.py) delivered,
failed or dropped, per exporter."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from server.api.auth import require_api_key
from server.api.deps import State
from server.api.errors import documented
from server.api.limits import GuardedRoute

router = APIRouter(dependencies=[Depends(require_api_key)], route_class=GuardedRoute,
                   responses=documented(401, 503))


@router.get("/v1/exporters")
async def exporters(state: State) -> dict[str, Any]:
    """Per exporter: trajectories exported, failed, dropped (queue full), queued, in flight, last error."""
    if state.export_queue is None:
        return {"enabled": False, "data": []}
    return {"enabled": True, **state.export_queue.stats()}
