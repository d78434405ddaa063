"""A run's stored trajectories as JSONL: downloaded (export.jsonl) and uploaded into a run (import),
with token ids and logprobs kept, so they can be trained on again."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Iterator

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field, ValidationError

from protocol.choices import INT64
from protocol.trajectory import Trajectory
from protocol.validation import first_problem
from server.api.auth import require_api_key
from server.api.deps import RunDep, State
from server.api.errors import documented
from server.api.limits import GuardedRoute
from server.api.training_routes import SPLIT
from server.request_errors import APIError

router = APIRouter(dependencies=[Depends(require_api_key)], route_class=GuardedRoute,
                   responses=documented(401, 503))


class JsonlLine(BaseModel):
    """One line of export.jsonl, as import reads it back."""

    trajectory: Trajectory
    step: int = Field(default=0, ge=0, le=INT64)
    split: str = Field(default="train", pattern=SPLIT)
    group_index: int = Field(default=0, ge=0, le=INT64)
    traj_index: int = Field(default=0, ge=0, le=INT64)


@router.get("/v1/runs/{name}/export.jsonl", responses=documented(404, 409))
async def export_jsonl(run: RunDep, state: State, step: int | None = Query(None, ge=0, le=INT64),
                       split: str | None = Query(None, pattern=SPLIT)) -> StreamingResponse:
    """One JSON line per stored trajectory: run, step, split, group_index, traj_index, reward, trajectory."""
    store, name = state.store, run.name

    def lines() -> Iterator[bytes]:  # one step at a time: a long run's export need not fit in memory
        for s in [step] if step is not None else store.trajectories.steps(name):
            for r in store.trajectories.of(name, s, split):
                rec = {"run": name, "step": r["step"], "split": r["split"], "group_index": r["group_index"],
                       "traj_index": r["traj_index"], "reward": r["reward"], "trajectory": r["data"]}
                yield (json.dumps(rec) + "\n").encode()

    return StreamingResponse(lines(), media_type="application/x-ndjson",
                             headers={"Content-Disposition": f'attachment; filename="{name}.jsonl"'})


def _why(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "{}: {}".format(*first_problem(e))
    if isinstance(e, RecursionError):
        return "nested too deeply"
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
            rec = JsonlLine.model_validate_json(line)
        except (ValueError, RecursionError) as e:  # pydantic's ValidationError is a ValueError
            raise APIError(400, f"line {n}: {_why(e)}", param="body", code="invalid_jsonl")
        rows.append((rec.step, split or rec.split, rec.group_index, rec.traj_index, rec.trajectory.reward,
                     rec.trajectory.model_dump(mode="json")))
    return rows


@router.post("/v1/runs/{name}/import", responses=documented(404, 409))
async def import_jsonl(run: RunDep, request: Request, state: State,
                       split: str | None = Query(None, pattern=SPLIT)) -> dict[str, Any]:
    """Store trajectories from an export into this run, at their steps and groups (and `split`, if
    given, instead of theirs). Added beside what the run has; nothing is trained or created."""
    rows = await asyncio.to_thread(_parse, await request.body(), split)
    if not rows:
        raise APIError(400, "no trajectories in the body: send the JSONL that export.jsonl returns", param="body")
    by_key: dict[tuple[int, str], list[tuple[int, int, float, dict[str, Any]]]] = {}
    for step, row_split, g, t, reward, data in rows:
        by_key.setdefault((step, row_split), []).append((g, t, reward, data))
    for (step, row_split), batch in sorted(by_key.items()):
        await asyncio.to_thread(state.store.trajectories.put, run.name, step, row_split, batch)
    return {"stored": len(rows), "steps": sorted({k[0] for k in by_key}), "splits": sorted({k[1] for k in by_key})}
