"""OpenPipe, over its HTTP API (POST /report; its SDK pins an old `openai`): each model turn as a
request/response log, tagged with run, step, split and reward so a dataset can be filtered from it."""

from __future__ import annotations

from typing import Any

import httpx

from exporters.base import Outcome, env, require, send_each
from exporters.flatten import Item, Turn, turns

DEFAULT_BASE_URL = "https://api.openpipe.ai/api/v1"


def report(item: Item, turn: Turn) -> dict[str, Any]:
    t = item.trajectory
    tags = {**item.tags(), "turn": str(turn.index), "policy": turn.model, "source": "artisan"}
    request: dict[str, Any] = {"model": turn.model, "messages": turn.request, **turn.parameters, "metadata": tags}
    if t.tools:
        request["tools"] = t.tools
    usage = {"prompt_tokens": turn.prompt_tokens or 0, "completion_tokens": turn.completion_tokens or 0}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    response = {"id": f"artisan-{item.key}-{turn.index}", "object": "chat.completion", "created": int(t.start_time),
                "model": turn.model, "usage": usage,
                "choices": [{"index": 0, "message": turn.output, "finish_reason": turn.finish_reason or "stop"}]}
    # Turns carry no timestamps of their own; the trajectory's span is the honest bound.
    return {"requestedAt": int(t.start_time * 1000), "receivedAt": int((t.end_time or t.start_time) * 1000),
            "reqPayload": request, "respPayload": response, "statusCode": 200,
            "tags": tags}  # deprecated by OpenPipe in favour of reqPayload.metadata; older deployments read it


class OpenPipeExporter:
    name = "openpipe"

    def __init__(self, api_key: str | None = None, base_url: str | None = None, timeout: float = 10.0):
        api_key = require(api_key or env("OPENPIPE_API_KEY"), "OPENPIPE_API_KEY", self.name)
        self.base_url = (base_url or env("OPENPIPE_BASE_URL", default=DEFAULT_BASE_URL)).rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout,
                                  headers={"Authorization": f"Bearer {api_key}"})

    def export(self, items: list[Item]) -> Outcome:
        def send(item: Item) -> None:
            for turn in turns(item.trajectory):
                self._http.post("/report", json=report(item, turn)).raise_for_status()

        return send_each(items, send)

    def close(self) -> None:
        self._http.close()
