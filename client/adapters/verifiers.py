"""verifiers environments (0.4, `verifiers.v1`) trained by art-server.

verifiers runs an episode as a harness program talking to its own interception server, which
forwards each model call to an OpenAI-compatible endpoint (its eval client) and keeps only the
message on the trace: the token ids and logprobs in the provider's reply are dropped. So the
adapter puts a loopback relay, `ChoiceRecorder`, between verifiers and art-server: it keeps every
Choice art-server returns, as art-server returned it, under the rollout's trace id (verifiers sends
it as `X-Session-ID` on every call), and `gather_verifiers_groups` pairs each finished trace with
its choices and the rubric's reward.

verifiers' train client renders prompts itself (with a local tokenizer) and calls the token-in
route `/inference/v1/generate`; the relay passes that on too and keeps art-server's answer (ids,
logprobs and the sampling record, whose fingerprint is of the ids verifiers sent). Such a turn's
Choice is put together from that answer and the trace, which holds the conversation and the
message verifiers parsed from the ids. Training re-renders the conversation with art-server's
template and counts a prompt mismatch wherever verifiers rendered it otherwise.

A rollout verifiers records as failed (a provider, harness, sandbox or scoring error), or whose
turns the relay did not see one for one, is an exception of its group: counted, never scored.

Needs `verifiers` and `aiohttp` (a verifiers dependency): `make test-verifiers` builds such an
environment. Never imports torch.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Iterable

import httpx
import verifiers.v1 as vf
from aiohttp import web
from openai.types.chat.chat_completion import Choice
from verifiers.v1.clients.train import tool_to_wire
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.graph import path as path_to

from client.gather import check_exceptions
from client.model import TrainableModel
from protocol.histories import RecordedExchange, spliced
from protocol.histories import histories as histories_of
from protocol.trajectory import History, Trajectory, TrajectoryGroup

SESSION_HEADER = "X-Session-ID"  # verifiers.v1.clients.client.SESSION_ID_HEADER: the trace id
# verifiers' client reads its API key from this variable; the relay holds art-server's key itself.
UNUSED_KEY_VAR = "ARTISAN_VERIFIERS_RELAY_KEY"
GENERATE_PATH = "/inference/v1/generate"  # at the root, not under /v1 (renderers.client.generate)


@dataclass
class RecordedCall:
    """One model call as art-server saw it: the request's messages and tools, and its Choice."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    choice: Choice


@dataclass
class ChoiceRecorder:
    """A loopback relay to art-server that records every chat completion per rollout.

    Streamed requests go upstream unstreamed and come back as one SSE chunk: the Choice kept
    is art-server's whole choice (token ids, logprobs, sampling record), and verifiers, which
    reads a stream to its end before it serves the turn, sees the same message."""

    upstream: str  # art-server's base URL
    api_key: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    calls: dict[str, list[RecordedCall]] = field(default_factory=dict)
    # Per trace id, art-server's token-in answers: each one's choice (ids, logprobs, sampling record).
    generated: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    _runner: web.AppRunner | None = None
    _http: httpx.AsyncClient | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> "ChoiceRecorder":
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._http = httpx.AsyncClient(base_url=self.upstream.rstrip("/").removesuffix("/v1"), headers=headers,
                                       timeout=httpx.Timeout(None, connect=10.0))
        app = web.Application(client_max_size=256 * 2**20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post(GENERATE_PATH, self._generate)
        app.router.add_route("*", "/{path:.*}", self._passthrough)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]  # the port the OS picked for port 0
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __aenter__(self) -> "ChoiceRecorder":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def client_config(self, renderer_model: str | None = None) -> vf.EvalClientConfig | vf.TrainClientConfig:
        """verifiers' endpoint config for this relay: its eval client, or with `renderer_model`
        its train client, which renders prompts with that model's tokenizer and chat template."""
        if renderer_model is None:
            return vf.EvalClientConfig(base_url=self.base_url, api_key_var=UNUSED_KEY_VAR)
        return vf.TrainClientConfig(base_url=self.base_url, api_key_var=UNUSED_KEY_VAR,
                                    renderer_model_name=renderer_model)

    async def _forward(self, method: str, path: str, **kw: Any) -> httpx.Response | web.Response:
        assert self._http is not None
        try:
            return await self._http.request(method, path, **kw)
        except httpx.HTTPError as exc:  # art-server unreachable: a 502 verifiers records as a provider error
            return web.json_response({"error": {"message": f"art-server: {type(exc).__name__}: {exc}",
                                                "type": "upstream_error"}}, status=502)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        stream = bool(body.pop("stream", False))
        stream_options = body.pop("stream_options", None) or {}
        session = request.headers.get(SESSION_HEADER)
        resp = await self._forward("POST", "/v1/chat/completions", json=body,
                                   headers={SESSION_HEADER: session} if session else None)
        if isinstance(resp, web.Response):
            return resp
        if resp.status_code >= 400:
            return web.Response(body=resp.content, status=resp.status_code, content_type="application/json")
        completion = resp.json()
        if session is not None and len(completion.get("choices") or []) == 1:
            self.calls.setdefault(session, []).append(RecordedCall(
                messages=body.get("messages") or [], tools=body.get("tools"),
                choice=Choice.model_validate(completion["choices"][0])))
        if not stream:
            return web.json_response(completion)
        return web.Response(body=_as_sse(completion, bool(stream_options.get("include_usage"))),
                            content_type="text/event-stream")

    async def _generate(self, request: web.Request) -> web.Response:
        raw = await request.read()
        session = request.headers.get(SESSION_HEADER)
        resp = await self._forward("POST", GENERATE_PATH, content=raw,
                                   headers={"Content-Type": "application/json", **({SESSION_HEADER: session} if session else {})})
        if isinstance(resp, web.Response):
            return resp
        if resp.status_code < 400 and session is not None:
            choices = resp.json().get("choices") or []
            if len(choices) == 1:
                self.generated.setdefault(session, []).append(choices[0])
        return web.Response(body=resp.content, status=resp.status_code, content_type="application/json")

    async def _passthrough(self, request: web.Request) -> web.Response:
        resp = await self._forward(request.method, "/" + request.match_info["path"], content=await request.read(),
                                   headers={"Content-Type": request.headers.get("Content-Type", "application/json")})
        if isinstance(resp, web.Response):
            return resp
        return web.Response(body=resp.content, status=resp.status_code,
                            content_type=resp.headers.get("content-type", "application/json").split(";")[0])


def _as_sse(completion: dict[str, Any], include_usage: bool) -> bytes:
    """A whole completion as the chunks a stream of it would end with."""
    head = {k: completion.get(k) for k in ("id", "created", "model")}
    events = []
    for choice in completion["choices"]:
        delta = {k: v for k, v in choice["message"].items() if v is not None}
        if delta.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
        events.append({**head, "object": "chat.completion.chunk",
                       "choices": [{"index": choice["index"], "delta": delta, "finish_reason": choice["finish_reason"]}]})
    if include_usage and completion.get("usage"):
        events.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": completion["usage"]})
    return b"".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


# ---- traces to trajectories --------------------------------------------------------------------

def recorded_exchange(call: RecordedCall) -> RecordedExchange:
    """A relayed call in the shape the history rule reads (protocol/histories.py)."""
    return RecordedExchange(messages=call.messages, tools=call.tools, choice=call.choice.model_dump())


def histories(calls: list[RecordedCall]) -> list[History]:
    """The conversations a rollout's calls make, by the one history rule (protocol/histories.py):
    each call joins the conversation it continues, with every earlier answer replaced by the
    Choice art-server returned for it. A harness that rewrote its history (compaction) starts
    another one. The last call's conversation is first."""
    recorded = [recorded_exchange(c) for c in calls]
    choices = [c.choice for c in calls]
    return [History(messages_and_choices=spliced(recorded, chain, choices), tools=recorded[chain[-1]].tools)
            for chain in histories_of(recorded)]


class RolloutFailed(RuntimeError):
    """A rollout that must not be trained: counted as an exception of its group."""


def _describe(errors: list[vf.Error]) -> str:
    e = errors[-1]
    return f"{e.type}: {e.message}"[:2000]


def trajectory(trace: vf.Trace, calls: list[RecordedCall]) -> Trajectory:
    """One finished, trainable trace and the choices recorded for it, with the rubric's reward."""
    if not trace.ok:
        raise RolloutFailed(_describe(trace.errors) if trace.errors else "verifiers marked the rollout as failed")
    committed = sum(1 for c in trace.calls if c.node is not None)
    if not calls or len(calls) != committed:
        raise RolloutFailed(f"the relay saw {len(calls)} model calls for trace {trace.id}, verifiers committed "
                            f"{committed} turns: its choices cannot be paired")
    main, *rest = histories(calls)
    metrics: dict[str, Any] = {k: v for k, v in trace.metrics.items()}
    metrics.update({f"reward_{k}": r.score for k, r in trace.rewards.items() if r is not None})
    metrics.update({"turns": trace.num_turns, "truncated": trace.is_truncated})
    return Trajectory(messages_and_choices=main.messages_and_choices, tools=main.tools, additional_histories=rest,
                      reward=trace.reward, metrics=metrics,
                      metadata={"task": trace.task.key, "trace_id": trace.id, "agent": trace.agent.name,
                                "stop_condition": trace.stop_condition},
                      **({"start_time": trace.timing.start} if trace.timing.start else {})).finish()


def token_in_calls(trace: vf.Trace, answers: list[dict[str, Any]]) -> list[RecordedCall]:
    """A trace's turns sampled through verifiers' train client, as calls: the conversation, tools
    and assistant message from the trace, the ids, logprobs and sampling record from art-server's
    answer (paired in order, and checked: the trace's sampled ids must be the answer's)."""
    committed = [c for c in trace.calls if c.node is not None]
    if len(committed) != len(answers):
        raise RolloutFailed(f"the relay saw {len(answers)} token-in calls for trace {trace.id}, verifiers committed "
                            f"{len(committed)} turns: its answers cannot be paired")
    out = []
    for call, answer in zip(committed, answers):
        node = trace.nodes[call.node]
        if [t for t, sampled in zip(node.token_ids, node.mask) if sampled] != answer["token_ids"]:
            raise RolloutFailed(f"trace {trace.id}: a turn's sampled ids are not art-server's answer")
        root = call.node
        while trace.nodes[root].parent is not None:
            root = trace.nodes[root].parent
        *context, reply = path_to(trace, call.node)
        choice = Choice.model_validate({
            "index": 0, "message": message_to_wire(reply), "token_ids": answer["token_ids"],
            "finish_reason": call.finish_reason or answer["finish_reason"], "sampling": answer["sampling"],
            "logprobs": {"content": [{**e, "bytes": None, "top_logprobs": []} for e in answer["logprobs"]["content"]]}})
        tools = [tool_to_wire(t) for t in trace.nodes[root].tools]
        out.append(RecordedCall(messages=[message_to_wire(m) for m in context], tools=tools or None, choice=choice))
    return out


def _recorded(trace: vf.Trace, recorder: ChoiceRecorder) -> list[RecordedCall]:
    answers = recorder.generated.pop(trace.id, [])
    calls = recorder.calls.pop(trace.id, [])
    return token_in_calls(trace, answers) if answers and trace.ok else calls


def episode_trajectories(episode: vf.Episode, recorder: ChoiceRecorder) -> list[Trajectory]:
    """The trajectories of an episode's trainable traces (a judge or a simulated user does not train)."""
    if not episode.ok:
        raise RolloutFailed(_describe(episode.errors) if episode.errors else
                            next((_describe(t.errors) for t in episode.traces if t.errors), "episode failed"))
    return [trajectory(t, _recorded(t, recorder)) for t in episode.traces if t.agent.trainable]


# ---- the gather ---------------------------------------------------------------------------------

async def gather_verifiers_groups(env: vf.Env, model: TrainableModel, tasks: Iterable[vf.Task], group_size: int,
                                  sampling: dict[str, Any] | None = None, policy: str | None = None,
                                  max_exceptions: int | float = 0.5, concurrency: int = 32,
                                  renderer_model: str | None = None) -> list[TrajectoryGroup]:
    """Run `group_size` episodes of every task with art-server as the model and return one
    TrajectoryGroup per task, ready for `model.train`.

    env: e.g. `vf.load_environment(config)`; its harness must speak chat completions.
    sampling: verifiers' sampling knobs (temperature, max_tokens, top_p, ...).
    policy: the served name to sample from (default the run's latest step).
    max_exceptions: as in `gather_trajectory_groups`.
    renderer_model: sample through verifiers' train client instead of its eval client: prompts
        rendered with this model's tokenizer and template (a local directory or hub id of the
        model art-server serves), sampled on art-server's token-in route.
    """
    if model.server_url is None:
        raise RuntimeError("call model.register(server_url) first")
    tasks = list(tasks)
    limit = asyncio.Semaphore(concurrency)
    async with ChoiceRecorder(model.server_url, model.api_key) as recorder:
        ctx = vf.ModelContext(model=policy or model.name, client=recorder.client_config(renderer_model),
                              sampling=vf.SamplingConfig(**(sampling or {})))

        async def one(task: vf.Task) -> list[Trajectory]:
            [slot] = env.slots(task, 1)
            return episode_trajectories(await env.run_slot(slot, ctx, limit), recorder)

        async def group(task: vf.Task) -> TrajectoryGroup:
            results = await asyncio.gather(*(one(task) for _ in range(group_size)), return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException) and not isinstance(r, Exception):
                    raise r
            return TrajectoryGroup(
                trajectories=[t for r in results if isinstance(r, list) for t in r],
                exceptions=[f"{type(r).__name__}: {r}" for r in results if isinstance(r, Exception)],
                metadata={"task": task.key})

        async with env.serving():
            groups = await asyncio.gather(*(group(t) for t in tasks))
    check_exceptions(groups, group_size * len(tasks), max_exceptions, "verifiers rollouts")
    return groups
