"""One run never holds the others: a job is stopped in any phase, runs take turns, a job or a run
past the server's bounds is refused at once, and a run can be deleted and made again. Against a
real server on loopback with the embedded model."""

from __future__ import annotations

import time

import httpx
import pytest

from client import ServerError, TrainableModel

FIRST = {"role": "user", "content": "Say something."}


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def _register(url: str, name: str, **lora) -> httpx.Response:
    return _post(url, "/v1/runs", {"name": name, **({"lora": lora} if lora else {})})


def _sampled(url: str, model: str) -> dict:
    """One choice sampled by the server, as it travels back (token ids, logprobs, sampling record)."""
    r = _post(url, "/v1/chat/completions", {"model": model, "messages": [FIRST], "max_tokens": 6,
                                            "temperature": 1.0, "seed": 3})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _history(choice: dict, turns: int) -> list:
    """`turns` user messages each answered by the sampled choice. Only the first turn is the
    prompt it was sampled after; the others are still rendered and checked, one by one."""
    items: list = []
    for i in range(turns):
        items += [FIRST if i == 0 else {"role": "user", "content": f"And again, {i}."}, choice]
    return items


def _rl(items: list, key: str, **config) -> dict:
    group = {"trajectories": [{"messages_and_choices": items, "reward": r} for r in (0.0, 1.0)]}
    return {"kind": "rl", "groups": [group], "config": {"learning_rate": 1e-3, **config}, "idempotency_key": key}


def _submit(url: str, run: str, body: dict) -> str:
    r = _post(url, f"/v1/runs/{run}/jobs", body)
    assert r.status_code == 202, r.text
    return r.json()["job_id"]


def _status(url: str, job: str) -> str:
    r = httpx.get(f"{url}/v1/jobs/{job}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["status"]


def _wait(url: str, job: str, until: tuple[str, ...], timeout: float) -> float:
    """Seconds until the job's status is one of `until`; fails past `timeout`."""
    t0 = time.monotonic()
    while (status := _status(url, job)) not in until:
        assert time.monotonic() - t0 < timeout, f"job {job} still {status} after {timeout}s"
        time.sleep(0.05)
    return time.monotonic() - t0


ENDED = ("succeeded", "failed", "cancelled", "interrupted")


@pytest.fixture(scope="module")
def plain(fresh_server_module):
    """A server with no bounds but its defaults."""
    return fresh_server_module()


@pytest.fixture(scope="module")
def bounded(fresh_server_module):
    """A server that bounds jobs at 200 optimizer steps and its runs' adapters at 700 MiB (a
    rank-1024 LoRA on the embedded model is estimated at 511 MiB, rank 8 at 4 MiB)."""
    return fresh_server_module(extra=["--max-job-optimizer-steps", "200", "--adapter-memory-mb", "700"])


def test_a_2000_turn_job_is_cancelled_within_2s_and_another_runs_job_starts_within_5s(plain):
    url = plain.url
    for name in ("long", "short"):
        assert _register(url, name).status_code == 200
    choice = _sampled(url, "long")
    long_job = _submit(url, "long", _rl(_history(choice, 2000), "k-long"))
    _wait(url, long_job, ("running",), 60)
    time.sleep(1.0)  # well into assembling its 2 x 2,000 turns
    short_job = _submit(url, "short", _rl(_history(_sampled(url, "short"), 1), "k-short"))
    submitted = time.monotonic()
    r = httpx.delete(f"{url}/v1/jobs/{long_job}", timeout=30)
    assert r.status_code == 200, r.text
    assert _wait(url, long_job, ENDED, 2.0) <= 2.0
    assert _status(url, long_job) == "cancelled"
    _wait(url, short_job, ("running", *ENDED), 5.0 - (time.monotonic() - submitted))
    _wait(url, short_job, ENDED, 120)
    assert _status(url, short_job) == "succeeded"
    assert httpx.get(f"{url}/v1/runs/long", timeout=30).json()["step"] == 0  # the cancelled step never landed


def test_one_runs_queue_of_jobs_does_not_hold_another_runs_job(plain):
    """Four jobs of one run queued before one of another: runs take turns, so the other run's job
    runs after the first of the four, not after all of them."""
    url = plain.url
    for name in ("busy", "patient"):
        assert _register(url, name).status_code == 200
    items = _history(_sampled(url, "busy"), 1)
    busy = [_submit(url, "busy", _rl(items, f"k-busy-{i}", epochs=50, num_minibatches=2)) for i in range(4)]
    patient = _submit(url, "patient", _rl(items, "k-patient", epochs=1))
    _wait(url, patient, ENDED, 300)
    still_waiting = [j for j in busy if _status(url, j) not in ENDED]
    assert _status(url, patient) == "succeeded"
    assert len(still_waiting) >= 2, "the other run's job waited for the busy run's whole queue"
    # Last first: cancelling the running job first would start the next one before its own DELETE.
    for job in reversed(still_waiting):
        httpx.delete(f"{url}/v1/jobs/{job}", timeout=30)
    queued = still_waiting[-1]  # cancelled in the queue: ended at once, never started
    assert _wait(url, queued, ENDED, 2.0) <= 2.0
    events = httpx.get(f"{url}/v1/jobs/{queued}/events", timeout=30).text
    assert '"cancelled"' in events and '"started"' not in events


@pytest.mark.parametrize("body", [
    {"kind": "sft", "conversations": [{"messages": [FIRST, {"role": "assistant", "content": "Hi."}]}] * 3,
     "config": {"epochs": 100, "batch_size": 1}},
    "rl-4x100x1024",
], ids=["sft-epochs-100-batch-1", "rl-epochs-100-minibatches-1024"])
def test_a_job_past_the_step_bound_is_refused_naming_the_flag(bounded, body):
    url = bounded.url
    assert _register(url, "big").status_code == 200
    if body == "rl-4x100x1024":
        body = _rl(_history(_sampled(url, "big"), 1), "k-big", epochs=100, num_minibatches=1024)
        body["groups"][0]["trajectories"] *= 2  # 4 trajectories: 4 minibatches of one, 100 times
    r = _post(url, "/v1/runs/big/jobs", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "job_too_large" and error["param"] == "config"
    assert "300" in error["message"] or "400" in error["message"]
    assert "allows 200 per job" in error["message"] and "--max-job-optimizer-steps" in error["message"]
    ok = _submit(url, "big", _rl(_history(_sampled(url, "big"), 1), f"k-fits-{body['kind']}", epochs=50))
    _wait(url, ok, ENDED, 120)
    assert _status(url, ok) == "succeeded"  # the server kept serving, and a job within the bound trains


def test_a_job_whose_assembly_passes_the_step_bound_fails_naming_the_flag(bounded):
    """Counted at submission as one sequence per trajectory; each trajectory here has three more
    histories, so assembly makes 8 sequences and 50 epochs of 8 minibatches pass the bound."""
    url = bounded.url
    assert _register(url, "split").status_code == 200
    items = _history(_sampled(url, "split"), 1)
    body = _rl(items, "k-split", epochs=50, num_minibatches=8)
    for t in body["groups"][0]["trajectories"]:
        t["additional_histories"] = [{"messages_and_choices": items}] * 3
    job = _submit(url, "split", body)
    _wait(url, job, ENDED, 120)
    record = httpx.get(f"{url}/v1/jobs/{job}", timeout=30).json()
    assert record["status"] == "failed"
    assert "would take 400 optimizer steps" in record["error"] and "--max-job-optimizer-steps" in record["error"]
    assert httpx.get(f"{url}/v1/runs/split", timeout=30).json()["step"] == 0


async def test_a_run_is_deleted_with_everything_it_had_and_made_again(bounded, tmp_path):
    url = bounded.url

    model = await TrainableModel("doomed").register(url)
    items = _history(_sampled(url, "doomed"), 1)
    first = _submit(url, "doomed", _rl(items, "k-doomed"))
    _wait(url, first, ENDED, 120)
    assert await model.get_step() == 1
    running = _submit(url, "doomed", _rl(_history(_sampled(url, "doomed"), 2000), "k-doomed-long"))
    _wait(url, running, ("running",), 60)
    deleted = await model.delete()  # cancels the running job first
    assert deleted == {"deleted": "doomed", "step": 1}
    for path in ("/v1/runs/doomed", "/v1/runs/doomed/trajectories", f"/v1/jobs/{first}", f"/v1/jobs/{running}"):
        assert httpx.get(url + path, timeout=30).status_code == 404, path
    names = [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]]
    assert not [n for n in names if n.startswith("doomed")]
    for name in ("doomed", "doomed@1", "doomed@0"):
        r = _post(url, "/v1/chat/completions", {"model": name, "messages": [FIRST], "max_tokens": 2})
        assert r.status_code == 404, (name, r.text)
    ui = httpx.get(url + "/ui/api/runs", timeout=30).json()
    assert "doomed" not in str(ui)
    with pytest.raises(ServerError, match="404"):
        await model.delete()

    await model.register(url)  # the same name, afresh
    assert await model.get_step() == 0
    info = httpx.get(url + "/v1/runs/doomed", timeout=30).json()
    assert info["checkpoints"] == [0] and info["steps"] == []
    assert httpx.get(url + "/v1/runs/doomed/trajectories", timeout=30).json()["data"] == []
    again = _submit(url, "doomed", _rl(items, "k-doomed"))  # its old key is forgotten: a new job
    assert again != first
    _wait(url, again, ENDED, 120)
    assert _status(url, again) == "succeeded" and await model.get_step() == 1


def test_a_rank_too_large_for_the_memory_left_is_refused(bounded):
    url = bounded.url
    assert _register(url, "wide-1", rank=1024).status_code == 200
    r = _register(url, "wide-2", rank=1024)
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "insufficient_memory" and "--adapter-memory-mb" in error["message"]
    assert "lora.rank 1024 needs about 511 MiB" in error["message"]
    assert httpx.get(url + "/v1/runs/wide-2", timeout=30).status_code == 404  # nothing was made
    assert _register(url, "narrow", rank=8).status_code == 200  # a small one still fits
    assert httpx.delete(url + "/v1/runs/wide-1", timeout=60).status_code == 200
    assert _register(url, "wide-2", rank=1024).status_code == 200  # deleting a run made room


def test_a_run_that_would_eat_into_the_reserved_memory_is_refused(fresh_server):
    srv = fresh_server(extra=["--memory-reserve-mb", str(10**9)])  # more than any machine has
    r = _register(srv.url, "any")
    assert r.status_code == 409, r.text
    assert "--memory-reserve-mb" in r.json()["error"]["message"]
    assert httpx.get(srv.url + "/health", timeout=30).json()["status"] == "ok"
