"""Recorded sessions under the failures issue 36 found, against the real server on the embedded model:
a session job's idempotency key answers before its sessions (after the job, after a restart, and
after a SIGKILL mid-job, when it trains again from its stored groups); recorded sessions survive a
clean stop and a SIGKILL token-exactly, stay taken by the job that trained them, and are dropped at
start when expired or damaged (the server serving the rest); a failed request leaves no
session; each key has its own count of sessions and its own namespace of session ids; fields no
chat template renders are not kept, and a session's bytes are bounded; a session job refuses
sessions with an exchange still being sampled, and sessions another job trained. Kept Responses
outlive a restart as sessions do.
"""

from __future__ import annotations

import json
import sqlite3
import time

import httpx
import pytest

from client import TrainableModel

KEYS = ("key-one", "key-two")
CONFIG = {"learning_rate": 1e-3}


def _say(model: str, text: str = "hi", **extra) -> dict:
    return {"model": model, "max_tokens": 3, "seed": 1, "messages": [{"role": "user", "content": text}], **extra}


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _record(url: str, key: str, sid: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/sessions/{sid}/chat/completions", headers=_auth(key), json=body, timeout=120)


def _job(sids: list[str], key: str | None = None) -> dict:
    body = {"groups": [{"sessions": [{"session_id": s, "reward": float(i)} for i, s in enumerate(sids)]}],
            "config": CONFIG}
    return {**body, "idempotency_key": key} if key else body


def _submit(url: str, run: str, sids: list[str], key: str, api_key: str = "") -> httpx.Response:
    """A session job of one group of these sessions, under idempotency key `key`."""
    return httpx.post(f"{url}/v1/runs/{run}/session-jobs", headers=_auth(api_key), json=_job(sids, key), timeout=60)


def _record_each(url: str, run: str, sids: tuple[str, ...]) -> None:
    """One exchange in each session, each sampled with a seed of its own."""
    for seed, sid in enumerate(sids):
        assert _record(url, "", sid, _say(run, seed=seed)).status_code == 200


def _wait(url: str, key: str, job_id: str, timeout: float = 300) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = httpx.get(f"{url}/v1/jobs/{job_id}", headers=_auth(key), timeout=30).json()
        if job["status"] not in ("queued", "running"):
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not end within {timeout}s")


# ---- H1: the key before the sessions ---------------------------------------------------------------


async def test_a_session_job_retried_after_a_restart_answers_as_its_stored_job(fresh_server, tmp_path):
    data = tmp_path / "data"
    srv = fresh_server(data_dir=data)
    run = (await TrainableModel("sessions-restart").register(srv.url)).name
    _record_each(srv.url, run, ("r-a", "r-b"))
    first = _submit(srv.url, run, ["r-a", "r-b"], "once")
    assert first.status_code == 202, first.text
    assert _wait(srv.url, "", first.json()["job_id"])["status"] == "succeeded"
    srv.stop()

    srv = fresh_server(data_dir=data)  # the job is stored, and so are the sessions it took
    again = _submit(srv.url, run, ["r-a", "r-b"], "once")
    assert again.status_code == 202, again.text
    assert again.json()["job_id"] == first.json()["job_id"] and again.json()["created"] is False
    assert again.json()["status"] == "succeeded"
    other = _submit(srv.url, run, ["r-a"], "once")
    assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_key_reused", other.text


async def test_a_session_job_killed_mid_step_trains_again_from_its_stored_groups(fresh_server, tmp_path):
    data = tmp_path / "data"
    srv = fresh_server(data_dir=data, env={"ARTISAN_CRASH_AT": "step_start"})
    run = (await TrainableModel("sessions-crash").register(srv.url)).name
    _record_each(srv.url, run, ("c-a", "c-b"))
    try:
        first = _submit(srv.url, run, ["c-a", "c-b"], "crashy")
        assert first.status_code == 202, first.text
    except httpx.TransportError:  # the server may die before its answer is out: the client only knows its key
        first = None
    assert srv.wait_exit(timeout=120) != 0  # SIGKILLed itself as the step began
    srv.stop()

    srv = fresh_server(data_dir=data)
    again = _submit(srv.url, run, ["c-a", "c-b"], "crashy")
    assert again.status_code == 202, again.text
    job_id = again.json()["job_id"]
    assert first is None or first.json()["job_id"] == job_id
    assert again.json()["created"] is True  # it runs again
    events = httpx.get(f"{srv.url}/v1/jobs/{job_id}/events", params={"after": -1}, timeout=300).text
    assert '"type": "interrupted"' in events
    done = _wait(srv.url, "", job_id)
    assert done["status"] == "succeeded", done
    assert done["result"]["step"] == 1 and done["result"]["metrics"]["trained_choices"] == 2
    twice = _submit(srv.url, run, ["c-a", "c-b"], "crashy")
    assert twice.json()["job_id"] == job_id and twice.json()["created"] is False  # trained once


# ---- H1: recorded sessions outlive the process ------------------------------------------------------

CHAT_TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look an item up.",
    "parameters": {"type": "object", "properties": {"item": {"type": "string", "maxLength": 8}},
                   "required": ["item"], "additionalProperties": False}}}


def _streamed(url: str, sid: str, body: dict) -> None:
    """A streamed exchange, read to its end: once the last byte is in, the exchange is recorded."""
    with httpx.stream("POST", f"{url}/v1/sessions/{sid}/chat/completions", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines), lines[-3:]


def _record_with_a_tool_call(url: str, run: str, sid: str) -> None:
    """Two exchanges: a tool call (not streamed), then its result and the answer (streamed), which continues it."""
    ask = [{"role": "user", "content": "What does a hat cost?"}]
    first = _record(url, "", sid, _say(run, tools=[CHAT_TOOL], tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=60, messages=ask))
    assert first.status_code == 200, first.text
    reply = first.json()["choices"][0]["message"]
    assert reply.get("tool_calls"), reply
    result = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "12"}
    _streamed(url, sid, _say(run, tools=[CHAT_TOOL], messages=[*ask, reply, result]))


def _stored_rows(data, table: str, column: str, value: str) -> int:
    db = sqlite3.connect(data / "artisan.sqlite")
    try:
        return db.execute(f"SELECT COUNT(*) FROM {table} WHERE {column} = ?", (value,)).fetchone()[0]
    finally:
        db.close()


@pytest.mark.parametrize("how", ["stop", "sigkill"])
async def test_recorded_sessions_survive_a_restart_and_train_token_exactly(fresh_server, tmp_path, how):
    data = tmp_path / "data"
    srv = fresh_server(data_dir=data)
    run = (await TrainableModel(f"sessions-survive-{how}").register(srv.url)).name
    _record_with_a_tool_call(srv.url, run, "kept-a")
    assert _record(srv.url, "", "kept-b", _say(run, seed=2)).status_code == 200
    before = {sid: _get(srv, "", sid).json() for sid in ("kept-a", "kept-b")}
    assert before["kept-a"]["exchanges"] == 2, before
    if how == "sigkill":
        srv.kill()  # no shutdown code runs: what was answered was stored already
    srv.stop()

    srv = fresh_server(data_dir=data)
    for sid, info in before.items():
        r = _get(srv, "", sid)
        assert r.status_code == 200, r.text
        assert r.json() == info  # the same exchanges, tokens, bytes and times
    job = _submit(srv.url, run, ["kept-a", "kept-b"], "after")
    assert job.status_code == 202, job.text
    done = _wait(srv.url, "", job.json()["job_id"])
    assert done["status"] == "succeeded", done
    m = done["result"]["metrics"]
    assert m["trained_choices"] == 3 and m["prompt_mismatches"] == 0, m


async def test_a_session_trained_before_a_restart_is_refused_after_it(fresh_server, tmp_path):
    data = tmp_path / "data"
    srv = fresh_server(data_dir=data)
    run = (await TrainableModel("sessions-trained-once").register(srv.url)).name
    _record_each(srv.url, run, ("once-a", "once-b"))
    first = _submit(srv.url, run, ["once-a", "once-b"], "first")
    assert first.status_code == 202, first.text
    job_id = first.json()["job_id"]
    assert _wait(srv.url, "", job_id)["status"] == "succeeded"
    srv.kill()
    srv.stop()

    srv = fresh_server(data_dir=data)
    assert _get(srv, "", "once-a").json()["trained_by"] == job_id
    again = _submit(srv.url, run, ["once-b", "once-a"], "second")
    assert again.status_code == 409, again.text
    assert job_id in again.json()["error"]["message"]  # a session trains once, restart or not
    assert _record(srv.url, "", "once-a", _say(run, "more")).status_code == 409  # and records no more


async def test_expired_and_damaged_sessions_are_dropped_at_start_and_the_rest_served(fresh_server, tmp_path):
    data = tmp_path / "data"
    srv = fresh_server(data_dir=data)
    run = (await TrainableModel("sessions-damaged").register(srv.url)).name
    _record_each(srv.url, run, ("old", "broken", "fine"))
    fine = _get(srv, "", "fine").json()
    srv.stop()

    db = sqlite3.connect(data / "artisan.sqlite")
    with db:
        db.execute("UPDATE sessions SET touched = touched - 7200 WHERE id = 'old'")  # past the default ttl of 3600 s
        db.execute("UPDATE session_exchanges SET exchange = 'not json {' WHERE session_id = 'broken'")
        db.execute("INSERT INTO sessions VALUES ('', 'no-exchanges', 'yesterday', NULL, 7)")
        db.execute("INSERT INTO session_exchanges VALUES ('', 'orphan', 0, ?)",
                   (json.dumps({"messages": [], "tools": None, "choice": {}}),))
    db.close()

    srv = fresh_server(data_dir=data)
    assert _get(srv, "", "fine").json() == fine
    for sid in ("old", "broken", "no-exchanges", "orphan"):
        assert _get(srv, "", sid).status_code == 404, sid
        # removed from the store, not skipped at every start
        assert _stored_rows(data, "session_exchanges", "session_id", sid) == 0, sid
    log = srv.log_path.read_text()
    assert "'broken'" in log and "damaged" in log, log[-2000:]
    assert _record(srv.url, "", "broken", _say(run)).status_code == 200  # the id is free again
    assert _get(srv, "", "broken").json()["exchanges"] == 1
    assert httpx.get(f"{srv.url}/health", timeout=30).json()["status"] == "ok"


def _respond(url: str, model: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/responses", json={"model": model, "max_output_tokens": 4, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("how", ["stop", "sigkill"])
async def test_kept_responses_survive_a_restart_and_continue_token_exactly(fresh_server, tmp_path, how):
    """A harness that continues by previous_response_id goes on across a restart; what was deleted,
    has expired or is damaged is gone, from the store too."""
    data = tmp_path / "data"
    srv = fresh_server(data_dir=data)
    model = (await TrainableModel(f"responses-survive-{how}").register(srv.url)).name
    first = _respond(srv.url, model, input="What does a hat cost?")
    deleted, old, damaged = (_respond(srv.url, model, input=text) for text in ("deleted", "old", "damaged"))
    assert httpx.delete(f"{srv.url}/v1/responses/{deleted['id']}", timeout=30).status_code == 200
    if how == "sigkill":
        srv.kill()  # no shutdown code runs: what was answered was stored already
    srv.stop()
    db = sqlite3.connect(data / "artisan.sqlite")
    with db:
        db.execute("UPDATE kept_responses SET created = created - 7200 WHERE id = ?", (old["id"],))  # ttl 3600 s
        db.execute("UPDATE kept_responses SET body = 'not json {' WHERE id = ?", (damaged["id"],))
    db.close()

    srv = fresh_server(data_dir=data)
    assert httpx.get(f"{srv.url}/v1/responses/{first['id']}", timeout=30).json() == first
    second = _respond(srv.url, model, previous_response_id=first["id"], input="And a cap?")
    prompt, ids = first["prompt_token_ids"], first["token_ids"]
    assert second["prompt_token_ids"][: len(prompt) + len(ids)] == prompt + ids  # spliced as sampled
    for gone in (deleted, old, damaged):
        assert httpx.get(f"{srv.url}/v1/responses/{gone['id']}", timeout=30).status_code == 404
        assert _stored_rows(data, "kept_responses", "id", gone["id"]) == 0  # removed from the store too
    assert f"{damaged['id']!r} is damaged" in srv.log_path.read_text()


def test_an_exchange_the_store_refuses_is_not_recorded(tmp_path, monkeypatch):
    """The request fails rather than answer with an exchange a restart would lose; the session goes on."""
    from server.harness.sessions import Sessions
    from server.store import Store

    store = Store(tmp_path / "artisan.sqlite")
    sessions = Sessions(ttl=60, max_sessions=10, max_per_key=10, max_exchanges=10, max_tokens=10_000,
                        max_bytes=100_000, store=store.sessions)
    choice = {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop",
              "logprobs": {"content": [{"token": "ok", "logprob": float("-inf"), "bytes": None, "top_logprobs": []}]},
              "token_ids": [5], "sampling": {"prompt_len": 3}}

    def record() -> None:
        recording = sessions.recording("s", "owner")
        recording.begin([{"role": "user", "content": "hi"}], None)
        try:
            recording(choice)
        finally:
            recording.end()

    record()
    write = store.sessions.write

    def full(statements):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(store.sessions, "write", full)
    with pytest.raises(sqlite3.OperationalError):
        record()
    assert sessions.get("s", "owner").info()["exchanges"] == 1  # forgotten in memory too
    monkeypatch.setattr(store.sessions, "write", write)
    record()
    again = Sessions(ttl=60, max_sessions=10, max_per_key=10, max_exchanges=10, max_tokens=10_000,
                     max_bytes=100_000, store=store.sessions)
    assert again.get("s", "owner").info() == sessions.get("s", "owner").info()
    assert again.get("s", "owner").exchanges == sessions.get("s", "owner").exchanges  # a -inf logprob as sampled
    store.close()


# ---- one server for the rest: two keys, small bounds ------------------------------------------------


@pytest.fixture(scope="module")
def srv(fresh_server_module):
    return fresh_server_module(api_key=",".join(KEYS), extra=[
        "--max-sessions-per-key", "3", "--session-max-bytes", "16000"])


@pytest.fixture(scope="module")
async def run(srv):
    return (await TrainableModel("sessions-bounded").register(srv.url, api_key=KEYS[0])).name


def _get(srv, key: str, sid: str) -> httpx.Response:
    return httpx.get(f"{srv.url}/v1/sessions/{sid}", headers=_auth(key), timeout=30)


def _delete(srv, key: str, sid: str) -> None:
    httpx.delete(f"{srv.url}/v1/sessions/{sid}", headers=_auth(key), timeout=30)


# ---- H2: no session from a failed request; a count per key ------------------------------------------


@pytest.mark.parametrize("body", [
    {"model": "no-such-model", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},  # 404
    {"model": "MODEL", "max_tokens": 3, "messages": [{"role": "assistant", "content": "no user"},
                                                     {"role": "robot", "content": "x"}]},  # 400
])
def test_a_failed_request_leaves_no_session(srv, run, body):
    body = {**body, "model": run if body["model"] == "MODEL" else body["model"]}
    r = _record(srv.url, KEYS[0], "failed-once", body)
    assert 400 <= r.status_code < 500, r.text
    assert _get(srv, KEYS[0], "failed-once").status_code == 404


def test_one_key_cannot_take_every_session(srv, run):
    for i in range(3):
        assert _record(srv.url, KEYS[0], f"mine-{i}", _say(run)).status_code == 200
    full = _record(srv.url, KEYS[0], "mine-3", _say(run))
    assert full.status_code == 429, full.text
    assert "this key" in full.json()["error"]["message"]
    assert _record(srv.url, KEYS[0], "mine-0", _say(run, "more")).status_code == 200  # its own go on
    assert _record(srv.url, KEYS[1], "theirs-0", _say(run)).status_code == 200  # the other key is not locked out
    for i in range(3):
        _delete(srv, KEYS[0], f"mine-{i}")
    _delete(srv, KEYS[1], "theirs-0")
    assert _record(srv.url, KEYS[0], "mine-3", _say(run)).status_code == 200
    _delete(srv, KEYS[0], "mine-3")


# ---- H3: unrendered fields dropped, bytes bounded ---------------------------------------------------


def test_fields_no_template_renders_are_not_kept(srv, run):
    big = "x" * 60_000  # more than the session's 16,000 bytes, were it kept
    body = _say(run)
    body["messages"][0]["debug_blob"] = big
    for _ in range(3):
        r = _record(srv.url, KEYS[0], "blob", body)
        assert r.status_code == 200, r.text
    info = _get(srv, KEYS[0], "blob").json()
    assert info["exchanges"] == 3 and info["bytes"] < 16_000, info
    _delete(srv, KEYS[0], "blob")


def test_a_session_full_of_bytes_refuses_more_with_a_409(srv, run):
    text = "hello world " * 450  # about 1,500 tokens, 5,400 bytes: two fit in 16,000 bytes, not three
    for _ in range(2):
        r = _record(srv.url, KEYS[0], "bulky", _say(run, text))
        assert r.status_code == 200, r.text
    full = _record(srv.url, KEYS[0], "bulky", _say(run, text))
    assert full.status_code == 409, full.text
    err = full.json()["error"]
    assert err["param"] == "session_id" and "bulky" in err["message"] and "bytes" in err["message"], err
    assert _get(srv, KEYS[0], "bulky").json()["exchanges"] == 2
    _delete(srv, KEYS[0], "bulky")


# ---- session ids per key --------------------------------------------------------------------------


def test_another_keys_session_id_is_another_session(srv, run):
    assert _record(srv.url, KEYS[0], "shared-name", _say(run)).status_code == 200
    assert _get(srv, KEYS[1], "shared-name").status_code == 404  # not a 403 that tells it exists
    r = _record(srv.url, KEYS[1], "shared-name", _say(run, "other"))
    assert r.status_code == 200, r.text
    r = _record(srv.url, KEYS[1], "shared-name", _say(run, "again"))
    assert _get(srv, KEYS[1], "shared-name").json()["exchanges"] == 2
    assert _get(srv, KEYS[0], "shared-name").json()["exchanges"] == 1
    _delete(srv, KEYS[1], "shared-name")
    assert _get(srv, KEYS[0], "shared-name").status_code == 200  # deleting theirs left mine
    _delete(srv, KEYS[0], "shared-name")


# ---- M7: in flight, and trained before -------------------------------------------------------------


async def test_a_session_job_refuses_exchanges_in_flight_and_sessions_trained_before(srv, run):
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    assert _record(srv.url, KEYS[0], "m7-a", _say(run)).status_code == 200
    async with httpx.AsyncClient(base_url=srv.url, headers=headers, timeout=120) as http:
        long = _say(run, "count", max_tokens=400, stream=True, ignore_eos=True)
        async with http.stream("POST", "/v1/sessions/m7-b/chat/completions", json=long) as stream:
            lines = stream.aiter_lines()
            while not (await lines.__anext__()).startswith("data: "):
                pass
            r = await http.post(f"/v1/runs/{run}/session-jobs", json=_job(["m7-a", "m7-b"], "m7"))
            assert r.status_code == 409, r.text
            assert "m7-b" in r.json()["error"]["message"] and "m7-a" not in r.json()["error"]["message"]
            async for _ in lines:
                pass
    first = _submit(srv.url, run, ["m7-a", "m7-b"], "m7", KEYS[0])
    assert first.status_code == 202, first.text
    same = _submit(srv.url, run, ["m7-a", "m7-b"], "m7", KEYS[0])
    assert same.json()["job_id"] == first.json()["job_id"]  # the same key is the same job
    again = _submit(srv.url, run, ["m7-b", "m7-a"], "m7-again", KEYS[0])
    assert again.status_code == 409, again.text
    assert first.json()["job_id"] in again.json()["error"]["message"]
    assert _wait(srv.url, KEYS[0], first.json()["job_id"])["status"] == "succeeded"
    for sid in ("m7-a", "m7-b"):
        _delete(srv, KEYS[0], sid)


# ---- which fields a template may render -------------------------------------------------------------


def _template(source: str):
    from transformers import PreTrainedTokenizerFast

    from server.chat.template import ChatTemplate
    from server.settings import DEFAULT_MODEL_DIR

    return ChatTemplate(PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_MODEL_DIR / "tokenizer.json")), source)


def test_the_fields_kept_are_those_a_template_may_render():
    from server.harness.kept_fields import rendered_fields

    named = rendered_fields(_template("{% for m in messages %}{{ m.role }}{{ m['thinking'] }}{{ m.content }}"
                                      "{% endfor %}"))
    assert named is not None and {"thinking", "role", "content"} <= named and "debug_blob" not in named
    # A template that prints whole messages renders fields it never names: every field is kept.
    assert rendered_fields(_template("{% for m in messages %}{{ m | tojson }}{% endfor %}")) is None
    assert rendered_fields(_template("{% for m in messages %}{% for k, v in m.items() %}{{ v }}{% endfor %}"
                                     "{% endfor %}")) is None
