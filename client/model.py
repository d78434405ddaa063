"""`TrainableModel`: a run on an art-server, seen from the laptop.

Training is a job: `train()` submits it with an idempotency key (so a retried submission trains
once), then follows the job's events, reconnecting where it left off if the connection drops.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Iterable

import httpx
from openai import AsyncOpenAI

from client.types import Conversation, SFTConfig, TrainConfig, TrainResult, Trajectory, TrajectoryGroup

TRANSIENT = (httpx.TransportError, httpx.TimeoutException)


class ServerError(RuntimeError):
    """The server refused a request (a 4xx with its message) or a job failed."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    try:
        msg = resp.json()["error"]["message"]
    except Exception:
        msg = resp.text[:500]
    raise ServerError(f"{resp.status_code}: {msg}", resp.status_code)


class TrainableModel:
    def __init__(self, name: str, project: str = "default", base_model: str | None = None,
                 lora: dict[str, Any] | None = None):
        self.name, self.project, self.base_model, self.lora = name, project, base_model, lora or {}
        self.server_url: str | None = None
        self.api_key: str | None = None
        self.step = 0

    # ---- plumbing --------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _http(self, timeout: float = 60.0) -> httpx.AsyncClient:
        if self.server_url is None:
            raise RuntimeError("call register(server_url) first")
        return httpx.AsyncClient(base_url=self.server_url, headers=self._headers(), timeout=timeout)

    async def _request(self, method: str, path: str, retries: int = 5, **kw: Any) -> Any:
        """A request retried on connection errors and 5xx; safe because every mutating call here
        is idempotent (run creation by name, job submission by key)."""
        delay = 0.5
        for attempt in range(retries + 1):
            try:
                async with self._http() as http:
                    resp = await http.request(method, path, **kw)
                if resp.status_code < 500 or attempt == retries:
                    _raise_for(resp)
                    return resp.json()
            except TRANSIENT:
                if attempt == retries:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 8.0)

    # ---- API -------------------------------------------------------------------------------
    async def register(self, server_url: str, api_key: str | None = None) -> "TrainableModel":
        self.server_url = server_url.rstrip("/")
        if self.server_url.endswith("/v1"):
            self.server_url = self.server_url[:-3]
        self.api_key = api_key
        body = {"name": self.name, "project": self.project, "base_model": self.base_model}
        if self.lora:
            body["lora"] = self.lora
        info = await self._request("POST", "/v1/runs", json=body)
        self.step = info["step"]
        return self

    def openai_client(self, **kw: Any) -> AsyncOpenAI:
        """An AsyncOpenAI client for this server; use `model=self.name` for the latest step. Close it
        (`async with`) when done: unclosed clients stalled later requests (see client/train.py)."""
        if self.server_url is None:
            raise RuntimeError("call register(server_url) first")
        return AsyncOpenAI(base_url=self.server_url + "/v1", api_key=self.api_key or "EMPTY", **kw)

    @property
    def inference_name(self) -> str:
        return self.name

    async def get_step(self) -> int:
        info = await self._request("GET", f"/v1/runs/{self.name}")
        self.step = info["step"]
        return self.step

    async def train(self, groups: Iterable[TrajectoryGroup], config: TrainConfig | None = None,
                    idempotency_key: str | None = None) -> TrainResult:
        body = {"kind": "rl", "groups": [g.model_dump(mode="json") for g in groups],
                "config": (config or TrainConfig()).model_dump()}
        return await self._run_job(body, idempotency_key)

    async def train_sft(self, conversations: Iterable[Conversation | Trajectory | list[dict[str, Any]]],
                        config: SFTConfig | None = None, idempotency_key: str | None = None) -> TrainResult:
        convs = []
        for c in conversations:
            if isinstance(c, Trajectory):
                c = Conversation(messages=c.messages(), tools=c.tools)
            elif isinstance(c, list):
                c = Conversation(messages=c)
            convs.append(c.model_dump(mode="json"))
        body = {"kind": "sft", "conversations": convs, "config": (config or SFTConfig()).model_dump()}
        return await self._run_job(body, idempotency_key)

    async def log(self, groups: Iterable[TrajectoryGroup], split: str = "val", step: int | None = None) -> dict[str, Any]:
        body = {"groups": [g.model_dump(mode="json") for g in groups], "split": split, "step": step}
        return await self._request("POST", f"/v1/runs/{self.name}/log", json=body)

    async def list_checkpoints(self) -> list[dict[str, Any]]:
        return (await self._request("GET", f"/v1/runs/{self.name}/checkpoints"))["data"]

    async def delete_checkpoints(self, best_metric: str | None = None, mode: str = "max", keep_last: int = 1) -> list[int]:
        body = {"best_metric": best_metric, "mode": mode, "keep_last": keep_last}
        return (await self._request("POST", f"/v1/runs/{self.name}/checkpoints/prune", json=body))["deleted"]

    # ---- jobs ------------------------------------------------------------------------------
    async def _run_job(self, body: dict[str, Any], key: str | None) -> TrainResult:
        body["idempotency_key"] = key or uuid.uuid4().hex
        payload = json.dumps(body, allow_nan=True)  # a NaN reward reaches the server and is refused there
        headers = {"Content-Type": "application/json"}
        for _ in range(3):  # resubmit only if the server restarted mid-job (same key: trains once)
            job = await self._request("POST", f"/v1/runs/{self.name}/jobs", content=payload, headers=headers)
            event = await self._follow(job["job_id"], job.get("after", -1))
            if event["type"] == "result":
                result = TrainResult.model_validate(event["data"])
                self.step = result.step
                return result
            if event["type"] == "error":
                raise ServerError(f"training job {job['job_id']} failed: {event['data'].get('message')}")
        raise ServerError(f"training job was interrupted by server restarts three times: {event['data']}")

    async def _follow(self, job_id: str, after: int = -1) -> dict[str, Any]:
        """Follow a job's events to its terminal one, reconnecting after the last seen event."""
        last, delay = after, 0.5
        while True:
            try:
                async with self._http(timeout=None) as http:
                    async with http.stream("GET", f"/v1/jobs/{job_id}/events", params={"after": last}) as resp:
                        if resp.status_code >= 400:
                            await resp.aread()
                            _raise_for(resp)
                        async for line in resp.aiter_lines():
                            if not line.startswith("data: "):
                                continue
                            event = json.loads(line[6:])
                            last = event["seq"]
                            delay = 0.5
                            if event["type"] in ("result", "error", "interrupted"):
                                return event
            except TRANSIENT:
                pass
            await asyncio.sleep(delay)
            delay = min(delay * 2, 8.0)
