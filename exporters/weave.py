"""W&B Weave, over its documented service API (POST /call/upsert_batch, basic auth `api:<key>`): a
call per trajectory, a child call per model turn with its token usage, a child call per tool call,
the reward in the trajectory call's output and attributes.

Not the `weave` SDK: `weave.init` patches LLM libraries process-wide and needs the W&B API at
start-up, and the SDK's dependency chain installs a top-level `tests` package into site-packages
that shadows this repository's own. The calls sent are the ones the SDK sends. The project must
exist already (create it once in the W&B UI, or with `weave.init("entity/project")`).
"""

from __future__ import annotations

import base64
import uuid
from datetime import datetime, timezone
from typing import Any

import httpx

from exporters.base import ExportConfigError, Outcome, env, require, send_each
from exporters.flatten import Item, initial_messages, turns

DEFAULT_URL = "https://trace.wandb.ai"


def _ts(t: float | None) -> str:
    return datetime.fromtimestamp(t or 0.0, tz=timezone.utc).isoformat()


def _new_id() -> str:
    return str(uuid.uuid4())


def calls(item: Item, project_id: str) -> list[dict[str, Any]]:
    """A trajectory as finished Weave calls (start and end fields together), the root first."""
    t = item.trajectory
    trace_id, root_id = _new_id(), _new_id()
    attrs = {"artisan": item.tags()}
    usage: dict[str, dict[str, int]] = {}
    children = []
    for turn in turns(t):
        u = {"prompt_tokens": turn.prompt_tokens or 0, "completion_tokens": turn.completion_tokens or 0, "requests": 1}
        u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
        total = usage.setdefault(turn.model, dict.fromkeys(u, 0))
        for k in total:
            total[k] += u[k]
        children.append({"id": _new_id(), "op_name": "artisan.chat_completion", "display_name": f"turn {turn.index}",
                         "inputs": {"model": turn.model, "messages": turn.request, **turn.parameters},
                         "output": {"message": turn.output, "finish_reason": turn.finish_reason},
                         "summary": {"usage": {turn.model: u}}, "parent_id": root_id, "attributes": attrs})
        children += [{"id": _new_id(), "op_name": "artisan.tool", "display_name": c.name,
                      "inputs": {"name": c.name, "arguments": c.arguments, "tool_call_id": c.id},
                      "output": c.result, "summary": {}, "parent_id": root_id, "attributes": attrs}
                     for c in turn.tool_calls]
    root = {"id": root_id, "op_name": "artisan.trajectory",
            "display_name": f"{item.run} step {item.step} {item.split} g{item.group_index}#{item.traj_index}",
            "inputs": {"messages": initial_messages(t), "tools": t.tools},
            "output": {"reward": t.reward, "metrics": t.metrics, "final_message": (t.messages() or [None])[-1]},
            "summary": {"usage": usage}, "parent_id": None,
            "attributes": {"artisan": {**item.tags(), "metadata": t.metadata}}}
    # Turns carry no timestamps of their own; the trajectory's span is the honest bound.
    start, end = _ts(t.start_time), _ts(t.end_time or t.start_time)
    return [{**c, "project_id": project_id, "trace_id": trace_id, "started_at": start, "ended_at": end}
            for c in [root, *children]]


def upsert_batch(batch: list[dict[str, Any]]) -> dict[str, Any]:
    out = []
    for c in batch:
        end = {k: c[k] for k in ("project_id", "id", "ended_at", "output", "summary")}
        start = {k: v for k, v in c.items() if k not in ("ended_at", "output", "summary")}
        out += [{"mode": "start", "req": {"start": start}}, {"mode": "end", "req": {"end": end}}]
    return {"batch": out}


class WeaveExporter:
    name = "weave"

    def __init__(self, project: str | None = None, api_key: str | None = None, url: str | None = None,
                 timeout: float = 10.0):
        self.project = require(project or env("WEAVE_PROJECT"), "WEAVE_PROJECT (entity/project)", self.name)
        if self.project.count("/") != 1 or not all(self.project.split("/")):
            raise ExportConfigError(f"WEAVE_PROJECT must be entity/project, not {self.project!r}")
        api_key = require(api_key or env("WANDB_API_KEY"), "WANDB_API_KEY", self.name)
        self.url = (url or env("WF_TRACE_SERVER_URL", default=DEFAULT_URL)).rstrip("/")
        auth = base64.b64encode(f"api:{api_key}".encode()).decode()
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers={"Authorization": f"Basic {auth}"})

    def export(self, items: list[Item]) -> Outcome:
        return send_each(items, lambda item: self._http.post(
            "/call/upsert_batch", json=upsert_batch(calls(item, self.project))).raise_for_status())

    def close(self) -> None:
        self._http.close()
