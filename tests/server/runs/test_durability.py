"""Files damaged at rest never lose a step silently, never reuse a step's number, and never stop the
server: each test damages a stopped server's data directory as a bad disk or an operator would,
restarts a real server on it, and checks what it serves and what it says.

Findings of a fault-injection pass (issue 25): a missing meta.json made the run resume one step
back in silence and give the next step the old number, replacing its stored figures; a flipped
weight byte went unnoticed until 500s; one unreadable meta.json stopped the server from starting;
after a clean stop everything sat in the WAL, so losing it lost the trajectories without a word;
a damaged page gave 500s on reads; a full disk killed the trainer thread, left every later job
queued forever, and answered submissions with a bare 500.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
from pathlib import Path

import httpx
import pytest

from client import ServerError, TrainConfig, TrainableModel
from conftest import ServerProcess
from tests.helpers import ServedApp, demo_groups, get_json, with_rewards

CONFIG = TrainConfig(learning_rate=1e-3)
RUN = "durable"


def _checkpoint(data_dir, step: int):
    return data_dir / "runs" / RUN / "checkpoints" / f"step_{step:06d}"


async def _train_steps(url: str, n: int, first_key: int = 0) -> list:
    model = await TrainableModel(RUN).register(url)
    groups = await demo_groups(model, 2, 3, seed=31)
    out = []
    for i in range(n):
        rewarded = with_rewards(groups, [[0.0, 1.0, 0.5], [1.0, 0.0, 0.0 + 0.1 * i]])
        out.append(await model.train(rewarded, CONFIG, idempotency_key=f"k{first_key + i}"))
    return out


@pytest.fixture
async def two_steps(fresh_server, tmp_path):
    """A stopped server's data directory holding a run of two trained steps."""
    data_dir = tmp_path / "data"
    srv = fresh_server(data_dir=data_dir)
    results = await _train_steps(srv.url, 2)
    assert [r.step for r in results] == [1, 2] and all(r.trained for r in results)
    steps = get_json(srv.url, f"/v1/runs/{RUN}")["steps"]
    srv.stop()
    return data_dir, steps


async def _restart_and_go_on(fresh_server, data_dir, stored_before):
    """The run must resume at step 1, say why, and train its next step as step 3: step 2's number
    and its stored figures stay what they were."""
    srv = fresh_server(data_dir=data_dir)
    run = get_json(srv.url, f"/v1/runs/{RUN}")
    assert run["step"] == 1
    assert len(run["damaged"]) == 1 and "step 2" in run["damaged"][0], run["damaged"]
    health = get_json(srv.url, "/health")
    assert health["status"] == "degraded" and any("step 2" in p for p in health["problems"]), health
    assert "step 2" in srv.log_path.read_text()
    # what is served as the run is step 1's adapter, and it answers
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "model": RUN, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    [result] = await _train_steps(srv.url, 1, first_key=10)
    assert result.trained and result.step == 3
    after = {s["step"]: s for s in get_json(srv.url, f"/v1/runs/{RUN}")["steps"]}
    assert after[2]["metrics"] == stored_before[1]["metrics"]  # step 2's record was not replaced
    assert sorted(after) == [1, 2, 3]
    return srv


async def test_a_missing_meta_json_falls_back_says_so_and_never_reuses_the_number(fresh_server, two_steps):
    data_dir, steps = two_steps
    (_checkpoint(data_dir, 2) / "meta.json").unlink()
    srv = await _restart_and_go_on(fresh_server, data_dir, steps)
    assert "meta.json is missing" in get_json(srv.url, f"/v1/runs/{RUN}")["damaged"][0]


async def test_a_flipped_weight_byte_is_caught_by_its_checksum(fresh_server, two_steps):
    data_dir, steps = two_steps
    path = _checkpoint(data_dir, 2) / "adapter.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) - 100] ^= 0x01  # inside the tensors, past the header: the file still loads
    path.write_bytes(bytes(data))
    srv = await _restart_and_go_on(fresh_server, data_dir, steps)
    assert "SHA-256" in get_json(srv.url, f"/v1/runs/{RUN}")["damaged"][0]


async def test_an_unreadable_older_checkpoint_neither_stops_the_server_nor_hides_the_run(fresh_server, two_steps):
    data_dir, _ = two_steps
    (_checkpoint(data_dir, 1) / "meta.json").write_text("{not json")
    srv = fresh_server(data_dir=data_dir)
    assert get_json(srv.url, f"/v1/runs/{RUN}")["step"] == 2
    listed = {c["step"]: c for c in get_json(srv.url, f"/v1/runs/{RUN}/checkpoints")["data"]}
    assert "damaged" in listed[1] and "damaged" not in listed[2]
    # asking for the damaged step by name is a clear error that names it, not a 500
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "model": f"{RUN}@1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 409 and "step 1" in r.json()["error"]["message"], r.text
    ok = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "model": f"{RUN}@2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert ok.status_code == 200, ok.text


def _trajectory_count(url: str) -> int:
    return len(get_json(url, f"/v1/runs/{RUN}/trajectories")["data"])


async def test_after_a_clean_stop_the_main_file_holds_everything(fresh_server, two_steps):
    data_dir, _ = two_steps
    wal = data_dir / "artisan.sqlite-wal"
    assert not wal.exists() or wal.stat().st_size == 0
    with sqlite3.connect(f"file:{data_dir / 'artisan.sqlite'}?mode=ro", uri=True) as db:  # the main file alone
        assert db.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0] == 12
    wal.unlink(missing_ok=True)
    srv = fresh_server(data_dir=data_dir)
    assert _trajectory_count(srv.url) == 12
    assert get_json(srv.url, "/health")["status"] == "ok"


async def test_a_wal_lost_after_a_crash_is_reported_and_steps_come_back_from_checkpoints(fresh_server, tmp_path):
    data_dir = tmp_path / "data"
    srv = fresh_server(data_dir=data_dir)
    await _train_steps(srv.url, 2)
    srv.kill()  # no clean stop: the last writes are in the WAL only
    (data_dir / "artisan.sqlite-wal").unlink()
    srv = fresh_server(data_dir=data_dir)
    health = get_json(srv.url, "/health")
    assert health["status"] == "degraded", health
    assert any(str(data_dir / "artisan.sqlite") in p and "trajectories are gone" in p for p in health["problems"])
    run = get_json(srv.url, f"/v1/runs/{RUN}")
    assert run["step"] == 2 and [s["step"] for s in run["steps"]] == [1, 2]
    [result] = await _train_steps(srv.url, 1, first_key=10)
    assert result.trained and result.step == 3


async def test_a_damaged_page_is_reported_with_the_path_and_the_rest_is_served(fresh_server, two_steps):
    data_dir, _ = two_steps
    path = data_dir / "artisan.sqlite"
    with sqlite3.connect(path) as db:
        page_size = db.execute("PRAGMA page_size").fetchone()[0]
        # a leaf page of the trajectories table (the biggest): its rows are what is lost
        pages = [r[0] for r in db.execute("SELECT pageno FROM dbstat WHERE name = 'trajectories' AND pagetype = 'leaf'")]
    assert pages
    with open(path, "r+b") as fh:
        fh.seek((pages[0] - 1) * page_size)
        fh.write(os.urandom(page_size))
    srv = fresh_server(data_dir=data_dir)
    health = get_json(srv.url, "/health")
    assert health["status"] == "degraded" and any(str(path) in p and "damaged" in p for p in health["problems"]), health
    run = get_json(srv.url, f"/v1/runs/{RUN}")
    assert run["step"] == 2 and [s["step"] for s in run["steps"]] == [1, 2]  # the figures were on other pages
    assert _trajectory_count(srv.url) < 12  # the damaged page's rows are gone, and said to be
    for page in ("/ui/api/runs", f"/ui/api/runs/{RUN}/attempts"):
        assert httpx.get(srv.url + page, timeout=30).status_code == 200
    [result] = await _train_steps(srv.url, 1, first_key=10)
    assert result.trained and result.step == 3
    assert list(data_dir.glob("artisan.sqlite.damaged-*"))  # the damaged file is kept for the operator


# ---- a full disk fails one job, keeps the trainer, and says so -------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 48 MB tmpfs: a filesystem that really fills (root may mount one; elsewhere the test skips)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(disk, leave: int) -> None:
    """Fill the filesystem but `leave` bytes."""
    free = shutil.disk_usage(disk).free
    with open(disk / "filler", "wb") as fh:
        fh.write(b"\0" * max(0, free - leave))


async def test_a_full_disk_fails_that_job_keeps_the_trainer_and_shows_on_health(small_disk, tmp_path):
    srv = ServerProcess(small_disk / "data")
    srv.log_path = tmp_path / "server.log"  # the log must not need the full disk
    srv.start()
    try:
        model = await TrainableModel(RUN).register(srv.url)
        other = await TrainableModel("other-run").register(srv.url)
        groups = with_rewards(await demo_groups(model, 2, 3, seed=31), [[0.0, 1.0, 0.5], [1.0, 0.0, 0.0]])
        _fill(small_disk, leave=256 * 1024)  # room for the job's records, not for its 1.8 MB checkpoint
        try:
            await model.train(groups, CONFIG, idempotency_key="full")
        except ServerError as exc:
            failure = str(exc)
        else:
            raise AssertionError("a step trained on a full disk")
        assert "No space left" in failure or "disk is full" in failure, failure
        health = get_json(srv.url, "/health")
        assert health["status"] == "degraded" and health["problems"], health
        assert await model.get_step() == 0
        (small_disk / "filler").unlink()
        # the trainer is alive: both runs train once space is back, the failed run from where it was
        assert (await model.train(groups, CONFIG, idempotency_key="after")).step == 1
        assert (await other.train(groups, CONFIG, idempotency_key="other")).step == 1
        assert get_json(srv.url, "/health")["status"] == "ok"
    finally:
        srv.stop()


async def test_an_optimizer_state_torch_cuts_short_is_one_named_error_and_degrades_health(small_disk, tmp_path):
    """The probe's case (issue 36 M4): room for the adapter, not for its optimizer state, which
    torch.save cuts short with only "unexpected pos ..."; /health stayed ok."""
    srv = ServerProcess(small_disk / "data")
    srv.log_path = tmp_path / "server.log"
    srv.start()
    try:
        model = await TrainableModel(RUN).register(srv.url)
        groups = with_rewards(await demo_groups(model, 2, 3, seed=31), [[0.0, 1.0, 0.5], [1.0, 0.0, 0.0]])
        _fill(small_disk, leave=1_200_000)  # the adapter (0.6 MB) fits; its optimizer state (1.2 MB) does not
        with pytest.raises(ServerError) as failed:
            await model.train(groups, CONFIG, idempotency_key="short")
        failure, written = str(failed.value), _checkpoint(small_disk / "data", 1) / "optimizer.pt"
        assert f"DiskFull: the disk is full: {written} could not be written whole (" in failure, failure
        assert "unexpected pos" not in failure and "\n" not in failure
        health = get_json(srv.url, "/health")
        assert health["status"] == "degraded", health
        assert [p for p in health["problems"] if "DiskFull" in p and str(written) in p], health
        assert await model.get_step() == 0
        assert not list((small_disk / "data" / "runs" / RUN / "checkpoints").glob(".tmp-*"))  # no partial files
        (small_disk / "filler").unlink()
        assert (await model.train(groups, CONFIG, idempotency_key="after")).step == 1
        assert get_json(srv.url, "/health")["status"] == "ok"  # a later write that succeeded
    finally:
        srv.stop()


async def test_a_submission_to_a_full_disk_is_a_503_and_is_not_kept(small_disk, tmp_path):
    srv = ServerProcess(small_disk / "data")
    srv.log_path = tmp_path / "server.log"
    srv.start()
    try:
        groups = await _sampled(srv.url)
        body = {"kind": "rl", "groups": [g.model_dump(mode="json") for g in groups],
                "config": {"learning_rate": 1e-3}, "idempotency_key": "k"}
        _fill(small_disk, leave=0)
        r = httpx.post(srv.url + f"/v1/runs/{RUN}/jobs", json=body, timeout=60)
        assert r.status_code == 503 and "could not write" in r.json()["error"]["message"], r.text
        (small_disk / "filler").unlink()
        again = httpx.post(srv.url + f"/v1/runs/{RUN}/jobs", json=body, timeout=60)  # the same key, now accepted
        assert again.status_code == 202, again.text
        model = TrainableModel(RUN)
        await model.register(srv.url)
        result = await model._follow(again.json()["job_id"])
        assert result.type == "result" and result.data["step"] == 1, result
    finally:
        srv.stop()


async def _sampled(url: str):
    model = await TrainableModel(RUN).register(url)
    return with_rewards(await demo_groups(model, 2, 3, seed=31), [[0.0, 1.0, 0.5], [1.0, 0.0, 0.0]])


async def test_a_store_that_fails_around_a_committed_step_neither_refuses_the_job_nor_calls_it_failed(tmp_path):
    """The store refuses exactly the writes around one step: the job's queued event, then its
    success. The submission is still accepted (it was stored, so it runs), and the step it committed
    is served as a success from memory, never as a failure a client would train again."""
    from server.app import create_app
    from server.settings import Settings

    app = create_app(Settings(data_dir=tmp_path / "data"))
    store = app.state.artisan.store
    refused: list[str] = []

    def full() -> sqlite3.OperationalError:
        exc = sqlite3.OperationalError("database or disk is full")
        exc.sqlite_errorcode = sqlite3.SQLITE_FULL
        return exc

    put_event, put_job = store.jobs.put_event, store.jobs.put

    def refuse_queued(job_id, seq, type_, data):
        if type_ == "queued" and "queued" not in refused:
            refused.append("queued")
            raise full()
        return put_event(job_id, seq, type_, data)

    def refuse_succeeded(record, *kept):  # kept: the job's request, where the store keeps it too
        if record["status"] == "succeeded" and "succeeded" not in refused:
            refused.append("succeeded")
            raise full()
        return put_job(record, *kept)

    store.jobs.put_event, store.jobs.put = refuse_queued, refuse_succeeded
    with ServedApp(app, log_level="critical") as served:
        url = served.url
        model = await TrainableModel(RUN).register(url)
        groups = with_rewards(await demo_groups(model, 2, 3, seed=31), [[0.0, 1.0, 0.5], [1.0, 0.0, 0.0]])
        result = await model.train(groups, CONFIG, idempotency_key="around")
        assert result.trained and result.step == 1
        assert await model.get_step() == 1
        # asked again (a retry), the same key is the same succeeded job: nothing trains twice
        again = await model.train(groups, CONFIG, idempotency_key="around")
        assert again.step == 1 and await model.get_step() == 1
        assert refused == ["queued", "succeeded"]
        health = get_json(url, "/health")
        assert health["status"] == "degraded" and "succeeded and could not be recorded" in health["problems"][0]


@pytest.mark.unit
def test_only_a_disk_that_refuses_writes_is_a_storage_failure():
    """A lock, a schema or an SQL bug must reach the log as the 500 it is, not a 503 "free some space"."""
    from server.store import storage_failure

    db = sqlite3.connect(":memory:")
    with pytest.raises(sqlite3.OperationalError) as bug:
        db.execute("SELECT * FROM no_such_table")
    assert not storage_failure(bug.value)
    full = sqlite3.OperationalError("database or disk is full")
    full.sqlite_errorcode = sqlite3.SQLITE_FULL
    assert storage_failure(full)
    assert storage_failure(OSError(28, "No space left on device"))
    assert storage_failure(RuntimeError("safetensors: No space left on device (os error 28)"))


@pytest.mark.unit
def test_every_way_a_disk_cuts_a_write_short_is_out_of_space():
    from server.runs.disk_full import DiskFull, out_of_space
    from server.store import storage_failure

    assert out_of_space(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 497728 vs 497620"))
    assert out_of_space(RuntimeError("safetensors: No space left on device (os error 28)"))
    assert out_of_space(OSError(122, "Disk quota exceeded"))
    assert not out_of_space(RuntimeError("size mismatch for lora_A"))
    assert not out_of_space(OSError(13, "Permission denied"))
    full = DiskFull(Path("/data/runs/r/checkpoints/step_000001/optimizer.pt"), 1_234_567)
    assert storage_failure(full)
    assert str(full).startswith("the disk is full: /data/runs/r/checkpoints/step_000001/optimizer.pt could not be "
                                "written whole (1,234,567 bytes free")
