"""An operator's probe, kept as a test: external SIGKILLs at random instants while a client trains.

A client trains one step after another (a new idempotency key each), retrying across restarts as
users' clients do; meanwhile the server is SIGKILLed at random moments and started again on the
same data and port. Afterwards every step the client was told about is there, whole, and each key
trained exactly once. `make test-sigkill` runs it with 20 kills (ARTISAN_SIGKILL_KILLS); the main
suite skips it, as it takes a few minutes.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time

import pytest

from client import ServerError, TrainConfig, TrainableModel
from client.local_server import free_port
from conftest import ServerProcess
from tests.helpers import demo_groups, get_json, with_rewards

KILLS = int(os.environ.get("ARTISAN_SIGKILL_KILLS", "0"))
pytestmark = pytest.mark.skipif(KILLS == 0, reason="the SIGKILL loop: make test-sigkill (ARTISAN_SIGKILL_KILLS=20)")
CONFIG = TrainConfig(learning_rate=1e-3)


async def test_random_sigkills_keep_every_completed_step_and_train_each_key_once(tmp_path):
    rng = random.Random(int(os.environ.get("ARTISAN_SIGKILL_SEED", "0")))
    data, port = tmp_path / "data", free_port()
    srv = ServerProcess(data, port=port).start()
    model = await TrainableModel("killed").register(srv.url)
    groups = with_rewards(await demo_groups(model, 2, 3, seed=5), [[0.0, 1.0, 0.5], [1.0, 0.0, 0.0]])
    n_trajectories = sum(len(g.trajectories) for g in groups)
    results, errors, resubmitted, killing = [], [], [], threading.Event()
    killing.set()

    def client() -> None:
        async def go():
            model = await TrainableModel("killed", retry_seconds=300).register(srv.url)
            i = 0
            while killing.is_set() or i < 2:  # at least two steps after the last kill
                i += 1
                while True:
                    try:
                        results.append((f"key-{i}", await model.train(groups, CONFIG, idempotency_key=f"key-{i}")))
                        break
                    except ServerError as exc:
                        # A job restarts cut short three times in a row is handed back to the caller,
                        # who resubmits it, as its message says, under the same key.
                        if "interrupted by server restarts" not in str(exc):
                            raise
                        resubmitted.append(f"key-{i}")
        try:
            asyncio.run(go())
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    worker = threading.Thread(target=client, daemon=True)
    worker.start()
    kill_times = []
    try:
        for _ in range(KILLS):
            time.sleep(rng.uniform(0.2, 5.0))  # anywhere: between steps, assembling, optimising, committing
            if not worker.is_alive():
                break
            kill_times.append(len(results))
            srv.kill()
            srv.stop()
            srv = ServerProcess(data, port=port).start()
        killing.clear()
        worker.join(timeout=600)
        assert not worker.is_alive(), "the client did not finish within 10 minutes of the last kill"
        assert not errors, errors
        assert len(kill_times) == KILLS, f"the client stopped after {len(kill_times)} kills"

        # Each key trained once: the client saw steps 1..K in order, one per key.
        assert [r.step for _, r in results] == list(range(1, len(results) + 1)), results
        run = get_json(srv.url, "/v1/runs/killed")
        assert run["step"] == len(results)
        assert {s["step"] for s in run["steps"]} == set(range(1, len(results) + 1))
        for s in range(1, len(results) + 1):  # every completed step whole
            assert s in run["checkpoints"], s
            rows = get_json(srv.url, "/v1/runs/killed/trajectories", step=s, split="train")["data"]
            assert len(rows) == n_trajectories, (s, len(rows))
        attempts = get_json(srv.url, "/ui/api/runs/killed/attempts")["data"]
        trained = [a for a in attempts if a["trained"]]
        assert [a["step"] for a in trained] == list(range(1, len(results) + 1)), attempts
        assert not any(a["pending"] for a in attempts), attempts
        print(f"\n{KILLS} SIGKILLs, {len(results)} steps trained, each key once; "
              f"{len(attempts) - len(trained)} attempts cut short by a kill, {len(resubmitted)} keys resubmitted "
              f"after the client's three interruptions")
    finally:
        killing.clear()
        srv.stop()
