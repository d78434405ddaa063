"""Exporters against local stand-ins of Langfuse, Weave and OpenPipe, driven by the real Langfuse
SDK (OpenTelemetry underneath) and by a real art-server training real rollouts.

Fakes here are only the hosted services: small HTTP receivers on 127.0.0.1 that record what the
exporters send (Langfuse's OTLP spans decoded with opentelemetry-proto)."""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import socket
import time
from collections import Counter
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request, Response

from client import TrainableModel, Trajectory, TrajectoryGroup
from exporters import ExportConfigError, export_groups, make_exporter
from protocol.choices import choice_token_ids
from tests.conftest import ServerProcess
from tests.helpers import ServedApp, demo_groups, with_rewards

KEYS = {"LANGFUSE_PUBLIC_KEY": "pk-test", "LANGFUSE_SECRET_KEY": "sk-test", "OPENPIPE_API_KEY": "op-test",
        "WANDB_API_KEY": "wandb-test", "WEAVE_PROJECT": "ent/proj"}


class Receiver:
    """Records every request; holds each one `delay` seconds before answering."""

    def __init__(self, delay: float = 0.0):
        self.requests: list[dict[str, Any]] = []
        self.pending = 0
        self.delay = delay
        self.closing = False
        app = FastAPI()

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT"])
        async def record(path: str, request: Request) -> Response:
            self.pending += 1
            try:
                body = await request.body()
                if request.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                self.requests.append({"path": "/" + path, "headers": dict(request.headers), "body": body})
                held = time.monotonic() + self.delay
                while time.monotonic() < held and not self.closing:  # let go at stop(), not cancelled mid-sleep
                    await asyncio.sleep(0.05)
                return Response('{"status": "ok"}', media_type="application/json")
            finally:
                self.pending -= 1

        self.served = ServedApp(app, timeout_graceful_shutdown=1).start()
        self.url = self.served.url

    def bodies(self, suffix: str) -> list[bytes]:
        return [r["body"] for r in self.requests if r["path"].endswith(suffix)]

    def stop(self) -> None:
        self.closing = True
        self.served.stop(timeout=5)


def closed_port() -> int:
    with socket.socket() as s:  # bound, never listening: connections are refused at once
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def otlp_spans(bodies: list[bytes]) -> list[dict[str, Any]]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    def value(v):  # noqa: ANN001, ANN202
        kind = v.WhichOneof("value")
        if kind == "array_value":
            return [value(x) for x in v.array_value.values]
        return getattr(v, kind) if kind else None

    spans = []
    for body in bodies:
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append({"name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                  "parent": s.parent_span_id.hex(),
                                  "attrs": {a.key: value(a.value) for a in s.attributes}})
    return spans


def _expected(groups_by_split: dict[str, list[TrajectoryGroup]]) -> dict[str, Any]:
    trajs = [t for gs in groups_by_split.values() for g in gs for t in g.trajectories]
    choices = [c for t in trajs for c in t.choices()]
    return {"trajectories": len(trajs), "choices": len(choices),
            "tool_calls": sum(len(c.message.tool_calls or []) for c in choices),
            "completion_tokens": sum(len(choice_token_ids(c)) for c in choices),
            "prompt_tokens": sum(c.sampling["prompt_len"] for c in choices),
            "rewards": Counter(round(t.reward, 6) for t in trajs)}


def _wait_exported(srv: ServerProcess, want: int, timeout: float = 90) -> dict[str, Any]:
    deadline = time.time() + timeout
    while True:
        stats = httpx.get(srv.url + "/v1/exporters", timeout=10).json()
        lanes = {d["name"]: d for d in stats["data"]}
        if all(d["exported"] + d["failed"] + d["dropped"] >= want for d in lanes.values()) or time.time() > deadline:
            return lanes
        time.sleep(0.3)


def _tool_using_group() -> TrajectoryGroup:
    """A logged trajectory that certainly called a tool (the demo model does not always)."""
    def choice(message: dict, finish: str, n: int) -> dict:
        return {"index": 0, "message": message, "finish_reason": finish, "token_ids": list(range(n)),
                "logprobs": {"content": [{"token": "x", "logprob": -0.5, "bytes": None, "top_logprobs": []}] * n},
                "sampling": {"temperature": 1.0, "top_p": 1.0, "logprob_temperature": 1.0, "policy": "exp", "step": 1,
                             "prompt_fingerprint": "f", "prompt_len": 40 + n, "model_fingerprint": "m"}}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_price", "arguments": '{"item": "pen"}'}}
    t = Trajectory(messages_and_choices=[
        {"role": "system", "content": "You sell things."}, {"role": "user", "content": "How much is a pen?"},
        choice({"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls", 7),
        {"role": "tool", "tool_call_id": "call_1", "content": "2.50"},
        choice({"role": "assistant", "content": "2.50"}, "stop", 3)],
        tools=[{"type": "function", "function": {"name": "get_price", "parameters": {"type": "object"}}}], reward=0.75)
    return TrajectoryGroup(trajectories=[t])


@pytest.fixture(scope="module")
async def exported(tmp_path_factory):
    """A server exporting to all three stand-ins; one real step trained and one eval batch logged."""
    pytest.importorskip("langfuse")
    recv = Receiver()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in KEYS.items():
            mp.setenv(k, v)
        for k in ("LANGFUSE_HOST", "OPENPIPE_BASE_URL", "WF_TRACE_SERVER_URL"):
            mp.setenv(k, recv.url)
        srv = ServerProcess(tmp_path_factory.mktemp("exporting"),
                            extra=["--export", "langfuse,openpipe", "--export", "weave"]).start()

    try:
        model = await TrainableModel("exp").register(srv.url)
        rng = random.Random(0)
        train = with_rewards(await demo_groups(model, 2, 3, seed=11), [[rng.random() for _ in range(3)] for _ in range(2)])
        result = await model.train(train)
        evals = await demo_groups(model, 1, 1, seed=12) + [_tool_using_group()]
        await model.log(evals, split="val")
        assert result.trained
        want = sum(len(g.trajectories) for g in train + evals)
        lanes = _wait_exported(srv, want)
        yield {"server": srv, "recv": recv, "train": train, "evals": evals, "lanes": lanes,
               "expected": _expected({"train": train, "val": evals})}
    finally:
        srv.stop()
        recv.stop()


def test_exporters_route_counts_every_trajectory(exported):
    exp = exported["expected"]
    assert set(exported["lanes"]) == {"langfuse", "openpipe", "weave"}
    for name, lane in exported["lanes"].items():
        assert (lane["exported"], lane["failed"], lane["dropped"]) == (exp["trajectories"], 0, 0), (name, lane)
        assert lane["last_error"] is None and lane["last_success_at"] is not None


def test_langfuse_gets_a_trace_per_trajectory_generations_tools_and_reward_scores(exported):
    recv, exp = exported["recv"], exported["expected"]
    assert all(r["headers"]["authorization"].startswith("Basic ") for r in recv.requests
               if r["path"].startswith("/api/public/"))
    spans = otlp_spans(recv.bodies("/api/public/otel/v1/traces"))
    roots = [s for s in spans if s["attrs"].get("langfuse.observation.type") == "agent"]
    gens = [s for s in spans if s["attrs"].get("langfuse.observation.type") == "generation"]
    tools = [s for s in spans if s["attrs"].get("langfuse.observation.type") == "tool"]
    assert len(roots) == exp["trajectories"] and len({s["trace_id"] for s in roots}) == exp["trajectories"]
    assert len(gens) == exp["choices"] and len(tools) == exp["tool_calls"]
    assert exp["tool_calls"] > 0
    # every turn hangs under its trajectory's root span
    root_of = {s["trace_id"]: s["span_id"] for s in roots}
    assert all(s["parent"] == root_of[s["trace_id"]] for s in gens + tools)
    usage = [json.loads(s["attrs"]["langfuse.observation.usage_details"]) for s in gens]
    assert sum(u["output"] for u in usage) == exp["completion_tokens"]
    assert sum(u["input"] for u in usage) == exp["prompt_tokens"]
    assert {s["attrs"]["langfuse.observation.model.name"] for s in gens} == {"exp"}  # the served policy
    assert Counter(tuple(s["attrs"]["langfuse.trace.tags"]) for s in roots) == Counter(
        {("run:exp", "split:train", "step:1"): 6, ("run:exp", "split:val", "step:1"): 2})
    scores = [sc for body in recv.bodies("/api/public/scores") for sc in json.loads(body)]
    assert {sc["name"] for sc in scores} == {"reward"}
    assert {sc["traceId"] for sc in scores} == set(root_of)
    assert Counter(round(sc["value"], 6) for sc in scores) == exp["rewards"]


def test_openpipe_gets_each_model_turn_as_a_tagged_request_response_log(exported):
    recv, exp = exported["recv"], exported["expected"]
    reports = [r for r in recv.requests if r["path"] == "/report"]
    assert len(reports) == exp["choices"]
    assert all(r["headers"]["authorization"] == "Bearer op-test" for r in reports)
    bodies = [json.loads(r["body"]) for r in reports]
    for b in bodies:
        req, resp, tags = b["reqPayload"], b["respPayload"], b["reqPayload"]["metadata"]
        assert tags == b["tags"] and tags["run"] == "exp" and tags["step"] == "1"
        assert req["messages"][0]["role"] == "system" and req["tools"]
        assert resp["choices"][0]["message"]["role"] == "assistant" and b["statusCode"] == 200
        assert b["requestedAt"] <= b["receivedAt"]
    assert Counter(b["tags"]["split"] for b in bodies)["val"] == sum(
        len(t.choices()) for g in exported["evals"] for t in g.trajectories)
    assert sum(b["respPayload"]["usage"]["completion_tokens"] for b in bodies) == exp["completion_tokens"]
    per_traj = {(b["tags"]["split"], b["tags"]["group"], b["tags"]["trajectory"]): b["tags"]["reward"] for b in bodies}
    assert Counter(round(float(r), 6) for r in per_traj.values()) == exp["rewards"]


def test_weave_gets_trajectory_turn_and_tool_calls_with_usage(exported):
    recv, exp = exported["recv"], exported["expected"]
    posts = [r for r in recv.requests if r["path"] == "/call/upsert_batch"]
    assert posts and all(r["headers"]["authorization"] == "Basic YXBpOndhbmRiLXRlc3Q=" for r in posts)  # api:key
    items = [i for r in posts for i in json.loads(r["body"])["batch"]]
    calls = [i["req"]["start"] for i in items if i["mode"] == "start"]
    ends = {i["req"]["end"]["id"]: i["req"]["end"] for i in items if i["mode"] == "end"}
    assert set(ends) == {c["id"] for c in calls}  # every call started is finished
    calls = [{**c, **ends[c["id"]]} for c in calls]
    ops = Counter(c["op_name"] for c in calls)
    assert ops == {"artisan.trajectory": exp["trajectories"], "artisan.chat_completion": exp["choices"],
                   "artisan.tool": exp["tool_calls"]}
    roots = {c["id"]: c for c in calls if c["op_name"] == "artisan.trajectory"}
    assert all(c["project_id"] == "ent/proj" for c in calls)
    assert all(roots[c["parent_id"]]["trace_id"] == c["trace_id"] for c in calls if c["parent_id"])
    assert sum(u["completion_tokens"] for r in roots.values() for u in r["summary"]["usage"].values()) == exp["completion_tokens"]
    assert Counter(round(r["output"]["reward"], 6) for r in roots.values()) == exp["rewards"]


def test_client_side_export_sends_the_same_without_a_server(exported):
    recv = Receiver()
    try:
        groups = exported["train"]
        n = sum(len(g.trajectories) for g in groups)
        targets = [make_exporter("openpipe", api_key="k", base_url=recv.url),
                   make_exporter("weave", api_key="k", project="e/p", url=recv.url),
                   make_exporter("langfuse", public_key="pk-client", secret_key="sk", host=recv.url)]
        outcomes = export_groups(groups, to=targets, run="laptop", step=3)
        assert {k: (o.exported, o.failed) for k, o in outcomes.items()} == {k: (n, 0) for k in ("openpipe", "weave", "langfuse")}
        assert {json.loads(b)["tags"]["step"] for b in recv.bodies("/report")} == {"3"}
        assert len([s for s in otlp_spans(recv.bodies("/otel/v1/traces"))
                    if s["attrs"].get("langfuse.observation.type") == "agent"]) == n
        for t in targets:
            t.close()
        # Made again with the same keys (as export_groups(to="langfuse") does per call), it still
        # sends, and still sees its failures: the SDK's one-client-per-key is shared, not stale.
        def roots() -> int:
            return len([s for s in otlp_spans(recv.bodies("/otel/v1/traces"))
                        if s["attrs"].get("langfuse.observation.type") == "agent"])
        before = roots()
        again = export_groups(groups[:1], to=make_exporter("langfuse", public_key="pk-client", secret_key="sk",
                                                           host=recv.url), run="laptop", step=4)
        assert (again["langfuse"].exported, again["langfuse"].failed) == (len(groups[0].trajectories), 0)
        assert roots() == before + len(groups[0].trajectories)
        with pytest.raises(ExportConfigError, match="one client per public key"):
            make_exporter("langfuse", public_key="pk-client", secret_key="sk", host="http://elsewhere")
        # a dead endpoint is counted, not raised, and costs one failure, not one per trajectory
        dead = make_exporter("openpipe", api_key="k", base_url=f"http://127.0.0.1:{closed_port()}", timeout=2)
        outcome = export_groups(groups, to=dead, run="laptop")["openpipe"]
        assert (outcome.exported, outcome.failed) == (0, n) and "Connect" in outcome.error
    finally:
        recv.stop()


async def test_a_slow_or_dead_exporter_never_holds_up_training(fresh_server, monkeypatch):
    slow = Receiver(delay=5.0)  # answers after 5 s; the exporter gives up after 2 s
    try:
        plain = fresh_server()
        for k, v in KEYS.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("OPENPIPE_BASE_URL", slow.url)
        monkeypatch.setenv("LANGFUSE_HOST", f"http://127.0.0.1:{closed_port()}")
        srv = fresh_server(extra=["--export", "openpipe,langfuse", "--export-timeout", "2", "--export-queue", "1"])

        models = {"plain": await TrainableModel("timing").register(plain.url),
                  "exporting": await TrainableModel("timing").register(srv.url)}
        rng = random.Random(1)
        groups = with_rewards(await demo_groups(models["plain"], 2, 3, seed=21),
                              [[rng.random() for _ in range(3)] for _ in range(2)])
        # The plain server is warm from sampling; warm the other alike, so step 1 compares fairly.
        await demo_groups(models["exporting"], 1, 2, seed=21)
        figures: dict[str, list] = {"plain": [], "exporting": []}
        lanes = None
        for _ in range(3):  # the same steps on the same config, but for the exporters; interleaved
            for label, model in models.items():
                t0 = time.perf_counter()
                result = await model.train(groups)
                wall = time.perf_counter() - t0
                if label == "exporting" and lanes is None:
                    lanes = {d["name"]: d for d in httpx.get(srv.url + "/v1/exporters", timeout=10).json()["data"]}
                assert result.trained and result.metrics.prompt_mismatches == 0
                figures[label].append({"wall_s": round(wall, 3), "step_seconds": round(result.metrics.step_seconds, 3)})
        # More batches while the lanes are stuck: one waits, the rest are dropped and counted.
        for _ in range(3):
            await models["exporting"].log([TrajectoryGroup(trajectories=groups[0].trajectories[:1])])
        print("train steps without and with a slow and a dead exporter:", json.dumps(figures))
        # The first step came back while its export was still under way: training never waited for it.
        for name in ("openpipe", "langfuse"):
            assert lanes[name]["exported"] + lanes[name]["failed"] == 0, lanes[name]
            assert lanes[name]["in_flight"] + lanes[name]["queued"] == 6, lanes[name]
        deadline = time.time() + 5
        while slow.pending == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert slow.pending >= 1  # the export is really out there, held by the slow endpoint

        deadline = time.time() + 60
        while time.time() < deadline:
            lanes = {d["name"]: d for d in httpx.get(srv.url + "/v1/exporters", timeout=10).json()["data"]}
            if all(lane["queued"] == 0 and lane["in_flight"] == 0 for lane in lanes.values()):
                break
            time.sleep(0.3)
        print("exporter counters after the slow/dead endpoints:", json.dumps(lanes))
        for name in ("openpipe", "langfuse"):
            lane = lanes[name]
            # every trajectory accounted for: 3 steps of 6 and 3 logged ones, none exported
            assert lane["exported"] == 0 and lane["failed"] + lane["dropped"] == 21, lane
            assert lane["failed"] >= 6 and lane["dropped"] >= 1 and lane["last_error"], lane
        assert "Timeout" in lanes["openpipe"]["last_error"]
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
    finally:
        slow.stop()


def test_an_exporter_without_its_keys_stops_the_server_at_start(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENPIPE_API_KEY", raising=False)
    srv = ServerProcess(tmp_path / "d", extra=["--export", "openpipe"])
    with pytest.raises(RuntimeError, match="OPENPIPE_API_KEY"):
        srv.start(timeout=60)
    srv = ServerProcess(tmp_path / "e", extra=["--export", "datadog"])
    with pytest.raises(RuntimeError, match="unknown exporter datadog"):
        srv.start(timeout=60)
