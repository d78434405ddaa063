"""Getting trajectories out: the exporters' counters, and a run's trajectories as JSONL (export,
and import into another run) with token ids and logprobs kept, so they can be trained on again."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Iterator

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from client.types import Trajectory
from server.api.auth import require_api_key
from server.api.errors import APIError

router = APIRouter(dependencies=[Depends(require_api_key)])
SPLIT = r"^[A-Za-z0-9_-]{1,32}$"


def _state(request: Request):
    return request.app.state.artisan


def _require_run(request: Request, name: str) -> None:
    if name not in _state(request).runs.runs:
        raise APIError(404, f"run {name!r} does not exist", param="name", code="run_not_found")


@router.get("/v1/exporters")
async def exporters(request: Request) -> dict[str, Any]:
    """Per exporter: trajectories exported, failed, dropped (queue full), queued, in flight, last error."""
    dispatcher = _state(request).exports
    if dispatcher is None:
        return {"enabled": False, "data": []}
    return {"enabled": True, **dispatcher.stats()}


@router.get("/v1/runs/{name}/export.jsonl")
async def export_jsonl(name: str, request: Request, step: int | None = None,
                       split: str | None = Query(None, pattern=SPLIT)) -> StreamingResponse:
    """One JSON line per stored trajectory: run, step, split, group_index, traj_index, reward, trajectory."""
    _require_run(request, name)
    store = _state(request).store

    def lines() -> Iterator[bytes]:  # one step at a time: a long run's export need not fit in memory
        if step is not None:
            steps = [step]
        else:
            # The store has no step listing of its own; a DISTINCT over its index is cheap.
            steps = [r["step"] for r in store._rows("SELECT DISTINCT step FROM trajectories WHERE run = ? ORDER BY step", (name,))]
        for s in steps:
            for r in store.trajectories(name, s, split):
                rec = {"run": name, "step": r["step"], "split": r["split"], "group_index": r["group_index"],
                       "traj_index": r["traj_index"], "reward": r["reward"], "trajectory": r["data"]}
                yield (json.dumps(rec) + "\n").encode()

    return StreamingResponse(lines(), media_type="application/x-ndjson",
                             headers={"Content-Disposition": f'attachment; filename="{name}.jsonl"'})


def _why(e: Exception) -> str:
    if isinstance(e, KeyError):
        return "no 'trajectory'"
    if isinstance(e, ValidationError):
        err = e.errors()[0]
        return f"trajectory.{'.'.join(str(x) for x in err.get('loc', ()))}: {err['msg']}"
    return str(e).splitlines()[0][:300]


def _parse(body: bytes, split: str | None) -> list[tuple[int, str, int, int, float, dict[str, Any]]]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not UTF-8 JSONL: {e}", param="body", code="invalid_jsonl")
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            traj = Trajectory.model_validate(rec["trajectory"])
            row_split = split or str(rec.get("split", "train"))
            rows.append((int(rec.get("step", 0)), row_split, int(rec.get("group_index", 0)),
                         int(rec.get("traj_index", 0)), traj.reward, traj.model_dump(mode="json")))
        except (ValueError, KeyError, TypeError, ValidationError) as e:
            raise APIError(400, f"line {n}: {_why(e)}", param="body", code="invalid_jsonl")
    return rows


@router.post("/v1/runs/{name}/import")
async def import_jsonl(name: str, request: Request, split: str | None = Query(None, pattern=SPLIT)) -> dict[str, Any]:
    """Store trajectories from an export into this run, at their steps and groups (and `split`, if
    given, instead of theirs). Added beside what the run has; nothing is trained or created."""
    _require_run(request, name)
    rows = await asyncio.to_thread(_parse, await request.body(), split)
    if not rows:
        raise APIError(400, "no trajectories in the body: send the JSONL that export.jsonl returns", param="body")
    by_key: dict[tuple[int, str], list[tuple[int, int, float, dict[str, Any]]]] = {}
    for step, row_split, g, t, reward, data in rows:
        by_key.setdefault((step, row_split), []).append((g, t, reward, data))
    store = _state(request).store
    for (step, row_split), batch in sorted(by_key.items()):
        await asyncio.to_thread(store.put_trajectories, name, step, row_split, batch)
    return {"stored": len(rows), "steps": sorted({k[0] for k in by_key}), "splits": sorted({k[1] for k in by_key})}
