"""An OpenAI-compatible endpoint on loopback that answers from a script.

Only for what cannot run here (a hosted judge LLM) or cannot be made to happen on demand (a model
that writes a malformed tool call); everything else talks to a real art-server.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.helpers import ServedApp


def completion(content: str | None, tool_calls: list[dict] | None = None, finish: str = "stop",
               model: str = "scripted", malformed: bool = False) -> dict[str, Any]:
    """`malformed`: the choice says its tool call could not be parsed, as art-server's do."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice = {"index": 0, "message": message, "finish_reason": finish}
    if malformed:
        choice["malformed_tool_call"] = True
    return {"id": "chatcmpl-scripted", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


class ScriptedEndpoint:
    """`replies` is consumed in order: a dict is a chat completion body, an int an error status."""

    def __init__(self) -> None:
        self.replies: list[dict[str, Any] | int] = []
        self.requests: list[dict[str, Any]] = []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            self.requests.append(await request.json())
            reply = self.replies.pop(0) if self.replies else 500
            if isinstance(reply, int):
                return JSONResponse({"error": {"message": f"scripted {reply}", "type": "server_error",
                                               "param": None, "code": None}}, status_code=reply)
            return JSONResponse(reply)

        self.served = ServedApp(app)

    @property
    def url(self) -> str:
        return self.served.url + "/v1"

    def __enter__(self) -> "ScriptedEndpoint":
        self.served.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.served.stop(timeout=5)
