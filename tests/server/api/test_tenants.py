"""Keys per tenant, against a real server: a tenant key sees only the runs it created (another's
run answers exactly as a run that does not exist), an admin key sees every run, each key may create
only so many runs, and ownership outlives a restart."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from client import TrainConfig, TrainableModel
from tests.helpers import demo_groups, with_rewards

ADMIN, ALICE, BOB = "admin-key", "alice-key", "bob-key"


@pytest.fixture(scope="module")
async def tenants(fresh_server_module, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "tenants"
    keys.write_text(f"# name=key\nalice={ALICE}\n\nbob = {BOB}\n")
    srv = fresh_server_module(api_key=ADMIN, extra=["--tenant-keys", str(keys), "--max-runs-per-key", "3"])
    alice = await TrainableModel("alice-run").register(srv.url, api_key=ALICE)
    groups = with_rewards(await demo_groups(alice, 1, 2, seed=3), [[0.0, 1.0]])
    await alice.train(groups, TrainConfig(learning_rate=1e-3))
    await alice.log(groups, split="val")
    await TrainableModel("bob-run").register(srv.url, api_key=BOB)
    return srv, groups


def _client(srv, key: str) -> httpx.Client:
    return httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def _job_body(groups, key: str) -> dict:
    return {"kind": "rl", "groups": [g.model_dump(mode="json") for g in groups], "idempotency_key": key}


def _run_requests(run: str, job_id: str, traj_id: int, groups) -> list[tuple[str, str, dict | None]]:
    """Every run-scoped route family: (method, path, json body)."""
    log = {"groups": [g.model_dump(mode="json") for g in groups], "split": "val"}
    return [
        ("GET", f"/v1/runs/{run}", None),
        ("POST", f"/v1/runs/{run}/jobs", _job_body(groups, "another-tenants-try")),
        ("GET", f"/v1/jobs/{job_id}", None),
        ("GET", f"/v1/jobs/{job_id}/events", None),
        ("DELETE", f"/v1/jobs/{job_id}", None),
        ("GET", f"/v1/runs/{run}/checkpoints", None),
        ("DELETE", f"/v1/runs/{run}/checkpoints/0", None),
        ("POST", f"/v1/runs/{run}/checkpoints/prune", {"keep_last": 1}),
        ("POST", f"/v1/runs/{run}/adapters/retain", {"steps": []}),
        ("POST", f"/v1/runs/{run}/log", log),
        ("GET", f"/v1/runs/{run}/trajectories", None),
        ("GET", f"/v1/runs/{run}/export.jsonl", None),
        ("POST", f"/v1/runs/{run}/session-jobs", {"groups": [{"sessions": [{"session_id": "s1", "reward": 1}]}]}),
        ("GET", f"/ui/api/runs/{run}", None),
        ("GET", f"/ui/api/runs/{run}/attempts", None),
        ("GET", f"/ui/api/runs/{run}/steps/1/groups", None),
        ("GET", f"/ui/api/runs/{run}/trajectories", None),
        ("GET", f"/ui/api/trajectories/{traj_id}", None),
        ("DELETE", f"/v1/runs/{run}", None),  # last: when it is wrongly allowed, the rest still ran
    ]


def _alice_job_and_trajectory(srv) -> tuple[str, int]:
    with _client(srv, ALICE) as c:
        traj = c.get("/ui/api/runs/alice-run/trajectories").json()["data"][0]["id"]
        attempts = c.get("/ui/api/runs/alice-run/attempts").json()["data"]
    return next(a["job_id"] for a in attempts if a["job_id"]), traj


def _anonymised(r: httpx.Response, name: str) -> tuple[int, str]:
    return r.status_code, r.text.replace(name, "NAME")


def test_another_tenants_run_is_absent_on_every_route(tenants):
    srv, groups = tenants
    job_id, traj_id = _alice_job_and_trajectory(srv)
    with _client(srv, BOB) as bob:
        for method, path, body in _run_requests("alice-run", job_id, traj_id, groups):
            r = bob.request(method, path, json=body)
            assert r.status_code == 404, (method, path, r.status_code, r.text[:300])
            # Word for word what a run that does not exist gets: nothing tells that it does.
            ghost = path.replace("alice-run", "ghost-run").replace(job_id, "job-" + "0" * 16) \
                        .replace(f"trajectories/{traj_id}", "trajectories/999999")
            g = bob.request(method, ghost, json=body)
            assert _anonymised(r, "alice-run")[0] == _anonymised(g, "ghost-run")[0]
            assert _anonymised(r, "alice-run")[1].replace(job_id, "JOB").replace(str(traj_id), "T") == \
                _anonymised(g, "ghost-run")[1].replace("job-" + "0" * 16, "JOB").replace("999999", "T"), path
        listed = [r["name"] for r in bob.get("/v1/runs").json()["data"]]
        assert listed == ["bob-run"]
        assert [r["name"] for r in bob.get("/ui/api/runs").json()["data"]] == ["bob-run"]
        assert not any(m["id"].startswith("alice-run") for m in bob.get("/v1/models").json()["data"])
        # Creating a run under a name another key holds: refused, and the run stays alice's.
        taken = bob.post("/v1/runs", json={"name": "alice-run"})
        assert taken.status_code == 409 and taken.json()["error"]["code"] == "run_name_taken"
        assert bob.post("/v1/runs", json={"name": "alice-run"}).status_code == 409
        # The job alice trained is untouched by bob's cancel attempt.
    with _client(srv, ALICE) as alice:
        assert alice.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded"


@pytest.mark.parametrize("model", ["alice-run", "alice-run@0", "alice-run@1"])
def test_another_tenants_run_cannot_be_sampled(tenants, model):
    srv, _ = tenants
    bob = openai.OpenAI(base_url=srv.url + "/v1", api_key=BOB, max_retries=0)
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.NotFoundError) as e:
        bob.chat.completions.create(model=model, messages=messages, max_tokens=2)
    served = e.value.body["message"].partition("served: ")[2]  # the names bob may use, and no other
    assert served and "alice" not in served
    with pytest.raises(openai.NotFoundError):
        bob.responses.create(model=model, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        bob.completions.create(model=model, prompt="Hi", max_tokens=2)
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=srv.url, api_key=BOB, max_retries=0).messages.create(
            model=model, max_tokens=2, messages=messages)
    r = httpx.post(srv.url + "/inference/v1/generate", headers={"Authorization": f"Bearer {BOB}"},
                   json={"model": model, "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}})
    assert r.status_code == 404, r.text
    with pytest.raises(openai.NotFoundError):  # inside a session too
        openai.OpenAI(base_url=srv.url + "/v1/sessions/bob-s1", api_key=BOB, max_retries=0).chat.completions.create(
            model=model, messages=messages, max_tokens=2)
    # Its owner and the admin sample from it.
    for key in (ALICE, ADMIN):
        owner = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)
        out = owner.chat.completions.create(model=model, messages=messages, max_tokens=2)
        assert out.choices[0].message is not None
        echoed = owner.completions.create(model=model, prompt="Hi there", max_tokens=0, echo=True, logprobs=0)
        assert echoed.choices[0].logprobs.token_logprobs[1] < 0  # scored under the step's adapter


def test_the_owner_and_the_admin_see_the_run(tenants):
    srv, groups = tenants
    job_id, traj_id = _alice_job_and_trajectory(srv)
    for key in (ALICE, ADMIN):
        with _client(srv, key) as c:
            for method, path, body in _run_requests("alice-run", job_id, traj_id, groups):
                if method == "DELETE" or path.endswith(("/jobs", "/session-jobs", "/log", "/prune")):
                    continue  # writes: checked below, once
                r = c.request(method, path, json=body)
                assert r.status_code == 200, (key, method, path, r.status_code, r.text[:300])
    with _client(srv, ADMIN) as admin:
        assert {r["name"] for r in admin.get("/v1/runs").json()["data"]} >= {"alice-run", "bob-run"}
        assert admin.get("/v1/runs/bob-run").status_code == 200
        assert admin.post("/v1/runs/alice-run/log", json={"groups": [groups[0].model_dump(mode="json")]}).status_code == 200
        models = {m["id"] for m in admin.get("/v1/models").json()["data"]}
        assert {"alice-run", "bob-run"} <= models
    with _client(srv, ALICE) as alice:
        assert alice.post("/v1/runs/alice-run/checkpoints/prune", json={"keep_last": 1}).status_code == 200
        assert alice.get("/v1/runs/bob-run").status_code == 404


def test_a_key_may_create_only_so_many_runs(tenants):
    srv, _ = tenants
    with _client(srv, BOB) as bob:
        assert bob.post("/v1/runs", json={"name": "bob-2"}).status_code == 200
        assert bob.post("/v1/runs", json={"name": "bob-3"}).status_code == 200
        over = bob.post("/v1/runs", json={"name": "bob-4"})
        assert over.status_code == 403, over.text
        assert over.json()["error"]["code"] == "run_limit_reached"
        assert "--max-runs-per-key 3" in over.json()["error"]["message"]
        assert bob.post("/v1/runs", json={"name": "bob-run"}).json()["created"] is False  # its own: still fine
        assert bob.get("/v1/runs/bob-4").status_code == 404
    with _client(srv, ALICE) as alice:  # one key's bound is not another's
        assert alice.post("/v1/runs", json={"name": "alice-2"}).status_code == 200


def test_ownership_outlives_a_restart(tenants):
    srv, _ = tenants
    srv.stop()
    srv.start()
    with _client(srv, BOB) as bob:
        assert bob.get("/v1/runs/alice-run").status_code == 404
        assert bob.get("/v1/runs/bob-run").status_code == 200
    with _client(srv, ALICE) as alice:
        assert alice.get("/v1/runs/alice-run").status_code == 200


def test_a_run_name_that_differs_only_by_case_is_refused_naming_the_run(tenants):
    srv, _ = tenants
    with _client(srv, ALICE) as alice, _client(srv, ADMIN) as admin:
        for client, name, existing in ((alice, "Alice-Run", "alice-run"), (admin, "BOB-RUN", "bob-run")):
            r = client.post("/v1/runs", json={"name": name})
            assert r.status_code == 409, r.text
            error = r.json()["error"]
            assert (error["code"], error["param"]) == ("run_name_taken", "name")
            assert f"differs only by case from the existing run '{existing}'" in error["message"]
            assert client.get(f"/v1/runs/{name}").status_code == 404
        assert alice.post("/v1/runs", json={"name": "alice-run"}).json()["created"] is False  # its own name: as before


async def test_health_without_an_admin_key_counts_problems_and_names_no_run_or_path(fresh_server, tmp_path):
    keys, data = tmp_path / "tenants", tmp_path / "data"
    keys.write_text(f"alice={ALICE}\n")
    srv = fresh_server(data_dir=data, api_key=ADMIN, extra=["--tenant-keys", str(keys)])
    await TrainableModel("secret-run", lora={"rank": 8}).register(srv.url, api_key=ADMIN)
    srv.stop()
    (data / "runs" / "secret-run" / "run.json").write_text("{not json")
    srv.start()
    for headers in ({}, {"Authorization": f"Bearer {ALICE}"}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(srv.url + "/health", headers=headers, timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "degraded", r.text
        assert r.json()["problems"] == ["1 problem; /health with an admin key names them (so does the server's log)"]
        assert "secret-run" not in r.text and str(tmp_path) not in r.text, r.text
    with _client(srv, ADMIN) as admin:
        assert "run secret-run: its run.json cannot be read" in " ".join(admin.get("/health").json()["problems"])
        # registered again with a rank its checkpoint contradicts: a 409 naming both; the run stays its own
        wrong = admin.post("/v1/runs", json={"name": "secret-run", "lora": {"rank": 4}})
        assert wrong.status_code == 409 and "LoRA rank 8, not 4" in wrong.json()["error"]["message"], wrong.text
        assert admin.post("/v1/runs", json={"name": "secret-run", "lora": {"rank": 8}}).status_code == 200
        assert admin.get("/health").json()["status"] == "ok"


def test_tenant_keys_file_mistakes_are_one_line(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "keys"
    bad.write_text("alice=k1\nbob k2\n")
    out = subprocess.run([sys.executable, "-m", "server.cli", "--tenant-keys", str(bad)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0
    assert f"--tenant-keys {bad}:2: expected NAME=KEY" in out.stderr
    assert "Traceback" not in out.stderr
