"""`TrainableModel`: a run on an art-server, seen from the laptop.

Training is a job: `train()` submits it with an idempotency key (so a retried submission trains
once), then follows the job's events, reconnecting where it left off if the connection drops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from typing import Any, AsyncIterator, Iterable

import httpx
from openai import AsyncOpenAI
from pydantic import BaseModel

from client.errors import ConfigError, RunInUse, ServerError, ServerUnreachable
from protocol.config import LoraSettings, RunSpec, SFTConfig, TrainConfig
from protocol.jobs import JobEvent, RLJob, ScoredSession, SessionGroup, SessionJob, SFTJob, TrainResult
from protocol.logprobs import LogprobsRequest, LogprobsResponse, TokenSequence
from protocol.retry import RetryPolicy
from protocol.trajectory import Conversation, Trajectory, TrajectoryGroup

# The first contact only: a server that refuses connections there is most likely not started, and
# saying so in two seconds beats retrying for half a minute.
FIRST_CONTACT_RETRY = RetryPolicy(attempts=3, initial_wait=0.5, max_wait=1.0)
# After that, every call (each is idempotent: run creation by name, job submission by key) waits out
# a server restart, which takes 20-140 s (model load, runs resumed); 5 minutes leaves room.
DEFAULT_RETRY_SECONDS = 300.0
SAY_WAITING_EVERY = 30.0  # seconds between "waiting for the server" lines during one outage
# A lease the client stops renewing (killed) frees its run this long after its last renewal.
LEASE_SECONDS = 60.0
LEASE_CALL = RetryPolicy(attempts=2, initial_wait=0.5, max_wait=1.0)  # a renewal or release: the next one comes
# Seconds before each submission of a training job: the first, then each resubmission of an
# interrupted one.
RESUBMIT_WAITS = (0.0, 2.0, 8.0, 30.0)


def raise_for_status(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    try:
        msg = resp.json()["error"]["message"]
    except Exception:
        msg = resp.text[:500]
    if resp.status_code == 401:
        msg += " (give the key art-server was started with: register(url, api_key=...) or ARTISAN_API_KEY)"
    raise ServerError(f"{resp.status_code}: {msg}", resp.status_code)


def check_server_url(url: str, name: str = "server URL") -> str:
    """The server's base URL, without a trailing / or /v1; a URL without its scheme is refused
    here, where httpx would only say 'unsupported protocol'."""
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{name} {url!r} has no scheme: write http://{url.removeprefix('//')} "
                          f"(or https://...)")
    return url.rstrip("/").removesuffix("/v1")


def session_groups(groups: Iterable[SessionGroup | Iterable[tuple[str, float]]]) -> list[SessionGroup]:
    """Groups of (session id, reward) pairs, or SessionGroups, as SessionGroups."""
    return [g if isinstance(g, SessionGroup) else
            SessionGroup(sessions=[ScoredSession(session_id=sid, reward=r) for sid, r in g]) for g in groups]


class TrainableModel:
    def __init__(self, name: str, project: str = "default", base_model: str | None = None,
                 lora: dict[str, Any] | LoraSettings | None = None, retry_seconds: float | None = None):
        """`retry_seconds`: how long a call keeps retrying an unreachable or failing server
        (default ARTISAN_RETRY_SECONDS, else 300), saying on stderr that it is waiting."""
        self.spec = RunSpec(name=name, project=project, base_model=base_model,
                            lora=LoraSettings.model_validate(lora or {}))
        self.server_url: str | None = None
        self.api_key: str | None = None
        self.base_model: str | None = base_model
        self.step = 0
        self.created: bool | None = None  # whether register() made the run (None: not registered yet)
        seconds = retry_seconds if retry_seconds is not None else float(
            os.environ.get("ARTISAN_RETRY_SECONDS", DEFAULT_RETRY_SECONDS))
        self.retry = RetryPolicy(attempts=None, initial_wait=0.5, max_wait=8.0, seconds=seconds,
                                 on_retry=self._say_waiting)
        self.lease_id: str | None = None  # while this client holds the run's lease (`lease()`)
        self._said_waiting = float("-inf")

    @property
    def name(self) -> str:
        return self.spec.name

    # ---- plumbing --------------------------------------------------------------------------
    def http(self, timeout: float | None = 60.0) -> httpx.AsyncClient:
        if self.server_url is None:
            raise RuntimeError("call register(server_url) first")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        if self.lease_id:  # jobs carry it: the server queues them while another client's lease would refuse them
            headers["X-Artisan-Lease"] = self.lease_id
        return httpx.AsyncClient(base_url=self.server_url, headers=headers, timeout=timeout)

    def _say_waiting(self, failure: BaseException, seconds_left: float | None) -> None:
        now = time.monotonic()
        if now - self._said_waiting < SAY_WAITING_EVERY:
            return
        self._said_waiting = now
        why = f"{type(failure).__name__}: {failure}".strip().splitlines()[0][:200]
        left = f"for up to {seconds_left:.0f} s more" if seconds_left is not None else "without end"
        print(f"artisan: waiting for the server at {self.server_url} ({why}); retrying {left} "
              f"(ARTISAN_RETRY_SECONDS sets how long)", file=sys.stderr, flush=True)

    async def request(self, method: str, path: str, retry: RetryPolicy | None = None, **kw: Any) -> Any:
        """A request, retried on connection errors and 5xx; a 4xx raises ServerError at once, and
        no connection after the retries ServerUnreachable."""
        async def once() -> Any:
            async with self.http() as http:
                resp = await http.request(method, path, **kw)
            raise_for_status(resp)
            return resp.json()

        try:
            return await (retry or self.retry).call(once)
        except httpx.TransportError as exc:
            raise ServerUnreachable(str(self.server_url), exc) from exc

    # ---- API -------------------------------------------------------------------------------
    async def register(self, server_url: str, api_key: str | None = None) -> "TrainableModel":
        self.server_url = check_server_url(server_url)
        self.api_key = api_key
        info = await self.request("POST", "/v1/runs", retry=FIRST_CONTACT_RETRY,
                                  json=self.spec.model_dump(mode="json"))
        self.step = info["step"]
        self.created = bool(info.get("created"))  # made by this call, not found
        # The name the server serves its base model under: A*-PO's reference, the default judge (neither drifts)
        self.base_model = info.get("base_model") or self.base_model
        return self

    @contextlib.asynccontextmanager
    async def lease(self, seconds: float | None = None) -> AsyncIterator["TrainableModel"]:
        """Hold the run for this client while the block runs (`python -m client.train` does): another
        client's lease, and jobs without this one, are refused until it ends; RunInUse when another
        client holds it now. Renewed in the background; a client killed without releasing it frees
        the run `seconds` after its last renewal (default ARTISAN_LEASE_SECONDS, else 60)."""
        seconds = seconds or float(os.environ.get("ARTISAN_LEASE_SECONDS", LEASE_SECONDS))
        lease_id = uuid.uuid4().hex
        await self._hold_lease(lease_id, seconds, self.retry)
        self.lease_id = lease_id
        renewing = asyncio.create_task(self._renew_lease(lease_id, seconds))
        try:
            yield self
        finally:
            renewing.cancel()
            self.lease_id = None
            with contextlib.suppress(ServerError):  # not released: it expires
                await self.request("DELETE", f"/v1/runs/{self.name}/lease/{lease_id}", retry=LEASE_CALL)

    async def _hold_lease(self, lease_id: str, seconds: float, retry: RetryPolicy) -> None:
        try:
            await self.request("PUT", f"/v1/runs/{self.name}/lease", retry=retry,
                               json={"lease_id": lease_id, "seconds": seconds})
        except ServerError as e:
            if e.status == 409:
                raise RunInUse(str(e).removeprefix("409: ")) from None
            raise

    async def _renew_lease(self, lease_id: str, seconds: float) -> None:
        """Every quarter of the lease; after a server restart (which forgets leases) this takes it again."""
        while True:
            await asyncio.sleep(seconds / 4)
            try:
                await self._hold_lease(lease_id, seconds, LEASE_CALL)
            except RunInUse as e:  # it expired and another client took it: this one's next job is refused
                print(f"artisan: lost run {self.name} to another client: {e}", file=sys.stderr, flush=True)
                return
            except ServerError:
                pass  # unreachable for now: the next renewal tries again, and the lease outlasts three

    def openai_client(self, **kw: Any) -> AsyncOpenAI:
        """An AsyncOpenAI client for this server; use `model=self.name` for the latest step.
        Close it (`async with`) when done: an unclosed client's connections can hold later
        responses unread until they time out."""
        if self.server_url is None:
            raise RuntimeError("call register(server_url) first")
        return AsyncOpenAI(base_url=self.server_url + "/v1", api_key=self.api_key or "EMPTY", **kw)

    async def get_step(self) -> int:
        self.step = (await self.request("GET", f"/v1/runs/{self.name}"))["step"]
        return self.step

    async def train(self, groups: Iterable[TrajectoryGroup], config: TrainConfig | None = None,
                    idempotency_key: str | None = None) -> TrainResult:
        job = RLJob(groups=list(groups), config=config or TrainConfig(), idempotency_key=idempotency_key)
        return await self._run_job(job)

    def session_url(self, session_id: str) -> str:
        """The base URL that records a session: give it to a harness you cannot change, as the
        OpenAI SDK's `base_url` (Chat Completions, Responses) or Anthropic's (Messages); every
        exchange under it is kept by the server, token-exactly, for `train_sessions`."""
        if self.server_url is None:
            raise RuntimeError("call register(server_url) first")
        return f"{self.server_url}/v1/sessions/{session_id}"

    async def train_sessions(self, groups: Iterable[SessionGroup | Iterable[tuple[str, float]]],
                             config: TrainConfig | None = None, idempotency_key: str | None = None) -> TrainResult:
        """Train on sessions the server recorded, each group a list of (session id, reward)."""
        job = SessionJob(groups=session_groups(groups), config=config or TrainConfig(), idempotency_key=idempotency_key)
        return await self._run_job(job, "session-jobs")

    async def train_sft(self, conversations: Iterable[Conversation | Trajectory | list[dict[str, Any]]],
                        config: SFTConfig | None = None, idempotency_key: str | None = None) -> TrainResult:
        convs = [Conversation(messages=c.messages(), tools=c.tools) if isinstance(c, Trajectory)
                 else Conversation(messages=c) if isinstance(c, list) else c for c in conversations]
        job = SFTJob(kind="sft", conversations=convs, config=config or SFTConfig(), idempotency_key=idempotency_key)
        return await self._run_job(job)

    async def score_tokens(self, sequences: Iterable[list[int] | TokenSequence], model: str | None = None,
                           top_k: int = 0) -> LogprobsResponse:
        """The logprobs a served model (this run's latest step unless `model` names another: the
        base model, a run, run@step) gives to each sequence's tokens after the first (or from a
        TokenSequence's `start`), with the `top_k` likeliest alternatives and the rest's mass: a
        teacher's view of a student's exact tokens."""
        body = LogprobsRequest(model=model or self.name, top_k=top_k, sequences=[
            s if isinstance(s, TokenSequence) else TokenSequence(token_ids=list(s)) for s in sequences])
        return LogprobsResponse.model_validate(await self.request("POST", "/v1/logprobs", json=body.model_dump()))

    async def log(self, groups: Iterable[TrajectoryGroup], split: str = "val", step: int | None = None) -> dict[str, Any]:
        body = {"groups": [g.model_dump(mode="json") for g in groups], "split": split, "step": step}
        return await self.request("POST", f"/v1/runs/{self.name}/log", json=body)

    async def list_checkpoints(self) -> list[dict[str, Any]]:
        return (await self.request("GET", f"/v1/runs/{self.name}/checkpoints"))["data"]

    async def delete_checkpoints(self, best_metric: str | None = None, mode: str = "max", keep_last: int = 1) -> list[int]:
        body = {"best_metric": best_metric, "mode": mode, "keep_last": keep_last}
        return (await self.request("POST", f"/v1/runs/{self.name}/checkpoints/prune", json=body))["deleted"]

    async def retain_adapters(self, steps: Iterable[int]) -> list[int]:
        """Keep these steps' adapters loaded on the server (rollouts still sample from them) and
        unload older ones; returns the steps loaded now. Any step with a checkpoint stays
        servable as `run@step`: an unloaded one is loaded again when asked for."""
        body = {"steps": sorted(set(steps))}
        return (await self.request("POST", f"/v1/runs/{self.name}/adapters/retain", json=body))["loaded"]

    async def delete(self) -> dict[str, Any]:
        """Delete this run on the server: its jobs cancelled, its adapters, checkpoints, steps and
        trajectories gone. `register()` then creates a fresh run of the same name."""
        info = await self.request("DELETE", f"/v1/runs/{self.name}")
        self.step = 0
        return info

    async def cancel(self, job_id: str) -> dict[str, Any]:
        """Stop a queued or running job; a step it has not finished never lands."""
        return await self.request("DELETE", f"/v1/jobs/{job_id}")

    # ---- jobs ------------------------------------------------------------------------------
    async def _run_job(self, job: RLJob | SFTJob | SessionJob, route: str = "jobs") -> TrainResult:
        job.idempotency_key = job.idempotency_key or uuid.uuid4().hex
        return (await self.submit_jobs(f"/v1/runs/{self.name}/{route}", job))[self.name]

    async def submit_jobs(self, path: str, body: BaseModel) -> dict[str, TrainResult]:
        """POST a training submission (a run's job, or a joint job of several runs: client/team.py)
        and follow each job it answers with to its end; each run's result, by run name. Sent again,
        the same body under its key, while a job was interrupted (the server restarted, or a
        training process was lost with its machine): the key trains each step once. The waits give
        Ray time to declare a lost node dead (15-30 s), or the next attempt's processes may be placed
        on it again."""
        # allow_nan: a NaN reward reaches the server and is refused there, with the field named.
        payload = json.dumps(body.model_dump(mode="json"), allow_nan=True)
        results: dict[str, TrainResult] = {}
        interrupted: list[str] = []
        for tries, wait in enumerate(RESUBMIT_WAITS):
            if tries:
                print(f"artisan: training job {'; '.join(interrupted)}; submitting it again in {wait:.0f} s",
                      file=sys.stderr, flush=True)
            await asyncio.sleep(wait)
            answer = await self.request("POST", path, content=payload, headers={"Content-Type": "application/json"})
            jobs = answer.get("jobs") or {self.name: answer}  # a joint job's answer names one job per run
            ends = await asyncio.gather(*(self._follow(j["job_id"], j.get("after", -1)) for j in jobs.values()))
            interrupted = []
            for run, job, event in zip(jobs, jobs.values(), ends):
                if event.type == "result":
                    results[run] = TrainResult.model_validate(event.data)
                elif event.type == "interrupted":
                    interrupted.append(f"{job['job_id']} was interrupted ({event.data.get('message')})")
                else:
                    raise ServerError(f"training job {job['job_id']} {event.type}: {event.data.get('message')}")
            if not interrupted:
                if self.name in results:
                    self.step = results[self.name].step
                return results
        raise ServerError(f"training job was interrupted {len(RESUBMIT_WAITS)} times: {'; '.join(interrupted)}")

    async def _follow(self, job_id: str, after: int = -1) -> JobEvent:
        """A job's events to its terminal one, reconnecting after the last event seen."""
        last = [after]

        async def stream() -> JobEvent | None:
            async with self.http(timeout=None) as http:
                async with http.stream("GET", f"/v1/jobs/{job_id}/events", params={"after": last[0]}) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        raise_for_status(resp)
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            event = JobEvent.model_validate_json(line[6:])
                            last[0] = event.seq
                            if event.terminal:
                                return event
            return None  # the stream ended early: follow again from the last event

        while True:
            try:
                event = await self.retry.call(stream)
            except httpx.TransportError as exc:
                raise ServerUnreachable(str(self.server_url), exc) from exc
            if event is not None:
                return event
