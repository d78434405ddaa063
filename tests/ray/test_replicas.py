"""`art-server --replicas 2` on a Ray cluster: one API in front of two engine replicas (Ray actors),
driven with the openai SDK; the replicas are also addressed directly through Ray, to show each
one's answer and adapters."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import ray
from openai import AsyncOpenAI, OpenAI

from client import TrainConfig, TrainableModel
from server.engine.sampling import SamplingParams
from server.runs.run import adapter_name
from tests.conftest import ServerProcess
from tests.helpers import demo_groups, with_rewards

STEP_1 = adapter_name("replicated", "s1")  # the engine's name for the run's first trained step
REPLICA_BACK_S = 300  # the server's own start timeout below


@pytest.fixture(scope="module")
def srv(ray_cluster, tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("replicas"), extra=["--replicas", "2", "--ray-address", ray_cluster])
    server.start(timeout=REPLICA_BACK_S)
    ray.init(address=ray_cluster, namespace="artisan", log_to_driver=False)  # to address the replicas
    yield server
    ray.shutdown()
    server.stop()


def _health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=30).json()


def _until_back(srv, index: int, killed_pid: int) -> list[dict]:
    """Every /health seen until replica `index` is up again under a new pid. A restart loads the model
    again: 6-15 s on an idle machine, and five times as long or more beside CI's other suites, so it is
    given as long as the server's own start."""
    seen, start = [], time.monotonic()
    while time.monotonic() < start + REPLICA_BACK_S:
        seen.append(_health(srv.url))
        now = seen[-1]["replicas"][index]
        if now["state"] == "up" and now["pid"] != killed_pid:
            print(f"replica {index} was back {time.monotonic() - start:.1f}s after it was killed")
            return seen
        time.sleep(0.1)
    raise AssertionError(f"replica {index} was not back within {REPLICA_BACK_S}s: {seen[-1]}; the end of the "
                         f"server's log:\n{Path(srv.log_path).read_text(errors='replace')[-3000:]}")


def _replica_answer(name: str, prompt_ids: list[int], params: SamplingParams, adapter: str | None):
    """One replica's ids and logprobs for a prompt, asked of its actor directly."""
    actor = ray.get_actor(name)
    ids, lps = [], []
    for ref in actor.generate.remote(f"test-{time.monotonic_ns()}", prompt_ids, params, adapter, 1, False):
        for ev in ray.get(ref):
            assert ev.kind in ("token", "finished"), ev.message
            ids += ev.token_ids
            lps += ev.logprobs
    return ids, lps


def _seeded(srv, model: str) -> tuple[dict, list[int], list[float]]:
    client = OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=120, max_retries=0)
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What does a pear cost?"}],
                                       max_tokens=12, temperature=1.0, seed=1234, logprobs=True,
                                       extra_body={"ignore_eos": True})
    raw = r.model_dump()
    return raw, raw["choices"][0]["token_ids"], [t.logprob for t in r.choices[0].logprobs.content]


async def test_two_replicas_serve_and_health_shows_each(srv):
    health = _health(srv.url)
    assert health["status"] == "ok"
    assert [(r["index"], r["state"]) for r in health["replicas"]] == [(0, "up"), (1, "up")]
    pids = {r["pid"] for r in health["replicas"]}
    assert len(pids) == 2 and os.getpid() not in pids
    # at the niceness of the process that started the cluster, not Ray's default of 15 above it
    assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in pids] == [os.getpriority(os.PRIO_PROCESS, 0)] * 2

    # at once, on a fresh server: the least loaded rule spreads them
    async with AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", timeout=120, max_retries=0) as client:
        answers = await asyncio.gather(*(client.chat.completions.create(
            model="artisan-tiny", messages=[{"role": "user", "content": f"Tell me about the {fruit}."}],
            max_tokens=48, extra_body={"ignore_eos": True}) for fruit in ("apple", "banana", "cherry", "plum")))
    assert all(a.usage.completion_tokens == 48 for a in answers)
    assert [r["served"] for r in _health(srv.url)["replicas"]] == [2, 2]


def test_a_seeded_request_is_token_exact_on_either_replica(srv):
    raw, ids, lps = _seeded(srv, "artisan-tiny")
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    for replica in _health(srv.url)["replicas"]:
        assert _replica_answer(replica["name"], raw["prompt_token_ids"], params, None) == (ids, lps), replica["name"]


def test_a_streamed_answer_arrives_in_pieces_with_the_same_tokens(srv):
    _, ids, lps = _seeded(srv, "artisan-tiny")
    client = OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=120, max_retries=0)
    stream = client.chat.completions.create(model="artisan-tiny",
                                            messages=[{"role": "user", "content": "What does a pear cost?"}],
                                            max_tokens=12, temperature=1.0, seed=1234, logprobs=True, stream=True,
                                            extra_body={"ignore_eos": True})
    pieces = [c.choices[0].model_dump() for c in stream if c.choices]
    with_tokens = [p for p in pieces if p.get("token_ids")]
    assert len(with_tokens) >= 2  # streamed, not one answer at the end
    assert [t for p in with_tokens for t in p["token_ids"]] == ids
    assert [e["logprob"] for p in with_tokens for e in p["logprobs"]["content"]] == lps


def _served(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]}


def test_a_conversation_s_next_turn_goes_to_the_replica_that_served_its_last(srv):
    client = OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=120, max_retries=0)
    busy = threading.Thread(target=lambda: client.chat.completions.create(
        model="artisan-tiny", messages=[{"role": "user", "content": "Keep replica 0 busy."}], max_tokens=400,
        extra_body={"ignore_eos": True}))
    busy.start()
    deadline = time.monotonic() + 60
    while _health(srv.url)["replicas"][0]["in_flight"] == 0:
        assert time.monotonic() < deadline and busy.is_alive(), "replica 0 was never seen sampling"
        time.sleep(0.02)
    messages = [{"role": "user", "content": "Tell me about the pear and the plum, please, in detail."}]
    before = [r["served"] for r in _health(srv.url)["replicas"]]
    first = client.chat.completions.create(model="artisan-tiny", messages=messages, max_tokens=40)
    after_first = [r["served"] for r in _health(srv.url)["replicas"]]
    assert after_first[1] == before[1] + 1  # the least loaded took the first turn
    busy.join()
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And the cherry?"}]
    client.chat.completions.create(model="artisan-tiny", messages=messages, max_tokens=8)
    after_second = [r["served"] for r in _health(srv.url)["replicas"]]
    # Both idle now, so the least loaded rule alone would pick replica 0: the prefix kept it on 1.
    assert after_second[1] == after_first[1] + 1


async def test_a_trained_step_is_served_under_its_run_name_only_once_every_replica_has_it(srv):
    model = await TrainableModel("replicated").register(srv.url)
    groups = with_rewards(await demo_groups(model, 2, 3, seed=5), [[0.0, 1.0, 0.5], [1.0, 0.0, 0.0]])
    replicas = _health(srv.url)["replicas"]
    frozen = replicas[1]
    os.kill(frozen["pid"], signal.SIGSTOP)  # alive to Ray, but it loads nothing until it is let go
    try:
        done = threading.Event()
        trainer = threading.Thread(target=lambda: (asyncio.run(model.train(
            groups, TrainConfig(learning_rate=5e-2), idempotency_key="replicated-1")), done.set()))
        trainer.start()
        deadline = time.monotonic() + 180
        while STEP_1 not in ray.get(ray.get_actor(replicas[0]["name"]).info.remote())["adapters"]:
            assert time.monotonic() < deadline and trainer.is_alive(), "the step never reached replica 0"
            time.sleep(0.2)
        for _ in range(10):  # the step is trained and on replica 0: its name waits for replica 1
            assert "replicated@1" not in _served(srv.url) and not done.is_set()
            time.sleep(0.3)
    finally:
        os.kill(frozen["pid"], signal.SIGCONT)
    trainer.join(timeout=180)
    assert done.is_set() and "replicated@1" in _served(srv.url)
    raw, ids, lps = _seeded(srv, "replicated")
    _, _, base_lps = _seeded(srv, "artisan-tiny")
    assert lps != base_lps  # the run's name decodes with the trained adapter, not the base model
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    for replica in replicas:  # and both replicas give its answer
        assert _replica_answer(replica["name"], raw["prompt_token_ids"], params, STEP_1) == (ids, lps)


async def test_a_replica_killed_mid_load_loses_no_retried_request_and_comes_back(srv):
    before = {r["index"]: r for r in _health(srv.url)["replicas"]}
    victim = before[0]

    # The SDK retries a 500 (here: the replica died under the request) after a short wait.
    async with AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", timeout=120, max_retries=4) as client:
        async def one(i: int):
            return await client.chat.completions.create(
                model="replicated", messages=[{"role": "user", "content": f"Count to {i} in fruit."}],
                max_tokens=64, extra_body={"ignore_eos": True})

        tasks = [asyncio.create_task(one(i)) for i in range(16)]
        deadline = time.monotonic() + 60
        while _health(srv.url)["replicas"][0]["in_flight"] == 0:
            assert time.monotonic() < deadline and not all(t.done() for t in tasks), "replica 0 was never seen sampling"
            await asyncio.sleep(0.05)
        os.kill(victim["pid"], signal.SIGKILL)
        answers = await asyncio.gather(*tasks)
    assert len(answers) == 16 and all(a.usage.completion_tokens == 64 for a in answers)
    assert f"replica {victim['name']} failed a request" in Path(srv.log_path).read_text()  # some were retried
    now = _until_back(srv, 0, victim["pid"])[-1]["replicas"][0]
    assert now["restarts"] == before[0]["restarts"] + 1, now
    # Given every loaded adapter before it took requests again:
    assert STEP_1 in ray.get(ray.get_actor(victim["name"]).info.remote())["adapters"]
    raw, ids, lps = _seeded(srv, "replicated")
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    assert _replica_answer(victim["name"], raw["prompt_token_ids"], params, STEP_1) == (ids, lps)


async def _fate(call) -> str:
    """How one request ended: "ok", or the code (or Anthropic error type) it failed with."""
    try:
        await call()
        return "ok"
    except openai.APIStatusError as exc:  # not streamed: the status and code, with the wait to retry after
        assert exc.status_code == 503 and exc.response.headers.get("retry-after") == "1", exc
        return exc.body["code"]
    except openai.APIError as exc:  # a Chat Completions stream's last event
        return exc.body["code"]
    except anthropic.APIStatusError as exc:  # a Messages stream's error event
        return exc.body["error"]["type"]


async def test_a_replica_lost_mid_request_is_an_error_a_client_may_retry(srv):
    """Each API's way of saying "send it again": a 503 with Retry-After before any byte is sent;
    once a stream has begun, its last event, with the code replica_lost (Anthropic's
    overloaded_error on Messages)."""
    base = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]  # any model it serves
    body = {"model": base, "max_tokens": 1024, "extra_body": {"ignore_eos": True}}
    async with AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", timeout=120, max_retries=0) as oa, \
            anthropic.AsyncAnthropic(base_url=srv.url, api_key="x", timeout=120, max_retries=0) as an:
        async def chat(i: int, stream: bool):
            messages = [{"role": "user", "content": f"Name {i} fruits."}]
            if not stream:
                return await oa.chat.completions.create(messages=messages, **body)
            async for _ in await oa.chat.completions.create(messages=messages, stream=True, **body):
                pass

        async def message(i: int):
            async with an.messages.stream(model=base, max_tokens=1024, extra_body={"ignore_eos": True},
                                          messages=[{"role": "user", "content": f"Name {i} pears."}]) as stream:
                async for _ in stream:
                    pass

        calls = [lambda i=i: chat(i, False) for i in range(6)] + [lambda i=i: chat(i, True) for i in range(6)] + \
                [lambda i=i: message(i) for i in range(6)]
        tasks = [asyncio.create_task(_fate(c)) for c in calls]
        deadline = time.monotonic() + 60
        while not (busy := [r for r in _health(srv.url)["replicas"] if r["in_flight"] > 0]):
            assert time.monotonic() < deadline and not all(t.done() for t in tasks), "no replica was seen sampling"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # streams under way
        victim = busy[0]  # requests go where their prefix was served last: perhaps all to one replica
        os.kill(victim["pid"], signal.SIGKILL)
        fates = await asyncio.gather(*tasks)
    print("fates (6 chat, 6 chat streams, 6 message streams):", fates)
    assert set(fates[:12]) <= {"ok", "replica_lost"} and set(fates[12:]) <= {"ok", "overloaded_error"}, fates
    assert {"replica_lost", "overloaded_error"} & set(fates)  # the lost replica's requests failed, and said how
    await asyncio.to_thread(_until_back, srv, victim["index"], victim["pid"])


def test_health_is_degraded_while_a_replica_is_down_and_ok_once_it_is_back(srv):
    victim = _health(srv.url)["replicas"][1]
    os.kill(victim["pid"], signal.SIGKILL)
    *meanwhile, health = _until_back(srv, 1, victim["pid"])
    down = [seen for seen in meanwhile if seen["replicas"][1]["state"] != "up"]
    assert down, "the replica was never seen down"
    for seen in down:  # the other replica serves meanwhile: degraded, not engine_down
        assert seen["status"] == "degraded", seen
        assert any(p.startswith("engine replica 1 is down (1 of 2 up)") for p in seen["problems"]), seen
    assert health["status"] == "ok" and health["problems"] == [], health


async def test_the_teacher_route_scores_the_base_model_but_not_a_run_whose_adapter_is_on_the_replicas(srv):
    await TrainableModel("scored").register(srv.url)
    base = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"sequences": [{"token_ids": [1, 2, 3]}]}
    r = httpx.post(srv.url + "/v1/logprobs", json={"model": "scored", **body}, timeout=60)
    assert r.status_code == 409 and r.json()["error"]["code"] == "not_scorable_here", r.text
    assert "--replicas or vLLM" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/logprobs", json={"model": base, **body}, timeout=60)
    assert r.status_code == 200 and len(r.json()["data"][0]["logprobs"]) == 2, r.text
