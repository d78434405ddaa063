"""The web UI: a static page under /ui and the JSON it reads under /ui/api.

The page itself (HTML, JS, CSS) holds no data, so it loads without a key; every /ui/api route
needs the same Bearer key as the rest of the API. When the server has a key, the page asks for
it, keeps it in sessionStorage (gone when the tab closes) and sends it as `Authorization: Bearer`.
A key in the URL would end up in browser history and proxy logs, hence no `?key=`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Query
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, RedirectResponse

from protocol.choices import INT64
from server.api.auth import CallerDep, require_api_key
from server.api.deps import RunName, State
from server.api.errors import documented
from server.api.limits import GuardedRoute
from server.request_errors import APIError, run_not_found
from server.runs.ownership import Caller
from server.state import ServerState
from server.store import json_safe

STATIC_DIR = Path(__file__).resolve().parent.parent / "ui" / "static"
_MEDIA_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
# Everything the page needs comes from this server: a CDN script or an inline injection is refused.
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'")
_PAGE_HEADERS = {"Content-Security-Policy": _CSP, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

page = APIRouter(include_in_schema=False, route_class=GuardedRoute)
api = APIRouter(prefix="/ui/api", dependencies=[Depends(require_api_key)], route_class=GuardedRoute,
                responses=documented(401, 503))


@page.get("/ui")
async def ui_redirect() -> RedirectResponse:
    # The page uses relative URLs (static/..., api/...), which resolve under /ui/ only.
    return RedirectResponse("/ui/")


@page.get("/ui/")
async def ui_index() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=_PAGE_HEADERS)


@page.get("/ui/static/{name}")
async def ui_static(name: str) -> FileResponse:
    # Only files that are in the folder by name: a crafted path never leaves it.
    files = {p.name: p for p in STATIC_DIR.iterdir() if p.is_file()}
    if name not in files or files[name].suffix not in _MEDIA_TYPES:
        raise APIError(404, f"no UI file {name!r}", code="not_found")
    return FileResponse(files[name], media_type=_MEDIA_TYPES[files[name].suffix], headers=_PAGE_HEADERS)


def _known_runs(state: ServerState, who: Caller) -> dict[str, dict[str, Any]]:
    """Runs the server hosts, plus any the store remembers whose checkpoints are gone, of those the
    caller may see."""
    out = {r["name"]: {"name": r["name"], "project": r["project"], "step": None} for r in state.store.runs.all()}
    for run in state.runs.all():
        out[run.name] = {"name": run.name, "project": run.spec.project, "step": run.step,
                         # what the bare name serves: an earlier step while one is pinned (--keep-best)
                         "serving_step": run.step if run.serving_step is None else run.serving_step}
    return {name: run for name, run in out.items() if state.runs.owners.visible(who, name)}


def _require_run(state: ServerState, who: Caller, name: str) -> dict[str, Any]:
    run = _known_runs(state, who).get(name)
    if run is None:
        raise run_not_found(name)
    return run


def _curves(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    curves: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        curves.setdefault(r["split"], []).append({"step": r["step"], "n": r["n"], "reward_mean": r["reward_mean"]})
    return curves


def best_held_out(points: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The evaluated step with the highest mean held-out ("val") reward, the earliest on ties."""
    scored = [p for p in points if p["reward_mean"] is not None]
    if not scored:
        return None
    best = max(scored, key=lambda p: (p["reward_mean"], -p["step"]))
    return {"step": best["step"], "reward": best["reward_mean"], "n": best["n"]}


@api.get("/runs")
async def ui_runs(state: State, who: CallerDep) -> dict[str, Any]:
    store = state.store
    runs = list(_known_runs(state, who).values())
    for run in runs:
        curves = _curves(await asyncio.to_thread(store.trajectories.reward_by_step, run["name"]))
        run["last_reward"] = curves["train"][-1]["reward_mean"] if curves.get("train") else None
        run["last_eval_reward"] = curves["val"][-1]["reward_mean"] if curves.get("val") else None
    return {"data": runs}


@api.get("/runs/{name}", responses=documented(404, 409))
async def ui_run(name: RunName, state: State, who: CallerDep) -> dict[str, Any]:
    run = _require_run(state, who, name)
    store = state.store
    steps = await asyncio.to_thread(store.steps.of, name)
    curves = _curves(await asyncio.to_thread(store.trajectories.reward_by_step, name))
    return {**run, "steps": [{k: s[k] for k in ("step", "kind", "metrics", "warnings")} for s in steps],
            "rewards": curves, "best_held_out": best_held_out(curves.get("val", []))}


@api.get("/runs/{name}/attempts", responses=documented(404, 409))
async def ui_attempts(name: RunName, state: State, who: CallerDep) -> dict[str, Any]:
    """Every attempt at a step of the run, oldest first, trained or not, with its figures and
    warnings: what explains a run that does not learn."""
    _require_run(state, who, name)
    rows = await asyncio.to_thread(state.store.steps.attempts, name)
    return json_safe({"run": name, "data": rows})


@api.get("/runs/{name}/steps/{step}/groups", responses=documented(404, 409))
async def ui_step_groups(name: RunName, state: State, who: CallerDep, step: int = PathParam(ge=0, le=INT64),
                         split: str = Query("train", max_length=32)) -> dict[str, Any]:
    """A step's groups, those with the widest reward spread first: where the learning signal is."""
    _require_run(state, who, name)
    rows = await asyncio.to_thread(state.store.trajectories.find, name, step=step, split=split,
                                   limit=100_000)
    groups: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["group_index"], []).append(r)
    out = []
    for gi, members in groups.items():
        rewards = [m["reward"] for m in members]
        shared = {k: v for k, v in members[0]["metadata"].items() if all(m["metadata"].get(k) == v for m in members)}
        out.append({"group_index": gi, "n": len(members), "mean": sum(rewards) / len(rewards),
                    "min": min(rewards), "max": max(rewards), "spread": max(rewards) - min(rewards),
                    "metadata": shared,
                    "trajectories": [{"id": m["id"], "traj_index": m["traj_index"], "reward": m["reward"]}
                                     for m in members]})
    out.sort(key=lambda g: (-g["spread"], g["group_index"]))
    return json_safe({"run": name, "step": step, "split": split, "data": out})


@api.get("/runs/{name}/trajectories", responses=documented(404, 409))
async def ui_trajectories(name: RunName, state: State, who: CallerDep, step: int | None = Query(None, ge=0, le=INT64),
                          split: str | None = Query(None, max_length=32),
                          group: int | None = Query(None, ge=0, le=INT64),
                          min_reward: float | None = Query(None, allow_inf_nan=False),
                          max_reward: float | None = Query(None, allow_inf_nan=False),
                          meta_key: str | None = Query(None, max_length=200),
                          meta_value: str | None = Query(None, max_length=1000),
                          q: str | None = Query(None, max_length=1000),
                          limit: int = Query(200, ge=1, le=5000)) -> dict[str, Any]:
    """Summaries matching every filter given; messages and tokens come from /trajectories/{id}."""
    _require_run(state, who, name)
    rows = await asyncio.to_thread(state.store.trajectories.find, name, step=step, split=split,
                                   group=group, min_reward=min_reward, max_reward=max_reward,
                                   meta_key=meta_key or None, meta_value=meta_value, text=q or None,
                                   limit=limit + 1)
    return json_safe({"data": rows[:limit], "truncated": len(rows) > limit})


@api.get("/trajectories/{traj_id}", responses=documented(404, 409))
async def ui_trajectory(state: State, who: CallerDep, traj_id: int = PathParam(ge=0, le=INT64)) -> dict[str, Any]:
    row = await asyncio.to_thread(state.store.trajectories.get, traj_id)
    if row is None or not state.runs.owners.visible(who, row["run"]):
        raise APIError(404, f"trajectory {traj_id} does not exist", code="trajectory_not_found")
    return json_safe(row)


router = APIRouter()
router.include_router(page)
router.include_router(api)
