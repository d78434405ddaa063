"""A crash, a bad config or a hostile body loses nothing and harms no other run.

Each test is one finding of a fuzzing and fault-injection pass over the old server, tried again
against a real server on loopback: SIGKILL at every point of a step's commit, configs no sane run
uses, bodies that are too big or not text, keys reused, a run whose weights are not finite.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
import math

import httpx
import pytest
from fastapi import FastAPI
from safetensors.torch import load_file, save_file

from client import ServerError, TrainConfig, TrainableModel, TrajectoryGroup
from conftest import ServerProcess
from server.faults import POINTS
from tests.helpers import ServedApp, demo_groups, get_json, with_rewards

CONFIG = TrainConfig(learning_rate=1e-3)
INT64 = 2**63 - 1


def _post(url: str, path: str, body, **kw) -> httpx.Response:
    return httpx.post(url + path, content=json.dumps(body, allow_nan=True),
                      headers={"content-type": "application/json", **kw.pop("headers", {})}, timeout=120, **kw)


@pytest.fixture(scope="module")
async def groups(server):
    model = await TrainableModel("reliability-sampler").register(server.url)
    return with_rewards(await demo_groups(model, 2, 3, seed=21), [[0.0, 1.0, 0.5], [1.0, 0.0, 0.0]])


def _rl_body(groups: list[TrajectoryGroup], key: str, **config) -> dict:
    return {"kind": "rl", "groups": [g.model_dump(mode="json") for g in groups],
            "config": {"learning_rate": 1e-3, **config}, "idempotency_key": key}


def _register(url: str, name: str) -> None:
    assert _post(url, "/v1/runs", {"name": name}).status_code == 200


# ---- a crash at any instant leaves each step whole or absent --------------------------------------

async def test_sigkill_at_every_point_of_a_step_leaves_it_whole_or_absent(tmp_path, groups):
    data = tmp_path / "crashy"
    n_trajectories = sum(len(g.trajectories) for g in groups)
    with ServerProcess(data) as srv:  # the run exists, one step done, before any crash
        await _train(srv.url, groups, "k-1")
    for i, point in enumerate(POINTS):
        key, step = f"k-crash-{i}", i + 2
        crashy = ServerProcess(data, env={"ARTISAN_CRASH_AT": point}).start()
        try:
            r = _post(crashy.url, "/v1/runs/crashy/jobs", _rl_body(groups, key))
            assert r.status_code == 202, r.text
            job_id = r.json()["job_id"]
        except httpx.RemoteProtocolError:  # the crash can beat the answer to the submission itself
            job_id = None
        assert crashy.wait_exit() != 0, f"the server did not crash at {point}"
        crashy.stop()
        with ServerProcess(data) as srv:
            run = get_json(srv.url, "/v1/runs/crashy")
            stored = {s["step"] for s in run["steps"]}
            assert run["step"] in (step - 1, step), point
            assert stored == set(range(1, run["step"] + 1)), (point, stored, run["step"])  # no partial step
            for s in stored:  # every completed step whole: figures, checkpoint and all its trajectories
                assert s in run["checkpoints"]
                rows = get_json(srv.url, "/v1/runs/crashy/trajectories", step=s, split="train")["data"]
                assert len(rows) == n_trajectories, (point, s, len(rows))
            if job_id is not None:
                job = get_json(srv.url, f"/v1/jobs/{job_id}")
                assert job["status"] == ("succeeded" if run["step"] == step else "interrupted"), (point, job)
            _attempts_match_steps(srv.url, point)
            # the client's retry finishes the step once, and reads a finished job as finished
            result = await _train(srv.url, groups, key)
            assert result.step == step and get_json(srv.url, "/v1/runs/crashy")["step"] == step, point
            rows = get_json(srv.url, "/v1/runs/crashy/trajectories", step=step, split="train")["data"]
            assert len(rows) == n_trajectories, point
            _attempts_match_steps(srv.url, point)


def _attempts_match_steps(url: str, point: str) -> None:
    """Each step is one trained attempt; an attempt the crash cut short is settled, never left pending."""
    attempts = get_json(url, "/ui/api/runs/crashy/attempts")["data"]
    steps = [s["step"] for s in get_json(url, "/v1/runs/crashy")["steps"]]
    assert [a["step"] for a in attempts if a["trained"]] == steps, (point, attempts)
    assert not any(a["pending"] for a in attempts), (point, attempts)
    assert {a["outcome"] for a in attempts if not a["trained"]} <= {"interrupted"}, (point, attempts)


async def _train(url: str, groups, key: str):
    model = await TrainableModel("crashy").register(url)
    return await model.train(groups, CONFIG, idempotency_key=key)


# ---- bounded configs and bodies ---------------------------------------------------------------------

@pytest.mark.parametrize("config, field", [
    ({"learning_rate": 1e308}, "learning_rate"), ({"epochs": 10**9}, "epochs"),
    ({"num_minibatches": 10**9}, "num_minibatches"), ({"max_grad_norm": math.inf}, "max_grad_norm"),
    ({"kl_coef": 1e300}, "kl_coef"),
])
def test_configs_no_sane_run_uses_are_refused_with_the_field_named(server, groups, config, field):
    r = _post(server.url, "/v1/runs/reliability-sampler/jobs", _rl_body(groups, f"k-{field}", **config))
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("lora, field", [({"alpha": 1e308}, "alpha"), ({"seed": 2**70}, "seed"),
                                         ({"target_modules": ["no_such_proj"]}, "target_modules"),
                                         ({"rank": 10**6}, "rank")])
def test_lora_settings_are_checked_when_the_run_is_made(server, lora, field):
    r = _post(server.url, "/v1/runs", {"name": f"lora-{field}", "lora": lora})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


async def test_names_that_differ_only_in_punctuation_are_different_runs(server, groups):
    for name in ("x-y", "x_y", "x.y"):
        model = await TrainableModel(name).register(server.url)
        assert (await model.train(groups, CONFIG)).step == 1
    assert _post(server.url, "/v1/runs", {"name": "p", "project": "x" * 1000}).status_code == 400


def test_bad_payloads_are_refused_at_submission(server, groups):
    body = _rl_body(groups, "k-nan-temperature")
    choice = next(i for i in body["groups"][0]["trajectories"][0]["messages_and_choices"] if "finish_reason" in i)
    choice["sampling"]["temperature"] = math.nan
    r = _post(server.url, "/v1/runs/reliability-sampler/jobs", body)
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"], r.text
    sft = {"kind": "sft", "conversations": [{"messages": [{"role": "user", "content": "hi"}]}]}
    r = _post(server.url, "/v1/runs/reliability-sampler/jobs", sft)
    assert r.status_code == 400 and "assistant" in r.json()["error"]["message"], r.text


def test_log_and_import_refuse_what_could_not_be_read_back(server, groups):
    traj = groups[0].trajectories[0].model_dump(mode="json")
    for bad in ({**traj, "reward": math.nan}, {**traj, "metadata": {"note": "\ud800"}}):
        body = json.dumps({"groups": [{"trajectories": [bad]}], "split": "val"}, allow_nan=True)
        r = httpx.post(server.url + "/v1/runs/reliability-sampler/log", content=body,
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400, r.text
    nested = '{"x": ' * 5000 + "1" + "}" * 5000  # deeper than any JSON encoder here would write
    line = json.dumps({"trajectory": {**traj, "metadata": {}}}).replace('"metadata": {}', f'"metadata": {nested}')
    r = httpx.post(server.url + "/v1/runs/reliability-sampler/import", content=line, timeout=60)
    assert r.status_code == 400, r.text
    r = httpx.post(server.url + "/v1/runs/reliability-sampler/import", params={"split": "no spaces!"},
                   content=json.dumps({"trajectory": traj}), timeout=60)
    assert r.status_code == 400, r.text
    # and reading the run back still works
    assert get_json(server.url, "/v1/runs/reliability-sampler/trajectories")["data"] is not None
    assert get_json(server.url, "/ui/api/runs/reliability-sampler")["name"] == "reliability-sampler"


@pytest.mark.parametrize("path", [
    f"/ui/api/trajectories/{2**80}", f"/ui/api/runs/reliability-sampler/steps/{2**70}/groups",
    f"/ui/api/runs/reliability-sampler/trajectories?step={2**70}", f"/v1/runs/reliability-sampler/export.jsonl?step={2**64}",
    f"/v1/jobs/job-0000000000000000/events?after={2**64}", f"/v1/runs/reliability-sampler/checkpoints/{2**64}",
])
def test_integers_past_int64_are_a_400(server, groups, path):
    method = "DELETE" if path.endswith(f"checkpoints/{2**64}") else "GET"
    r = httpx.request(method, server.url + path, timeout=60)
    assert r.status_code in (400, 404), (path, r.status_code, r.text)
    assert r.status_code == 400 or "does not exist" in r.text


def test_a_lone_surrogate_in_a_chat_message_is_a_400(server):
    body = '{"model": "artisan-tiny", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'
    r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
    pair = '{"model": "artisan-tiny", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 2}'
    r = httpx.post(server.url + "/v1/chat/completions", content=pair, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text  # an emoji, escaped as a surrogate pair, is text


def test_chunked_bodies_are_limited_and_the_key_is_checked_first(fresh_server):
    srv = fresh_server(api_key="k", extra=["--max-request-bytes", "1000000"])

    def chunks():
        for _ in range(200):
            yield b" " * 100_000

    r = httpx.post(srv.url + "/v1/runs/x/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 401, r.text  # before a byte of the body mattered
    r = httpx.post(srv.url + "/v1/runs/x/jobs", content=chunks(),
                   headers={"content-type": "application/json", "authorization": "Bearer k"})
    assert r.status_code == 413, r.text
    assert httpx.get(srv.url + "/health").status_code == 200


# ---- idempotency --------------------------------------------------------------------------------

async def test_a_key_reused_for_another_body_is_a_409(server, groups):
    model = await TrainableModel("idem").register(server.url)
    await model.train(groups, CONFIG, idempotency_key="same")
    again = await model.train(groups, CONFIG, idempotency_key="same")  # same body: the same job
    assert again.step == 1
    with pytest.raises(ServerError) as e:
        await model.train(groups[:1], CONFIG, idempotency_key="same")
    assert e.value.status == 409


def test_a_byte_identical_retry_without_start_times_is_the_same_job(server, groups):
    """curl and other-language clients send no start_time; the server's default for it must not make
    their retry a different body (it was 202, then 409)."""
    body = _rl_body(groups, "k-raw")
    for g in body["groups"]:
        for t in g["trajectories"]:
            del t["start_time"], t["end_time"]
    _register(server.url, "raw-retry")
    first = _post(server.url, "/v1/runs/raw-retry/jobs", body)
    again = _post(server.url, "/v1/runs/raw-retry/jobs", body)
    assert (first.status_code, again.status_code) == (202, 202), again.text
    assert again.json()["job_id"] == first.json()["job_id"]


def test_a_reward_too_large_for_group_statistics_is_a_400_naming_it(server, groups):
    body = _rl_body(groups, "k-huge")
    body["groups"][0]["trajectories"][0]["reward"] = 1e308
    _register(server.url, "huge-reward")
    r = _post(server.url, "/v1/runs/huge-reward/jobs", body)
    assert r.status_code == 400, r.text
    assert "reward" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_following_a_finished_job_past_its_last_event_ends_the_stream(server, groups):
    _register(server.url, "events-past-end")
    job = _post(server.url, "/v1/runs/events-past-end/jobs", _rl_body(groups, "k-events")).json()["job_id"]
    with httpx.stream("GET", f"{server.url}/v1/jobs/{job}/events", timeout=120) as r:  # to the end
        seen = [line for line in r.iter_lines() if line.startswith("data:")]
    last = json.loads(seen[-1][len("data: "):])["seq"]
    # Past the end: an empty stream that closes (it sent keep-alives forever); the read timeout is
    # below the 15 s keep-alive interval, so a stream that stays open fails here.
    with httpx.stream("GET", f"{server.url}/v1/jobs/{job}/events", params={"after": last + 10**6},
                      timeout=httpx.Timeout(60, read=10)) as r:
        assert r.status_code == 200
        assert [line for line in r.iter_lines() if line.strip()] == []


# ---- jobs end ------------------------------------------------------------------------------------

async def test_a_job_can_be_cancelled_and_another_runs_job_then_goes_ahead(server, groups):
    slow = await TrainableModel("slow").register(server.url)
    other = await TrainableModel("other").register(server.url)
    body = _rl_body(groups, "k-slow", epochs=100, num_minibatches=6)
    job = (await slow.request("POST", "/v1/runs/slow/jobs", json=body))["job_id"]
    waiting = asyncio.create_task(other.train(groups, CONFIG))
    await asyncio.sleep(1.0)
    cancelled = await slow.request("DELETE", f"/v1/jobs/{job}")
    assert cancelled["id"] == job
    result = await waiting  # the other run's job was not held up for 100 epochs
    assert result.step == 1
    assert (await slow.request("GET", f"/v1/jobs/{job}"))["status"] == "cancelled"
    assert await slow.get_step() == 0  # the cancelled step never landed
    [attempt] = (await slow.request("GET", "/ui/api/runs/slow/attempts"))["data"]
    assert (attempt["outcome"], attempt["trained"], attempt["job_id"]) == ("cancelled", False, job)


async def test_a_job_past_its_time_limit_is_stopped(fresh_server, groups):
    srv = fresh_server(extra=["--job-time-limit", "1"])

    model = await TrainableModel("bounded").register(srv.url)
    with pytest.raises(ServerError, match="time limit"):
        await model.train(groups, TrainConfig(learning_rate=1e-3, epochs=100, num_minibatches=6))
    assert await model.get_step() == 0


async def test_a_non_finite_update_is_rolled_back_and_never_served(server, groups):
    model = await TrainableModel("blowup").register(server.url)
    # Decoupled weight decay of lr * wd = 1e4 per step multiplies the LoRA's A by -9999 each
    # time: after a few optimizer steps its weights overflow to inf.
    with pytest.raises(ServerError, match="non-finite"):
        await model.train(groups, TrainConfig(learning_rate=1.0, weight_decay=1e4, epochs=20))
    assert await model.get_step() == 0
    async with model.openai_client(max_retries=0) as client:
        resp = await client.chat.completions.create(model="blowup", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=4)
    assert all(math.isfinite(e.logprob) for e in resp.choices[0].logprobs.content)
    # the attempt is kept, with the figures of the update that was rolled back
    [attempt] = (await model.request("GET", "/ui/api/runs/blowup/attempts"))["data"]
    assert (attempt["outcome"], attempt["trained"], attempt["step"]) == ("failed", False, 1)
    assert "non-finite" in attempt["warnings"][-1] and attempt["metrics"]["optimizer_steps"] > 0


# ---- one run cannot harm the others ---------------------------------------------------------------

async def test_a_poisoned_adapter_fails_alone_in_a_shared_batch(tmp_path, groups):
    data = tmp_path / "poison"
    with ServerProcess(data) as srv:
        await _make_runs(srv.url, groups)
    ckpt = data / "runs" / "poisoned" / "checkpoints" / "step_000001" / "adapter.safetensors"
    # weights that went non-finite before the save: the checksum matches, so only serving can tell
    save_file({k: v * math.inf for k, v in load_file(str(ckpt)).items()}, str(ckpt))
    meta_path = ckpt.parent / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["sha256"]["adapter.safetensors"] = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    meta_path.write_text(json.dumps(meta))
    with ServerProcess(data) as srv:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
            responses = await asyncio.gather(*(http.post("/v1/chat/completions", json={
                "model": name, "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 6})
                for i in range(4) for name in ("artisan-tiny", "healthy", "poisoned")))
        for r in responses:
            model = json.loads(r.request.content)["model"]
            if model == "poisoned":
                assert r.status_code == 500 and "non-finite" in r.json()["error"]["message"], r.text
            else:
                assert r.status_code == 200, r.text
                assert all(math.isfinite(e["logprob"]) for e in r.json()["choices"][0]["logprobs"]["content"])


async def _make_runs(url: str, groups) -> None:
    for name in ("healthy", "poisoned"):
        model = await TrainableModel(name).register(url)
        await model.train(groups, CONFIG)


async def test_one_huge_request_does_not_starve_a_normal_one(fresh_server):
    srv = fresh_server(extra=["--max-batch", "8"])

    async with httpx.AsyncClient(base_url=srv.url, timeout=600) as http:
        finished: list[str] = []

        async def call(name: str, body: dict) -> None:
            r = await http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            finished.append(name)

        huge = asyncio.create_task(call("huge", {"model": "artisan-tiny", "n": 64, "max_tokens": 100000,
                                                 "ignore_eos": True, "messages": [{"role": "user", "content": "go"}]}))
        await asyncio.sleep(1.0)
        await call("normal", {"model": "artisan-tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
        assert finished == ["normal"], finished  # served while the huge one still decodes
        huge.cancel()


# ---- an unexpected error answers a plain 500 on a connection that stays usable ----------------------

@pytest.mark.unit
def test_an_unexpected_error_is_a_plain_500_and_the_connection_survives():
    from server.api.errors import install
    from server.api.limits import GuardedRoute

    app = FastAPI()
    install(app)
    app.router.route_class = GuardedRoute

    @app.get("/boom")
    async def boom():
        raise RuntimeError("secret internals")

    @app.get("/fine")
    async def fine():
        return {"ok": True}

    with ServedApp(app, log_level="critical") as served:
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)  # one keep-alive connection
        conn.request("GET", "/boom")
        r = conn.getresponse()
        body = r.read().decode()
        assert r.status == 500 and "secret internals" not in body and json.loads(body)["error"]["message"]
        assert not r.will_close  # the connection stays usable...
        sock = conn.sock
        conn.request("GET", "/fine")
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read()) == {"ok": True}
        assert conn.sock is sock  # ...and was used again
        conn.close()
